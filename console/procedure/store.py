"""The run store: one directory per run of the procedure, enough to audit it and to resume it.

    <runs>/<run_id>/state.json       where the run stands (`state.RunState`), rewritten atomically
    <runs>/<run_id>/journal.jsonl    append-only and fsynced: every decision, command, exit and step
    <runs>/<run_id>/telemetry.jsonl  the telemetry samples seen during the run (window chart, replay)
    <runs>/<run_id>/results/         the evaluation's results fetched from the eval host
    <runs>/<run_id>/report.md|json   the report
    <runs>/<run_id>/claim.json       the console acting on the run now (claim.py), while it does

`<runs>` is the user data dir's `runs/` (platformdirs) unless `--runs DIR` (or DFLASH_OPS_RUNS)
names another. A run id sorts by time: `20261201-091500-ab12`.

Writing the store can fail (a full disk). Before the service is stopped that fails the run: nothing
has changed yet. Once the service is down, from the first save of a run opened with the service down
(`run --resume`, `r`), and whenever a run ends (`Run.keep_going_on_write_errors`), a failed write is
said once on stderr and kept in memory, and the run goes on: ending our jobs, the restart and the
lock's release need no disk of ours.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from console.messages import JournalEntry
from console.procedure import identity
from console.procedure.state import RUN_FINISHED, SCHEMA, Owner, RunState, StateError, current_user
from remote.artifacts import write_bytes_atomic

if TYPE_CHECKING:
    from console.config import Config

STATE, JOURNAL, TELEMETRY = "state.json", "journal.jsonl", "telemetry.jsonl"
FINISHED = RUN_FINISHED
STATE_FORMAT = SCHEMA


class RunStoreError(Exception):
    """A run directory that cannot be used; the message names it."""


class StoreWriteError(RunStoreError):
    """The store could not be written (the message names the path and the OS error)."""


class UnfinishedRun(LookupError):
    """A new run was asked for while an earlier one has not finished: that one comes first (resume
    or discard it); the message says which and how (`what_next`)."""

    def __init__(self, run: Run):
        head = (f"run {run.run_id} is in progress" if driven_elsewhere(run.state) is not False
                else f"unfinished run {run.run_id}: resume / discard")
        super().__init__(f"{head}. {what_next(run)}; no new run starts while it is unfinished (it may hold the "
                         f"host's lock and jobs)")
        self.run_id, self.run = run.run_id, run


class Run:
    """One run's directory: its typed state (saved whole), journal and telemetry log."""

    def __init__(self, directory: Path, state: RunState):
        self.dir = directory
        self.state = state
        self.user = current_user()
        self.keep_going_on_write_errors = False
        self.write_errors: list[str] = []  # what could not be written (said once each on stderr)
        self.unwritten: list[dict[str, Any]] = []  # journal entries kept in memory after a failed write
        self._telemetry: Any = None
        self._journal_checked = False

    @property
    def run_id(self) -> str:
        return self.state.run_id

    @property
    def results_dir(self) -> Path:
        return self.dir / "results"

    def failed_write(self, what: Path, exc: OSError) -> None:
        message = f"cannot write {what}: {exc.strerror or exc}"
        if not self.keep_going_on_write_errors:
            raise StoreWriteError(message) from exc
        if message not in self.write_errors:
            self.write_errors.append(message)
            print(f"dflash-ops: {message} (the run goes on; what it records is kept in memory)", file=sys.stderr)

    def save(self) -> None:
        """Write state.json atomically (temp file, fsync, rename): a crash leaves the old or the new."""
        self.state.updated_at = time.time()
        try:
            write_bytes_atomic(self.dir / STATE, self.state.dumps())
        except OSError as exc:
            self.failed_write(self.dir / STATE, exc)

    def _append(self, record: dict[str, Any]) -> None:
        path = self.dir / JOURNAL
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if not self._journal_checked:
                self._journal_checked = True
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":
                    # A crash cut the last line mid-write: the next entry starts on a line of its own.
                    note = {"t": time.time(), "run_id": self.run_id, "user": self.user, "level": "warning",
                            "message": "the journal's last line was cut mid-write (a crash): a new line begins here"}
                    os.write(fd, ("\n" + json.dumps(note, sort_keys=True) + "\n").encode())
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def journal(self, step: str | None, message: str, **fields: Any) -> JournalEntry:
        """Append one entry to journal.jsonl and fsync it before returning."""
        entry = JournalEntry(t=time.time(), run_id=self.run_id, step=step, message=message,
                             user=fields.pop("user", self.user), **fields)
        record = {k: v for k, v in dataclasses.asdict(entry).items() if v is not None}
        try:
            self._append(record)
        except OSError as exc:
            self.unwritten.append(record)
            self.failed_write(self.dir / JOURNAL, exc)
        return entry

    def read_journal(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / JOURNAL) + list(self.unwritten)

    def record_telemetry(self, host: str, sample: Any, extra: dict[str, Any] | None = None) -> None:
        """Append a telemetry sample (not fsynced: losing the last second of a chart is fine)."""
        record = {"host": host, "t": time.time(), **(extra or {})}
        if sample is not None:
            record["sample"] = dataclasses.asdict(sample)
        try:
            if self._telemetry is None:
                self._telemetry = open(self.dir / TELEMETRY, "a", encoding="utf-8")  # noqa: SIM115 - kept open
            self._telemetry.write(json.dumps(record) + "\n")
            self._telemetry.flush()
        except OSError:
            pass  # a chart's samples are the first thing to give up on a full disk

    def close(self) -> None:
        if self._telemetry is not None:
            with contextlib.suppress(OSError):
                self._telemetry.close()
            self._telemetry = None


