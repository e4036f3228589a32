"""What the core publishes: small frozen dataclasses that the TUI and the CLI render.

Host connection state, GPU telemetry, service state and health, start-up progress, and the VRAM
waiter's findings. Nothing here does I/O; a message is a snapshot of state at the time it was made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# --- Hosts (console/ssh/supervisor.py) ---------------------------------------------------------------

HostStatus = Literal["connecting", "connected", "reconnecting", "down"]


@dataclass(frozen=True)
class HostState:
    """The connection state of one host, as its supervisor last saw it.

    connecting    first attempt in progress, never connected yet
    connected     link up; `latency_s` is the last measured round trip
    reconnecting  the link was lost at `since` and the supervisor is trying again
    down          no link and no recent one: never reached, or refused for a reason retrying cannot
                  fix by itself (unknown host key, authentication); `last_error` says why. The
                  supervisor still retries, slowly, so a fixed known_hosts is picked up.
    """

    host: str
    status: HostStatus
    since: float  # unix time the host entered this status
    latency_s: float | None = None
    last_error: str | None = None
    attempts: int = 0  # failed attempts since the last successful connection

    @property
    def is_connected(self) -> bool:
        return self.status == "connected"


# --- Telemetry (console/telemetry.py) ------------------------------------------------------------


@dataclass(frozen=True)
class GpuReading:
    """One GPU in one telemetry sample; a field the host could not read is None."""

    index: int
    name: str | None
    uuid: str | None
    mem_used_mib: int | None
    mem_total_mib: int | None
    util_pct: float | None
    temp_c: float | None
    power_w: float | None


@dataclass(frozen=True)
class GpuProcess:
    """A process holding GPU memory, with what the host's /proc says about it."""

    pid: int
    gpu: int | None
    mib: int | None
    user: str | None = None
    command: str | None = None
    ppid: int | None = None
    ancestors: tuple[int, ...] = ()
    start_time: int | None = None  # clock ticks since boot: with pid, names exactly one process
    cgroup: str | None = None
    # False when the pid NVML gave names no GPU process in the agent's pid namespace (a container):
    # shown, never signalled. `visible_reason` says why.
    visible: bool = True
    visible_reason: str | None = None


@dataclass(frozen=True)
class TelemetrySample:
    """One line of `remote.agent`: a host's GPUs and GPU processes at time `t` (host clock)."""

    host: str
    seq: int
    t: float
    interval: float
    source: str  # "nvml" | "nvidia-smi" | "simulated" | "none"
    simulated: bool  # a drill host: draw it labelled SIMULATED
    reason: str | None  # why there are no GPU readings, when there are none
    gpus: tuple[GpuReading, ...]
    processes: tuple[GpuProcess, ...]
    ram_total_mib: int | None = None
    ram_available_mib: int | None = None
    agent_cpu_ms: float | None = None


@dataclass(frozen=True)
class TelemetryUpdate:
    """A host's telemetry as the console sees it now: the last sample, its age, and which GPU
    processes belong to the service. Published on every sample and when a stream drops."""

    host: str
    sample: TelemetrySample | None
    age_s: float | None  # seconds since the last sample arrived (console clock); None: never
    stale: bool  # no sample for longer than 3 intervals: draw the readings as old
    streaming: bool  # the agent stream is up
    error: str | None = None  # why the stream is down, when it is
    service_pids: frozenset[int] = frozenset()


# --- Service (console/service/control.py, console/service/sglang_api.py) -----------------------------------------


@dataclass(frozen=True)
class ServiceStatus:
    """What the service manager says: systemd's ActiveState/SubState/MainPID, or the status command."""

    manager: str  # "systemd" | "command"
    name: str
    active: bool
    state: str  # systemd ActiveState ("active", "inactive", "failed", ...) or "running" / "stopped"
    sub_state: str | None = None
    main_pid: int | None = None
    since: float | None = None  # unix time it entered the active state
    cgroup: str | None = None
    detail: str | None = None


@dataclass(frozen=True)
class ServiceHealth:
    """The server as seen through the forwarded port."""

    health_status: int | None  # HTTP status of /health; None: no answer
    ready: bool  # /health 200 and a one-token /generate worked
    model: str | None = None
    model_path: str | None = None
    version: str | None = None
    running_requests: float | None = None
    queued_requests: float | None = None
    token_usage: float | None = None
    gen_throughput: float | None = None
    error: str | None = None


