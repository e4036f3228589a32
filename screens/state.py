"""What the console has seen on the bus: the newest message of each kind, folded into one plain object.

The app feeds every core message to `ConsoleState.apply`; panels draw from the state, so a panel
mounted late (or repainted after a modal closes) shows the same thing as one that saw every message.
No Textual here: it is plain data, tested on its own.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from console import messages as m
from console.procedure.steps import ROUTES, STEPS


def default_rows(fleet: bool = False) -> tuple[str, ...]:
    """Before a plan says which route: the default route's rows (the engine's step table is the one
    list of steps; a plan of another route brings its own), without the steps only a fleet behind
    SGLang's router takes (drain, rejoin) when there is none."""
    return tuple(s.name for s in STEPS if s.name in ROUTES["window"]
                 and (fleet or "[fleet]" not in (s.left_out_when or "")))


STEP_NAMES = default_rows()
FLEET_STEPS = frozenset(s.name for s in STEPS if "[fleet]" in (s.left_out_when or ""))  # drain, rejoin
JOURNAL_KEPT = 500
DOWN_STEPS = tuple(s.name for s in STEPS if s.while_down)  # the service is down from the stop to the restart's ready


def event_words(kind: str) -> str:
    """An event type the console has no message for (`staged`, `gpu_released`), in the operator's
    words: never its raw fields."""
    return {"staged": "staged: weights in host RAM, waiting for the stop",
            "gpu_released": "GPUs released: the restart begins",
            "invalid": "an unreadable event line (see the journal)"}.get(kind, kind.replace("_", " "))


@dataclass
class StepView:
    """One line of the stepper."""

    name: str
    status: str = "pending"
    acts: bool = True
    why: str = ""
    host: str | None = None
    estimate_s: float | None = None
    started_at: float | None = None
    ended_at: float | None = None
    detail: str | None = None
    work_s: float | None = None  # the step's own work, the operator's answers left out
    decision_s: float | None = None  # the time its questions waited for the operator


@dataclass
class JobView:
    """One remote job's progress, by unit (weights in tensors and bytes, prompts, anchors)."""

    job_id: str
    label: str
    bars: dict[str, Any] = field(default_factory=dict)  # unit -> the newest JobProgress for it
    phase: str | None = None
    last_log: str | None = None
    finished: bool = False
    stalled: str | None = None
    worker: str | None = None
    received: dict[str, float] = field(default_factory=dict)  # unit -> when its newest progress came (console clock)
    ended: int = 0  # the order in which the jobs ended (1 the first), 0 while it goes

    def eta_key(self) -> str | None:
        """The counter that measures the work: tokens, else prompts (the one the time left is read from)."""
        return next((k for k in ("tokens", "prompts") if k in self.bars), None)

    def eta_s(self, now: float) -> float | None:
        """Seconds left by the counter that measures the work: what is left over the measured rate,
        less the time since that rate was reported; None before a rate."""
        key = self.eta_key()
        progress = self.bars.get(key) if key else None
        if progress is None or progress.total is None or not progress.rate:
            return None
        left = max(0.0, progress.total - progress.done) / progress.rate
        return max(0.0, left - max(0.0, now - self.received.get(key, now)))


