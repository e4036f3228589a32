"""Replay a past run from its store: the bus's own messages, in the order and at the times they happened.

`read_recording(run_dir)` reads what the engine left in `runs/<id>/` and turns it into the typed
messages the console folds (console/messages.py), each at its time and with where it came from:

    journal.jsonl    every entry (the event log); the steps' ends ("extract: done: ..."); the questions
                     and their answers ("approved: stop the service", with host, argv, decision);
                     the jobs it started (with their argv) and their log lines; the run's end
    telemetry.jsonl  the GPU panels' samples (a host sending samples is a connected host)
    state.json       what the journal does not say: the plan and the forecast, when each step began
                     and its time working and waiting, when the service stopped and was ready again
                     (the DOWN banner), the jobs' ids and exit codes, when the GPUs were released

A fleet run's drain and rejoin also give the fleet panel's views, the drained replica out of the
router from its drain to its rejoin (console/procedure/replay_fleet.py).

`Player` walks the recording on a clock it is given (no sleeps of its own): play, pause, the next
event, a step's start, and the speed. The console's replay screen (screens/replay.py) and
`dflash-ops replay` are its views.

A damaged store replays up to the damage: the first line of journal.jsonl or telemetry.jsonl that is
not a complete JSON record (a crash cut it, a disk flipped it) ends the recording at the last good
record before it, and `Recording.damage` names the file and line. A line the store itself marked as
cut by a crash (the journal's next line says so) is an old crash, not damage. A state.json that is
missing or unreadable is damage too; the journal and telemetry are then replayed alone.

A journal written since the engine tags its entries (`kind`, docs/engine.md "The journal") says
itself each step's change with its status and the attempt's start, each question whole (impact,
estimate, when it was asked and answered), the jobs by id with their progress (throttled: at most
two a second per counter, and every phase change and milestone), their exits, and the service's
state; those are replayed from the journal, and state.json only adds what it alone keeps. Older
stores (tests/data/replay/) are replayed as before: the steps' ends and the answers read from the
entries' text, the jobs matched by host and argv, the milestones and final counts from state.json;
their questions have no impact or estimate and no time asked, and their jobs no progress before the
end. Never kept: the service panel's memory figures and the hosts' link drops.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from console import messages as m
from console.procedure.replay_fleet import fleet_events
from console.procedure.state import STEP_ENDED, RunState, StateError
from console.procedure.store import JOURNAL, STATE, TELEMETRY, for_replay_only, journal_entry
from console.telemetry import SampleError, parse_sample
from console.views.units import duration

CRASH_NOTE = "the journal's last line was cut mid-write"  # console/procedure/store.py: Run._append
SPEEDS = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)


class ReplayError(Exception):
    """A run directory that cannot be replayed at all (the message names it)."""


@dataclass(frozen=True)
class Damage:
    """Where a store is damaged: the file, its line (1-based; None for a whole file) and what is wrong."""

    file: str
    line: int | None
    why: str

    def __str__(self) -> str:
        return f"{self.file}{f' line {self.line}' if self.line else ''}: {self.why}"


@dataclass(frozen=True)
class Event:
    """One message of the recording, at `t` (epoch seconds, the run's clock), from `source`
    ("journal.jsonl:12", "telemetry.jsonl:40", "state.json")."""

    t: float
    message: Any
    source: str


@dataclass
class Recording:
    """A run's messages in time order, and what could not be read."""

    run_id: str
    run_dir: Path
    events: list[Event]
    damage: list[Damage] = field(default_factory=list)
    state: RunState | None = None
    cut_at: float | None = None  # the damage ends the recording here
    _memory: dict[tuple[str, int], tuple[list[float], list[int | None]]] | None = field(default=None, repr=False)

    @property
    def start(self) -> float:
        return self.events[0].t if self.events else 0.0

    @property
    def end(self) -> float:
        return self.events[-1].t if self.events else 0.0

    def step_starts(self) -> list[tuple[str, float]]:
        """(step, when it began) in time order: where a seek can go."""
        seen: dict[str, float] = {}
        for event in self.events:
            msg = event.message
            if isinstance(msg, m.StepUpdate) and msg.status == "running" and msg.step not in seen:
                seen[msg.step] = event.t
        return sorted(seen.items(), key=lambda kv: kv[1])

    def hosts(self) -> list[str]:
        """The hosts the run talked to, in the order they first appear (telemetry, then the journal)."""
        names: dict[str, None] = {}
        for event in self.events:
            if isinstance(event.message, m.TelemetryUpdate):
                names.setdefault(event.message.host)
        for event in self.events:
            host = getattr(event.message, "host", None)
            if isinstance(event.message, m.JournalEntry | m.DecisionMade) and host:
                names.setdefault(host)
        return list(names)

    def history(self, host: str, gpu: int, until: float, seconds: float | None = None) -> list[float | None]:
        """GPU `gpu` of `host`'s memory used (MiB) in the samples up to `until` (the sparkline)."""
        if self._memory is None:  # built once: a repaint looks it up, never walks every sample
            self._memory = {}
            for event in self.events:
                msg = event.message
                if isinstance(msg, m.TelemetryUpdate) and msg.sample is not None:
                    for g in msg.sample.gpus:
                        times, used = self._memory.setdefault((msg.host, g.index), ([], []))
                        times.append(event.t)
                        used.append(g.mem_used_mib)
        times, used = self._memory.get((host, gpu), ([], []))
        first = bisect.bisect_left(times, until - seconds) if seconds is not None else 0
        return used[first:bisect.bisect_right(times, until)]

    @property
    def results_dir(self) -> Path | None:
        return self.run_dir / "results" if (self.run_dir / "results" / "results.json").is_file() else None


def damage_report(recording: Recording) -> list[str]:
    """What is damaged (file and line) and where the replay stops because of it, in words."""
    lines = [f"damaged: {d}" for d in recording.damage]
    if recording.cut_at is not None:
        lines.append(f"replayed up to the damage: {time.strftime('%H:%M:%S', time.localtime(recording.cut_at))}, "
                     f"{duration(recording.cut_at - recording.start)} into the run")
    return lines


# --- reading the store -------------------------------------------------------------------------


def _lines(path: Path) -> tuple[list[tuple[int, dict[str, Any]]], Damage | None]:
    """(line number, record) of each complete JSON object line up to the first damaged one."""
    if not path.exists():
        return [], None
    data = path.read_bytes()
    records: list[tuple[int, dict[str, Any]]] = []
    lines = data.split(b"\n")
    cut_last = bool(data) and not data.endswith(b"\n")
    if not cut_last:
        lines = lines[:-1]  # after the last newline: nothing
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        why = None
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                why = f"a JSON {type(record).__name__}, not a record"
        except UnicodeDecodeError as exc:
            why = f"not UTF-8 ({exc.reason} at byte {exc.start})"
        except json.JSONDecodeError as exc:
            why = f"not complete JSON ({exc.msg} at column {exc.colno})"
        if number == len(lines) and cut_last:  # the last line has no end: a write cut short
            why = f"cut mid-write ({why or 'no end of line'})"
        if why is not None:
            if path.name == JOURNAL and number < len(lines) and CRASH_NOTE.encode() in lines[number]:
                continue  # the store marked it as cut by an old crash, and went on on the next line
            return records, Damage(path.name, number, why)
        records.append((number, record))
    return records, None


def _read_state(run_dir: Path) -> tuple[RunState | None, Damage | None]:
    path = run_dir / STATE
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        return None, Damage(STATE, None, "missing: the plan, the steps' starts and the downtime are not known")
    except OSError as exc:
        return None, Damage(STATE, None, f"cannot be read ({exc.strerror or exc})")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, Damage(STATE, None, f"not JSON ({exc})")
    try:
        return RunState.from_json(data, STATE), None
    except StateError as exc:
        return None, Damage(STATE, None, str(exc).removeprefix(f"{STATE}: "))


def telemetry_update(record: dict[str, Any]) -> m.TelemetryUpdate:
    """A telemetry.jsonl line (Run.record_telemetry: host, t, the sample as a dict) as the update
    the console drew; SampleError when it is not one."""
    host, sample = record.get("host"), record.get("sample")
    if not isinstance(host, str) or not isinstance(sample, dict):
        raise SampleError("expected a host and a sample")
    parsed = parse_sample(json.dumps(sample))
    parsed = dataclasses.replace(parsed, host=host, ram_total_mib=sample.get("ram_total_mib"),
                                 ram_available_mib=sample.get("ram_available_mib"),
                                 agent_cpu_ms=sample.get("agent_cpu_ms"))
    return m.TelemetryUpdate(host, parsed, age_s=0.0, stale=False, streaming=True)


_STEP_LINE = re.compile(r"^(?P<step>[\w-]+): (?P<status>" + "|".join(("running", *STEP_ENDED)) + r")(?:: (?P<detail>.*))?$",
                        re.S)
_ANSWER = re.compile(r"^(?P<answer>approved|refused): (?P<action>.*)$", re.S)


def read_recording(run_dir: Path | str) -> Recording:
    """The run in `run_dir` as a recording; ReplayError when there is nothing to replay."""
    run_dir = Path(run_dir).expanduser()
    if not run_dir.is_dir():
        raise ReplayError(f"{run_dir}: no such run directory")
    state, state_damage = _read_state(run_dir)
    journal, journal_damage = _lines(run_dir / JOURNAL)
    telemetry, telemetry_damage = _lines(run_dir / TELEMETRY)
    if state is None and not journal and not telemetry:
        found = [str(d) for d in (journal_damage, telemetry_damage) if d is not None]
        raise ReplayError(f"{run_dir}: nothing to replay: " + ("; ".join([str(state_damage), *found]) if found else
                                                              "no state.json, journal.jsonl or telemetry.jsonl"))
    run_id = state.run_id if state is not None else run_dir.name
    events: list[Event] = []
    add = events.append

    for index, (number, record) in enumerate(telemetry):
        t = record.get("t")
        try:
            update = telemetry_update(record)
            if not isinstance(t, int | float):
                raise ValueError("no time, t")
        except (SampleError, TypeError, ValueError) as exc:
            telemetry_damage = Damage(TELEMETRY, number, f"not a telemetry sample ({exc})")
            telemetry = telemetry[:index]  # nothing after the damage is read
            break
        add(Event(float(t), update, f"{TELEMETRY}:{number}"))
    _connected(events)

    entries: list[tuple[int, m.JournalEntry]] = []
    for number, record in journal:
        entry = journal_entry(record, run_id)
        if entry is None or not isinstance(entry.t, int | float) or isinstance(entry.t, bool):
            journal_damage = Damage(JOURNAL, number, "not a journal entry (it needs a message and a time, t)")
            break
        entries.append((number, entry))
        if not for_replay_only(record):  # the event log as it was: a job's progress was never in it
            add(Event(float(entry.t), entry, f"{JOURNAL}:{number}"))
    events.extend(_from_journal(run_id, entries, state))
    events.extend(Event(*event) for event in fleet_events(run_id, entries, state))  # a fleet run: the fleet panel (replay_fleet.py)
    if state is not None:
        try:
            events.extend(list(_from_state(run_id, run_dir, state, entries, events)))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # a plan or forecast not in its shape
            state_damage = Damage(STATE, None, f"a damaged run state ({type(exc).__name__}: {exc}): "
                                               "replayed from the journal and telemetry alone")
            events.extend(_downtime_from_telemetry(run_id, telemetry))
    elif telemetry:
        events.extend(_downtime_from_telemetry(run_id, telemetry))

    events.sort(key=lambda e: e.t)  # stable: what was added first at one time comes first
    damage = [d for d in (state_damage, journal_damage, telemetry_damage) if d is not None]
    cut_at = None
    ends = []
    if journal_damage is not None:
        ends.append(max((e.t for _, e in entries), default=float("-inf")))
    if telemetry_damage is not None:
        ends.append(max((float(r["t"]) for _, r in telemetry), default=float("-inf")))
    if ends:
        cut_at = min(ends)
        events = [e for e in events if e.t <= cut_at]
    if not events:
        raise ReplayError(f"{run_dir}: nothing to replay before the damage: {'; '.join(map(str, damage))}"
                          if damage else f"{run_dir}: nothing to replay: the run recorded nothing yet")
    return Recording(run_id, run_dir, events, damage, state, cut_at)


def _connected(events: list[Event]) -> None:
    """A host whose samples arrive is connected (the agent streams over its SSH link): said at its first."""
    seen: set[str] = set()
    for event in list(events):
        host = event.message.host
        if host not in seen:
            seen.add(host)
            events.append(Event(event.t, m.HostState(host, "connected", event.t), event.source))


def _from_journal(run_id: str, entries: list[tuple[int, m.JournalEntry]], state: RunState | None) -> Iterable[Event]:
    """The steps' ends, the questions' answers, the jobs' starts, logs and the run's end."""
    jobs = list(state.jobs.values()) if state is not None else []
    spans = _job_spans(entries, state)
    for number, entry in entries:
        where = f"{JOURNAL}:{number}"
        if entry.kind is not None:  # a store that says what each entry is (docs/engine.md, "The journal")
            yield from _said(run_id, entry, where, state)
            continue
        step_line = _STEP_LINE.match(entry.message) if entry.step else None
        if step_line and step_line["step"] == entry.step and step_line["status"] != "running":
            rec = state.steps.get(entry.step) if state is not None else None
            final = rec is not None and rec.ended_at is not None and abs(rec.ended_at - entry.t) < 1.0
            yield Event(entry.t, m.StepUpdate(
                run_id, entry.step, step_line["status"], rec.started_at if rec else None, entry.t,
                step_line["detail"], work_s=rec.work_s if final else None,
                decision_s=rec.decision_s if final else None,
                found_on_resume=bool(final and rec.found_on_resume)), where)
            continue
        answer = _ANSWER.match(entry.message) if entry.step and entry.decision else None
        if answer:
            # The question's impact and estimate are not journalled: the action, host and argv are.
            question = m.Confirmation(entry.step, answer["action"], entry.host or "", tuple(entry.argv or ()),
                                      impact="", destructive=False)
            by = entry.decision.partition("(")[2].rstrip(")") or entry.decision
            yield Event(entry.t, m.DecisionMade(question, answer["answer"] == "approved", by), where)
            continue
        job = _job_started(entry, jobs)
        if job is not None:
            yield Event(entry.t, m.JobLog(job.job_id, job.worker, job.host, "info", entry.message,
                                          t=entry.t), where)
            continue
        job = _job_of_log(entry, jobs, spans)
        if job is not None:
            text = entry.message.removeprefix(f"{job.host} {job.worker}: ")
            yield Event(entry.t, m.JobLog(job.job_id, job.worker, job.host, entry.level, text, t=entry.t), where)


def _said(run_id: str, entry: m.JournalEntry, where: str, state: RunState | None) -> Iterable[Event]:
    """A journal entry with its `kind`: the message the console showed for it, from its own fields."""
    data = entry.data if isinstance(entry.data, dict) else {}
    job = next((j for j in state.jobs.values() if j.job_id == entry.job_id), None) if state is not None else None
    worker = data.get("worker") or (job.worker if job is not None else "?")
    if entry.kind == "step" and entry.step and entry.status:
        line = _STEP_LINE.match(entry.message)
        detail = line["detail"] if line and line["step"] == entry.step else None
        if entry.status == "running":
            yield Event(entry.t, m.StepUpdate(run_id, entry.step, "running", entry.started_at, None, detail), where)
            return
        rec = state.steps.get(entry.step) if state is not None else None
        final = rec is not None and rec.ended_at is not None and abs(rec.ended_at - entry.t) < 1.0
        yield Event(entry.t, m.StepUpdate(run_id, entry.step, entry.status, entry.started_at, entry.t, detail,
                                          work_s=rec.work_s if final else None,
                                          decision_s=rec.decision_s if final else None,
                                          found_on_resume=bool(final and rec.found_on_resume)), where)
    elif entry.kind == "question" and entry.step:
        answer = _ANSWER.match(entry.message)
        question = m.Confirmation(entry.step, answer["action"] if answer else entry.message, entry.host or "",
                                  tuple(entry.argv or ()), impact=str(data.get("impact") or ""),
                                  destructive=bool(data.get("destructive")), estimate_s=data.get("estimate_s"),
                                  estimate_basis=str(data.get("estimate_basis") or ""))
        asked_at = data.get("asked_at")
        if isinstance(asked_at, int | float) and asked_at <= entry.t:
            yield Event(float(asked_at), question, where)  # shown as asked, waiting for its answer
        by = (entry.decision or "").partition("(")[2].rstrip(")") or entry.decision or "?"
        yield Event(entry.t, m.DecisionMade(question, bool(answer and answer["answer"] == "approved"), by, run_id),
                    where)
    elif entry.kind in ("job-start", "job-log") and entry.job_id:
        if entry.kind == "job-start":
            worker = job.worker if job is not None else entry.message.removeprefix("started ").split(" ")[0]
            text = entry.message
        else:
            worker = job.worker if job is not None else entry.message.partition(": ")[0].split(" ")[-1]
            text = entry.message.partition(": ")[2]
        yield Event(entry.t, m.JobLog(entry.job_id, worker, entry.host or "", entry.level, text, t=entry.t), where)
    elif entry.kind == "job-progress" and entry.job_id:
        ids = (entry.job_id, worker, entry.host or "")
        if "done" in data:
            yield Event(entry.t, m.JobProgress(*ids, data["done"], data.get("total"), str(data.get("unit", "")),
                                               rate=data.get("rate"), phase=data.get("phase"),
                                               message=data.get("label"), key=str(data.get("key", "")), t=entry.t),
                        where)
        elif data.get("event") == "phase":
            phase = str(data.get("phase", ""))
            yield Event(entry.t, m.JobLog(*ids, "info", phase, kind="phase", phase=phase, t=entry.t), where)
        elif data.get("event"):
            yield Event(entry.t, m.JobLog(*ids, "info", str(data["event"]), kind=str(data["event"]), t=entry.t), where)
    elif entry.kind == "job-exit" and entry.job_id and entry.exit is not None:
        yield Event(entry.t, m.JobExit(entry.job_id, worker, entry.host or "", entry.exit), where)
    elif entry.kind == "service" and data.get("state") in ("down", "up", "paused") and "ready" not in data:
        said = data["state"]
        since = data.get("since") if said != "up" else None
        yield Event(entry.t, m.Downtime(run_id, since if isinstance(since, int | float) else None,
                                        data.get("back_at") if said == "up" else None, paused=said == "paused"), where)


def _job_started(entry: m.JournalEntry, jobs: list[Any]) -> Any:
    """The job a "started WORKER on HOST (pid N)" entry began: its host and argv (less the python) match."""
    if not entry.argv or not entry.host or not entry.message.startswith("started "):
        return None
    for job in jobs:
        argv = (job.handle or {}).get("argv") or []
        if job.host == entry.host and list(argv[1:]) == list(entry.argv[1:]):
            return job
    return None


def _job_spans(entries: list[tuple[int, m.JournalEntry]], state: RunState | None) -> dict[str, tuple[float, float | None]]:
    """job id -> (started, ended): from the entry that started it to the end of the last step that
    started or found it again (a staged extractor lives from the stage to the extract's end)."""
    if state is None:
        return {}
    spans: dict[str, tuple[float, float | None]] = {}
    for _, entry in entries:
        for job in state.jobs.values():
            started = _job_started(entry, [job]) is job
            if started or (entry.step and job.job_id in entry.message):
                rec = state.steps.get(entry.step or "")
                begun = spans.get(job.job_id, (entry.t, None))[0]
                spans[job.job_id] = (begun, rec.ended_at if rec is not None else None)
    return spans


def _job_of_log(entry: m.JournalEntry, jobs: list[Any], spans: dict[str, tuple[float, float | None]]) -> Any:
    """The job whose log line this is ("HOST WORKER: message", Engine._publish_event): of that host
    and worker, the newest one going at the time (the journal line does not name the job)."""
    if entry.step is not None or not entry.host:
        return None
    going = [job for job in jobs if entry.message.startswith(f"{job.host} {job.worker}: ") and job.job_id in spans
             and spans[job.job_id][0] <= entry.t and (spans[job.job_id][1] or float("inf")) >= entry.t]
    return max(going, key=lambda job: spans[job.job_id][0], default=None)


def _from_state(run_id: str, run_dir: Path, state: RunState, entries: list[tuple[int, m.JournalEntry]],
                so_far: list[Event]) -> Iterable[Event]:
    """What state.json holds and the journal does not: the plan and forecast, the steps' starts,
    the downtime, the jobs' milestones and exits, the run's end."""
    steps_ended = {e.message.step: e.t for e in so_far if isinstance(e.message, m.StepUpdate)
                   and e.message.status != "running"}
    # What a newer journal says itself is not taken from the state as well (docs/engine.md, "The journal").
    journalled_steps = {e.step for _, e in entries if e.kind == "step"}
    journalled_jobs = {e.job_id for _, e in entries if e.kind in ("job-progress", "job-exit")}
    service_journalled = any(e.kind == "service" and isinstance(e.data, dict) and "ready" not in e.data
                             for _, e in entries)
    preflight = state.steps.get("preflight")
    plan_at = preflight.ended_at if preflight and preflight.ended_at else state.created_at
    if state.plan:
        planned = tuple(m.PlannedStep(p["name"], bool(p.get("acts", True)), p.get("why", ""), p.get("host"),
                                      tuple(p.get("argv") or ()), p.get("estimate_s")) for p in state.plan)
        yield Event(plan_at, m.PlanReady(run_id, state.route or "window", planned), STATE)
    if state.forecast and state.forecast.get("downtime_s") is not None:
        f = state.forecast
        phases = tuple(m.ForecastPhase(name, None if p.get("seconds") is None else float(p["seconds"]),
                                       p.get("basis", ""), p.get("spread_s"),
                                       bool(p.get("estimated"))) for name, p in (f.get("phases") or {}).items())
        yield Event(plan_at, m.Forecast(run_id, float(f["downtime_s"]), phases, f.get("budget_s"),
                                        bool(f.get("over_budget"))), STATE)
    for name, rec in state.steps.items():
        if rec.started_at is not None and name not in journalled_steps:
            yield Event(rec.started_at, m.StepUpdate(run_id, name, "running", rec.started_at), STATE)
        if rec.status != "pending" and name not in steps_ended and (rec.ended_at or rec.status == "running"):
            # ended (or still running when the run stopped) without a journal line saying so
            yield Event(rec.ended_at or rec.started_at or state.created_at, m.StepUpdate(
                run_id, name, rec.status, rec.started_at, rec.ended_at, rec.detail, work_s=rec.work_s,
                decision_s=rec.decision_s, found_on_resume=rec.found_on_resume), STATE)
    windows = [] if service_journalled else [*(w.get("service") or {} for w in state.windows),
                                             dataclasses.asdict(state.service)]
    for window in windows:
        if window.get("stopped_at"):
            yield Event(window["stopped_at"], m.Downtime(run_id, window["stopped_at"]), STATE)
            if window.get("ready_at"):
                yield Event(window["ready_at"], m.Downtime(run_id, None, window["ready_at"]), STATE)
        elif window.get("paused_at"):  # the pause route: paused (requests held), never stopped
            yield Event(window["paused_at"], m.Downtime(run_id, window["paused_at"], paused=True), STATE)
            if window.get("continued_at"):
                yield Event(window["continued_at"], m.Downtime(run_id, None, window["continued_at"]), STATE)
    spans = _job_spans(entries, state)
    released = state.extraction.gpu_released_at
    staged = state.steps.get("stage")
    for job in state.jobs.values():
        if job.job_id in journalled_jobs:  # its progress, milestones and exit are in the journal
            continue
        if job.worker == "extract" and staged and staged.ended_at and "staged" in job.events_seen:
            # the stage step ends when the engine sees the worker's `staged` event
            yield Event(staged.ended_at, m.JobLog(job.job_id, job.worker, job.host, "info", "staged",
                                                  kind="staged", t=staged.ended_at), STATE)
        if job.worker == "extract" and released and "gpu_released" in job.events_seen:
            yield Event(released, m.JobLog(job.job_id, job.worker, job.host, "info", "gpu_released",
                                           kind="gpu_released", t=released), STATE)
            yield from _extraction_counts(job, state.extraction.window, released)
        end = spans.get(job.job_id, (None, None))[1]
        if end is not None and job.exit_code is not None:
            yield Event(end, m.JobExit(job.job_id, job.worker, job.host, job.exit_code), STATE)
    if state.finished:
        last = next((e for _, e in reversed(entries) if e.step is None and e.exit is not None), None)
        at = last.t if last is not None else (state.updated_at or state.created_at)
        results = run_dir / "results" / "results.json"
        if results.is_file():
            yield Event(at, m.ResultsReady(run_id, str(run_dir)), STATE)
        yield Event(at, m.RunFinished(run_id, state.status, state.exit_code if state.exit_code is not None else 0,
                                      not state.service.down, state.message or "", str(run_dir)), STATE)


def _extraction_counts(job: Any, window: dict[str, Any], at: float) -> Iterable[Event]:
    """The extraction's counters as its worker reported them when it released the GPUs (its window
    figures, kept in state.json): prompts and tokens done, at its measured rate. Only these final
    counts are kept: the progress events before them are not."""
    done, missing, tokens = window.get("prompts_done"), window.get("prompts_missing"), window.get("tokens")
    if isinstance(done, int):
        total = done + (missing if isinstance(missing, int) else 0)
        yield Event(at, m.JobProgress(job.job_id, job.worker, job.host, done, total, "prompts", phase="extract",
                                      key="prompts", t=at), STATE)
    if isinstance(tokens, int):
        rate = window.get("tokens_per_s")
        yield Event(at, m.JobProgress(job.job_id, job.worker, job.host, tokens, tokens, "tokens",
                                      rate=rate if isinstance(rate, int | float) else None, phase="extract",
                                      key="tokens", t=at), STATE)


def _downtime_from_telemetry(run_id: str, telemetry: list[tuple[int, dict[str, Any]]]) -> Iterable[Event]:
    """Without state.json: each sample says whether the service was down because of the run."""
    down = False
    for number, record in telemetry:
        flag, t = bool(record.get("service_down")), record.get("t")
        if flag != down and isinstance(t, int | float):
            down = flag
            yield Event(t, m.Downtime(run_id, t if flag else None, None if flag else t), f"{TELEMETRY}:{number}")


# --- playing it back ---------------------------------------------------------------------------


class Player:
    """Where the playback stands in a recording, moved by a clock it is given.

    `now` is the run's time being shown; `position` the number of events already shown. Each
    method returns the events to show next, in order; `reset` is True when they replace what was
    shown (a seek back), to be folded into a fresh state."""

    def __init__(self, recording: Recording, speed: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 playing: bool = True):
        if speed <= 0:
            raise ValueError(f"the speed must be above 0, found {speed:g}")
        self.recording = recording
        self.speed = speed
        self.clock = clock
        self.playing = playing
        self.position = 0
        self.now = recording.start
        self._times = [e.t for e in recording.events]
        self._last = clock()
        self.reset = False

    @property
    def at_end(self) -> bool:
        return self.position >= len(self.recording.events)

    @property
    def elapsed_s(self) -> float:
        return self.now - self.recording.start

    def _take(self, upto: int) -> list[Event]:
        events = self.recording.events[self.position:upto]
        self.position = max(self.position, upto)
        return events

    def tick(self) -> list[Event]:
        """Move the run's time on by the clock's time since the last tick, times the speed."""
        real = self.clock()
        moved, self._last = real - self._last, real
        self.reset = False
        if not self.playing or self.at_end:
            return []
        self.now = min(self.recording.end, self.now + moved * self.speed)
        events = self._take(bisect.bisect_right(self._times, self.now))
        if self.at_end:
            self.playing = False
        return events

    def play(self) -> None:
        if self.at_end:
            return
        self.playing, self._last = True, self.clock()

    def pause(self) -> None:
        self.playing = False

    def toggle(self) -> None:
        self.pause() if self.playing else self.play()

    def step(self) -> list[Event]:
        """The next event (every event of its instant), then paused."""
        self.pause()
        self.reset = False
        if self.at_end:
            return []
        self.now = self._times[self.position]
        return self._take(bisect.bisect_right(self._times, self.now))

    def seek(self, t: float) -> list[Event]:
        """Show the run as it stood at `t`: forward, the events up to it; back, all of them again (reset)."""
        t = max(self.recording.start, min(self.recording.end, t))
        upto = bisect.bisect_right(self._times, t)
        self.now, self._last = t, self.clock()
        self.reset = upto < self.position
        if self.reset:
            self.position = 0
        return self._take(upto)

    def seek_step(self, name: str) -> list[Event]:
        """To the moment step `name` began; ValueError naming the steps there are when it never ran."""
        starts = dict(self.recording.step_starts())
        if name not in starts:
            raise ValueError(f"step {name!r} never began in this run (it has {', '.join(starts) or 'no steps'})")
        return self.seek(starts[name])

    def next_step(self) -> list[Event]:
        """To the next step's start after now (the end when there is none)."""
        later = [t for _, t in self.recording.step_starts() if t > self.now]
        return self.seek(later[0] if later else self.recording.end)

    def previous_step(self) -> list[Event]:
        """To the latest step start before now (at a step's start: the step before; the beginning when none)."""
        earlier = [t for _, t in self.recording.step_starts() if t < self.now]
        return self.seek(earlier[-1] if earlier else self.recording.start)

    def current_step(self) -> str | None:
        """The newest step begun at `now`."""
        started = [name for name, t in self.recording.step_starts() if t <= self.now]
        return started[-1] if started else None

    def faster(self) -> float:
        self.speed = next((s for s in SPEEDS if s > self.speed), self.speed)
        return self.speed

    def slower(self) -> float:
        self.speed = next((s for s in reversed(SPEEDS) if s < self.speed), self.speed)
        return self.speed
