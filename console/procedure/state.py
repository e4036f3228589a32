"""A run's state, typed: the run, its steps, its jobs, the service, the extraction, its owner.

`state.json` is these dataclasses as JSON (`to_json` / `RunState.from_json`), written atomically
after every transition. The schema has a version (`format`); a file that does not parse, is not an
object, names a version this code does not know, or holds a field of the wrong type (checked by
pydantic against these dataclasses, strictly: `"down": "false"` is no boolean) gets a `StateError`
naming the file, the field and why. Fields this code does not know are ignored. Version 1 (before
the typed state) is read too: its keys are a subset of version 2's.
"""

from __future__ import annotations

import functools
import getpass
import json
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any

SCHEMA = "dflash-ops.run/2"
READABLE = ("dflash-ops.run/1", SCHEMA)
STEP_ENDED = ("done", "skipped", "left-out", "failed", "refused", "cancelled")
RUN_FINISHED = ("done", "degraded", "failed", "refused", "cancelled", "discarded")


class StateError(Exception):
    """A state file that cannot be used; the message names it and says why."""


def current_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (a container): the uid says who
        return f"uid {os.getuid()}"


def _proc_start_ticks(pid: int) -> int | None:
    """/proc/<pid>/stat's starttime: tells a live console from a reused pid (None off Linux)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class Owner:
    """The console process driving the run: named when another console looks at it."""

    user: str
    host: str
    pid: int
    since: float
    start_ticks: int | None = None

    @classmethod
    def this_process(cls) -> Owner:
        return cls(current_user(), socket.gethostname(), os.getpid(), time.time(), _proc_start_ticks(os.getpid()))

    def alive(self) -> bool | None:
        """Whether the owning console still runs: None when it is on another machine (cannot tell)."""
        if self.host != socket.gethostname():
            return None
        ticks = _proc_start_ticks(self.pid)
        if ticks is None:
            return False
        return self.start_ticks is None or ticks == self.start_ticks

    def describe(self) -> str:
        return f"{self.who()} since {time.strftime('%H:%M:%S', time.localtime(self.since))}"

    def who(self) -> str:
        """"alice@ct129 pid 4242"."""
        return f"{self.user}@{self.host} pid {self.pid}"


@dataclass
class StepState:
    """One step: its status, when its work began and ended, and time spent working vs deciding.

    `started_at` is when the step's work first began and is kept across resumes; `work_s` adds up
    the time of every attempt less `decision_s`, the time it waited on the operator's answers
    (`answer_waits.py`): a step's time is its work, never `ended_at - started_at`.
    """

    status: str = "pending"
    started_at: float | None = None
    ended_at: float | None = None
    work_s: float = 0.0
    decision_s: float = 0.0
    detail: str | None = None
    found_on_resume: bool = False  # its work was found done on the hosts by a resumed run


@dataclass
class JobRecord:
    """A job the run started (or is about to): found again by its id after a crash, and followed
    from `offset` (the events before it were handled already and are never replayed as live)."""

    job_id: str
    host: str
    worker: str
    args: list[str] = field(default_factory=list)
    handle: dict[str, Any] | None = None  # JobHandle's JSON once it started (pid, start ticks, run dir)
    offset: int = 0
    events_seen: list[str] = field(default_factory=list)  # the kinds of event handled: "staged", "gpu_released", ...
    exit_code: int | None = None
    result: Any = None  # its `result` event's data, kept: a resumed run does not read the events again
    error: str | None = None
    attempt: int = 1  # a dead worker is replaced by a new attempt with its own id

    @property
    def pid(self) -> int | None:
        return (self.handle or {}).get("pid")


@dataclass
class ServiceState:
    """The service as this run changed it. `down` means: stopped by this run and not yet ready."""

    down: bool = False
    stopped_at: float | None = None  # the stop was about to run (epoch seconds)
    stop_returned_at: float | None = None
    stop_confirmed: bool = False  # the manager on the host said it was down after the stop
    stops: int = 0  # stop commands this run issued
    vram_free_at: float | None = None
    restart_begun_at: float | None = None  # the restart began (at gpu_released, or later)
    start_issued_at: float | None = None
    starts: int = 0  # start commands this run issued
    ready_at: float | None = None
    ready_seen_late: bool = False  # the console was away when the service became ready: ready_at is when it saw so
    restarted_outside_at: float | None = None  # found running again, started by someone else
    pids_before_stop: list[int] = field(default_factory=list)
    # The service's process before the stop, as its manager said at preflight (systemd's MainPID and
    # ActiveEnterTimestamp, or the status command's pid): a resume that finds it active again tells a
    # restart outside the run from a stop that never took effect. On the pause route, the process
    # paused (asked again just before the pause is sent): nothing is released, resumed or continued
    # on another one (steps/pause.py, `same_server`).
    main_pid_before_stop: int | None = None
    active_since_before_stop: float | None = None
    # The pause route: the server this run paused was found to be another process (both named): the
    # window's memory came back by that restart, and nothing more is sent for this window.
    restarted_outside: str | None = None
    restart_error: str | None = None  # why the last restart failed, shown before it is offered again
    # The pause route (the server is never stopped): `paused` and `released` mean paused / released
    # by this run and not yet given back; `held` is either, as `down` is for the stop route.
    paused: bool = False  # /pause_generation sent by this run, no /continue_generation since
    paused_at: float | None = None  # the pause was about to be sent: the route's downtime begins here
    pauses: int = 0  # /pause_generation requests this run sent (counted before each)
    pause_confirmed: bool = False  # its answer (or /ready's 503 after a lost one) was seen
    continues: int = 0  # /continue_generation requests this run sent (counted before each)
    continued_at: float | None = None  # the server took requests again: the route's downtime ends here
    # The console that gave the server back ("alice@ct129 pid 4242"): a console that opened the run
    # at the same moment and lost the claim to it (console/procedure/claim.py) names it.
    given_back_by: str | None = None
    releasing: list[str] = field(default_factory=list)  # tags asked for, the answer not yet seen
    released: list[str] = field(default_factory=list)  # tags this run released and has not resumed
    released_tags: list[str] = field(default_factory=list)  # what this window released (kept after the resume)
    released_at: float | None = None
    releases: int = 0  # /release_memory_occupation requests (counted before each)
    resumes: int = 0  # /resume_memory_occupation requests (counted before each)
    resuming: list[str] = field(default_factory=list)  # resume asked for, its answer not yet seen
    # When the release or resume whose answer is not yet seen was sent: a lost answer's worst case
    # counts from it (steps/pause_settle.py), not from the console's reconnect.
    memory_request_sent_at: float | None = None
    resumed_at: float | None = None
    used_before_release_mib: dict[str, int] = field(default_factory=dict)  # per GPU, before the release
    used_after_release_mib: dict[str, int] = field(default_factory=dict)  # per GPU, once it was seen
    # How the server's weights are checked after the resume (steps/pause.py, `take_weights_reference`):
    # "checksum" (a `weights` release on a server with /weights_checker's checksum: the one before the
    # release against the one after) or "probe" (the greedy probe: no such checker, or the weights stay
    # resident); None until chosen, just before the pause.
    weights_check: str | None = None
    weights_checksum_before: str | None = None
    weights_checksum_after: str | None = None
    weights_verified: bool = False  # that check passed after the continue (a console killed before it checks on resume)
    probe_tokens: list[int] | None = None  # a greedy /generate's answer before the pause (checked after)
    give_back_error: str | None = None  # why the last resume / continue failed, shown when offered again
    # The fleet window (console/procedure/steps/fleet.py): `drained` is {replica, router, since} from
    # just before the router was asked to remove the replica until it is listed healthy again.
    drained: dict[str, Any] | None = None
    drains: int = 0  # removals this run asked the router for (counted before each)
    rejoins: int = 0  # adds this run asked the router for (counted before each)
    rejoined_at: float | None = None
    # {why, at}: the operator ended this window early, the fleet degraded while the replica was out
    # (steps/fleet_guard.py): nothing deeper into the window begins, the run ends paused after the rejoin.
    ended_early: dict[str, Any] | None = None
    # [asked_at, answered_at] of each question answered in this window (the holders' end, the restart,
    # the release, resume and continue, ...): the window waited on the operator then, which no measured
    # phase and no forecast holds (forecast.measured_phases).
    answer_waits: list[list[float]] = field(default_factory=list)

    @property
    def held(self) -> bool:
        """Paused or released by this run and not given back (the pause route's `down`)."""
        return self.paused or bool(self.released) or bool(self.releasing)

    def began(self) -> bool:
        """This window's downtime began: the server stopped, or (the pause route) paused."""
        return self.stops > 0 or self.pauses > 0

    def left_as(self) -> str | None:
        """How this run left the server, in the words every view uses: "down", "paused", "drained"
        (out of the fleet's router) or None."""
        return "down" if self.down else "paused" if self.held else "drained" if self.drained else None


@dataclass
class ExtractionState:
    """The extraction's milestones (the staged worker's pid, the go, the GPUs released)."""

    staged_pid: int | None = None
    begun_at: float | None = None  # the go was given (staged) or the cold extraction started
    go_sent_at: float | None = None
    gpu_released_at: float | None = None
    window: dict[str, Any] = field(default_factory=dict)  # the worker's own window figures
    complete: bool = False  # manifest complete and sha256-verified on the host
    partial: dict[str, Any] | None = None  # cut short at the budget: {"done": [...], "missing": [...]}
    stop_asked_at: float | None = None  # the operator chose to stop the extraction at the budget


@dataclass
class RunState:
    """Everything `state.json` holds."""

    run_id: str
    created_at: float
    status: str = "running"  # running | paused | done | degraded | failed | refused | cancelled | discarded
    route: str | None = None
    config: str | None = None
    config_sha256: str | None = None
    # The service the run addresses (console/procedure/identity.py): host, address, manager, unit, URL.
    service_identity: dict[str, Any] | None = None
    started: bool = False
    owner: Owner | None = None
    steps: dict[str, StepState] = field(default_factory=dict)
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    service: ServiceState = field(default_factory=ServiceState)
    extraction: ExtractionState = field(default_factory=ExtractionState)
    facts: dict[str, Any] = field(default_factory=dict)  # what preflight found (layers, probes' digest, ...)
    plan: list[dict[str, Any]] = field(default_factory=list)
    forecast: dict[str, Any] | None = None
    windows: list[dict[str, Any]] = field(default_factory=list)  # earlier windows of a run cut short at its budget
    headline: dict[str, float | None] = field(default_factory=dict)
    exit_code: int | None = None
    message: str | None = None
    updated_at: float | None = None
    format: str = SCHEMA

    @property
    def finished(self) -> bool:
        return self.status in RUN_FINISHED

    def step(self, name: str) -> StepState:
        """Step `name`'s record, created pending (for the engine about to run it)."""
        return self.steps.setdefault(name, StepState())

    def status_of(self, name: str) -> str:
        """Step `name`'s status without creating its record ("pending" when it has none)."""
        rec = self.steps.get(name)
        return rec.status if rec is not None else "pending"

    def to_json(self) -> dict[str, Any]:
        """The state as JSON's types (what state.json holds), built by pydantic-core: the engine saves
        at every event, and `dataclasses.asdict` deep-copies every value (with json's indented encoder a
        window's state took 5.5 ms to save, 0.3 ms this way: bench/state_save.py). A value of no JSON
        type is its str. (pydantic-core is imported here, as the schema is: a command that never
        writes a state does not load it.)"""
        import pydantic_core

        return pydantic_core.to_jsonable_python(self, fallback=str, inf_nan_mode="constants")

    def dumps(self) -> bytes:
        """state.json's text, indented (an operator reads it), with Infinity/NaN as `json` writes them."""
        import pydantic_core

        return pydantic_core.to_json(self, indent=2, fallback=str, inf_nan_mode="constants") + b"\n"

    @classmethod
    def from_json(cls, data: Any, where: str) -> RunState:
        """The state in `data` (decoded JSON); StateError naming `where` when it is not one."""
        if not isinstance(data, dict):
            raise StateError(f"{where}: not a run state (a JSON {type(data).__name__}, expected an object)")
        version = data.get("format")
        if version not in READABLE:
            raise StateError(f"{where}: unknown run state version {version!r} (this dflash-ops reads "
                             f"{', '.join(READABLE)})")
        try:
            return _from_v1(data) if version == READABLE[0] else _build(data)
        except SchemaError as exc:
            raise StateError(f"{where}: a damaged run state: {exc}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as exc:
            raise StateError(f"{where}: a damaged run state ({type(exc).__name__}: {exc})") from None


class SchemaError(ValueError):
    """A field of the state has the wrong type (or is missing); the message names it."""


@functools.cache
def _schema() -> Any:
    """The state's schema, checked by pydantic from these dataclasses (built once, when first read):
    every field's type, nested ones included; fields this code does not know are ignored (a newer
    dflash-ops may add some)."""
    from pydantic import TypeAdapter

    return TypeAdapter(RunState)


def _schema_error(exc: Any) -> SchemaError:
    """pydantic's ValidationError in the operator's words: the first bad field, what was expected,
    what was found (`service.down`: expected a valid boolean, found 'false' (a str))."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    where = ".".join(str(part) for part in first["loc"]) or "the state"
    if first["type"] == "missing":
        said = f"`{where}`: missing"
    else:
        expected = first["msg"].replace("Input should be ", "expected ", 1)
        found = first.get("input")
        said = f"`{where}`: {expected}, found {found!r} (a {type(found).__name__})"[:300]
    return SchemaError(said + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))


def _build(data: dict[str, Any]) -> RunState:
    from pydantic import ValidationError

    # An absent table (null) is the empty one, as the first version's files have it.
    data = {k: v for k, v in data.items() if not (k in ("steps", "jobs", "service", "extraction") and v is None)}
    try:
        # Strict: "false" is no boolean and "3" no number (a hand-edited or damaged file), yet an
        # integer stands for a float as JSON writes it.
        state = _schema().validate_json(json.dumps(data), strict=True)
    except ValidationError as exc:
        raise _schema_error(exc) from None
    if not state.run_id:
        raise SchemaError("`run_id`: empty")
    return state


def _from_v1(data: dict[str, Any]) -> RunState:
    """Version 1 kept the extraction's milestones among the facts and a `stopped_monotonic`."""
    facts = dict(data.get("facts") or {})
    go = facts.pop("go_sent", None)
    extraction = {"staged_pid": facts.pop("staged_pid", None), "go_sent_at": go, "begun_at": go,
                  "gpu_released_at": facts.pop("gpu_released_at", None), "window": facts.pop("window", {}) or {},
                  "complete": bool(facts.pop("extraction_complete", False))}
    service = dict(data.get("service") or {})
    if service.get("stopped_at"):
        service.setdefault("stops", 1)
        service.setdefault("stop_confirmed", bool(service.get("stop_returned_at")))
    return _build({**data, "format": SCHEMA, "facts": facts, "extraction": extraction, "service": service})


# --- a fleet run's windows (steps/fleet.py, identity.py) ----------------------------------------


def recorded_replica(state: Any) -> str | None:
    """The replica a run's window is on, as its state recorded it (None: not chosen yet)."""
    drained = state.service.drained or {}
    return drained.get("replica") or state.facts.get("fleet_replica")


def between_windows(state: Any) -> bool:
    """A run cut short at its budget (or ended early: the fleet degraded while its replica was out) whose
    window is over (the replica served and back in the router):
    its next window extracts the missing prompts, on the replica chosen for it (`steps/fleet.py: next_replica`)."""
    svc = state.service
    over = svc.began() or svc.ended_early is not None  # ended early: maybe before the stop, the replica back
    return bool(state.extraction.partial) and over and svc.left_as() is None  # as the engine finds it on resume