@dataclass
class ConsoleState:
    """The newest of everything; `apply` returns the kinds that changed (the panels to repaint)."""

    hosts: dict[str, m.HostState] = field(default_factory=dict)
    telemetry: dict[str, m.TelemetryUpdate] = field(default_factory=dict)
    received: dict[str, float] = field(default_factory=dict)  # host -> when its last update came (console clock)
    service: m.ServiceView | None = None
    startup: m.StartupProgress | None = None
    run_id: str | None = None
    route: str | None = None
    rows: tuple[str, ...] = STEP_NAMES  # the rows shown before a plan
    steps: dict[str, StepView] = field(default_factory=lambda: {n: StepView(n) for n in STEP_NAMES})
    planned: bool = False
    downtime: m.Downtime | None = None
    holders: m.HoldersFound | None = None
    journal: deque = field(default_factory=lambda: deque(maxlen=JOURNAL_KEPT))
    journal_count: int = 0  # entries seen in all (the deque keeps the newest JOURNAL_KEPT)
    jobs: dict[str, JobView] = field(default_factory=dict)
    finished: m.RunFinished | None = None
    results: m.ResultsReady | None = None
    running: bool = False  # a procedure (or a restart) is in progress in this console
    projection: m.WindowProjection | None = None  # the engine's, when it publishes one
    forecast: m.Forecast | None = None
    downtime_estimate_s: float | None = None  # the stop's confirmation: earlier windows' downtime
    plan: m.PlanReady | None = None
    live: m.LiveRun | None = None  # the run driving the hosts, as the store says (another console's too)
    fleet: m.FleetView | None = None  # [fleet]: the router and its replicas, as the session last saw them
    driven_here: set = field(default_factory=set)  # the runs this console drove (their end, too, is ours)

    @property
    def down_since(self) -> float | None:
        return self.downtime.down_since if self.downtime is not None else None

    def driven_elsewhere(self) -> m.LiveRun | None:
        """The live run when another console (or `run --headless`) drives it, not this one."""
        live = self.live
        if live is None or live.ours or live.run_id in self.driven_here:
            return None
        return None if self.running and live.run_id == self.run_id else live

    def apply(self, message: Any, now: float | None = None) -> str | None:
        """Fold one message in; returns which panel it concerns ("host", "service", "fleet", "steps",
        "job", "journal", "downtime", "run") or None when nothing shown changed."""
        if isinstance(message, m.HostState):
            self.hosts[message.host] = message
            return "host"
        if isinstance(message, m.TelemetryUpdate):
            self.telemetry[message.host] = message
            if now is not None:
                self.received[message.host] = now
            return "host"
        if isinstance(message, m.ServiceView):
            self.service = message
            if message.status is not None and message.status.active and message.health and message.health.ready:
                self.startup = None
            return "service"
        if isinstance(message, m.FleetView):
            self.fleet = message
            return "fleet"
        if isinstance(message, m.StartupProgress):
            self.startup = None if message.stage == "ready" else message
            return "service"
        if isinstance(message, m.PlanReady):
            self._plan(message)
            return "steps"
        if isinstance(message, m.WindowProjection):
            self.projection = message
            return "downtime"
        if isinstance(message, m.Forecast):
            self.forecast = message
            return "downtime"
        if isinstance(message, m.DecisionMade):
            self.confirmation_seen(message.confirmation)
            return None
        if isinstance(message, m.StepUpdate):
            self._step(message)
            return "steps"
        if isinstance(message, m.Downtime):
            self.downtime = message
            if message.down_since is None:
                self.projection = None
            if message.down_since is None and message.restarted_at is not None:
                self.startup = None  # the restart's own check found it ready: no longer "starting"
            return "downtime"
        if isinstance(message, m.LiveRun):
            self.live = message
            return "downtime"
        if isinstance(message, m.HoldersFound):
            self.holders = message
            return None
        if isinstance(message, m.JournalEntry):
            self.journal.append(message)
            self.journal_count += 1
            return "journal"
        if isinstance(message, m.RunFinished):  # (only this console's engine says so: the follower never does)
            self.finished = message
            self.driven_here.add(message.run_id)
            for job in self.jobs.values():  # the run is over: nothing of it is going any more
                job.finished = True
            return "job"
        if isinstance(message, m.ResultsReady):
            self.results = message
            return "run"
        return self._job(message, now)

    def confirmation_seen(self, confirmation: m.Confirmation) -> None:
        """The stop's question carries its one figure (the forecast downtime): the fallback projection."""
        if confirmation.step == "stop" and confirmation.estimate_s is not None:
            self.downtime_estimate_s = confirmation.estimate_s

    def extraction(self) -> JobView | None:
        """The extraction job still going, if any."""
        return next((j for j in self.jobs.values() if j.worker == "extract" and not j.finished), None)

    def expected_back(self, now: float) -> tuple[float, str] | None:
        """When the service is expected ready again, and on what that rests: the engine's projection;
        else now + the extraction's time left + the restart's estimate; else the stop plus the
        forecast's downtime, or earlier windows' (the stop's question), or the plan's step estimates."""
        down = self.down_since
        if down is None:
            return None
        if self.projection is not None and self.projection.down_since == down:
            return self.projection.expected_ready_at, self.projection.basis or "projected"
        restart = self.steps.get("restart")
        job = self.extraction()
        eta = job.eta_s(now) if job is not None else None
        if eta is not None and restart is not None and restart.estimate_s is not None:
            return now + eta + restart.estimate_s, "extraction's rate + the restart's estimate"
        if self.forecast is not None:  # with a phase unknown its downtime is a floor, and says so
            unknown = [p.name for p in self.forecast.phases if p.seconds is None]
            return down + self.forecast.downtime_s, (f"forecast, at least ({', '.join(unknown)} unknown)"
                                                     if unknown else "forecast")
        if self.downtime_estimate_s is not None:
            return down + self.downtime_estimate_s, "the stop's question"
        window = [self.steps[n].estimate_s for n in DOWN_STEPS if n in self.steps]
        if window and all(e is not None for e in window):
            return down + sum(window), "the plan's step estimates"
        return None

    def window_ends(self) -> float | None:
        """When the window's downtime budget runs out (`[window] max_downtime_s`), when there is one."""
        if self.projection is not None and self.projection.budget_ends_at is not None:
            return self.projection.budget_ends_at
        if self.forecast is not None and self.forecast.budget_s is not None and self.down_since is not None:
            return self.down_since + self.forecast.budget_s
        return None

    def new_run(self) -> None:
        """A run starts in this console: every row pending until its own plan and steps come (the
        last run's ticks never stand for this one's, not even during its preflight)."""
        self.run_id = self.route = self.plan = self.finished = None
        self.planned = False
        self.steps = {n: StepView(n) for n in self.rows}
        self.jobs.clear()

    def _plan(self, plan: m.PlanReady) -> None:
        same_run = plan.run_id == self.run_id  # (a re-plan of the run shown keeps its progress)
        if not same_run:
            self.jobs.clear()
        self.run_id, self.route, self.planned, self.finished, self.plan = plan.run_id, plan.route, True, None, plan
        old = self.steps
        self.steps = {}
        for step in plan.steps:
            if self._fleet_only(step.name) and not step.acts:
                continue  # one server: drain and rejoin never run, and their rows would crowd the job's bars out
            view = StepView(step.name, acts=step.acts, why=step.why, host=step.host, estimate_s=step.estimate_s)
            if step.name in old and old[step.name].status != "pending" and same_run:
                before = old[step.name]
                view.status, view.started_at, view.ended_at, view.detail = (
                    before.status, before.started_at, before.ended_at, before.detail)
                view.work_s, view.decision_s = before.work_s, before.decision_s
            if not step.acts and view.status == "pending":
                view.status = "left-out"
            self.steps[step.name] = view

    def _fleet_only(self, name: str) -> bool:
        """A step only a fleet takes (drain, rejoin), on a console whose rows have none (one server)."""
        return name in FLEET_STEPS and name not in self.rows

    def _step(self, update: m.StepUpdate) -> None:
        if update.run_id != self.run_id and self.run_id is not None:  # another run's rows: none of ours stay
            self.steps = {n: StepView(n) for n in self.rows}
            self.planned = False
        self.run_id = update.run_id
        if self._fleet_only(update.step) and update.step not in self.steps and update.status in ("skipped",
                                                                                                "left-out"):
            return  # "one server: no router to leave": not a row of a window without a fleet
        view = self.steps.setdefault(update.step, StepView(update.step))
        view.status = update.status
        view.started_at = update.started_at if update.started_at is not None else view.started_at
        view.ended_at = update.ended_at
        view.detail = update.detail
        view.work_s, view.decision_s = update.work_s, update.decision_s

    def _job(self, message: Any, now: float | None = None) -> str | None:
        """Job messages (console/messages.py: JobProgress, JobLog, JobStalled, JobResult, JobError, JobExit)."""
        kind = type(message).__name__
        if not kind.startswith("Job") or not hasattr(message, "job_id"):
            return None
        job = self.jobs.get(message.job_id)
        if job is None:
            worker, host = getattr(message, "worker", None), getattr(message, "host", None)
            label = f"{worker} on {host}" if worker and host else str(worker or message.job_id)
            job = self.jobs[message.job_id] = JobView(message.job_id, label, worker=worker)
        if kind == "JobProgress":
            key = message.key or message.unit or "progress"
            job.bars[key] = message
            if now is not None:
                job.received[key] = now
            job.phase = message.phase or job.phase
            job.stalled = None
        elif kind == "JobLog":
            if message.kind == "phase":
                job.phase = message.message
            else:
                job.last_log = message.message if message.kind == "log" else event_words(message.kind)
            job.stalled = None
        elif kind == "JobStalled":
            job.stalled = f"no event for {message.silent_s:.0f} s (the process is alive)"
        elif kind in ("JobResult", "JobExit", "JobError"):
            job.finished = True
            job.ended = job.ended or max((j.ended for j in self.jobs.values()), default=0) + 1
        return "job"

    def current_jobs(self) -> list[JobView]:
        """The jobs still going, oldest first; when none, the newest finished one that has bars to
        show, the last to end (a check or a probe that reported none never hides the extraction's
        last counts)."""
        going = [j for j in self.jobs.values() if not j.finished]
        if going:
            return going
        shown = [j for j in self.jobs.values() if j.bars]
        return [max(shown, key=lambda j: j.ended)] if shown else []
