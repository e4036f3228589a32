"""Hosts for the command tests: embedded SSH servers served from a background thread, and a real
config file pointing at them.

The commands run their own asyncio loop (`asyncio.run` in `console.cli.main`), so the servers cannot
share it: they run on a loop in a thread of their own, and a test calls `main([...])` in-process.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from console.config import dump_toml, load_config
from console.ssh.embedded_server import EmbeddedSSHServer


class ThreadedHosts:
    """One `EmbeddedSSHServer` per name, on 127.0.0.1, served by a loop in a background thread."""

    def __init__(self, root: Path, names: list[str]):
        self.root = root
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="ssh-hosts", daemon=True)
        self._thread.start()
        self.servers: dict[str, EmbeddedSSHServer] = {}
        for name in names:
            server = EmbeddedSSHServer(root / name / "home", root / name / "ssh", python=sys.executable)
            self.call(server.start())
            self.servers[name] = server

    def call(self, coro: Coroutine[Any, Any, Any], timeout: float = 30) -> Any:
        """Run `coro` on the servers' loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @staticmethod
    async def _finish_tasks() -> None:
        """Let the servers' command handlers end (and close their subprocess transports) before the
        loop closes: a transport collected after that complains about a closed loop."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)

    def workdir(self, name: str) -> Path:
        return self.root / name / "work"

    def host_table(self, name: str, **overrides: Any) -> dict[str, Any]:
        """The `[hosts.<name>]` table an operator would write for this server."""
        server = self.servers[name]
        table = {"address": "127.0.0.1", "port": server.port, "user": server.user,
                 "identity_file": str(server.client_key_path), "known_hosts": str(server.known_hosts_path),
                 "python": sys.executable, "workdir": str(self.workdir(name)), "connect_timeout": 5,
                 "lock_dir": str(self.root / name / "locks")}  # this machine's /var/tmp is every test's
        table.update(overrides)
        return table

    def close(self) -> None:
        for server in self.servers.values():
            self.call(server.stop())
        self.call(self._finish_tasks())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def write_config(path: Path, hosts: dict[str, dict[str, Any]], service: dict[str, Any] | None = None,
                 target: dict[str, Any] | None = None) -> Path:
    """A real dflash-ops.toml: `hosts` tables as given, the service and target on the first host."""
    first = next(iter(hosts))
    data = {
        "hosts": hosts,
        "service": service or {"host": first, "manager": "command", "start": "true", "stop": "true", "status": "false"},
        "target": {"model_path": "/nonexistent/model", "layers": [1, 2], **(target or {})},
    }
    path.write_text(dump_toml(data))
    load_config(path)  # the file must be one the operator could have written
    return path


def python_with_path(path: Path, extra: list[Path]) -> Path:
    """An interpreter wrapper (a host's `python`) that puts `extra` on PYTHONPATH: how a host with
    other packages installed looks to the probe."""
    joined = ":".join(str(p) for p in extra)
    path.write_text(f'#!/bin/sh\nPYTHONPATH={joined}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path
