"""One supervisor per host: keeps a connection up, reconnects with backoff, publishes its state.

asyncssh leaves reconnection to the caller. The supervisor connects, watches the connection
(`wait_closed`, plus a periodic ping that measures latency and notices a dead link sooner than TCP
would), and on a drop tries again after 0.5 s, 1 s, 2 s ... up to 30 s. It never raises: every
failure becomes a published `HostState` with the error's message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from console.fanout import FanOut
from console.messages import HostState, HostStatus
from console.ssh.hosts import AuthFailed, Host, HostError, HostSpec, UnknownHostKey
from console.tasks import cancel_and_wait

log = logging.getLogger(__name__)

StateCallback = Callable[[HostState], None]

# Errors that retrying alone will not fix: the host is shown down, and retried at the slowest pace.
_PERMANENT = (UnknownHostKey, AuthFailed)


class HostSupervisor:
    """Keeps one `Host` connected and publishes `HostState` changes to subscribers."""

    def __init__(self, spec: HostSpec, backoff: tuple[float, float] = (0.5, 30.0),
                 ping_interval: float = 5.0, ping_timeout: float = 10.0):
        self.spec = spec
        self.backoff = backoff
        self.ping_interval = ping_interval
        self.ping_timeout = ping_timeout
        self._state = HostState(spec.name, "connecting", time.time())
        self._subscribers = FanOut("host state")
        self._host: Host | None = None
        self._task: asyncio.Task | None = None
        self._changed = asyncio.Event()
        self._wake = asyncio.Event()

    @property
    def state(self) -> HostState:
        return self._state

    @property
    def host(self) -> Host | None:
        """The connected Host, or None while not connected."""
        host = self._host
        return host if host is not None and host.is_connected else None

    def subscribe(self, callback: StateCallback) -> Callable[[], None]:
        """Call `callback(state)` on every change (and once now); returns an unsubscribe function."""
        unsubscribe = self._subscribers.subscribe(callback)
        self._subscribers.call(callback, self._state)
        return unsubscribe

    def _publish(self, status: HostStatus, *, latency_s: float | None = None,
                 last_error: str | None = None, attempts: int = 0, keep_since: bool = False) -> None:
        since = self._state.since if keep_since and self._state.status == status else time.time()
        self._state = HostState(self.spec.name, status, since, latency_s, last_error, attempts)
        self._changed.set()
        self._changed = asyncio.Event()
        self._subscribers.publish(self._state)

    def start(self) -> None:
        """Begin connecting in the background (on the running event loop)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"supervise {self.spec.name}")

    async def stop(self) -> None:
        """Stop supervising and close the connection."""
        await cancel_and_wait(self._task)
        self._task = None
        if self._host is not None:
            await self._host.close()
            self._host = None

    def retry_now(self) -> None:
        """Skip the current backoff wait (e.g. after the operator fixed known_hosts)."""
        self._wake.set()

    async def wait_connected(self, timeout: float | None = None) -> Host:
        """The connected Host, waiting for it up to `timeout` seconds (TimeoutError after)."""
        async def wait() -> Host:
            while True:
                host = self.host
                if host is not None and self._state.status == "connected":
                    return host
                await self._changed.wait()

        # asyncio.timeout, not wait_for: on 3.11 wait_for drops a cancel that lands as the wait ends.
        async with asyncio.timeout(timeout):
            return await wait()

    async def _run(self) -> None:
        delay = self.backoff[0]
        attempts = 0
        ever_connected = False
        while True:
            host = Host(self.spec)
            try:
                await host.connect()
                latency = await host.ping()
            except (HostError, OSError) as exc:
                await host.close()
                attempts += 1
                message = str(exc) if isinstance(exc, HostError) else f"{self.spec.name}: {exc}"
                permanent = isinstance(exc, _PERMANENT)
                status: HostStatus = "reconnecting" if ever_connected and not permanent else "down"
                self._publish(status, last_error=message, attempts=attempts, keep_since=True)
                await self._sleep(self.backoff[1] if permanent else delay)
                delay = min(delay * 2, self.backoff[1])
                continue
            except Exception as exc:  # never crash: publish the unexpected too
                await host.close()
                attempts += 1
                log.exception("connecting to %s failed unexpectedly", self.spec.name)
                self._publish("down", last_error=f"{self.spec.name}: {type(exc).__name__}: {exc}",
                              attempts=attempts, keep_since=True)
                await self._sleep(self.backoff[1])
                continue
            self._host = host
            ever_connected = True
            attempts = 0
            delay = self.backoff[0]
            self._publish("connected", latency_s=latency)
            reason = await self._watch(host)
            self._host = None
            await host.close()
            self._publish("reconnecting", last_error=f"{self.spec.name}: connection lost ({reason})")

    async def _sleep(self, seconds: float) -> None:
        self._wake.clear()
        with contextlib.suppress(TimeoutError):  # not wait_for: on 3.11 it can swallow a cancel (retry_now + stop)
            async with asyncio.timeout(seconds):
                await self._wake.wait()

    async def _watch(self, host: Host) -> str:
        """Ping the host until the link drops; return why it dropped."""
        closed = asyncio.ensure_future(host.wait_closed())
        try:
            while True:
                done, _ = await asyncio.wait({closed}, timeout=self.ping_interval)
                if done:
                    return "closed by the host or the network"
                try:
                    latency = await asyncio.wait_for(host.ping(), self.ping_timeout)
                except TimeoutError:
                    return f"no answer to a ping within {self.ping_timeout:g} s"
                except HostError as exc:
                    return exc.msg
                if self._state.latency_s is None or abs(latency - self._state.latency_s) > 0.0005:
                    self._publish("connected", latency_s=latency, keep_since=True)
        finally:
            closed.cancel()
