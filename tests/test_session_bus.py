"""The session's message bus: one semantics for every view (subscribe/unsubscribe, isolation, replacement)."""

from __future__ import annotations

import asyncio
import logging
import time

from hypothesis import given
from hypothesis import strategies as st

from console.messages import HostState, JournalEntry, TelemetryUpdate
from console.session.bus import MessageBus


def telemetry(host: str, age: float) -> TelemetryUpdate:
    return TelemetryUpdate(host=host, sample=None, age_s=age, stale=False, streaming=True)


def test_subscribe_returns_unsubscribe_and_filters_by_type() -> None:
    bus = MessageBus()
    seen: list[object] = []
    unsubscribe = bus.subscribe(seen.append, HostState)
    bus.publish(HostState("a", "connected", time.time()))
    bus.publish(telemetry("a", 1.0))  # another type: not delivered
    unsubscribe()
    bus.publish(HostState("a", "down", time.time()))
    assert [type(x).__name__ for x in seen] == ["HostState"]
    assert seen[0].status == "connected"  # type: ignore[attr-defined]


def test_a_failing_subscriber_is_isolated_and_logged(caplog) -> None:
    bus = MessageBus()
    seen: list[object] = []

    def broken(message: object) -> None:
        raise RuntimeError("view crashed")

    bus.subscribe(broken)
    bus.subscribe(seen.append)
    with caplog.at_level(logging.ERROR):
        for i in range(3):
            bus.publish(telemetry("a", float(i)))
    assert len(seen) == 3  # the others still get every message
    assert sum("subscriber" in r.message for r in caplog.records) == 1  # logged once, not per message


async def test_stream_replaces_a_waiting_high_rate_message_with_the_newest() -> None:
    bus = MessageBus()
    async with bus.stream() as stream:
        for i in range(50):
            bus.publish(telemetry("a", float(i)))
        bus.publish(JournalEntry(t=1.0, run_id="r", step=None, message="one"))
        bus.publish(JournalEntry(t=2.0, run_id="r", step=None, message="two"))
        got = [await asyncio.wait_for(stream.__anext__(), 1) for _ in range(3)]
    assert isinstance(got[0], TelemetryUpdate) and got[0].age_s == 49.0  # one tick, the newest
    assert [g.message for g in got[1:]] == ["one", "two"]  # journal lines are never replaced


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.floats(0, 100)), max_size=60))
def test_the_stream_holds_one_tick_per_host_and_the_newest(ticks: list[tuple[str, float]]) -> None:
    bus = MessageBus()
    stream = bus.stream()
    for host, age in ticks:
        bus.publish(telemetry(host, age))
    newest = {host: age for host, age in ticks}
    pending = list(stream._pending.values())
    assert {(p.host, p.age_s) for p in pending} == set(newest.items())
    assert bus.last[("telemetry", ticks[-1][0])].age_s == ticks[-1][1] if ticks else True
