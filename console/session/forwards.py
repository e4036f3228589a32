"""A URL as seen from a host, reached through that host's SSH connection: the one way the console
talks HTTP to what serves on a host (the [service] server, a fleet's replicas, a router on its
`router_host`).

`Forward` listens on a free 127.0.0.1 port that tunnels to the URL's host and port as the host
resolves and reaches them (`Host.forward_local_port`, SSH direct-tcpip). The forward is made once per
connection and made anew after a reconnect: a forward dies with the connection that carried it.
`Reached` is a client of such a URL (an `SglangClient`, a `RouterClient`) made over the forward's
current port for each call, so a reconnect between two calls is crossed; its errors name the URL as
configured and the host it is seen from, never the local port.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from console.service.replica_loads import LoadsUnreadable
from console.service.router import RouterError
from console.service.sglang_api import ServerAnswerError, ServerUnreachable
from console.ssh.hosts import Host, HostError
from console.ssh.supervisor import HostSupervisor

# The clients' own errors: re-raised with the URL as configured in place of the local port.
_RENAMED = (ServerUnreachable, ServerAnswerError, RouterError, LoadsUnreadable)


class Forward:
    """`url` as seen from the supervisor's host, through a port forwarded over its current connection."""

    def __init__(self, supervisor: HostSupervisor, url: str):
        self.supervisor = supervisor
        self.url = url.rstrip("/")
        parts = urlsplit(self.url)
        self._scheme = parts.scheme or "http"
        self._dest = (parts.hostname or "127.0.0.1", parts.port or (443 if self._scheme == "https" else 80))
        self._path = parts.path.rstrip("/")
        self._host: Host | None = None
        self._local: str | None = None
        self._lock = asyncio.Lock()

    @property
    def host(self) -> str:
        return self.supervisor.spec.name

    async def local_url(self, host: Host) -> str:
        """The local URL that reaches `url` over `host` (this connection's forward, made on first use);
        HostError naming the host and the URL when no forward can be made."""
        async with self._lock:
            if host is not self._host or self._local is None:
                self._host, self._local = host, None
                try:
                    port = await host.forward_local_port(*self._dest)
                except HostError as exc:
                    raise HostError(self.host, f"no port forward to {self.url} (as seen from {self.host}): "
                                               f"{exc.msg}") from None
                self._local = f"{self._scheme}://127.0.0.1:{port}{self._path}"
            return self._local

    async def current(self, timeout: float | None) -> str:
        """The local URL over the host's current connection (waits up to `timeout` for one)."""
        try:
            host = await self.supervisor.wait_connected(timeout)
        except TimeoutError:
            state = self.supervisor.state
            raise HostError(self.host, f"not connected within {timeout:g} s ({state.last_error or state.status}): "
                                       f"{self.url} is reached through it") from None
        return await self.local_url(host)


class Reached:
    """A client of `forward.url` (what `make(local_url)` builds; `kind`, its class), each call over the
    forward's current port. `base_url` names the URL and its host (what the clients' callers print)."""

    def __init__(self, forward: Forward, make: Callable[[str], Any], kind: type, connect_s: float):
        self._forward, self._make, self._kind, self._connect_s = forward, make, kind, connect_s
        self.base_url = f"{forward.url} (seen from {forward.host})"

    def __repr__(self) -> str:
        return f"Reached({self._kind.__name__}, {self.base_url!r})"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or not inspect.iscoroutinefunction(getattr(self._kind, name, None)):
            raise AttributeError(name)
        forward = self._forward

        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                local = await forward.current(self._connect_s)
            except HostError as exc:  # no connection or forward now: this call had no answer
                raise ServerUnreachable(f"{forward.url}: no answer: {exc}") from None
            try:
                return await getattr(self._make(local), name)(*args, **kwargs)
            except _RENAMED as exc:
                raise type(exc)(f"{forward.host}: {str(exc).replace(local, forward.url)}") from None
        return call
