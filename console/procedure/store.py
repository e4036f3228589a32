"""The run store: one directory per run of the procedure, enough to audit it and to resume it.

    <runs>/<run_id>/state.json       where the run stands, rewritten atomically after every transition
    <runs>/<run_id>/journal.jsonl    append-only and fsynced: every decision, command, exit and step
    <runs>/<run_id>/telemetry.jsonl  the telemetry samples seen during the run (window chart, replay)
    <runs>/<run_id>/results/         the evaluation's results fetched from the eval host
    <runs>/<run_id>/report.md|json   the report

`<runs>` is the user data dir's `runs/` (platformdirs) unless `--runs DIR` (or DFLASH_OPS_RUNS)
names another. A run id sorts by time: `20261201-091500-ab12`.
"""

from __future__ import annotations

import dataclasses
import getpass
import json
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console.messages import JournalEntry
from remote.artifacts import write_json_atomic

STATE_FORMAT = "dflash-ops.run/1"
STATE, JOURNAL, TELEMETRY = "state.json", "journal.jsonl", "telemetry.jsonl"
FINISHED = ("done", "failed", "refused", "cancelled")


class RunStoreError(Exception):
    """A run directory that cannot be used; the message names it."""


def default_runs_dir() -> Path:
    env = os.environ.get("DFLASH_OPS_RUNS")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_data_dir("dflash-ops")) / "runs"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container): the uid says who
        return f"uid {os.getuid()}"


class Run:
    """One run's directory: its state (a plain dict, saved whole), journal and telemetry log."""

    def __init__(self, directory: Path, state: dict[str, Any]):
        self.dir = directory
        self.state = state
        self.user = _user()
        self._telemetry: Any = None

    @property
    def run_id(self) -> str:
        return self.state["run_id"]

    @property
    def results_dir(self) -> Path:
        return self.dir / "results"

    def save(self) -> None:
        """Write state.json atomically (temp file, fsync, rename): a crash leaves the old or the new."""
        self.state["updated_at"] = time.time()
        write_json_atomic(self.dir / STATE, self.state)

    def step(self, name: str) -> dict[str, Any]:
        """The state of step `name` (created pending)."""
        return self.state.setdefault("steps", {}).setdefault(name, {"status": "pending"})

    def journal(self, step: str | None, message: str, **fields: Any) -> JournalEntry:
        """Append one entry to journal.jsonl and fsync it before returning."""
        entry = JournalEntry(t=time.time(), run_id=self.run_id, step=step, message=message,
                             user=fields.pop("user", self.user), **fields)
        record = {k: v for k, v in dataclasses.asdict(entry).items() if v is not None}
        fd = os.open(self.dir / JOURNAL, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(record, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return entry

    def read_journal(self) -> list[dict[str, Any]]:
        return read_jsonl(self.dir / JOURNAL)

    def record_telemetry(self, host: str, sample: Any, extra: dict[str, Any] | None = None) -> None:
        """Append a telemetry sample (not fsynced: losing the last second of a chart is fine)."""
        if self._telemetry is None:
            self._telemetry = open(self.dir / TELEMETRY, "a", encoding="utf-8")  # noqa: SIM115 - kept open
        record = {"host": host, "t": time.time(), **(extra or {})}
        if sample is not None:
            record["sample"] = dataclasses.asdict(sample)
        self._telemetry.write(json.dumps(record) + "\n")
        self._telemetry.flush()

    def close(self) -> None:
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The complete JSON lines of `path` (a torn last line, from a crash, is left out)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
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


class RunStore:
    """The runs directory."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root).expanduser() if root is not None else default_runs_dir()

    def create(self, config_path: str | None, config_sha256: str | None) -> Run:
        self.root.mkdir(parents=True, exist_ok=True)
        run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        directory = self.root / run_id
        directory.mkdir(mode=0o700)
        state = {"format": STATE_FORMAT, "run_id": run_id, "created_at": time.time(), "status": "running",
                 "config": config_path, "config_sha256": config_sha256, "steps": {}, "jobs": {}, "facts": {},
                 "service": {}}
        run = Run(directory, state)
        run.save()
        return run

    def open(self, run_id: str) -> Run:
        directory = self.root / run_id
        if not (directory / STATE).exists():
            directory = Path(run_id).expanduser()  # a path to a run directory works too
        path = directory / STATE
        try:
            state = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise RunStoreError(f"no run {run_id!r}: {self.root / run_id / STATE} does not exist") from None
        except json.JSONDecodeError as exc:
            raise RunStoreError(f"{path}: not a run state ({exc})") from None
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise RunStoreError(f"{path}: not a dflash-ops run state (format {state.get('format')!r})")
        return Run(directory, state)

    def run_ids(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if (p / STATE).is_file())

    def latest_unfinished(self) -> Run | None:
        for run_id in reversed(self.run_ids()):
            run = self.open(run_id)
            if run.state.get("status") not in FINISHED:
                return run
        return None

    def summaries(self) -> list[RunSummary]:
        out = []
        for run_id in self.run_ids():
            try:
                run = self.open(run_id)
            except RunStoreError:
                continue
            s = run.state
            service = s.get("service", {})
            downtime = None
            if service.get("stopped_at") and service.get("ready_at"):
                downtime = service["ready_at"] - service["stopped_at"]
            out.append(RunSummary(run_id, s.get("created_at", 0.0), s.get("status", "?"), s.get("route"), downtime,
                                  dict(s.get("headline", {})), s.get("config"), run.dir))
        return out
