"""One watcher for every viewer of `dflash-ops serve` (issue 42): sharing the window costs production
nothing, however many people watch.

`serve` holds one read-only console core, the `Hub`: one SSH connection per host, one telemetry
agent per host, one service watch (its `/health` and one-token `/generate`), one follower of the live
run (whose job bars it reads from the host). Each browser's console is a view of it: its session is a
`SharedSession`, which opens no connection to any host. It reads, from the hub's local socket, what
the hub's session publishes (the hosts' states, their telemetry, the service's and the fleet's views,
the live job's bars) and publishes it on its own bus, as a session of its own would. What each view
reads from the run store (the live run, its steps and journal, results) it reads itself, from the
disk of the machine that serves.

The channel: a Unix socket in a directory only the serving user can enter (0700), one length-prefixed
pickle a message, hub to viewer only (a viewer sends nothing). Pickle because the messages are the
core's own dataclasses, whole; it is safe here only because both ends are the same user's processes
and nothing else can reach the socket. A viewer that connects first gets the snapshot: each host's
telemetry history (its sparklines) and the last message of each kind. A viewer that closes leaves
nothing behind: its queue goes with its connection. A viewer too slow to keep up (its queue full) is
dropped, never the hub held back; it connects again and starts from the snapshot. A viewer whose hub
is gone (its socket no longer answers) says so on every host's line. docs/sharing.md is the design.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pickle
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console import messages as m
from console.config import Config
from console.operator import Operator
from console.session import MessageBus
from console.tasks import cancel_and_wait
from console.telemetry import HostTelemetry

# What the hub's session publishes and its viewers show (the store's part each view reads itself).
SHARED = (m.HostState, m.TelemetryUpdate, m.ServiceView, m.FleetView,
          m.JobProgress, m.JobLog, m.JobArtifact, m.JobResult, m.JobError, m.JobExit, m.JobStalled)
HEADER = struct.Struct("!I")
VIEWER_QUEUE = 2000  # messages waiting for one viewer; past it the viewer is dropped, never the hub held
GONE = "the watcher of `dflash-ops serve` is gone (serve stopped): what is shown is no longer live"
RECONNECT_S = 0.2  # a dropped viewer connects again after this (the hub had closed it: it may be going)


@dataclass(frozen=True)
class History:
    """One host's telemetry history, as the hub holds it: what a new viewer's sparklines start from."""

    host: str
    rings: dict[int, list[tuple[float, int | None, float | None]]]


def frame(message: Any) -> bytes:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def key_of(message: Any) -> tuple[str, ...] | None:
    """What a new viewer must see of this kind: the last of each host's state and telemetry, the
    service's and the fleet's last view, each job's last bar; None: only as it happens (logs, ends)."""
    name = type(message).__name__
    if isinstance(message, m.HostState | m.TelemetryUpdate):
        return name, message.host
    if isinstance(message, m.ServiceView | m.FleetView):
        return (name,)
    if isinstance(message, m.JobProgress):
        return name, message.job_id
    return None


