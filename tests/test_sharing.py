"""`serve`'s one watcher for every viewer (console/sharing.py, issue 42) over the drill's real hosts
(asyncssh servers, the rehearsal server, the real telemetry agent): ten viewers cost the hosts what
one does (one SSH connection and one agent per host, whatever their number), each viewer shows the
same live telemetry and service as a console of its own would, a viewer that leaves leaves nothing,
and a viewer whose hub is gone says so."""

from __future__ import annotations

import asyncio
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from console import messages as m
from console.sharing import Hub, SharedSession
from tests.window_fixtures import Drill  # (its fixture `drill` comes through tests/conftest.py)


async def until(predicate: Callable[[], bool], timeout: float = 60, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.05)


def agents(drill: Drill) -> dict[str, int]:
    """The telemetry agents running on each host of this drill (its processes, told apart by the host's
    home under this drill's directory: the other drills of a loaded machine, other tests' and other
    test workers', run agents of their own on hosts of the same names)."""
    counts = {name: 0 for name in drill.config.hosts}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "remote.agent" not in cmdline:
            continue
        for name in drill.config.hosts:
            if f"{drill.dir.resolve()}/{name}/home/" in cmdline:
                counts[name] += 1
    return counts


def ssh_connections(drill: Drill) -> dict[str, int]:
    """This process's TCP connections to each drill host's SSH port (the hub's and the viewers')."""
    ports = {host.port: name for name, host in drill.config.hosts.items()}
    counts = {name: 0 for name in drill.config.hosts}
    for conn in psutil.Process(os.getpid()).net_connections(kind="tcp"):
        if conn.raddr and conn.status == psutil.CONN_ESTABLISHED and conn.raddr.port in ports:
            counts[ports[conn.raddr.port]] += 1
    return counts


async def test_ten_viewers_cost_the_hosts_what_one_does(drill: Drill, tmp_path: Path) -> None:
    config = drill.config
    hub = Hub(config, str(drill.runs), tmp_path / "serve" / "hub.sock")
    await hub.start()
    viewers: list[tuple[SharedSession, list[Any]]] = []
    try:
        assert stat.S_IMODE(hub.path.parent.stat().st_mode) == 0o700 and stat.S_IMODE(hub.path.stat().st_mode) == 0o600
        sampled = lambda: all(isinstance(hub.last.get(("TelemetryUpdate", h)), m.TelemetryUpdate)  # noqa: E731
                              and hub.last[("TelemetryUpdate", h)].sample is not None for h in config.hosts)
        await until(sampled, what="the hub's first samples")
        await until(lambda: ("ServiceView",) in hub.last, what="the hub's first look at the service")
        alone = (agents(drill), ssh_connections(drill))
        assert alone == ({name: 1 for name in config.hosts}, {name: 1 for name in config.hosts}), alone

        for _ in range(10):
            seen: list[Any] = []
            session = SharedSession(config, hub.path)
            session.bus.subscribe(seen.append)
            session.start()
            viewers.append((session, seen))
        for session, seen in viewers:  # each shows what a console of its own would: hosts, GPUs, service
            await until(lambda seen=seen: {x.host for x in seen if isinstance(x, m.TelemetryUpdate) and x.sample}
                        == set(config.hosts), what="a viewer's telemetry")
            await until(lambda seen=seen: any(isinstance(x, m.ServiceView) for x in seen), what="a viewer's service")
            assert {x.host for x in seen if isinstance(x, m.HostState) and x.status == "connected"} == set(config.hosts)
            gpu = next(x for x in seen if isinstance(x, m.TelemetryUpdate) and x.sample).sample.gpus[0].index
            host = next(iter(config.hosts))
            assert session.history(host, gpu), "its sparkline starts from the hub's history"
        # Ten viewers: the hosts see what one costs (the hub's one connection and agent per host).
        assert (agents(drill), ssh_connections(drill)) == alone
        assert len(hub.viewers) == 10

        for session, _ in viewers[1:]:  # nine close their pages: nothing of them is left
            await session.stop()
        await until(lambda: len(hub.viewers) == 1, what="the closed viewers' queues")
        last, seen = viewers[0]
        before = len(seen)
        await until(lambda: len(seen) > before + len(config.hosts), what="the one left goes on")
    finally:
        await hub.stop()
    # The hub gone (serve stopped): the viewer says so on every host's line, never shows stale as live.
    await until(lambda: any(isinstance(x, m.HostState) and x.status == "down" and "is gone" in (x.last_error or "")
                            for x in seen), what="the viewer told its hub is gone")
    assert not hub.path.exists() and not hub.path.parent.exists()
    for session, _ in viewers[:1]:
        await session.stop()


async def test_a_viewer_whose_hub_cannot_be_reached_says_where(tmp_path: Path) -> None:
    from console.config import example_config_text, parse_config

    config = parse_config(example_config_text())
    session = SharedSession(config, tmp_path / "nowhere.sock")
    seen: list[Any] = []
    session.bus.subscribe(seen.append)
    session.start()
    try:
        await until(lambda: len(seen) == len(config.hosts), what="the viewer's lines")
    finally:
        await session.stop()
    assert {x.host for x in seen} == set(config.hosts)
    assert all(x.status == "down" and f"cannot be reached at {tmp_path / 'nowhere.sock'}" in x.last_error for x in seen)
