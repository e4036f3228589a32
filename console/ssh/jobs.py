"""Remote jobs: ship the `remote/` code, start a worker detached, follow its events, cancel it.

A job lives on the host, not in the console: the worker runs in its own session (`setsid nohup`,
stdin from /dev/null) and appends JSON-lines events to `<run_dir>/events.jsonl`. The console
follows that file by byte offset, so a dropped connection or a restarted console resumes from the
last offset it handled: no event lost, none repeated. A `JobHandle` is plain JSON for that reason.

Layout on the host (all under the host's workdir, private to the user):

    <workdir>/code/<sha256 of the local remote/ tree>/remote/...   shipped once per distinct tree
    <workdir>/runs/<job_id>/{handle.json, events.jsonl, stdout.log, stderr.log}  one run dir per job (0700)

A job can be found again on the host by its id alone: the start script writes `handle.json` (pid,
start ticks, argv, start time, worker, job id) into the run directory, which only appears under its
final name (`runs/<job_id>`) once that file is complete, and the worker waits for that name before it
runs at all. So for a console killed at any point of a start, `attach(job_id)` either finds the job
or it never ran (and never will). Callers may choose the job id (`start(..., job_id=...)`), e.g. the
engine records it in its state before the start; starting an id that exists is refused.

Workers write a heartbeat event every few seconds (`remote.events`), so `follow` can tell a job that
is alive but stuck (no event for `stall_timeout`) from one that is busy: it raises `JobStalledError`.
`job_message` turns events into the typed messages of `console.messages`; `collect` follows a job
to its end and returns its `JobOutcome`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
import shlex
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import asyncssh

from console.messages import JobArtifact, JobError, JobExit, JobLog, JobProgress, JobResult, JobStalled
from console.ssh.hosts import Host, HostDisconnected, HostError, tail_text
from remote.procstat import parse_start_ticks

if TYPE_CHECKING:
    from console.ssh.supervisor import HostSupervisor

LOCAL_CODE = Path(__file__).resolve().parents[2] / "remote"
_WORKER_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?$")  # "extract", "drill.standin"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A job id names a directory: no leading dot (".starting-<id>" is a start in progress), no slash.
JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HANDLE_FORMAT = "dflash-ops.job/1"
_READ_CHUNK = 1 << 20  # at most this much per read (and never more than the server's read limit)
_MAX_EVENT_LINE = 256 << 20  # a longer line is a broken worker, not an event to wait for
_TAIL_BYTES = 4096
_EXISTS_STATUS = 17  # the start script's exit status for "this job id is taken"
DEFAULT_STALL_TIMEOUT_S = 60.0
DEFAULT_KILL_WAIT_S = 5.0

log = logging.getLogger(__name__)


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
    argv: tuple[str, ...] = ()  # what runs: python -m remote.<worker> *args

    @property
    def events_path(self) -> str:
        return f"{self.run_dir}/events.jsonl"

    @property
    def handle_path(self) -> str:
        return f"{self.run_dir}/handle.json"

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
        try:
            fields = json.loads(data) if isinstance(data, str) else dict(data)
        except ValueError:
            raise ValueError(f"not a saved job handle (not JSON): {str(data)[:200]!r}") from None
        if not isinstance(fields, dict):
            raise ValueError(f"not a saved job handle: {fields!r}")
        fields.pop("format", None)  # handle.json names its format
        if isinstance(fields.get("argv"), list):
            fields["argv"] = tuple(fields["argv"])
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
    survived_kill: bool = False  # cancel: still running after SIGKILL (stuck in the kernel)
    note: str = ""  # what cancel saw, e.g. "survived KILL: ..."


class JobDead(HostError):
    """The worker's process is gone but it never wrote `exit`: killed, or the host rebooted."""

    def __init__(self, host: str, handle: JobHandle, stderr_tail: str):
        detail = f"stderr ends with:\n{stderr_tail}" if stderr_tail else "its stderr is empty"
        super().__init__(host, f"job {handle.job_id} ({handle.worker}, pid {handle.pid}) is dead: the "
                               f"process is gone without an exit event; {detail}")
        self.handle = handle
        self.stderr_tail = stderr_tail


