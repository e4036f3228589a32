"""The channel between `serve`'s hub and a viewer (console/sharing.py, docs/sharing.md), on a real
Unix socket with the hub's own server and the viewer's own session, no hosts: a viewer too slow to
keep up is dropped, never the hub held back, and connects again from the snapshot (before, it said
"the watcher is gone (serve stopped)" and showed nothing live again); a hub that really stops is said
gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console import messages as m
from console import sharing
from console.config import example_config_text, parse_config
from console.sharing import Hub, SharedSession


async def until(predicate: Callable[[], bool], timeout: float = 20, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out: {what}"
        await asyncio.sleep(0.02)


def gone(seen: list[Any]) -> bool:
    return any(isinstance(x, m.HostState) and x.status == "down" and "is gone" in (x.last_error or "") for x in seen)


async def a_hub(tmp_path: Path) -> Hub:
    """The hub's socket server alone (its operator, which would reach the hosts, never started)."""
    hub = Hub(parse_config(example_config_text()), str(tmp_path / "runs"), tmp_path / "serve" / "hub.sock")
    hub.path.parent.mkdir(mode=0o700)
    hub._server = await asyncio.start_unix_server(hub._serve_viewer, path=str(hub.path))
    return hub


async def test_a_viewer_too_slow_is_dropped_then_starts_again_from_the_snapshot(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(sharing, "VIEWER_QUEUE", 5)
    hub = await a_hub(tmp_path)
    viewer = SharedSession(hub.operator.config, hub.path)
    seen: list[Any] = []
    viewer.bus.subscribe(seen.append)
    viewer.start()
    try:
        await until(lambda: len(hub.viewers) == 1, what="the viewer connected")
        states = [m.HostState("ct129", "connected", 1000.0 + i, latency_s=0.001 * i) for i in range(50)]
        for state in states:  # at once: the viewer's queue (5) overflows and it is dropped
            hub._on(state)
        assert not hub.viewers  # dropped, the hub never waited on it
        await until(lambda: gone(seen) or states[-1] in seen, what="the viewer back, or said gone")
        assert not gone(seen), [x for x in seen if isinstance(x, m.HostState) and x.status == "down"]
        assert states[-1] in seen and len(hub.viewers) == 1  # the snapshot's last state, on a new connection
        # The hub really stops (serve ended): its socket no longer answers, and the viewer says so.
        hub._server.close()
        for writer in list(hub.viewers.values()):
            writer.close()
        hub.path.unlink()
        await until(lambda: gone(seen), what="the viewer told its hub is gone")
    finally:
        await viewer.stop()

