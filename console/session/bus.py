"""The session's message bus: every view subscribes here, nothing else is wired between parts.

One semantics for every message type:
- `subscribe(callback, *types)` calls `callback(message)` for each message published (of `types`,
  or all) and returns the function that unsubscribes;
- a subscriber that raises is isolated: the error is logged (once per subscriber and type) and the
  other subscribers, and the publisher, carry on;
- `stream(*types)` is an async iterator over a bounded queue in which a high-rate message (one that
  has a `replace_key`, e.g. a host's telemetry tick) replaces the one of the same key still waiting,
  so a slow reader sees the newest state, never a backlog.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from console import messages as m
from console.fanout import FanOut

log = logging.getLogger(__name__)

Callback = Callable[[Any], Any]


def replace_key(message: Any) -> Hashable | None:
    """The key under which a newer message replaces an older one still queued; None: never replaced."""
    if isinstance(message, m.TelemetryUpdate):
        return ("telemetry", message.host)
    if isinstance(message, m.HostState):
        return ("host", message.host)
    if isinstance(message, m.ServiceView):
        return ("service",)
    if isinstance(message, m.FleetView):
        return ("fleet",)
    if isinstance(message, m.Downtime):
        return ("downtime", message.run_id)
    progress = getattr(m, "JobProgress", None)
    if progress is not None and isinstance(message, progress):
        return ("progress", message.job_id)
    return None


class Subscription:
    """An async iterator over the bus's messages; close it (or leave its `async with`) to stop."""

    def __init__(self, bus: MessageBus, types: tuple[type, ...], maxsize: int):
        self._bus = bus
        self._types = types
        self._maxsize = maxsize
        self._pending: OrderedDict[Hashable, Any] = OrderedDict()
        self._serial = 0
        self._ready = asyncio.Event()
        self._closed = False
        self.dropped = 0  # messages without a replace key dropped because the queue was full

    def offer(self, message: Any) -> None:
        if self._closed or (self._types and not isinstance(message, self._types)):
            return
        key = replace_key(message)
        if key is not None and key in self._pending:
            self._pending[key] = message  # same place in the order: newest state, no backlog
        else:
            if len(self._pending) >= self._maxsize:
                self._pending.popitem(last=False)
                self.dropped += 1
            self._serial += 1
            self._pending[key if key is not None else ("seq", self._serial)] = message
        self._ready.set()

    def close(self) -> None:
        self._closed = True
        self._bus._streams.discard(self)
        self._ready.set()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Any:
        while not self._pending:
            if self._closed:
                raise StopAsyncIteration
            self._ready.clear()
            await self._ready.wait()
        _, message = self._pending.popitem(last=False)
        return message

    async def __aenter__(self) -> Subscription:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class MessageBus:
    """Publishes the core's typed messages to subscribers, and keeps the last one of each kind."""

    def __init__(self) -> None:
        self._callbacks = FanOut("bus")
        self._streams: set[Subscription] = set()
        self.last: dict[Hashable, Any] = {}  # the newest message per replace key (or per type)

    def subscribe(self, callback: Callback, *types: type) -> Callable[[], None]:
        if not types:
            return self._callbacks.subscribe(callback)

        def of_these_types(message: Any) -> None:
            if isinstance(message, types):
                callback(message)
        return self._callbacks.subscribe(of_these_types)

    def stream(self, *types: type, maxsize: int = 1000) -> Subscription:
        subscription = Subscription(self, tuple(types), maxsize)
        self._streams.add(subscription)
        return subscription

    def publish(self, message: Any) -> None:
        self.last[replace_key(message) or type(message)] = message
        self._callbacks.publish(message)  # one broken view never stops the engine
        for subscription in list(self._streams):
            subscription.offer(message)