def for_replay_only(record: dict[str, Any]) -> bool:
    """A journal record the engine wrote for the replay and never showed in the event log: a job's
    progress and exit, the service's state, a step's start (Engine.record)."""
    kind = record.get("kind")
    return kind in ("job-progress", "job-exit", "service") or (
        kind == "step" and record.get("status") == "running" and str(record.get("message", "")).endswith(": running"))


def journal_entry(record: dict[str, Any], run_id: str) -> JournalEntry | None:
    """A journal line as the message the engine published when it wrote it (the follower and the
    replay read the journal through this); None when it is not one."""
    if "message" not in record:
        return None
    names = {f.name for f in dataclasses.fields(JournalEntry)}
    known = {k: v for k, v in record.items() if k in names}
    known.setdefault("t", 0.0)
    known.setdefault("run_id", run_id)
    known.setdefault("step", None)
    if isinstance(known.get("argv"), list):
        known["argv"] = tuple(known["argv"])
    try:
        return JournalEntry(**known)
    except TypeError:
        return None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of `path` (a torn line, from a crash, is left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


@dataclass(frozen=True)
class RunSummary:
    """A line of `dflash-ops runs`."""

    run_id: str
    created_at: float
    status: str
    route: str | None
    downtime_s: float | None
    headline: dict[str, float]  # drafter -> vanilla tau (macro)
    config: str | None
    dir: Path
    service_down: bool = False  # this run stopped the service and it has not been seen ready since
    console_gone: bool = False  # status "running" but its console is no longer there
    online: dict[str, float] = field(default_factory=dict)  # drafter -> online tau (the cross-check)
    forecast_s: float | None = None  # the downtime forecast before the stop (of its last window)
    windows: int = 1  # down periods (more than one when a window was cut short at its budget)
    server_paused: bool = False  # the pause route: this run paused the server (or released its memory), not given back
    drained: str | None = None  # the fleet window: the replica this run took out of the router, not put back
    # The forecast's error on the downtime of its last window ((forecast - measured) / measured), the
    # measured left without the time the window waited on the operator's answers (`answers_s`), as
    # the forecast is: seen, not assumed.
    forecast_error: float | None = None
    answers_s: float = 0.0
    # The served drafter's acceptance length (before, after) when the window left it degraded (steps/drafter.py).
    drafter_fell: tuple[float, float] | None = None


@dataclass(frozen=True)
class UnreadableRun:
    """A run directory whose state cannot be read: listed as such, never hiding the others."""

    run_id: str
    dir: Path
    why: str


class RunStore:
    """The runs directory."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).expanduser() if root is not None else default_runs_dir()

    def create(self, config_path: str | None, config_sha256: str | None) -> Run:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
            directory = self.root / run_id
            directory.mkdir(mode=0o700)
        except OSError as exc:
            raise StoreWriteError(f"cannot create a run under {self.root}: {exc.strerror or exc}") from None
        run = Run(directory, RunState(run_id=run_id, created_at=time.time(), config=config_path,
                                      config_sha256=config_sha256))
        try:
            run.save()
        except StoreWriteError as exc:
            raise StoreWriteError(f"cannot start a run in {directory}: {exc}") from None
        return run

    def open(self, run_id: str) -> Run:
        directory = self.root / run_id
        if not (directory / STATE).exists():
            directory = Path(run_id).expanduser()  # a path to a run directory works too
        path = directory / STATE
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise RunStoreError(f"no run {run_id!r}: {self.root / run_id / STATE} does not exist") from None
        except OSError as exc:
            raise RunStoreError(f"{path}: cannot be read ({exc.strerror or exc})") from None
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise RunStoreError(f"{path}: not a run state (not JSON: {exc})") from None
        try:
            return Run(directory, RunState.from_json(data, str(path)))
        except StateError as exc:
            raise RunStoreError(str(exc)) from None

    def run_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / STATE).is_file())

    def readable(self) -> list[Run]:
        """Every run whose state can be read, oldest first (the unreadable ones: `summaries`)."""
        runs = []
        for run_id in self.run_ids():
            try:
                runs.append(self.open(run_id))
            except RunStoreError:
                continue
        return runs

    def latest_unfinished(self, runs: list[Run] | None = None) -> Run | None:
        """The newest run that has not finished (running, paused), whatever the service's state
        (`runs`: the store's readable runs, oldest first, when the caller has them already)."""
        for run in reversed(self.readable() if runs is None else runs):
            if not run.state.finished:
                return run
        return None

    def left_down(self, runs: list[Run] | None = None, service: Any = None) -> Run | None:
        """The run that left the service down, or paused with its memory released (the pause
        route), whatever its status (failed, refused and cancelled runs too): the newest whose stop
        was not followed by the service coming back ready, or whose pause by its continue.
        `run.state.service.left_as()` says which ("down" | "paused"). The banner, `status`, `r`,
        quit, `drill` and `run` all ask this one question. `service` (a `Config`): only the runs
        that address its service (`identity.same_service`), so that `r` under one config never
        takes another service's run for its own."""
        for run in reversed(self.readable() if runs is None else runs):
            if run.state.service.left_as() is not None and (
                    service is None or identity.same_service(run.state.service_identity, service)):
                return run
        return None

    def discard(self, run: Run, config: Config | None) -> list[str]:
        """Mark an unfinished run `discarded` (finished: never resumed, no longer offered) and say
        what it leaves on the hosts (`left_on_hosts`; without a config, less precisely): nothing
        there is touched. Refused for a run that left the service down (its resume restarts it) or
        that a live console drives."""
        state = run.state
        if state.finished:
            raise RunStoreError(f"run {run.run_id} has already finished ({state.status}): nothing to discard")
        if state.service.left_as() is not None:  # down, paused (the pause route) or drained (the fleet window)
            raise RunStoreError(f"run {run.run_id} left the service down: it is not discarded; "
                                f"`dflash-ops run --resume {run.run_id}` restarts the service")
        if driven_elsewhere(state) is not False:
            raise RunStoreError(f"{what_next(run)}: it is not discarded")
        left = left_on_hosts(state, config)
        was = state.status
        state.status, state.exit_code = "discarded", None
        state.message = f"discarded by {current_user()} (it was {was}); left on the hosts: " + "; ".join(left)
        run.save()
        run.journal(None, state.message, level="warning")
        return left

    def to_resume(self, runs: list[Run] | None = None) -> Run | None:
        """What a new console offers to continue: the run that left the service down, else the
        newest unfinished one."""
        runs = self.readable() if runs is None else runs
        return self.left_down(runs) or self.latest_unfinished(runs)

    def unreadable(self) -> list[UnreadableRun]:
        """Every run directory whose state cannot be read, oldest first, each with why."""
        return [s for s in self.summaries() if isinstance(s, UnreadableRun)]

    def run_to_resume(self) -> Run:
        """What `run --resume` (no RUN) continues: `to_resume()`. A damaged state.json newer than it
        (or any, when nothing readable is left to resume) may be the run to resume, the one that left
        the service down: it is named with why it cannot be resumed, never passed over in silence."""
        run = self.to_resume()
        damaged = [u for u in self.unreadable() if run is None or u.run_id > run.run_id]
        if damaged:
            older = (f"; `dflash-ops run --resume {run.run_id}` resumes the older run {run.run_id}" if run is not None
                     else "")
            raise RunStoreError("; ".join(f"run {u.run_id} cannot be resumed: {u.why}" for u in damaged)
                                + " (it may be the run that left the service down: repair its state.json, or move "
                                  f"its directory out of {self.root}){older}")
        if run is None:
            raise LookupError(f"no unfinished run to resume in {self.root}")
        return run

    def summaries(self) -> list[RunSummary | UnreadableRun]:
        out: list[RunSummary | UnreadableRun] = []
        for run_id in self.run_ids():
            try:
                run = self.open(run_id)
            except RunStoreError as exc:
                out.append(UnreadableRun(run_id, self.root / run_id, str(exc)))
                continue
            out.append(summary_of(run))
        return out


class CachedStore:
    """The store's readable runs for a view that looks often (the follower, once a second): each
    state.json is parsed again only when it changed (its mtime, size or inode: the store replaces
    it whole), so an idle store costs a directory listing and a stat per run. Read-only: the runs
    it returns are never saved."""

    def __init__(self, store: RunStore):
        self.store = store
        self._seen: dict[str, tuple[tuple[int, int, int], Run | None]] = {}

    def runs(self) -> list[Run]:
        """The readable runs, oldest first (an unreadable one is left out, as `readable()` does)."""
        seen: dict[str, tuple[tuple[int, int, int], Run | None]] = {}
        for run_id in self.store.run_ids():
            try:
                st = (self.store.root / run_id / STATE).stat()
            except OSError:  # removed meanwhile
                continue
            key = (st.st_mtime_ns, st.st_size, st.st_ino)
            cached = self._seen.get(run_id)
            if cached is not None and cached[0] == key:
                seen[run_id] = cached
                continue
            try:
                seen[run_id] = (key, self.store.open(run_id))
            except RunStoreError:
                seen[run_id] = (key, None)
        self._seen = seen
        return [run for _, run in seen.values() if run is not None]

    def to_resume(self) -> Run | None:
        return self.store.to_resume(self.runs())


def summary_of(run: Run) -> RunSummary:
    s = run.state
    downtimes = [w["service"].get("ready_at", 0) - w["service"].get("stopped_at", 0) for w in s.windows
                 if w.get("service", {}).get("stopped_at") and w["service"].get("ready_at")]
    if s.service.stopped_at and s.service.ready_at:
        downtimes.append(s.service.ready_at - s.service.stopped_at)
    if s.service.paused_at and s.service.continued_at:  # the pause route: pause -> continue
        downtimes.append(s.service.continued_at - s.service.paused_at)
    gone = s.status == "running" and s.owner is not None and s.owner.alive() is False
    online = s.facts.get("headline_online") if isinstance(s.facts.get("headline_online"), dict) else {}
    online = online_headline(run.dir) or online  # a later `dflash-ops crosscheck` keeps its result there
    error, answers = forecast_error(s)
    # the pause route's forecast (pause -> continue) is its own, kept beside the facts it was made from
    made = s.facts.get("pause_forecast") if s.route == "pause" else s.forecast
    return RunSummary(s.run_id, s.created_at, s.status, s.route, sum(downtimes) if downtimes else None,
                      dict(s.headline), s.config, run.dir, service_down=s.service.down, console_gone=gone,
                      online=dict(online), forecast_s=(made if isinstance(made, dict) else {}).get("downtime_s"),
                      windows=len(s.windows) + (1 if s.service.began() else 0) or 1,
                      server_paused=s.service.left_as() == "paused",
                      drained=(s.service.drained or {}).get("replica", "?") if s.service.drained else None,
                      forecast_error=error, answers_s=answers, drafter_fell=drafter_fell(s.facts))


def drafter_fell(facts: dict[str, Any]) -> tuple[float, float] | None:
    record = facts.get("drafter")
    if not isinstance(record, dict) or not record.get("degraded"):
        return None
    return float(record["before"]), float(record["after"])


def forecast_error(state: RunState) -> tuple[float | None, float]:
    """The forecast's error on the last window's downtime, and the time that window waited on the
    operator's answers (left out of both); (None, 0) without a forecast and a measured downtime."""
    from console.procedure import forecast as fc

    try:
        whole, answers = fc.error_of(state)
    except (KeyError, TypeError, ValueError, StopIteration):  # a damaged forecast in the state: no error to tell
        return None, 0.0
    return (whole.error if whole is not None else None), answers


def left_line(run: Run) -> str:
    """How `run` left the server, in one line every view says the same way: "SERVICE DOWN since
    09:31:02 (94 s): stopped by run X" or "PAUSED: memory released by run X (kv_cache, cuda_graph)
    since 09:31:02 (12 s)"."""
    svc = run.state.service
    if svc.left_as() == "drained":
        drained = svc.drained or {}
        since = drained.get("since") or time.time()
        return (f"DRAINED by run {run.run_id}: replica {drained.get('replica', '?')} out of the router "
                f"{drained.get('router', '?')} since {time.strftime('%H:%M:%S', time.localtime(since))} "
                f"({time.time() - since:.0f} s)")
    if svc.left_as() == "paused":
        since = svc.paused_at or svc.released_at or time.time()
        released = svc.released or svc.releasing
        what = (f"memory released by run {run.run_id} ({', '.join(released)})" if released
                else f"requests held by run {run.run_id}")
        return f"PAUSED: {what} since {time.strftime('%H:%M:%S', time.localtime(since))} ({time.time() - since:.0f} s)"
    since = svc.stopped_at or time.time()
    return (f"SERVICE DOWN since {time.strftime('%H:%M:%S', time.localtime(since))} ({time.time() - since:.0f} s): "
            f"stopped by run {run.run_id}")


def paused_by(run: Run | None) -> str | None:
    """"run X" while `run` holds the server paused (the pause route: paused or memory released, not
    given back), else None: what the service watch names instead of probing /health."""
    if run is None or run.state.service.left_as() != "paused":
        return None
    return f"run {run.run_id}"


def what_next(run: Run) -> str:
    """What can be done with `run`, one rule said the same way by `run`, `status`, `report`, the
    console and `discard`: a finished run is never resumed (one that left the service down is only
    restarted); an unfinished one is resumed or discarded, unless a live console drives it."""
    s, rid = run.state, run.run_id
    owner = s.owner
    alive = driven_elsewhere(s)
    if owner is not None and alive is not False:  # driven now (down, paused or drained by it): never --resume
        where = "" if alive else " (on another machine: cannot tell from here whether it still runs)"
        return (f"run {rid} is {s.status}, driven by {owner.describe()}{where}: `dflash-ops console --read-only` "
                f"follows it")
    if s.service.left_as() == "drained":
        return (f"run {rid} left replica {(s.service.drained or {}).get('replica', '?')} out of the router "
                f"({s.status}): `dflash-ops run --resume {rid}` finishes its window and puts it back (`r` in the "
                f"console)")
    if s.service.left_as() == "paused":
        return (f"run {rid} left the server paused ({s.status}): `dflash-ops run --resume {rid}` resumes the memory "
                f"it released and lets the server take requests again (`r` in the console)")
    if s.finished:
        if s.service.down:
            return (f"run {rid} ended {s.status} with the service down: `dflash-ops run --resume {rid}` restarts "
                    f"the service (a finished run is never run again)")
        back = s.service.given_back_by if s.service.pauses and s.service.continued_at else None
        return (f"run {rid} ended {s.status}: a finished run is never resumed; `dflash-ops run` starts a new one"
                + (f" (its server's memory was given back by {back} at "
                   f"{time.strftime('%H:%M:%S', time.localtime(s.service.continued_at))})" if back else ""))
    gone = ", its console is gone" if s.status == "running" and owner is not None else ""
    restarts = " and restarts the service" if s.service.down else ""
    return (f"run {rid} has not finished ({s.status}{gone}): `dflash-ops run --resume {rid}` continues it{restarts}"
            + ("" if s.service.down else f", `dflash-ops run --discard {rid}` discards it"))


def driven_elsewhere(state: RunState) -> bool | None:
    """Whether a live console drives the run now (None: its console is on another machine, which
    cannot be told from here; False for a finished or paused run, or one whose console is gone)."""
    if state.finished or state.status != "running" or state.owner is None:
        return False
    return state.owner.alive()


def owned_elsewhere(state: RunState) -> bool:
    """A live console other than this process drives the run, or one that cannot be told (on
    another machine): a resume, `r` or a discard from here is refused before anything is written
    or sent. This process's own earlier engine (a console reopening its run) is not another. Two
    consoles that check at the same moment both pass: the engine's claim (claim.py) decides between
    them before anything is sent."""
    if driven_elsewhere(state) is False:
        return False
    owner, me = state.owner, Owner.this_process()
    return not (owner.pid == me.pid and owner.host == me.host and owner.start_ticks in (None, me.start_ticks))


def left_on_hosts(state: RunState, config: Config | None) -> list[str]:
    """What a run leaves on the hosts when it is discarded: its jobs (pid, where their files are),
    its window directories (each host's workdir, as `config` says it) and the host lock that may
    still name it. Said, never touched."""
    workdirs: dict[str, str] = {}
    service_host = lock_dir = None
    if config is not None:
        workdirs = {name: host.workdir for name, host in config.hosts.items() if host.workdir is not None}
        service_host = config.service.host
        service = config.hosts.get(service_host)
        lock_dir = service.lock_dir if service is not None else None
    left = []
    for key, job in sorted(state.jobs.items()):
        handle = job.handle or {}
        if job.exit_code is not None:
            left.append(f"job {key} ({job.job_id}) on {job.host}: ended (exit {job.exit_code}), its files in "
                        f"{handle.get('run_dir', '?')}")
        elif handle:
            left.append(f"job {key} ({job.job_id}) on {job.host}: pid {handle.get('pid')}, maybe still running "
                        f"(not ended: `kill {handle.get('pid')}` on {job.host} ends it), its files in "
                        f"{handle.get('run_dir', '?')}")
    for host, workdir in sorted(workdirs.items()):
        left.append(f"its window files on {host}: {workdir}/windows/{state.run_id} (if any)")
    # The lock is in the host's lock directory, shared by every account (`[hosts.<name>] lock_dir`):
    # named whole when the config says it, else as the setting to look up.
    where = (f"{service_host or 'the service host'}:{lock_dir}/dflash-ops.lock" if lock_dir is not None else
             f"dflash-ops.lock in {service_host or 'the service host'}'s lock_dir (/var/tmp unless set)")
    left.append(f"the host lock {where} if it still names this run (the next run takes it over, its console "
                f"being gone)")
    return left


def online_headline(run_dir: Path) -> dict[str, float]:
    """{drafter: online tau} of the run's crosscheck.json (the command writes it, never state.json,
    which is the engine's); empty when there is none or it cannot be read."""
    try:
        data = json.loads((run_dir / "crosscheck.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or not isinstance(data.get("drafter"), str) \
            or not isinstance(data.get("tau"), int | float) or isinstance(data.get("tau"), bool):
        return {}
    return {data["drafter"]: float(data["tau"])}


def default_runs_dir() -> Path:
    env = os.environ.get("DFLASH_OPS_RUNS")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("dflash-ops")) / "runs"