class JobStalledError(HostError):
    """The worker's process is alive but has written no event, heartbeats included, for longer
    than the stall timeout: it hangs (a deadlock, a stuck driver call, SIGSTOP)."""

    def __init__(self, host: str, handle: JobHandle, silent_s: float, last_event: dict | None, stderr_tail: str):
        last = f"last event: {last_event.get('type')} (seq {last_event.get('seq')})" if last_event else "no event yet"
        detail = f"stderr ends with:\n{stderr_tail}" if stderr_tail else "its stderr is empty"
        super().__init__(host, f"job {handle.job_id} ({handle.worker}, pid {handle.pid}) has stalled: alive but no "
                               f"event for {silent_s:.0f} s ({last}); {detail}")
        self.handle = handle
        self.silent_s = silent_s
        self.last_event = last_event
        self.stderr_tail = stderr_tail


class JobNotFound(HostError, LookupError):
    """No job with that id on the host (never started there, or its run directory was removed)."""


class JobExists(HostError):
    """A job with that id already exists (or is being started) on the host: attach, don't start twice."""


DRILL_PACKAGE = "drill"  # remote/drill/: the rehearsal hosts' own workers, shipped to drill hosts only


def code_files(root: Path = LOCAL_CODE, drill: bool = True) -> list[tuple[str, Path]]:
    """The files of the local `remote/` tree to ship, as sorted (relative posix path, path) pairs;
    without `drill`, the workers a real host runs (remote/drill/ left out)."""
    files = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if not drill and rel.parts[0] == DRILL_PACKAGE:
            continue
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
        files = code_files(self.local_code, drill=self.host.spec.drill)
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

    async def start(self, worker: str, args: list[str], env: dict[str, str] | None = None,
                    job_id: str | None = None) -> JobHandle:
        """Start `python -m remote.<worker> *args` detached in a new private run directory.

        `job_id` (default: time, worker and a random suffix) names the run directory; an id that
        exists on the host raises JobExists. `handle.json` is in place before the worker runs.
        """
        if not _WORKER_NAME.match(worker):
            raise ValueError(f"worker name {worker!r} is not a module name")
        for name, value in (env or {}).items():
            if not _ENV_NAME.match(name):
                raise ValueError(f"environment variable name {name!r} is not valid")
            if "\n" in value or "\0" in value:
                raise ValueError(f"environment variable {name}: its value holds a newline or NUL")
        if job_id is None:
            job_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{worker}-{uuid.uuid4().hex[:6]}"
        elif not JOB_ID.match(job_id):
            raise ValueError(f"job id {job_id!r}: expected letters, digits, '.', '_' or '-' (not first), "
                             f"at most 128 characters")
        code_dir = await self.ensure_code()
        workdir = await self.workdir()
        python = await self.host.resolve_python()
        run_dir = f"{workdir}/runs/{job_id}"
        staging = f"{workdir}/runs/.starting-{job_id}"
        argv = [python, "-m", f"remote.{worker}", *args]
        # handle.json without pid and start ticks, which the shell fills in: '{"pid": P, "start_ticks": T, ' + rest
        rest = json.dumps({"format": HANDLE_FORMAT, "host": self.host.name, "job_id": job_id, "worker": worker,
                           "run_dir": run_dir, "started_at": time.time(), "argv": argv}, sort_keys=True)[1:]
        q = shlex.quote
        # The worker waits until its run directory holds handle.json under the final name, then
        # becomes the worker (exec: same pid, same start ticks). If the start script dies first (a
        # dropped link), it gives up after ~30 s, removes the half-made directory and never runs.
        gate = ('i=0; while [ ! -e "$0" ]; do i=$((i+1)); if [ "$i" -gt 3000 ]; then rm -rf -- "$1"; exit 97; fi; '
                'sleep 0.01 2>/dev/null || sleep 1; done; shift; exec "$@"')
        command = shlex.join([
            "env", f"DFLASH_EVENTS={run_dir}/events.jsonl", f"DFLASH_RUN_DIR={run_dir}",
            "setsid", "nohup", "sh", "-c", gate, f"{run_dir}/handle.json", staging, *argv,
        ])
        # One backgrounded simple command, so $! is the worker itself (setsid does not fork: the
        # child of a non-interactive shell is no group leader) and its pid is also its group's.
        # mkdir of the staging directory is the lock against a concurrent start of the same id.
        script = "\n".join([
            "set -e", "umask 077",
            f"mkdir -p {q(workdir)}/runs",
            # A staging directory older than a minute is a start cut off before its worker could
            # run (the worker gives up after ~30 s): it no longer blocks the id.
            f"if [ -n \"$(find {q(staging)} -maxdepth 0 -mmin +1 2>/dev/null)\" ]; then rm -rf -- {q(staging)}; fi",
            f"if ! mkdir -m 700 {q(staging)} 2>/dev/null; then echo 'being started' >&2; exit {_EXISTS_STATUS}; fi",
            f"if [ -e {q(run_dir)} ]; then rmdir {q(staging)}; echo 'exists' >&2; exit {_EXISTS_STATUS}; fi",
            f"cd {q(code_dir)}",
            # The caller's environment (an API key among it) comes on stdin, a line per value: an
            # argv is world-readable in the host's process list, a shell's own variables are not.
            *(f"IFS= read -r {name}; export {name}" for name in (env or {})),
            # Opened here, not by the child: its directory is renamed while the child starts.
            f"exec 3>{q(staging)}/stdout.log 4>{q(staging)}/stderr.log",
            f"{command} </dev/null >&3 2>&4 3>&- 4>&- &",
            "pid=$!",
            "exec 3>&- 4>&-",
            'stat=$(cat "/proc/$pid/stat" 2>/dev/null || true)',
            'ticks=null',
            'if [ -n "$stat" ]; then set -- ${stat##*) }; ticks=${20}; fi',
            "printf '{\"pid\": %s, \"start_ticks\": %s, %s\\n' \"$pid\" \"$ticks\" "
            f"{q(rest)} > {q(staging)}/handle.json",
            f"mv {q(staging)} {q(run_dir)}",
            f"cat {q(run_dir)}/handle.json",
        ])
        result = await self.host.run(["sh", "-c", script], check=False,
                                     input="".join(f"{value}\n" for value in (env or {}).values()))
        if result.exit_status == _EXISTS_STATUS:
            how = "is being started" if "being started" in result.stderr else "already exists"
            raise JobExists(self.host.name, f"job {job_id} {how} ({run_dir}): attach to it instead of "
                                            f"starting it twice")
        if result.exit_status != 0:
            raise HostError(self.host.name, f"starting {worker} failed (exit {result.exit_status}): "
                                            f"{tail_text(result.stderr or result.stdout, 500)}")
        try:
            return replace(JobHandle.from_json(result.stdout.strip().splitlines()[-1]), host=self.host.name)
        except (ValueError, IndexError):
            raise HostError(self.host.name, f"starting {worker} printed no handle: {result.stdout!r}") from None

    def _check_id(self, job_id: str) -> None:
        if not JOB_ID.match(job_id):
            raise ValueError(f"{job_id!r} is not a job id")

    async def attach(self, job_id: str) -> JobHandle:
        """The handle of job `job_id` on this host, read from its run directory's handle.json (what
        a restarted console calls with the id it saved). JobNotFound when there is no such job."""
        self._check_id(job_id)
        runs = f"{await self.workdir()}/runs"
        data = await self._read_whole(f"{runs}/{job_id}/handle.json")
        if data is None:
            sftp = await self.host.sftp()
            with self.host.errors(f"looking for job {job_id}"):
                if await sftp.exists(f"{runs}/.starting-{job_id}"):
                    why = "is being started (or its start was cut off less than a minute ago)"
                elif await sftp.exists(f"{runs}/{job_id}"):
                    why = "has a run directory without handle.json (started by an older console?)"
                else:
                    why = f"does not exist under {runs}"
            raise JobNotFound(self.host.name, f"job {job_id} {why}")
        try:
            return replace(JobHandle.from_json(data.decode(errors="replace")), host=self.host.name)
        except ValueError as exc:
            raise HostError(self.host.name, f"job {job_id}: unreadable handle.json: {exc}") from None

    async def list(self) -> list[JobHandle]:
        """Every job on this host that has a handle, oldest first."""
        runs = f"{await self.workdir()}/runs"
        sftp = await self.host.sftp()
        with self.host.errors(f"listing {runs}"):
            try:
                names = await sftp.listdir(runs)
            except asyncssh.SFTPNoSuchFile:
                return []
        handles = []
        for name in sorted(n for n in names if JOB_ID.match(n)):
            data = await self._read_whole(f"{runs}/{name}/handle.json")
            if data is None:
                continue
            try:
                handles.append(replace(JobHandle.from_json(data.decode(errors="replace")), host=self.host.name))
            except ValueError as exc:
                log.warning("%s: %s/%s: unreadable handle.json: %s", self.host.name, runs, name, exc)
        return sorted(handles, key=lambda h: (h.started_at, h.job_id))

    async def _open(self, path: str) -> asyncssh.SFTPClientFile:
        # block_size=0: each read is one SFTP request, no parallel reads. asyncssh's parallel
        # reader leaves the sibling requests' ConnectionLost unretrieved when the link drops
        # mid-read ("Task exception was never retrieved").
        sftp = await self.host.sftp()
        return await sftp.open(path, "rb", block_size=0)

    async def _read_size(self, size: int) -> int:
        """`size` capped to what one SFTP read request may ask of this server."""
        limit = (await self.host.sftp()).limits.max_read_len or 16384
        return max(1, min(size, limit, _READ_CHUNK))

    async def _read(self, path: str, offset: int, size: int, *, of_process: bool = False) -> bytes:
        """Bytes of a remote file from offset, at most one read request's worth (b"" when the
        file does not exist yet). `of_process`: a /proc file, whose process may end between the
        open and the read: the server then answers a failure (ESRCH, "No such process"), and the
        file counts as gone (b"") like one never there."""
        await self.host.sftp()
        with self.host.errors(f"reading {path}"):
            try:
                async with await self._open(path) as f:
                    return await f.read(await self._read_size(size), offset)
            except asyncssh.SFTPNoSuchFile:
                return b""
            except asyncssh.SFTPFailure:
                if of_process:
                    return b""
                raise

    async def _read_whole(self, path: str, limit: int = 1 << 20) -> bytes | None:
        """A small remote file's bytes, read one request at a time; None when it does not exist."""
        await self.host.sftp()
        with self.host.errors(f"reading {path}"):
            try:
                async with await self._open(path) as f:
                    data = b""
                    while len(data) < limit and (chunk := await f.read(await self._read_size(limit - len(data)),
                                                                        len(data))):
                        data += chunk
                    return data
            except asyncssh.SFTPNoSuchFile:
                return None

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
        stat = await self._read(f"/proc/{handle.pid}/stat", 0, 4096, of_process=True)
        parsed = parse_start_ticks(stat.decode(errors="replace"))
        if parsed is None:
            return False
        state, ticks = parsed
        if handle.start_ticks is not None and ticks != handle.start_ticks:
            return False  # the pid now belongs to another process
        return state not in ("Z", "X")

    async def follow(self, handle: JobHandle, offset: int = 0,
                     stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S) -> AsyncIterator[tuple[int, dict]]:
        """Yield (offset after the event's line, event) for each complete event from `offset` on.

        Ends after the `exit` event. Raises JobDead when the process is gone without `exit`,
        JobStalledError when it is alive but no event (heartbeats included) came for
        `stall_timeout` seconds (None: never), and HostDisconnected when the link drops: resume with
        a new runner from the last offset. A line of any length is read whole (up to 256 MiB).
        """
        events_file: asyncssh.SFTPClientFile | None = None
        pending = bytearray()  # bytes after `offset` that are not a complete line yet
        checked_dead = False
        last_liveness = last_event_at = time.monotonic()
        last_event: dict | None = None
        size = await self._read_size(_READ_CHUNK)
        try:
            while True:
                data = b""
                with self.host.errors(f"reading {handle.events_path}"):
                    if events_file is None:  # kept open: each poll is then one round trip
                        # (absent until the worker writes its first event)
                        with contextlib.suppress(asyncssh.SFTPNoSuchFile):
                            events_file = await self._open(handle.events_path)
                    if events_file is not None:
                        data = await events_file.read(size, offset + len(pending))
                if data:
                    pending += data
                    checked_dead = False
                    if b"\n" in data:
                        events, used = split_events(bytes(pending))
                        del pending[:used]
                        for length, event in events:
                            offset += length
                            last_event, last_event_at = event, time.monotonic()
                            yield offset, event
                            if event.get("type") == "exit":
                                return
                    if len(pending) > _MAX_EVENT_LINE:
                        raise HostError(self.host.name, f"job {handle.job_id}: an event line longer than "
                                                        f"{_MAX_EVENT_LINE >> 20} MiB at byte {offset} of "
                                                        f"{handle.events_path}")
                    continue  # there may be more: read again at once
                now = time.monotonic()
                if checked_dead or now - last_liveness >= self.liveness_interval:
                    last_liveness = now
                    if not await self.is_alive(handle):
                        if checked_dead:  # read once more after seeing it gone: `exit` may just have landed
                            raise JobDead(self.host.name, handle, await self.stderr_tail(handle))
                        checked_dead = True
                        continue
                    if stall_timeout is not None and now - last_event_at >= stall_timeout:
                        raise JobStalledError(self.host.name, handle, now - last_event_at, last_event,
                                              await self.stderr_tail(handle))
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
        if handle.pid <= 1:  # `kill -- -1` would signal every process the user may signal
            raise ValueError(f"job {handle.job_id}: refusing to signal pid {handle.pid}")
        pid = str(handle.pid)
        script = f"kill -s {sig} -- -{pid} 2>/dev/null || kill -s {sig} {pid} 2>/dev/null || true"
        await self.host.run(["sh", "-c", script], check=False)

    async def cancel(self, handle: JobHandle, grace: float = 10.0,
                     kill_wait: float = DEFAULT_KILL_WAIT_S) -> JobStatus:
        """Send TERM, wait up to `grace` seconds for the worker to end, then KILL; return the status.

        A process in uninterruptible sleep (a hung driver call) outlives even KILL: after
        `kill_wait` seconds the status is returned as it is, with `survived_kill` set."""
        if await self.is_alive(handle):
            await self._signal(handle, "TERM")
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and await self.is_alive(handle):
                await asyncio.sleep(min(self.poll_interval, 0.1))
            if await self.is_alive(handle):  # checked again: never signal a reused pid
                await self._signal(handle, "KILL")
                deadline = time.monotonic() + kill_wait
                while await self.is_alive(handle):
                    if time.monotonic() >= deadline:
                        return replace(await self.status(handle), survived_kill=True,
                                       note=f"survived KILL: pid {handle.pid} still running {kill_wait:g} s after "
                                            f"SIGKILL (stuck in the kernel, e.g. a hung driver call)")
                    await asyncio.sleep(0.05)
        return await self.status(handle)


