"""The one fan-out under the message bus, the supervisors and the telemetry streams."""

from __future__ import annotations

import asyncio

import pytest

from console.fanout import FanOut


def test_a_subscriber_that_raises_or_exits_is_isolated_and_stays_subscribed():
    """A view whose print hits a closed terminal (rich raises SystemExit) never stops the publisher:
    the others still get the value, and the failing one gets the next."""
    fan, seen = FanOut("test"), []

    def exits(value):
        seen.append(("exits", value))
        raise SystemExit(1)

    def raises(value):
        seen.append(("raises", value))
        raise ValueError(value)

    fan.subscribe(exits)
    fan.subscribe(raises)
    fan.subscribe(lambda value: seen.append(("ok", value)))
    fan.publish(1)
    fan.publish(2)
    assert seen == [("exits", 1), ("raises", 1), ("ok", 1), ("exits", 2), ("raises", 2), ("ok", 2)]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, asyncio.CancelledError])
def test_an_interrupt_or_a_cancel_still_passes(stop):
    fan = FanOut("test")

    def interrupted(value):
        raise stop

    fan.subscribe(interrupted)
    with pytest.raises(stop):
        fan.publish(1)
