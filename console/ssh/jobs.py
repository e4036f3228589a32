"""Remote jobs: ship the `remote/` code, start a worker detached, follow its events, cancel it.

A job lives on the host, not in the console: the worker runs in its own session (`setsid nohup`,
stdin from /dev/null) and appends JSON-lines events to `<run_dir>/events.jsonl`. The console
follows that file by byte offset, so a dropped connection or a restarted console resumes from the
last offset it handled: no event lost, none repeated. A `JobHandle` is plain JSON for that reason.

Layout on the host (all under the host's workdir, private to the user):

    <workdir>/code/<sha256 of the local remote/ tree>/remote/...   shipped once per distinct tree
    <workdir>/runs/<job_id>/{events.jsonl, stdout.log, stderr.log}  one run directory per job (0700)
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import re
import shlex
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import asyncssh

from console.ssh.hosts import Host, HostDisconnected, HostError, tail_text
from remote.procstat import parse_start_ticks

if TYPE_CHECKING:
    from console.ssh.supervisor import HostSupervisor

LOCAL_CODE = Path(__file__).resolve().parents[2] / "remote"
_WORKER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")  # "extract", "drill.standin"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_READ_CHUNK = 1 << 20
_TAIL_BYTES = 4096


@dataclass(frozen=True)
class JobHandle:
    """Everything needed to find a job again, on this console or a restarted one."""

    host: str
    job_id: str
    worker: str
    run_dir: str
    pid: int
    start_ticks: int | None  # /proc/<pid>/stat starttime: tells our process from a reused pid
    started_at: float

    @property
    def events_path(self) -> str:
        return f"{self.run_dir}/events.jsonl"

    @property
    def stderr_path(self) -> str:
        return f"{self.run_dir}/stderr.log"

    @property
    def stdout_path(self) -> str:
        return f"{self.run_dir}/stdout.log"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, data: str | dict[str, Any]) -> JobHandle:
        """Rebuild a handle saved with `to_json` (a JSON string or the decoded dict)."""
        fields = json.loads(data) if isinstance(data, str) else dict(data)
        try:
            return cls(**fields)
        except TypeError as exc:
            raise ValueError(f"not a saved job handle ({exc}): {fields!r}") from None


@dataclass(frozen=True)
class JobStatus:
    """Where a job stands: running, exited (with its code) or dead (gone without an `exit` event)."""

    state: Literal["running", "exited", "dead"]
    exit_code: int | None = None
    stderr_tail: str = ""


class JobDead(HostError):
    """The worker's process is gone but it never wrote `exit`: killed, or the host rebooted."""

    def __init__(self, host: str, handle: JobHandle, stderr_tail: str):
        detail = f"stderr ends with:\n{stderr_tail}" if stderr_tail else "its stderr is empty"
        super().__init__(host, f"job {handle.job_id} ({handle.worker}, pid {handle.pid}) is dead: the "
                               f"process is gone without an exit event; {detail}")
        self.handle = handle
        self.stderr_tail = stderr_tail