async def follow_with_reconnect(supervisor: HostSupervisor, handle: JobHandle, offset: int = 0,
                                poll_interval: float = 0.2, liveness_interval: float = 1.0,
                                connect_timeout: float | None = None,
                                stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
                                ) -> AsyncIterator[tuple[int, dict]]:
    """Follow a job through connection drops: after each drop, wait for the supervisor's next
    connection and resume from the last offset handled. JobDead, JobStalledError and a reconnect
    timeout propagate."""
    while True:
        host = await supervisor.wait_connected(connect_timeout)
        runner = JobRunner(host, poll_interval=poll_interval, liveness_interval=liveness_interval)
        try:
            async for new_offset, event in runner.follow(handle, offset, stall_timeout=stall_timeout):
                offset = new_offset
                yield offset, event
            return
        except HostDisconnected:
            await asyncio.sleep(poll_interval)  # the supervisor notices the drop and reconnects


# --- typed messages and outcomes ----------------------------------------------------------------------

JobMessage = JobProgress | JobLog | JobArtifact | JobResult | JobError | JobExit | JobStalled
_QUIET_TYPES = ("heartbeat",)  # events that only say "alive": no message
_ENVELOPE = ("type", "seq", "t")


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


class JobMessages:
    """Turns one job's events into the typed messages of `console.messages`, remembering its phase
    and each progress counter's previous reading (for the rate)."""

    def __init__(self, handle: JobHandle):
        self.handle = handle
        self.phase: str | None = None
        self._last: dict[str, tuple[float, float]] = {}  # progress key -> (t, done)

    def __call__(self, event: dict[str, Any]) -> JobMessage | None:
        """The message for `event`; None for heartbeats."""
        ids = (self.handle.job_id, self.handle.worker, self.handle.host)
        kind = event.get("type")
        t = _number(event.get("t"))
        if kind == "progress":
            key = str(event.get("key", ""))
            done = _number(event.get("done")) or 0.0
            rate = None
            previous = self._last.get(key)
            if previous is not None and t is not None and t > previous[0] and done >= previous[1]:
                rate = (done - previous[1]) / (t - previous[0])
            if t is not None:
                self._last[key] = (t, done)
            label = event.get("label")
            return JobProgress(*ids, done=done, total=_number(event.get("total")), unit=str(event.get("unit", "")),
                               rate=rate, phase=self.phase, message=None if label is None else str(label),
                               key=key, t=t)
        if kind == "phase":
            self.phase = str(event.get("name", ""))
            return JobLog(*ids, level="info", message=self.phase, kind="phase", phase=self.phase, t=t)
        if kind == "log":
            level = event.get("level") if event.get("level") in ("info", "warning", "error") else "info"
            return JobLog(*ids, level=str(level), message=str(event.get("msg", "")), phase=self.phase, t=t)
        if kind == "artifact":
            details = {k: v for k, v in event.items() if k not in (*_ENVELOPE, "path", "kind")}
            return JobArtifact(*ids, path=str(event.get("path", "")), kind=str(event.get("kind", "")), details=details)
        if kind == "result":
            return JobResult(*ids, data=event.get("data"))
        if kind == "error":
            where = event.get("where")
            return JobError(*ids, message=str(event.get("msg", "")), where=None if where is None else str(where))
        if kind == "exit":
            code = event.get("code")
            return JobExit(*ids, code=code if isinstance(code, int) and not isinstance(code, bool) else 1)
        if kind in _QUIET_TYPES:
            return None
        if kind == "invalid":
            return JobLog(*ids, level="warning", message=f"unreadable event line: {str(event.get('raw'))[:300]}",
                          kind="invalid", phase=self.phase, t=t)
        # Another event type (e.g. extract's `gpu_released`): a log line of that kind, with its fields.
        fields = {k: v for k, v in event.items() if k not in _ENVELOPE}
        text = ", ".join(f"{k}={v}" for k, v in fields.items())
        return JobLog(*ids, level="info", message=f"{kind}" + (f": {text[:300]}" if text else ""),
                      kind=str(kind), phase=self.phase, t=t)

    def stalled(self, exc: JobStalledError) -> JobStalled:
        """The message for a job that `follow` found stalled."""
        return JobStalled(self.handle.job_id, self.handle.worker, self.handle.host, exc.silent_s,
                          exc.last_event, exc.stderr_tail)