@dataclass(frozen=True)
class ServiceView:
    """The service panel's state: what the manager says and, while it runs, how the server answers."""

    status: ServiceStatus | None  # None: the manager could not be asked (see `error`)
    health: ServiceHealth | None  # None while the service is not running
    checked_at: float  # unix time of this check
    error: str | None = None
    # Who holds the server paused ("run X"): /health was not asked, since SGLang answers 503 for the
    # whole pause and each probe waits out its own health check before saying so.
    not_probed: str | None = None


@dataclass(frozen=True)
class StartupProgress:
    """A start-up log line turned into progress: stage, and done/total where the line says."""

    stage: str  # "loading" | "weights_loaded" | "ready"
    line: str
    done: int | None = None
    total: int | None = None


# --- VRAM waiter (console/service/vram.py) ---------------------------------------------------------------


@dataclass(frozen=True)
class VramHolder:
    """A process still holding memory on one of the service's GPUs after a stop."""

    pid: int
    mib: int
    gpus: tuple[int, ...]
    command: str | None
    user: str | None
    start_time: int | None
    was_service: bool  # seen in the service's process tree or cgroup before the stop
    visible: bool = True  # False: not visible from the host's namespace here; never offered to end
    visible_reason: str | None = None


@dataclass(frozen=True)
class EndOutcome:
    """What became of one process the operator asked to end."""

    pid: int
    outcome: str  # "gone" | "terminated" | "killed" | "survived" | "not_permitted" | "replaced"
    detail: str
    after_s: float = 0.0


# --- The window engine (console/procedure/) --------------------------------------------------------

StepStatus = Literal["pending", "running", "done", "skipped", "failed", "refused", "left-out", "cancelled"]


@dataclass(frozen=True)
class PlannedStep:
    """One step of a chosen plan: whether it will act, and why (left out, or already satisfied)."""

    name: str
    acts: bool
    why: str
    host: str | None = None
    argv: tuple[str, ...] = ()  # the literal command it runs on `host`, when it runs one
    estimate_s: float | None = None  # from earlier runs of this step


@dataclass(frozen=True)
class HostFit:
    """Whether a host can extract without the serving GPUs (the zero-downtime route), and why."""

    host: str
    proposed: bool
    why: str
    gpu: int | None = None
    free_mib: int | None = None
    need_mib: int | None = None
    model_path: str | None = None
    gpus: tuple[int, ...] = ()  # every GPU the extraction uses (more than one: a device_map split)


@dataclass(frozen=True)
class PlanReady:
    """The plan chosen at preflight (or read back on resume), with where the target fits elsewhere."""

    run_id: str
    route: str  # "window" | "zero-downtime"
    steps: tuple[PlannedStep, ...]
    fits: tuple[HostFit, ...] = ()
    proposal: str | None = None  # the route the plan proposes, with its reason
    preview: bool = False  # `p` / `run --plan`: no run was kept, nothing was changed
    forecast: Forecast | None = None  # the window's downtime by phase, made at preflight (before any stop)


@dataclass(frozen=True)
class StepUpdate:
    """A step changed status. `detail` says why a step was skipped, refused or failed."""

    run_id: str
    step: str
    status: StepStatus
    started_at: float | None = None
    ended_at: float | None = None
    detail: str | None = None
    work_s: float | None = None  # time the step's work took over all its attempts (the operator's answers left out)
    decision_s: float | None = None  # time spent waiting for the operator's answers
    found_on_resume: bool = False  # done while the console was away, found so on resume

    @property
    def duration_s(self) -> float | None:
        """The time the step worked, over all its attempts: never its waits on the operator's answers,
        nor the time no console ran it (a resumed step's first start is kept in `started_at`)."""
        if self.started_at is None or self.ended_at is None:
            return None
        return self.work_s if self.work_s is not None else self.ended_at - self.started_at


@dataclass(frozen=True)
class Confirmation:
    """What the engine asks before it changes a host: the literal argv exactly as it will run."""

    step: str
    action: str  # in the operator's words: "stop the service", "end 1 process holding VRAM"
    host: str
    argv: tuple[str, ...]
    impact: str  # "SGLang on ct129 goes down; earlier windows took 94 s"
    destructive: bool
    estimate_s: float | None = None  # expected downtime or duration
    estimate_basis: str = "earlier runs"  # what `estimate_s` comes from ("forecast": the stop's, by phase)
    # What a no leaves behind, when the engine says it: the restart offered after a no to a step that
    # must run while the service is down ("the service stays DOWN, stopped by run X ...: run --resume").
    leaves: str | None = None

    def estimate_apart(self) -> float | None:
        """The estimate to show beside the impact, or None: the stop's forecast is in its impact
        already, with its basis by phase (one figure per question, never the same one twice)."""
        return None if self.estimate_basis == "forecast" else self.estimate_s


