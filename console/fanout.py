"""One fan-out of values to subscribers, shared by the message bus, the host supervisors and the
telemetry streams: subscribing returns the unsubscribe, and a subscriber that raises is isolated
(logged once, kept subscribed) so one broken view never stops a connection, a stream or the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class FanOut:
    """Calls every subscriber with each value published, in subscription order."""

    def __init__(self, what: str):
        self.what = what  # named in the log when a subscriber fails: "host state", "telemetry", ...
        self._callbacks: list[Callable[[Any], Any]] = []
        self._failed: set[tuple[int, type]] = set()

    def subscribe(self, callback: Callable[[Any], Any]) -> Callable[[], None]:
        self._callbacks.append(callback)

        def unsubscribe() -> None:
            if callback in self._callbacks:
                self._callbacks.remove(callback)
        return unsubscribe

    def call(self, callback: Callable[[Any], Any], value: Any) -> None:
        """One subscriber, isolated: its failure is logged once per kind of value."""
        try:
            callback(value)
        # SystemExit too: rich raises it from a print to a closed terminal, and a view's print must
        # never end the engine mid-window (Ctrl-C and a cancel still pass: BaseException's others).
        except (Exception, SystemExit):  # noqa: BLE001 - one broken subscriber must not stop the publisher
            key = (id(callback), type(value))
            if key not in self._failed:
                self._failed.add(key)
                log.exception("a %s subscriber failed on %s; it stays subscribed", self.what, type(value).__name__)

    def publish(self, value: Any) -> None:
        for callback in list(self._callbacks):
            self.call(callback, value)

    def __len__(self) -> int:
        return len(self._callbacks)