_TRANSLATORS: OrderedDict[tuple[str, str], JobMessages] = OrderedDict()
_TRANSLATORS_KEPT = 64


def job_message(handle: JobHandle, event: dict[str, Any], state: JobMessages | None = None) -> JobMessage | None:
    """The typed message for one of the job's events (None for heartbeats). Rates and the phase need
    the job's earlier events: pass the job's `JobMessages`, or let this keep one per job (the last
    64 jobs)."""
    if state is None:
        key = (handle.host, handle.job_id)
        state = _TRANSLATORS.pop(key, None) or JobMessages(handle)
        _TRANSLATORS[key] = state
        while len(_TRANSLATORS) > _TRANSLATORS_KEPT:
            _TRANSLATORS.popitem(last=False)
    return state(event)


@dataclass(frozen=True)
class JobOutcome:
    """How a job ended, as `collect` saw it to the end."""

    handle: JobHandle
    state: Literal["exited", "dead", "stalled"]
    exit_code: int | None  # None unless it exited
    result: Any = None  # the `result` event's data
    artifacts: tuple[JobArtifact, ...] = ()
    error: str | None = None  # the `error` event, the exit status with stderr, or why dead / stalled
    stderr_tail: str = ""
    offset: int = 0  # after the last event handled (resume `follow` from here)

    @property
    def ok(self) -> bool:
        return self.state == "exited" and self.exit_code == 0 and self.error is None