@dataclass(frozen=True)
class DecisionMade:
    """The answer to a `Confirmation` (journalled)."""

    confirmation: Confirmation
    approved: bool
    by: str  # "--yes", "terminal", "tui", "continue"
    run_id: str | None = None  # the run that asked (None: a question of no run)


@dataclass(frozen=True)
class HoldersFound:
    """After the stop, processes still hold VRAM on the service's GPUs (the holders modal)."""

    host: str
    holders: tuple[VramHolder, ...]
    used: str  # "GPU0 40000 MiB, GPU1 40000 MiB"
    threshold_mib: int


@dataclass(frozen=True)
class Downtime:
    """Whether the service is down because of this run, and since when (every view shows it)."""

    run_id: str
    down_since: float | None  # unix time of the stop (the pause route: of the pause); None: up (or never stopped by us)
    restarted_at: float | None = None  # the pause route: when it took requests again
    paused: bool = False  # the pause route: paused (requests held), never stopped


@dataclass(frozen=True)
class FleetAtRisk:
    """While a run's replica is out of the router, the others cannot carry its users' requests (another
    replica unhealthy, none healthy, the router down): said at once (steps/fleet_guard.py); the
    notifier tells the people who share the window."""

    run_id: str
    replica: str  # the replica out for its window
    why: str
    t: float


@dataclass(frozen=True)
class JournalEntry:
    """One line of a run's journal.jsonl (also published, for the event log)."""

    t: float
    run_id: str
    step: str | None
    message: str
    host: str | None = None
    user: str | None = None
    decision: str | None = None
    argv: tuple[str, ...] | None = None
    exit: int | None = None
    duration_s: float | None = None
    level: str = "info"  # "info" | "warning" | "error"
    # What a replay needs (docs/engine.md, "The journal"); absent (None) in stores from before.
    kind: str | None = None  # "step" "question" "job-start" "job-log" "job-progress" "job-exit" "service"
    status: str | None = None  # kind "step": the step's new status (running included)
    started_at: float | None = None  # kind "step": when this attempt began
    job_id: str | None = None  # kind "job-*": which job
    data: dict[str, Any] | None = None  # kind "question" / "job-progress" / "service": the rest, small


@dataclass(frozen=True)
class RunFinished:
    """The run ended: `exit_code` 0 done, 1 failed with the service up, 3 failed with it down."""

    run_id: str
    status: str  # "done" | "failed" | "refused" | "cancelled"
    exit_code: int
    service_up: bool
    message: str
    run_dir: str


@dataclass(frozen=True)
class ResultsReady:
    """The evaluation's results were fetched into the run directory."""

    run_id: str
    run_dir: str


# --- Jobs (console/ssh/jobs.py: `job_message` turns a worker's events into these) ----------------------
# (Messages holding a dict — artifact details, result data, last event — are not hashable.)


@dataclass(frozen=True)
class JobProgress:
    """A `progress` event: `done` of `total` `unit`s, at `rate` units per second (from this key's
    previous progress event; None for the first), in the job's current `phase`."""

    job_id: str
    worker: str
    host: str
    done: float
    total: float | None
    unit: str
    rate: float | None = None
    phase: str | None = None
    message: str | None = None  # the event's label, e.g. the prompt's id
    key: str = ""  # which counter: a worker may report several ("tensors", "bytes", "prompts")
    t: float | None = None  # the worker's clock (unix seconds)

    @property
    def fraction(self) -> float | None:
        return None if not self.total else min(1.0, max(0.0, self.done / self.total))


@dataclass(frozen=True)
class JobLog:
    """A `log` event; also a `phase` event (kind "phase", message the phase's name) and any event
    type the console has no message for (kind = its type, e.g. "gpu_released")."""

    job_id: str
    worker: str
    host: str
    level: str  # "info" | "warning" | "error"
    message: str
    kind: str = "log"
    phase: str | None = None
    t: float | None = None


@dataclass(frozen=True)
class JobArtifact:
    """An `artifact` event: a finished, renamed file or folder on the job's host."""

    job_id: str
    worker: str
    host: str
    path: str
    kind: str
    details: dict[str, object]  # the event's other fields (sizes, sha256, prompts, ...)


@dataclass(frozen=True)
class JobResult:
    """The worker's `result` event: its answer."""

    job_id: str
    worker: str
    host: str
    data: object


