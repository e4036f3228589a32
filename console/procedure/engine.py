"""The window engine: a loop over the step table (`steps.STEPS`), asking before it acts.

For each step the engine asks its `check` (is the work already on the hosts? a resumed run trusts
the hosts, never its saved state), else runs it and `verify`s the result. The typed state
(`state.RunState`) is saved after every transition and every decision, command and exit is
journalled, so a console killed at any moment resumes from the first unsatisfied step. Jobs get
deterministic ids (`<run>-<step>`) recorded before they start and are followed from a persisted
offset, so a resumed run finds a job it started instead of starting it again, never takes an old
event for a live process, and never extracts twice.

Interlocks: the stop waits for verified completions and (when staging) a live `staged` worker; the
extraction waits until the service's GPUs are free (our staged worker's memory excluded); the
restart begins at `gpu_released`. One start per down period: before any start the manager is asked,
and a service already active or activating is waited for, never started again. Any failure, cancel
or signal after the stop ends our own jobs and offers the restart (`restart_on_failure`), in a
compensation that a second interruption does not abandon; the exit code says whether the service
is still down. One run per inference host at a time, whoever logs in: a lock in the service host's
shared lock directory (`host_lock.py`) names its owner.

All host access goes through `WindowHosts` (`console/procedure/hosts.py`), so the whole engine
runs over small fakes in the crash-point sweep (`tests/test_engine_sweep.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

from console.config import Config
from console.messages import (
    JournalEntry,
    PlanReady,
    RunFinished,
    StepUpdate,
)
from console.procedure import claim, ending, identity, run_jobs
from console.procedure.decider import Decider
from console.procedure.ending import (  # noqa: F401  (re-exported: the CLI, the views and the tests import them here)
    AS_IT_WAS,
    EXIT_DEGRADED,
    EXIT_DONE,
    EXIT_DOWN,
    EXIT_FAILED,
    EXIT_PAUSED,
    EXIT_USAGE,
    GIVE_BACK_ERRORS,
    held_line,
)
from console.procedure.hosts import WindowHosts
from console.procedure.outcomes import (  # noqa: F401  (re-exported: the views, the CLI and the tests import them here)
    Found,
    LeftOut,
    Paused,
    Refused,
    ResumeRefused,
    SimulatedCrash,
    Skip,
    StepFailed,
)
from console.procedure.state import STEP_ENDED, ExtractionState, Owner, ServiceState, between_windows
from console.procedure.steps import (
    BY_NAME,
    ROUTES,
    Step,
    estimates,
    fleet,
    fleet_guard,
    pause,
    route_steps,
    stop,
    units,
)
from console.procedure.steps.preflight import LOCK_FILE  # noqa: F401  (re-exported)
from console.procedure.store import Run, RunStore, RunStoreError, owned_elsewhere, what_next
from console.procedure.window import Window
from console.service.control import ReadyTimeout, ServiceError
from console.service.vram import VramError
from console.ssh.hosts import HostDisconnected, HostError

LINK_RETRIES = 3  # a step whose link drops is run again this many times
SETTLED = ("done", "skipped", "left-out")
log = logging.getLogger(__name__)
CANCEL_AGAIN_S = 0.5  # a cancel the run has not taken yet is asked again this often (Engine.cancel)
CRASH_POINTS = ("staged", "cached", "stop-asked", "stop-ran", "holders", "go", "gpu-released", "start-issued",
                "ready", "evaluated", "reported")
PAUSE_CRASH_POINTS = ("staged", "cached", "paused", "released", "go", "gpu-released", "resumed", "continued",
                      "evaluated", "reported")  # the pause route's
DRAFTER_CRASH_POINTS = ("drafter-stopped",)  # a drafter that came back degraded: its restart, stopped (either route)


class Engine:
    """Drives one run (new or resumed) of the procedure over `hosts`."""

    def __init__(self, hosts: WindowHosts, config: Config, run: Run, decider: Decider, store: RunStore | None = None,
                 restart_on_failure: bool = True, route: str | None = None, plan_only: bool = False,
                 stage: bool | None = None, one_step: bool = False,
                 crash_at: Callable[[str], None] | None = None):
        self.one_step = one_step  # run the next unsatisfied step (stage + cache together), then pause
        route = route or (None if run.state.started else getattr(config.window, "route", None))  # [window] route
        if route is not None and route not in (*ROUTES, "auto"):
            raise ValueError(f"unknown route {route!r}: expected one of {', '.join(ROUTES)} or auto")
        if route == "auto" and run.state.started and run.state.route:
            route = run.state.route  # chosen when the run was made: a resume keeps it
        if route is not None and run.state.started and run.state.route not in (None, route):
            raise ResumeRefused(f"run {run.run_id} was made for the {run.state.route} route: a resume keeps "
                                f"its route (asked for {route})")
        route = route or run.state.route or "window"
        if not plan_only and owned_elsewhere(run.state):  # another live console's run: refused, nothing written or sent
            raise ResumeRefused(f"{what_next(run)}; nothing was written or sent")
        if run.state.service.left_as() is not None:  # stopped (paused, drained) by this run: a full disk must not keep it so
            run.keep_going_on_write_errors = True
        if not plan_only and (run.state.started or run.state.service_identity):
            refused = identity.refusal(run.state, config, run.run_id)  # before anything is written or sent
            if refused is not None:
                raise ResumeRefused(refused)
        # What the steps see of this run: the only object they receive (`window.py`).
        self.window = window = Window(hosts, config, run, decider, store, route, route_steps,
                                      restart_on_failure=restart_on_failure, plan_only=plan_only,
                                      stage_override=stage, crash_at=crash_at)
        window.earlier = estimates(s.state.to_json() for s in window.earlier_runs())
        self.run, self.plan_only = run, plan_only
        self._unsubscribe_telemetry: Callable[[], None] | None = None
        self._ran: set[str] = set()  # steps this engine ran (not found satisfied)
        self._settled_at_start: set[str] = set()  # steps the run's state had settled when this engine began
        self._task: asyncio.Task | None = None  # the one running `execute`, while it does
        self._driving = False  # in `_drive`: the steps run, a cancel is taken there
        self._cancel_asked = False  # while driving: a cancel came, taken or not yet
        self._cancel_taken = False
        self._cancel_again: asyncio.TimerHandle | None = None
        self._claimed = False  # this engine took the run's claim (claim.py): it releases it

    # --- what the console and the CLI read of the run (the window's) ----------------------------

    @property
    def state(self):
        return self.run.state

    @property
    def route(self) -> str:
        return self.window.route  # "auto" until preflight chooses

    @property
    def config(self) -> Config:
        return self.window.config  # a fleet run's next window narrows it to its replica

    @property
    def plan(self) -> PlanReady | None:
        return self.window.plan

    @property
    def decider(self) -> Decider:
        return self.window.decider

    @decider.setter
    def decider(self, decider: Decider) -> None:  # the terminal gone: every question refused from now on
        self.window.decider = decider

    @property
    def restart_on_failure(self) -> bool:
        return self.window.restart_on_failure

    @property
    def service_down_by_us(self) -> bool:
        return self.window.service_down_by_us

    @property
    def server_held_by_us(self) -> bool:
        return self.window.server_held_by_us

    def shown_plan(self) -> PlanReady | None:
        return self.window.shown_plan()

    def journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.window.journal(step, message, **fields)

    def record(self, step: str | None, message: str, **fields: Any) -> None:
        self.window.record(step, message, **fields)

    # --- bookkeeping --------------------------------------------------------------------------

    def _publish_step(self, name: str, attempt_started: float | None = None) -> None:
        if self.plan_only:  # a preview keeps no run: the stepper shows the plan, not its ticks
            return
        rec = self.state.step(name)
        started = attempt_started if rec.status == "running" and attempt_started else rec.started_at
        self.window.bus.publish(StepUpdate(self.run.run_id, name, rec.status, started, rec.ended_at, rec.detail,
                                    work_s=rec.work_s, decision_s=rec.decision_s, found_on_resume=rec.found_on_resume))

    def _set(self, name: str, status: str, detail: str | None = None, attempt_started: float | None = None,
             found: bool = False) -> None:
        rec = self.state.step(name)
        now = time.time()
        if status == "running":
            rec.started_at = rec.started_at or now  # the first attempt's start is kept across resumes
            rec.ended_at = None
        elif status in STEP_ENDED:
            rec.ended_at = now
        rec.status = status
        rec.found_on_resume = found
        if detail is not None:
            rec.detail = detail
        self.run.save()
        self._publish_step(name, attempt_started)
        said = f"{name}: {status}" + (f": {detail}" if detail else "")
        fields = {"kind": "step", "status": status,
                  "started_at": attempt_started if status == "running" and attempt_started else rec.started_at}
        if status != "running" or detail:
            self.journal(name, said, level="error" if status == "failed" else "info", **fields)
        else:
            self.record(name, said, **fields)

    # --- the run ------------------------------------------------------------------------------

    async def execute(self) -> RunFinished:
        """Run (or resume) the procedure to its end; never raises for a failed step (a
        `SimulatedCrash` from the sweep's hook passes through untouched)."""
        self._task = asyncio.current_task()
        try:
            if not self.plan_only:
                lost = await self.claim_run()
                if lost is not None:  # another console gave the server back meanwhile: nothing to do
                    return lost
            return await self._execute()
        finally:
            self._task = None
            self._cancel_no_more()
            self._release_claim()
            if self.window.lease is not None:  # the console's lease is not renewed past its run
                self.window.lease.cancel()

    async def _execute(self) -> RunFinished:
        state = self.state
        if state.started and not state.finished and not self.plan_only:  # a resume: what it was, kept
            self.window.before_resume = copy.deepcopy(state)
        changed = identity.edited(state, self.config) if state.started and not self.plan_only else None
        if changed:  # the run's own file, edited since: allowed (the same service), said
            self.journal(None, changed, level="warning")
        if state.finished and not self.plan_only:
            return await self._restart_only()
        state.route = self.route
        if between_windows(state):
            # the window over: its server back (started, or resumed and continued), a fleet's replica
            # back in the router first (its rejoin)
            self._next_window()
        state.status = "running"
        resumed = self.window.resumed = state.started
        state.started = True
        if not self.plan_only:
            state.owner = Owner.this_process()
            state.service_identity = state.service_identity or identity.of(self.config)
            state.config = state.config or identity.config_path(self.config)
            state.config_sha256 = state.config_sha256 or identity.config_sha256(self.config)
        self.run.save()
        self.journal(None, ("resumed" if resumed else "started") + f" run {self.run.run_id} "
                     f"({self.route} route, config {self.config.source})")
        for step in route_steps(self.route):  # the views show where a resumed run stands
            if state.status_of(step.name) != "pending":
                self._publish_step(step.name)
        self._unsubscribe_telemetry = self.window.bus.subscribe(self._record_telemetry)
        if self.service_down_by_us or self.server_held_by_us:
            self.window.publish_downtime()
        self._settled_at_start = {name for name, rec in state.steps.items() if rec.status in SETTLED}
        status, message = await self._drive()
        return await self._end(status, message)

    def _doing(self, recovering: bool = False) -> str:
        """What this engine claims the run for, as another console is told: the whole run, or only
        bringing the server back (a finished run's resume, `r`: `recovering`)."""
        left = self.state.service.left_as()
        if recovering or self.state.finished:
            return {"paused": claim.GIVING_BACK, "down": "restarting the service",
                    "drained": "putting the replica back in the router"}.get(left or "", "ending the run")
        return claim.DRIVING

    async def claim_run(self, recovering: bool = False) -> RunFinished | None:
        """Claim the run before anything is sent (claim.py), then read it again under the claim: another
        console may have given the server back while this one opened it. A claim held for a give-back
        is waited for (`claim.take_waiting`); one held by a console driving the run refuses this one
        (`ResumeRefused`), as `owned_elsewhere` does. The run given back meanwhile: a RunFinished
        (exit 0) naming who and when, nothing written or sent; None: this engine goes on, claimed."""
        held_before = self.state.service.left_as()

        def waiting(line: str) -> None:
            self.window.bus.publish(JournalEntry(time.time(), self.run.run_id, None, line, level="warning"))

        took = await claim.take_waiting(self.run.dir, self.run.run_id, Owner.this_process(), self._doing(recovering),
                                        waiting)
        if took is None:  # a full disk, an unsafe claim file: the give-back must not wait on it
            return None
        if not took:  # this console's already (`r` while its run goes on): its state is the live one
            return None
        self._claimed = True
        with contextlib.suppress(RunStoreError):  # read at open, unreadable now: the state read then stands
            self.run.state = RunStore(self.run.dir.parent).open(self.run.dir.name).state
        if owned_elsewhere(self.state):
            self._release_claim()
            raise ResumeRefused(f"{what_next(self.run)}; nothing was written or sent")
        if held_before is not None and self.state.service.left_as() is None:
            self._release_claim()
            finished = RunFinished(self.run.run_id, self.state.status, EXIT_DONE, True,
                                   claim.given_back_line(self.run.run_id, self.state.service), str(self.run.dir))
            self.window.bus.publish(finished)
            return finished
        return None

    def _release_claim(self) -> None:
        if self._claimed:
            self._claimed = False
            with contextlib.suppress(OSError, claim.Unsafe):
                claim.release(self.run.dir, Owner.this_process())

    def cancel(self, leave_down: bool = False) -> None:
        """Cancel the run (Ctrl-C, a signal, the console's quit): it then compensates (`leave_down`:
        never offering the restart or the give-back, the quit modal's own key).

        A cancel can be lost on its way: on Python 3.11 `asyncio.wait_for` (asyncssh waits on each
        command with it) returns the command's result instead when the cancel lands in the moment
        the command completes. So until the run has taken it, it is asked again every
        `CANCEL_AGAIN_S`; once taken (compensating), a cancel is one more interruption, which the
        compensation journals and waits through."""
        if leave_down:
            self.window.restart_on_failure = False
        task = self._task
        if task is None or task.done():
            return
        task.cancel()
        self._cancel_asked = self._cancel_asked or self._driving
        if self._driving and not self._cancel_taken and self._cancel_again is None:
            self._cancel_again = asyncio.get_running_loop().call_later(CANCEL_AGAIN_S, self._ask_cancel_again)

    def _ask_cancel_again(self) -> None:
        self._cancel_again = None
        if not self._driving or self._cancel_taken or self._task is None or self._task.done():
            return
        log.warning("run %s: a cancel was lost on its way (asked again)", self.run.run_id)
        self.cancel()

    def _cancel_no_more(self) -> None:
        if self._cancel_again is not None:
            self._cancel_again.cancel()
            self._cancel_again = None

    async def _drive(self) -> tuple[str, str]:
        self._driving = True
        try:
            ended = await self._drive_steps()
        finally:
            self._driving = False
            self._cancel_no_more()
        if self._cancel_asked and not self._cancel_taken:
            # It came as the last step finished, and is still on its way: taken here, so that it
            # cannot interrupt the run's finish instead (on 3.11 only its delivery clears it).
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
            task = asyncio.current_task()
            while task is not None and task.cancelling():
                task.uncancel()
            self.journal(None, f"a cancel came as the last step finished: the run ended {ended[0]} all the same",
                         level="warning")
        return ended

    async def _drive_steps(self) -> tuple[str, str]:
        try:
            try:
                await self._do(BY_NAME["preflight"])
            except StepFailed as exc:
                if self.window.before_resume is not None:  # a resume's preflight: the run is left as it was
                    return AS_IT_WAS, exc.msg
                raise
            if self.plan_only:
                return "done", "plan only: nothing was changed"
            await self._steps()
            return "done", "the procedure finished"
        except Paused as exc:
            return "paused", exc.why or f"paused after {exc.step}: the next step runs on resume (run --resume)"
        except Refused as exc:
            return "refused", str(exc)
        except asyncio.CancelledError:
            self._cancel_taken = True
            self._cancel_no_more()
            task = asyncio.current_task()
            while task is not None and task.cancelling():
                task.uncancel()  # every ask of it (one may have been lost): the compensation must still be able to wait
            return "cancelled", "cancelled by the operator"
        except StepFailed as exc:
            return "failed", str(exc)
        except Exception as exc:  # anything at all: the run still compensates and finishes
            self.run.keep_going_on_write_errors = True  # a full disk among them: the end must still be written past
            message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HostError | ServiceError | VramError
                                                                         | ReadyTimeout | OSError) else str(exc)
            self.journal(None, f"the run failed: {message}", level="error")
            return "failed", message

    async def _end(self, status: str, message: str) -> RunFinished:
        if self._unsubscribe_telemetry:
            self._unsubscribe_telemetry()
        return await ending.end(self.window, status, message)

    async def _release_lock(self) -> None:
        await ending.release_lock(self.window)

    async def _restart_only(self) -> RunFinished:
        return await ending.restart_only(self.window)

    async def _steps(self) -> None:
        while await self._window_steps():
            pass  # a fleet's window cut short at its budget: the next replica's window, in this run

    async def _window_steps(self) -> bool:
        """The route's steps after preflight; True when the window was cut short at its budget and
        the fleet's next replica takes the missing prompts in this run (`_next_replica`)."""
        for unit in units(self.route)[1:]:
            if self._cancel_asked and not self._cancel_taken:  # asked, and lost on its way: taken now
                raise asyncio.CancelledError
            ran_before = set(self._ran)
            fleet_guard.cut(self.window, unit[0].name)  # ended early (the fleet degraded): no deeper
            try:
                if len(unit) == 1:
                    await self._do(unit[0])
                else:
                    await self._side_by_side(unit)
            except Refused as exc:
                if exc.step == "drain" and self.window.windows_here and not self.state.service.drains:
                    raise Paused("drain", f"{exc}: this run's window {len(self.state.windows) + 1} on replica "
                                          f"{self.state.facts.get('fleet_replica')} is not begun, nothing of it "
                                          f"changed; every prompt extracted is kept and `run --resume "
                                          f"{self.run.run_id}` extracts the rest") from None
                raise
            partial = self.state.extraction.partial
            ends = ("continue", "rejoin") if self.route == "pause" else ("restart", "extract", "rejoin")
            if partial and unit[-1].name in ends and self.state.service.left_as() is None:
                # the window over: the server back (a fleet's window: its replica back in the router)
                why = (f"the window was cut short at its budget: {len(partial['done'])} prompts extracted and kept, "
                       f"{len(partial['missing'])} missing; `run --resume {self.run.run_id}` extracts only those in "
                       f"the next window" + (f" (on the next replica: the least loaded other than "
                                             f"{self.state.facts.get('fleet_replica')} that can take it)"
                                             if self.config.fleet is not None else "") + ", then evaluates")
                early = fleet_guard.early_words(self.state)
                if early is not None:  # the fleet degraded: no next replica in this run
                    raise Paused(unit[-1].name, early)
                if self.config.fleet is None or self.one_step or not between_windows(self.state):
                    raise Paused(unit[-1].name, why)
                await self._next_replica(unit[-1].name, why)
                return True
            if self.one_step and self._stepped(unit, ran_before):
                raise Paused(unit[-1].name, self._next_step_waits(unit[-1].name))
        return False

    def _stepped(self, unit: tuple[Step, ...], ran_before: set[str]) -> bool:
        """Step mode: the unit just ended is the one step asked for, and the run pauses after it.

        It is the first unit of the route whose work the run's state did not record settled when this
        engine began: a step done earlier and run again on the way (free-vram trusts the hosts, not its
        record, until the extraction begins) is no step of its own, else a resume after it would pause
        after it again, forever, never reaching the extraction. Never while the restart (or give-back)
        begun at gpu_released is still to be joined: the step after the extraction is the restart, and
        the run never pauses with a question of it open; nor after the last step, which ends the run."""
        new = (self._ran - ran_before) - self._settled_at_start
        return bool(new) and self.window.restart_task is None and unit[-1].name != ROUTES[self.route][-1]

    def _next_step_waits(self, done: str) -> str:
        """What a pause of step mode says: the step done, the one that waits, how to run it."""
        names = ROUTES[self.route]
        acting = {s.name for s in self.plan.steps if s.acts} if self.window.plan is not None else set(names)
        waiting = next((n for n in names[names.index(done) + 1:]
                        if n in acting and self.state.status_of(n) not in SETTLED), None)
        then = f"the next step, {waiting}, runs" if waiting else "the rest runs"
        return f"paused after {done} (one step at a time): {then} on `dflash-ops run --resume {self.run.run_id}` " \
               f"(n in the console)"

    async def _next_replica(self, step: str, why: str) -> None:
        """A fleet's window cut short at its budget, its replica back in the router: the run goes on by
        itself on the next replica (`fleet.next_in_run`, as `run --resume` chooses it), through the
        same next window as a resume (`_next_window`) and a preflight addressed to that replica; its
        drain is asked as every drain is. A refusal of the choice, or that preflight's failure, ends
        the run paused (nothing of the next window changed; `run --resume` goes on)."""
        self.window.crash_point("window-over")
        try:
            chosen, chose = await fleet.next_in_run(self.window)
        except StepFailed as exc:
            raise Paused(step, f"{why}; the next window is not begun in this run: {exc.msg}") from None
        config = fleet.on_replica(self.window.config, chosen)
        if chosen.service.host != self.config.service.host and self.window.holds_lock:
            await ending.release_lock(self.window)  # the next window's preflight takes the lock on its host
        address = getattr(self.window.hosts, "address", None)
        if address is not None:  # the live session's service watch: the next replica's server and manager
            address(config)
        self.window.config = config
        self.journal(None, f"the window was cut short at its budget; the run goes on with the next replica: {chose}")
        self._next_window()
        self.window.windows_here += 1
        self.window.fresh()
        try:
            await self._do(BY_NAME["preflight"])
        except StepFailed as exc:
            raise Paused("preflight", f"{why}; the next window's preflight on replica {chosen.name} failed, nothing "
                                      f"of it changed: {exc.msg}") from None

    async def _side_by_side(self, unit: tuple[Step, ...]) -> None:
        """Steps of one group at once: the first to fail cancels the others (their jobs are ended
        by the compensation)."""
        try:
            async with asyncio.TaskGroup() as group:
                for step in unit:
                    group.create_task(self._do(step), name=f"step-{step.name}")
        except BaseExceptionGroup as grouped:
            crashes = grouped.subgroup(SimulatedCrash)
            if crashes is not None:
                raise crashes.exceptions[0] from None
            first = grouped.exceptions[0]
            for kind in (Refused, StepFailed):  # the operator's refusal and step failures read first
                match = grouped.subgroup(kind)
                if match is not None:
                    first = match.exceptions[0]
                    break
            raise first from None

    async def _do(self, step: Step) -> None:
        """One step: its check (satisfied? say why), else its run and verify; status published.

        A link that drops mid-step (outside a job's events, which are followed through drops) runs
        the step again once the host is back: each step is safe to run again by construction."""
        name = step.name
        rec = self.state.step(name)
        before = rec.status
        attempt_started = time.time()
        detail: str | Skip | None = None
        running = False
        try:
            for attempt in range(LINK_RETRIES + 1):
                try:
                    verdict = await step.check(self.window) if step.check else None
                    if verdict is not None:
                        detail = verdict
                        break
                    if not running:
                        self._set(name, "running", attempt_started=attempt_started)
                        running = True
                    self._ran.add(name)
                    detail = await step.run(self.window)
                    if step.verify and not isinstance(detail, Skip):
                        await step.verify(self.window)
                    break
                except HostDisconnected as exc:
                    if attempt == LINK_RETRIES:
                        raise
                    self.journal(name, f"the link dropped ({exc.msg}); running the step again once "
                                       f"{exc.host} is back", host=exc.host, level="warning")
                    await asyncio.sleep(0.5)  # the supervisor notices the drop and reconnects
        except SimulatedCrash:
            raise
        except Refused:
            self._account(name, attempt_started)
            self._set(name, "refused")
            raise
        except asyncio.CancelledError:
            self._account(name, attempt_started)
            if name in self.window.irreversible:  # its change was made: cancelled after it, it is done
                self._set(name, "done", self.window.irreversible[name])
            else:
                self._set(name, "cancelled")
            raise
        except StepFailed as exc:
            self._account(name, attempt_started)
            self._set(name, "failed", exc.msg)
            raise
        except Exception as exc:
            self._account(name, attempt_started)
            msg = str(exc) or type(exc).__name__
            self._set(name, "failed", msg)
            raise StepFailed(name, msg) from exc
        if isinstance(detail, LeftOut):
            self._set(name, "left-out", detail.why)
        elif isinstance(detail, Found):
            if before in ("done", "skipped") and not running:
                self._publish_step(name)  # recorded done before: its times and detail stay as they were
                return
            self._account(name, attempt_started)
            self._set(name, "done", detail.why, found=self.window.resumed and before in ("running", "pending", "cancelled"))
        elif isinstance(detail, Skip):
            if before in SETTLED and not running:
                self._publish_step(name)
                return
            self._set(name, "skipped", detail.why)
        else:
            self._account(name, attempt_started)
            self._set(name, "done", detail)

    def _account(self, name: str, attempt_started: float) -> None:
        """This attempt's work and its waits on the operator's answers (its own questions, and those
        of the restart or give-back it joined), kept apart and added to the step's: across attempts
        the step's work is the time it worked, and nothing else."""
        rec = self.state.step(name)
        now = time.time()
        waited = self.window.answer_waits.held(attempt_started, now)
        rec.work_s += max(0.0, now - attempt_started - waited)
        rec.decision_s += waited

    def _next_window(self) -> None:
        """A run cut short at its budget goes on in a new window: its service record and window steps
        start over (the earlier window kept in `windows`); the extractor, run again into the same
        output, keeps the verified prompts and extracts only the missing ones. On a fleet the drain and
        the rejoin start over too (one drain per window, one rejoin per drain), each window records
        its replica, and this one is on the replica the config was narrowed to (`fleet.next_replica`)."""
        state = self.state
        window_steps = [s.name for s in route_steps(self.route)
                        if s.while_down or s.name in ("stage", "drain", "rejoin")]
        state.windows.append({"service": dataclasses.asdict(state.service),
                              "extraction": dataclasses.asdict(state.extraction),
                              "steps": {n: dataclasses.asdict(state.steps[n]) for n in window_steps if n in state.steps},
                              "forecast": state.forecast,
                              **({"replica": state.facts.get("fleet_replica")} if self.config.fleet else {})})
        if self.config.fleet is not None:
            state.facts["fleet_replica"] = fleet.replica_of(self.window).name  # drained None: the narrowed config's
        missing = state.extraction.partial["missing"]
        state.service, state.extraction, state.forecast = ServiceState(), ExtractionState(), None
        for name in window_steps:
            state.steps.pop(name, None)
        run_jobs.new_attempt(self.window, "extract")
        self.run.save()
        on = f" on replica {state.facts['fleet_replica']}" if self.config.fleet is not None else ""
        self.journal(None, f"window {len(state.windows) + 1} of run {self.run.run_id}{on}: the {len(missing)} prompts "
                           f"missing ({', '.join(missing)}) are extracted now; the others are kept")
        self.window.crash_point("next-window")

    async def restart_service(self, reason: str, decider: Decider | None = None) -> None:
        """Bring the server back (asking first, `decider`: the one asking now, the console's `r`): start
        it and wait until it is ready (`steps/stop.py`), or, paused by this run, resume and continue it
        (`steps/pause.py`). Under the run's claim (`claim_run`): a console that finds the run given
        back meanwhile sends nothing and raises `GivenBack`, naming who gave it back and when."""
        if decider is not None:
            self.window.decider = decider
        lost = await self.claim_run(recovering=True)
        if lost is not None:
            raise claim.GivenBack(lost.message)
        try:
            await self._restart_service(reason)
        finally:
            self._release_claim()

    async def _restart_service(self, reason: str) -> None:
        if self.server_held_by_us and not self.service_down_by_us:
            await pause.give_back(self.window, reason)
        else:
            await stop.restart_service(self.window, reason)
        if self.state.finished and self.state.service.left_as() is None:  # `r` on a finished run: its lock goes
            await self._release_lock()

    # --- telemetry ----------------------------------------------------------------------------

    def _record_telemetry(self, message: Any) -> None:
        from console.messages import ServiceView, TelemetryUpdate

        if isinstance(message, TelemetryUpdate) and message.sample is not None:
            self.run.record_telemetry(message.host, message.sample, {"service_down": self.service_down_by_us})
        elif isinstance(message, ServiceView):  # the service panel's verdict, journalled when it changes
            status, health = message.status, message.health
            verdict = (getattr(status, "state", None), health.ready if health else None,
                       health.health_status if health else None, message.error)
            if verdict != self.window.health_said:
                self.window.health_said = verdict
                said = "ready" if verdict[1] else f"not ready ({verdict[3] or verdict[0] or 'no answer'})"
                self.record(None, f"the service's health: {said}", kind="service",
                            data={"state": verdict[0], "ready": verdict[1], "health_status": verdict[2],
                                  "error": verdict[3]})

