"""The window: what one run of the procedure is, as the steps see it.

Every step receives this object and nothing else (`console/procedure/steps/`). It holds the run
(its state, journal and store), the hosts, the config, the operator's decider, what preflight
learned, and what belongs to the window now open: the run's directory on each host, the server's
return begun at gpu_released, the forecast and the extraction's progress against it, the down
clock, the steps whose change on a host is already made. Its methods are named as the operator
would say them: `ask`, `journal`, `crash_point`, `dir_on`, `publish_downtime`, `make_forecast`.

The engine (`engine.py`) makes one, runs the steps' table over it and ends the run with it
(`ending.py`); a run cut short at its budget opens its next window with `fresh()`. Nothing here
imports a step or the engine: the steps import this module, the engine imports the steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console.config import Config
from console.messages import Confirmation, DecisionMade, HostFit, PlanReady
from console.procedure import forecast as fc
from console.procedure.answer_waits import AnswerWaits
from console.procedure.decider import ApproveAll, Decider
from console.procedure.facts import Preflight
from console.procedure.fit import longest_tokens
from console.procedure.follower import QUESTION, downtime_of, write_question
from console.procedure.hosts import WindowHosts, reconnect_wait
from console.procedure.outcomes import StepFailed
from console.procedure.step import Step, done_earlier
from console.procedure.store import Run, RunStore
from remote.prompts import DEFAULT_PROMPTS, load_prompts


class Window:
    """One run's window, as its steps see it (made by the engine; see the module's docstring)."""

    def __init__(self, hosts: WindowHosts, config: Config, run: Run, decider: Decider, store: RunStore | None,
                 route: str, steps_of: Callable[[str], tuple[Step, ...]], restart_on_failure: bool = True, plan_only: bool = False,
                 stage_override: bool | None = None, crash_at: Callable[[str], None] | None = None):
        self.hosts = hosts
        self.bus = hosts.bus
        self.config = config  # a fleet run's next window narrows it to the next replica
        self.connect_s = reconnect_wait(config)  # how long a step waits for a dropped host
        self.run = run
        self.decider = decider
        self.store = store
        self.route = route  # "auto" until preflight chooses (`choose_route`)
        self._steps_of = steps_of  # the step table's steps of a route (the engine's: no step imports the table)
        self.restart_on_failure = restart_on_failure
        self.plan_only = plan_only
        self.stage_override = stage_override  # None: the plan decides from the target host's RAM
        self._crash_at = crash_at  # the crash-point sweep's hook (raises SimulatedCrash at a named point)
        self.facts = Preflight()
        self.fits: list[HostFit] = []
        self.plan: PlanReady | None = None
        self.earlier: dict[str, float] = {}  # each step's median duration over earlier runs (the plan's estimates)
        # Every wait on the operator's answers, and which step it held up: a step's work is its time less those.
        self.answer_waits = AnswerWaits(lambda: time.time())  # (read at each call: the sweep's clock replaces `time`)
        # The operator said no to the restart: the run asks no more (the restart step, the compensation);
        # only `r` (or `run --resume`) asks again, as a decision of its own.
        self.restart_refused = False
        self.holds_lock = False  # this run took the host lock (host_lock.take): the run's jobs are its own
        self.lock_refused = False  # another live console's run holds the host: nothing of it is touched
        self.lease: Any = None  # renews the staged worker's lease while the run goes on (steps/serving.py)
        self.restart_lock = asyncio.Lock()  # one restart at a time (the step's, `r`'s, the compensation's)
        self.resumed = False  # a run begun earlier, resumed by this console
        self.before_resume: Any = None  # a resumed run's state before this console touched it (`kept.left_as_it_was`)
        self.windows_here = 0  # windows this console began after a budget cut (the engine's next replica)
        self._asking: list[Confirmation] = []  # the questions waiting for an answer, oldest first (question.json)
        self._dirs: set[tuple[str, str]] = set()  # (host, path) made by this console (`dir_on`)
        self.jobs_started_here: set[str] = set()  # job ids this console started (a later step follows one on)
        self.budget_task: asyncio.Task | None = None
        self.fresh()

    def fresh(self) -> None:
        """What belongs to one window: made at the start, and anew for a run's next window (as a new
        console would make it)."""
        if getattr(self, "budget_task", None) is not None:
            self.budget_task.cancel()  # the last window's offer to stop at its budget, if still open
        self.budget_task = None  # the offer to stop the extraction at the budget, while it is open
        if getattr(self, "fleet_watch", None) is not None:
            self.fleet_watch.cancel()  # the last window's watch of the other replicas
        self.fleet_watch: asyncio.Task | None = None  # the other replicas watched while ours is out (fleet_guard)
        self.ended_early = asyncio.Event()  # set when the operator ends this window early (fleet_guard.end_early)
        self.budget_asked = False
        self.gpu_released = asyncio.Event()
        self.start_issued = asyncio.Event()  # the restart's start is being sent (or the service found starting)
        # The server's return begun at gpu_released: the stop route's restart, the pause route's give-back.
        self.restart_task: asyncio.Task | None = None
        self.continued_early = False  # continued by that give-back: the continue step verifies it
        self.give_back_refused: Exception | None = None  # the operator's no to it, raised by its own step
        self.stopped_mono: float | None = None  # the stop, on this console's monotonic clock
        self.left_flushing: str | None = None  # why the extractor was left to finish (`kept.flushing`)
        self.irreversible: dict[str, str] = {}  # step -> detail, once its change on the host is made
        # job counter -> (when last journalled, its newest value not journalled yet): run_jobs.record_progress
        self.progress_said: dict[tuple[str, str], tuple[float, Any]] = {}
        self.forecast_made: tuple[fc.Forecast, fc.ForecastInputs] | None = None
        self.progress = fc.ExtractionProgress()
        self.service_said: str | None = None  # the service's state last journalled ("down", "up", "paused")
        self.health_said: tuple[Any, ...] | None = None  # its health verdict last journalled

    # --- the run's record ---------------------------------------------------------------------

    @property
    def steps(self) -> tuple[Step, ...]:
        """The route's steps, in order (the plan is made from them)."""
        return self._steps_of(self.route)

    def choose_route(self, route: str) -> None:
        """`--route auto` decided (preflight): the run's route from here, and its steps."""
        self.route = self.state.route = route

    @property
    def state(self):
        return self.run.state

    def journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.bus.publish(self.run.journal(step, message, **fields))

    def record(self, step: str | None, message: str, **fields: Any) -> None:
        """Journalled for the replay only, not the event log (a step's start, the jobs' progress)."""
        if not self.plan_only:
            self.run.journal(step, message, **fields)

    def crash_point(self, point: str) -> None:
        """A named point of the procedure: the crash-point sweep raises `SimulatedCrash` here."""
        if self._crash_at is not None:
            self._crash_at(point)

    def earlier_runs(self) -> list[Run]:
        if self.store is None:
            return []
        return [r for r in self.store.readable() if r.run_id != self.run.run_id]

    @property
    def service_down_by_us(self) -> bool:
        return self.state.service.down

    @property
    def server_held_by_us(self) -> bool:
        """Paused or released by this run and not given back yet (the pause route)."""
        return self.state.service.held

    def began(self) -> float | None:
        """When the window's downtime began, while it lasts: the stop (the server down), or the pause
        (its requests held) on the pause route; None outside a window."""
        svc = self.state.service
        if svc.stopped_at is not None and svc.down:
            return svc.stopped_at
        if self.route == "pause" and svc.paused_at is not None and svc.paused:
            return svc.paused_at
        return None

    # --- the operator -------------------------------------------------------------------------

    @property
    def unattended(self) -> bool:
        """`--yes` decides: what only an operator may answer (a restart offered as a remedy, a lost
        answer to settle on a guess) is not asked, and the step says what it leaves instead."""
        return self.decider.name == ApproveAll.name

    async def ask(self, confirmation: Confirmation, holds: bool = True) -> bool:
        """The operator's yes or no. Its wait is no step's work (`answer_waits`) and no phase of the
        window's (`ServiceState.answer_waits`): never measured, never forecast. `holds=False`: the work
        goes on while it waits (the offer to stop the extraction at the budget), so it holds up nothing."""
        asked_at = time.time()
        wait = self.answer_waits.asked() if holds else None
        self._asking.append(confirmation)
        self._say_question()
        try:
            approved = await self.decider.decide(confirmation)
        finally:
            self._asking.remove(confirmation)
            self._say_question()
            if wait is not None:
                self._answered(wait)
        self.bus.publish(DecisionMade(confirmation, approved, self.decider.name, self.run.run_id))
        # The whole question, for the replay: it is shown at `asked_at`, answered at the entry's time.
        question = {"impact": confirmation.impact, "destructive": confirmation.destructive,
                    "estimate_s": confirmation.estimate_s, "estimate_basis": confirmation.estimate_basis,
                    "asked_at": asked_at}
        self.journal(confirmation.step, f"{'approved' if approved else 'refused'}: {confirmation.action}",
                     host=confirmation.host, decision=f"{'yes' if approved else 'no'} ({self.decider.name})",
                     argv=list(confirmation.argv), kind="question", data=question)
        return approved

    def _answered(self, wait: Any) -> None:
        """A question of the window answered: its wait is kept with the window's stamps, so that no
        measured phase holds it (`forecast.measured_phases`), and the service's expected return moves
        by it: the banner's "late" counts from the answer, not from the question."""
        self.answer_waits.answered(wait)
        service = self.state.service
        if not service.began() or self.plan_only:
            return  # before the stop (or the pause): no window holds it yet
        service.answer_waits.append([wait.asked_at, wait.answered_at])  # saved with what the answer lets happen
        began = self.began()
        if began is not None and self.forecast_made is not None:
            made, inputs = self.forecast_made
            waited = fc.overlap(service.answer_waits, began, wait.answered_at)
            self.bus.publish(fc.project(made, inputs, began, wait.answered_at, self.progress, waited_s=waited))

    def _say_question(self) -> None:
        """question.json beside the run's state: the question this run waits on (the oldest still
        open), so that a read-only console, the browser view and `status` say what it waits on,
        whichever decider asks (the TUI's modals, `run --step`'s prompts); removed once answered."""
        path = self.run.dir / QUESTION
        with contextlib.suppress(OSError):  # a store we cannot write loses only this courtesy
            if self._asking:
                write_question(self.run.dir, self._asking[0], time.time())
            else:
                path.unlink(missing_ok=True)

    def shown_plan(self) -> PlanReady | None:
        """The plan as the views show it: on a resume, the steps that ended earlier in this run do not
        act again (said as the terminal's plan view says it). The run's own plan is unchanged: a
        staged extraction is still staged when its stage step is done."""
        if self.plan is None or not self.resumed:
            return self.plan
        ended = {name: rec.status for name, rec in self.state.steps.items() if name != "preflight"}
        return dataclasses.replace(self.plan, steps=done_earlier(self.plan.steps, ended))

    def acts(self, name: str) -> bool:
        """Whether step `name` acts in this run's plan."""
        if self.plan is not None:
            return any(s.name == name and s.acts for s in self.plan.steps)
        return any(s.get("name") == name and s.get("acts") for s in self.state.plan)

    def publish_downtime(self) -> None:
        """The service's state (down since the stop until ready; on the pause route paused since the
        pause until the continue): published for every view and the notifier, journalled on a change."""
        said = downtime_of(self.run.run_id, self.state.service)  # one rule for every console, live or following
        now = "down" if self.state.service.down else "paused" if said.paused else "up"
        self.bus.publish(said)
        if now != self.service_said:
            self.service_said = now
            self.record(None, f"the service is {now}", kind="service",
                        data={"state": now, "since": said.down_since, "back_at": said.restarted_at})

    # --- the hosts ----------------------------------------------------------------------------

    async def connected(self, name: str, step: str) -> None:
        """Host `name` connected (waiting for a dropped link up to `connect_s`), else the step fails."""
        try:
            await self.hosts.connect(name, self.connect_s)
        except TimeoutError:
            raise StepFailed(step, f"{name} is not connected after {self.connect_s:.0f} s "
                                   f"({self.hosts.link_state(name)})") from None

    async def dir_on(self, name: str) -> str:
        """This run's directory on host `name` (created private, once per console: every step asks
        for it, some inside the window, where each round trip is downtime)."""
        path = f"{await self.hosts.workdir(name)}/windows/{self.run.run_id}"
        if (name, path) not in self._dirs:
            await self.hosts.run(name, ["mkdir", "-p", "-m", "700", path])
            self._dirs.add((name, path))
        return path

    def extract_host(self) -> tuple[str, str]:
        """(host, model path) of the extraction: the target host, or the zero-downtime route's choice."""
        chosen = self.state.facts.get("extract_on")
        if self.route == "zero-downtime" and chosen:
            return chosen["host"], chosen["model_path"]
        return self.config.target.host, self.config.target.model_path

    def prompt_records(self) -> list[dict[str, Any]]:
        """The prompts as the workers will read them (the config's max_new_tokens applied)."""
        source = self.config.prompts.file
        path = DEFAULT_PROMPTS if source is None else Path(source).expanduser()
        if not path.is_absolute():
            path = self.config.base_dir() / path
        try:
            prompt_set = load_prompts(path)
        except Exception as exc:  # PromptFileError names file, line and field
            raise StepFailed("preflight", getattr(exc, "msg", str(exc))) from None
        records = []
        for prompt in prompt_set.prompts:
            record = prompt.to_json()
            if self.config.prompts.max_new_tokens:
                record["max_new_tokens"] = self.config.prompts.max_new_tokens
            records.append(record)
        return records

    # --- the forecast -------------------------------------------------------------------------

    async def forecast_inputs(self, manager: Any | None = None) -> fc.ForecastInputs:
        facts = self.state.facts
        tokens = facts.get("prompt_tokens")
        if not tokens:  # before the cache: the prompts' length estimated from their text
            tokens = [longest_tokens([p]) for p in self.prompt_records()]
        history = None
        if manager is not None:  # the unit's last stop and start (None from a command manager)
            with contextlib.suppress(Exception):
                history = await manager.history()
        record = self.state.jobs.get("extract")
        staged_event = record.result if record is not None and "staged" in record.events_seen else None
        plan_stage = facts.get("plan_stage", {})
        return fc.ForecastInputs(
            run_id=self.run.run_id, service_host=self.config.service.host, extract_host=self.extract_host()[0],
            staged=self.acts("stage"), prompt_tokens=fc.tokens_left(self.state, tokens),
            model_bytes=self.facts.model_bytes, stop_grace_s=self.config.service.stop_grace_s,
            budget_s=self.config.window.max_downtime_s, systemd=history,
            speeds=self.facts.probes.get(self.config.target.host, {}).get("speeds"),
            staged_event=staged_event if isinstance(staged_event, dict) else None,
            earlier=[r.state.to_json() for r in self.earlier_runs()],
            stage_left_out=None if plan_stage.get("stage", True) else plan_stage.get("why"),
            zero_downtime=facts.get("proposal"))

    async def make_forecast(self, manager: Any | None = None) -> tuple[fc.Forecast, fc.ForecastInputs]:
        """The window's downtime by phase, each with its basis; published and kept in the state."""
        inputs = await self.forecast_inputs(manager)
        made = fc.forecast(inputs)
        self.state.forecast = fc.to_state(made)
        self.run.save()
        self.bus.publish(made)
        self.forecast_made = (made, inputs)
        return made, inputs