class Hub:
    """`serve`'s one read-only console core, published to every viewer over `path` (a Unix socket)."""

    def __init__(self, config: Config, runs_dir: str | None, path: Path):
        self.operator = Operator(config, runs_dir=runs_dir, read_only=True)
        self.path = path
        self.last: dict[tuple[str, ...], Any] = {}
        self.viewers: dict[asyncio.Queue, asyncio.StreamWriter] = {}
        self._server: asyncio.Server | None = None
        self._follower: asyncio.Task | None = None
        self._unsubscribe: Any = None

    async def start(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)  # only the serving user's processes reach the socket
        self._unsubscribe = self.operator.bus.subscribe(self._on, *SHARED)
        self.operator.start()
        self._follower = asyncio.create_task(self.operator.follow_live_run(), name="hub-follower")
        self._server = await asyncio.start_unix_server(self._serve_viewer, path=str(self.path))
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self.viewers.values()):
            writer.close()
        await cancel_and_wait(self._follower)
        if self._unsubscribe is not None:
            self._unsubscribe()
        await self.operator.stop()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        with contextlib.suppress(OSError):  # its directory, when nothing else is in it
            self.path.parent.rmdir()

    def _on(self, message: Any) -> None:
        key = key_of(message)
        if key is not None:
            self.last[key] = message
        for queue, writer in list(self.viewers.items()):
            try:
                queue.put_nowait(message)
            except asyncio.QueueFull:  # it does not keep up: dropped (its page reconnects, snapshot first)
                del self.viewers[queue]
                writer.close()

    def snapshot(self) -> list[Any]:
        """What a viewer that connects now starts from: histories, then the last message of each kind."""
        histories = [History(name, stream.telemetry.rings()) for name, stream in self.operator.session.streams.items()]
        return [*histories, *self.last.values()]

    async def _serve_viewer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue(maxsize=VIEWER_QUEUE)
        self.viewers[queue] = writer
        try:
            writer.write(b"".join(frame(message) for message in self.snapshot()))
            await writer.drain()
            while queue in self.viewers:
                writer.write(frame(await queue.get()))
                await writer.drain()
        except (ConnectionError, OSError):
            pass  # the viewer closed its page: nothing of it is left
        finally:
            self.viewers.pop(queue, None)
            writer.close()


class SharedSession:
    """A viewer's session: `Session`'s face over what the hub publishes, with no connection to any
    host (no supervisors: the live job's bars come from the hub's follower)."""

    def __init__(self, config: Config, path: Path, bus: MessageBus | None = None):
        self.config = config
        self.path = path
        self.bus = bus or MessageBus()
        self.supervisors: dict[str, Any] = {}
        self.paused_by: str | None = None
        self.fleet: m.FleetView | None = None
        self.received = 0  # messages read from the hub (the tests count them)
        self.connections = 0  # to the hub: more than one after it dropped this viewer for being slow
        self._telemetry = {name: HostTelemetry(name) for name in config.hosts}
        self._task: asyncio.Task | None = None

    def start(self, watch_service: bool = True) -> None:
        self._task = asyncio.create_task(self._listen(), name="shared-session")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _listen(self) -> None:
        """Read the hub until it is gone. A connection the hub closes while its socket still answers
        is this viewer dropped for being slow: it connects again and starts from the snapshot."""
        connected = False
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(str(self.path))
            except OSError as exc:
                self._hub_gone(GONE if connected else f"the watcher of `dflash-ops serve` cannot be reached at "
                                                      f"{self.path}: {exc.strerror or exc}")
                return
            connected = True
            self.connections += 1
            try:
                while True:
                    (size,) = HEADER.unpack(await reader.readexactly(HEADER.size))
                    self._take(pickle.loads(await reader.readexactly(size)))
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # closed by the hub: dropped (it answers again) or gone (it does not)
            finally:
                writer.close()
            await asyncio.sleep(RECONNECT_S)

    def _take(self, message: Any) -> None:
        self.received += 1
        if isinstance(message, History):
            if message.host in self._telemetry:
                self._telemetry[message.host].seed(message.rings)
            return
        if isinstance(message, m.TelemetryUpdate) and message.sample is not None and message.host in self._telemetry:
            telemetry = self._telemetry[message.host]
            if telemetry.latest is None or telemetry.latest.t != message.sample.t:
                telemetry.add(message.sample)
        if isinstance(message, m.FleetView):
            self.fleet = message
        self.bus.publish(message)

    def _hub_gone(self, why: str) -> None:
        for name in self.config.hosts:
            self.bus.publish(m.HostState(name, "down", time.time(), last_error=why))

    # --- what views and the follower ask of a session ----------------------------------------------

    def history(self, host: str, gpu: int, seconds: float | None = None) -> list[float | None]:
        return self._telemetry[host].history(gpu, "mem_used_mib", seconds)

    def held_paused(self, by: str | None) -> None:
        self.paused_by = by  # (the hub's own follower keeps its service watch off /health meanwhile)

    def poke_service(self) -> None:
        pass  # the hub checks the service; a viewer asks nothing