async def collect(source: JobRunner | HostSupervisor, handle: JobHandle,
                  on_message: Callable[[JobMessage], Any] | None = None, offset: int = 0,
                  stall_timeout: float | None = DEFAULT_STALL_TIMEOUT_S,
                  connect_timeout: float | None = None) -> JobOutcome:
    """Follow the job to its end and say how it ended; every message goes to `on_message` (which
    may be async). `source`: a JobRunner (a drop raises HostDisconnected) or a HostSupervisor
    (followed through drops). A dead or stalled job is an outcome, not an exception."""
    translate = JobMessages(handle)
    if isinstance(source, JobRunner):
        events = source.follow(handle, offset, stall_timeout=stall_timeout)
    else:
        events = follow_with_reconnect(source, handle, offset, connect_timeout=connect_timeout,
                                       stall_timeout=stall_timeout)

    async def tell(message: JobMessage) -> None:
        if on_message is not None:
            answer = on_message(message)
            if asyncio.iscoroutine(answer) or isinstance(answer, asyncio.Future):
                await answer

    result: Any = None
    artifacts: list[JobArtifact] = []
    error: str | None = None
    code: int | None = None
    try:
        async for new_offset, event in events:
            offset = new_offset
            message = translate(event)
            if message is None:
                continue
            if isinstance(message, JobResult):
                result = message.data
            elif isinstance(message, JobArtifact):
                artifacts.append(message)
            elif isinstance(message, JobError):
                error = message.message
            elif isinstance(message, JobExit):
                code = message.code
            await tell(message)
    except JobDead as exc:
        return JobOutcome(handle, "dead", None, result, tuple(artifacts), str(exc), exc.stderr_tail, offset)
    except JobStalledError as exc:
        await tell(translate.stalled(exc))
        return JobOutcome(handle, "stalled", None, result, tuple(artifacts), str(exc), exc.stderr_tail, offset)
    tail = ""
    if code != 0:
        runner = source if isinstance(source, JobRunner) else JobRunner(await source.wait_connected(connect_timeout))
        tail = await runner.stderr_tail(handle)
        if error is None:
            error = f"exited with status {code}" + (f"; stderr ends with: {tail_text(tail, 400)}" if tail else "")
    return JobOutcome(handle, "exited", code, result, tuple(artifacts), error, tail, offset)