def code_files(root: Path = LOCAL_CODE) -> list[tuple[str, Path]]:
    """The files of the local `remote/` tree to ship, as sorted (relative posix path, path) pairs."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if path.is_file() and "__pycache__" not in rel.parts and not any(
                p.startswith(".") for p in rel.parts) and path.suffix != ".pyc":
            files.append((rel.as_posix(), path))
    return files


def tree_digest(files: list[tuple[str, Path]]) -> str:
    """sha256 over names and contents: equal trees give equal digests, any change a new one."""
    digest = hashlib.sha256()
    for rel, path in files:
        data = path.read_bytes()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()


def split_events(data: bytes) -> tuple[list[tuple[int, dict]], int]:
    """The complete event lines at the start of `data` as (line length in bytes, event), and the
    bytes they use. A trailing partial line is left for the next read; a line that is not JSON
    becomes an `invalid` event (readers ignore unknown types) rather than stopping the job's view.
    """
    end = data.rfind(b"\n") + 1
    events = []
    for raw in data[:end].splitlines(keepends=True):
        try:
            event = json.loads(raw)
            if not isinstance(event, dict):
                raise ValueError("not an object")
        except ValueError:
            event = {"type": "invalid", "raw": raw.decode(errors="replace").rstrip("\n")}
        events.append((len(raw), event))
    return events, end


class JobRunner:
    """Starts and follows jobs on one connected host."""

    def __init__(self, host: Host, local_code: Path = LOCAL_CODE, poll_interval: float = 0.2,
                 liveness_interval: float = 1.0):
        self.host = host
        self.local_code = Path(local_code)
        self.poll_interval = poll_interval  # how often an idle follower reads the events file
        self.liveness_interval = liveness_interval  # how often it checks the process when idle
        self.uploaded_files = 0  # files sent by the last ensure_code (0 when the tree was there)

    async def workdir(self) -> str:
        """The host's workdir as an absolute path, created private (0700) if missing."""
        path = await self.host.expand(self.host.spec.workdir)
        sftp = await self.host.sftp()
        with self.host.errors(f"creating the workdir {path}"):
            if not await sftp.exists(path):
                await sftp.makedirs(path, attrs=asyncssh.SFTPAttrs(permissions=0o700), exist_ok=True)
        return path

    async def ensure_code(self, progress: Callable[[int, int], None] | None = None) -> str:
        """Ship the local remote/ tree unless the host already has this exact tree; return its dir.

        The tree goes to a temporary directory renamed into place last, so a directory under its
        final (content) name is always complete.
        """
        files = code_files(self.local_code)
        if not files:
            raise FileNotFoundError(f"no worker code to ship under {self.local_code}")
        digest = tree_digest(files)
        code_root = f"{await self.workdir()}/code"
        final = f"{code_root}/{digest[:24]}"
        sftp = await self.host.sftp()
        self.uploaded_files = 0
        with self.host.errors(f"shipping worker code to {final}"):
            if await sftp.exists(final):
                return final
            staging = f"{code_root}/.incoming-{digest[:12]}-{uuid.uuid4().hex[:8]}"
            try:
                await self._upload(files, staging, progress)
                await sftp.rename(staging, final)
            except asyncssh.SFTPError:
                with contextlib.suppress(Exception):  # best effort: the link may be what failed
                    await self.host.run(["rm", "-rf", "--", staging], check=False)
                if not await sftp.exists(final):  # not merely a concurrent upload of the same tree
                    raise
        return final

    async def _upload(self, files: list[tuple[str, Path]], staging: str,
                      progress: Callable[[int, int], None] | None) -> None:
        sftp = await self.host.sftp()
        made: set[str] = set()
        for done, (rel, path) in enumerate(files, 1):
            parent = f"{staging}/{self.local_code.name}/{rel}".rsplit("/", 1)[0]
            if parent not in made:
                await sftp.makedirs(parent, exist_ok=True)
                made.add(parent)
            await sftp.put(str(path), f"{parent}/{path.name}")
            self.uploaded_files += 1
            if progress:
                progress(done, len(files))

    async def _python(self) -> str:
        python = self.host.spec.python
        return await self.host.expand(python) if python.startswith("~") else python

    async def start(self, worker: str, args: list[str], env: dict[str, str] | None = None) -> JobHandle:
        """Start `python -m remote.<worker> *args` detached in a new private run directory."""
        if not _WORKER_NAME.match(worker):
            raise ValueError(f"worker name {worker!r} is not a module name")
        for name in env or {}:
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not valid")
        code_dir = await self.ensure_code()
        workdir = await self.workdir()
        job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{worker}-{uuid.uuid4().hex[:6]}"
        run_dir = f"{workdir}/runs/{job_id}"
        q = shlex.quote
        command = shlex.join([
            "env", f"DFLASH_EVENTS={run_dir}/events.jsonl", f"DFLASH_RUN_DIR={run_dir}",
            *(f"{k}={v}" for k, v in (env or {}).items()),
            "setsid", "nohup", await self._python(), "-m", f"remote.{worker}", *args,
        ])
        # One backgrounded simple command, so $! is the worker itself (setsid does not fork: the
        # child of a non-interactive shell is no group leader) and its pid is also its group's.
        script = "\n".join([
            "set -e", "umask 077",
            f"mkdir -p {q(workdir)}/runs", f"mkdir -m 700 {q(run_dir)}", f"cd {q(code_dir)}",
            f"{command} </dev/null >{q(run_dir)}/stdout.log 2>{q(run_dir)}/stderr.log &",
            "pid=$!", 'echo "$pid"', 'cat "/proc/$pid/stat" 2>/dev/null || true',
        ])
        result = await self.host.run(["sh", "-c", script])
        first, _, stat = result.stdout.partition("\n")
        try:
            pid = int(first.strip())
        except ValueError:
            raise HostError(self.host.name, f"starting {worker} printed no pid: {result.stdout!r}") from None
        parsed = parse_start_ticks(stat)
        return JobHandle(self.host.name, job_id, worker, run_dir, pid,
                         parsed[1] if parsed else None, time.time())

    async def _read(self, path: str, offset: int, size: int) -> bytes:
        """Bytes of a remote file from offset (b"" when the file does not exist yet)."""
        sftp = await self.host.sftp()
        with self.host.errors(f"reading {path}"):
            try:
                async with sftp.open(path, "rb") as f:
                    return await f.read(size, offset)
            except asyncssh.SFTPNoSuchFile:
                return b""

    async def _tail(self, path: str, size: int = _TAIL_BYTES) -> bytes:
        sftp = await self.host.sftp()
        with self.host.errors(f"reading {path}"):
            try:
                length = (await sftp.stat(path)).size or 0
            except asyncssh.SFTPNoSuchFile:
                return b""
        return await self._read(path, max(0, length - size), size)

    async def stderr_tail(self, handle: JobHandle) -> str:
        """The last lines the worker wrote to stderr."""
        return tail_text((await self._tail(handle.stderr_path)).decode(errors="replace"))

    async def is_alive(self, handle: JobHandle) -> bool:
        """True while the job's own process runs (a reused pid or a zombie does not count)."""
        stat = await self._read(f"/proc/{handle.pid}/stat", 0, 4096)
        parsed = parse_start_ticks(stat.decode(errors="replace"))
        if parsed is None:
            return False
        state, ticks = parsed
        if handle.start_ticks is not None and ticks != handle.start_ticks:
            return False  # the pid now belongs to another process
        return state not in ("Z", "X")

    async def follow(self, handle: JobHandle, offset: int = 0) -> AsyncIterator[tuple[int, dict]]:
        """Yield (offset after the event's line, event) for each complete event from `offset` on.

        Ends after the `exit` event. Raises JobDead when the process is gone without `exit`, and
        HostDisconnected when the link drops: resume with a new runner from the last offset.
        """
        sftp = await self.host.sftp()
        events_file: asyncssh.SFTPClientFile | None = None
        checked_dead = False
        last_liveness = time.monotonic()
        try:
            while True:
                data = b""
                with self.host.errors(f"reading {handle.events_path}"):
                    if events_file is None:  # kept open: each poll is then one round trip
                        # (absent until the worker writes its first event)
                        with contextlib.suppress(asyncssh.SFTPNoSuchFile):
                            events_file = await sftp.open(handle.events_path, "rb")
                    if events_file is not None:
                        data = await events_file.read(_READ_CHUNK, offset)
                events, used = split_events(data)
                for length, event in events:
                    offset += length
                    yield offset, event
                    if event.get("type") == "exit":
                        return
                if used:
                    checked_dead = False
                    continue
                if checked_dead or time.monotonic() - last_liveness >= self.liveness_interval:
                    last_liveness = time.monotonic()
                    if not await self.is_alive(handle):
                        if checked_dead:  # read once more after seeing it gone: `exit` may just have landed
                            raise JobDead(self.host.name, handle, await self.stderr_tail(handle))
                        checked_dead = True
                        continue
                await asyncio.sleep(self.poll_interval)
        finally:
            if events_file is not None:
                with contextlib.suppress(Exception):
                    await events_file.close()

    async def _exit_code(self, handle: JobHandle) -> int | None:
        for line in reversed((await self._tail(handle.events_path)).splitlines()):
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("type") == "exit":
                return int(event.get("code", 1))
            return None
        return None

    async def status(self, handle: JobHandle) -> JobStatus:
        """Running, exited with its code, or dead with the tail of its stderr."""
        alive = await self.is_alive(handle)
        code = await self._exit_code(handle)
        if code is not None:
            return JobStatus("exited", code)
        if alive:
            return JobStatus("running")
        return JobStatus("dead", None, await self.stderr_tail(handle))

    async def _signal(self, handle: JobHandle, sig: str) -> None:
        # The worker leads its own process group (setsid): signal the group, so helpers it
        # started go too; fall back to the pid should it not lead one.
        pid = str(handle.pid)
        script = f"kill -s {sig} -- -{pid} 2>/dev/null || kill -s {sig} {pid} 2>/dev/null || true"
        await self.host.run(["sh", "-c", script], check=False)

    async def cancel(self, handle: JobHandle, grace: float = 10.0) -> JobStatus:
        """Send TERM, wait up to `grace` seconds for the worker to end, then KILL; return the status."""
        if await self.is_alive(handle):
            await self._signal(handle, "TERM")
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and await self.is_alive(handle):
                await asyncio.sleep(min(self.poll_interval, 0.1))
            if await self.is_alive(handle):  # checked again: never signal a reused pid
                await self._signal(handle, "KILL")
                while await self.is_alive(handle):
                    await asyncio.sleep(0.05)
        return await self.status(handle)


async def follow_with_reconnect(supervisor: HostSupervisor, handle: JobHandle, offset: int = 0,
                                poll_interval: float = 0.2, liveness_interval: float = 1.0,
                                connect_timeout: float | None = None) -> AsyncIterator[tuple[int, dict]]:
    """Follow a job through connection drops: after each drop, wait for the supervisor's next
    connection and resume from the last offset handled. JobDead and a reconnect timeout propagate."""
    while True:
        host = await supervisor.wait_connected(connect_timeout)
        runner = JobRunner(host, poll_interval=poll_interval, liveness_interval=liveness_interval)
        try:
            async for new_offset, event in runner.follow(handle, offset):
                offset = new_offset
                yield offset, event
            return
        except HostDisconnected:
            await asyncio.sleep(poll_interval)  # the supervisor notices the drop and reconnects