@dataclass(frozen=True)
class JobError:
    """An `error` event: a clear, human error (an exit with a non-zero code follows)."""

    job_id: str
    worker: str
    host: str
    message: str
    where: str | None = None


@dataclass(frozen=True)
class JobExit:
    """The `exit` event, always a job's last."""

    job_id: str
    worker: str
    host: str
    code: int


@dataclass(frozen=True)
class JobStalled:
    """The job's process is alive but wrote no event (heartbeats included) for `silent_s` seconds."""

    job_id: str
    worker: str
    host: str
    silent_s: float
    last_event: dict[str, object] | None
    stderr_tail: str


@dataclass(frozen=True)
class ForecastPhase:
    """One phase of the window's forecast downtime, with what it is based on."""

    name: str  # "stop" | "free-vram" | "extract" | "start"
    seconds: float | None  # None: unknown (nothing on the hosts tells it), never taken as 0 s
    basis: str  # in the operator's words: "median of 3 earlier runs on ct129", "54 GiB at 3.1 GB/s (probe)"
    spread_s: float | None = None  # (max - min) of the earlier runs it is based on, when there are several
    estimated: bool = False  # True when no measurement of this host backs it (labelled "estimate")


@dataclass(frozen=True)
class Forecast:
    """The window's downtime before the stop, by phase; `budget_s` from `[window] max_downtime_s`."""

    run_id: str
    downtime_s: float  # the known phases' sum: a floor when a phase is unknown (forecast.unknown / figure)
    phases: tuple[ForecastPhase, ...]
    budget_s: float | None = None
    over_budget: bool = False


@dataclass(frozen=True)
class WindowProjection:
    """During the window: when the service is expected back, re-projected as the extraction goes.

    Times are epoch seconds on the console's clock; `extract_eta_s` is the extraction's time left
    (tokens left / measured rate), None before a rate is known."""

    run_id: str
    down_since: float
    expected_ready_at: float
    extract_eta_s: float | None = None
    budget_ends_at: float | None = None
    basis: str = ""


@dataclass(frozen=True)
class AskedQuestion:
    """The question a run's console waits on (question.json), in its parts: the banner says what and
    where ("start the service on ct129"), the block under it (screens/widgets/asked_panel.py) the
    literal command, whole."""

    action: str  # "start the service"
    host: str
    command: str  # the literal command, shell-quoted ("" for a question that runs none: the budget offer)

    @property
    def what(self) -> str:
        return f"{self.action} on {self.host}"


@dataclass(frozen=True)
class LiveRun:
    """The run driving the hosts now, as any console sees it (its own, or another console's)."""

    run_id: str
    status: str  # the run's own status: running, paused, failed, ...
    owner: str | None  # "user@host pid N since HH:MM:SS"
    console_gone: bool  # its console is no longer running (killed): resume it
    service_down: bool  # this run stopped the service and it is not back
    ours: bool  # driven by this console
    question: AskedQuestion | None = None  # what its console waits for the operator to answer
    paused_since: float | None = None  # the pause route: the run holds the server paused since then
    released: tuple[str, ...] = ()  # ... and these memory tags of it are released (or being released)


# --- the fleet behind SGLang's router (console/service/fleet_watch.py) ----------------------------------


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the router lists it and as it reports itself, and what a run does with it."""

    name: str
    host: str
    gpus: tuple[int, ...]  # the GPUs its service uses ([service] gpus; () = all of its host's)
    listed: bool  # the router lists it
    healthy: bool  # ... healthy
    router_load: int | None  # the router's own count of its requests in flight to it
    running: int | None  # its own /v1/loads: running requests (None: unreadable)
    queued: int | None
    error: str | None = None  # why its figures could not be read
    state: str = "serving"  # serving | draining | in window | rejoining | DRAINED | unhealthy | out of the router
    run_id: str | None = None  # the run whose window it is in (or that left it drained)
    router_status: str | None = None  # smg's status for it (ready, draining, ...); None from sglang-router


@dataclass(frozen=True)
class FleetView:
    """The router's health and every replica, at one time (epoch seconds)."""

    router: str
    router_up: bool  # GET /health answered 200
    replicas: tuple[ReplicaView, ...]
    checked_at: float
    error: str | None = None  # why the router could not be read
    gateway: str | None = None  # which router answers: "smg 1.13.0", "sglang-router" (None: not known)

    @property
    def healthy_count(self) -> int:
        return sum(1 for r in self.replicas if r.listed and r.healthy)
