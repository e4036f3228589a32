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
is still down. One run per inference host at a time: a lock in the service host's workdir names
its owner.

All host access goes through `WindowHosts` (`console/procedure/hosts.py`), so the whole engine
runs over small fakes in the crash-point sweep (`tests/test_engine_sweep.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shlex
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console.config import Config
from console.messages import (
    Confirmation,
    DecisionMade,
    Downtime,
    HoldersFound,
    HostFit,
    JobProgress,
    PlanReady,
    ResultsReady,
    RunFinished,
    StepUpdate,
    TelemetrySample,
)
from console.procedure import forecast as fc
from console.procedure.decider import Decider
from console.procedure.fit import SPLIT_FILL, longest_tokens, where_it_fits
from console.procedure.hosts import WindowHosts, reconnect_wait
from console.procedure.state import STEP_ENDED, ExtractionState, JobRecord, Owner, ServiceState
from console.procedure.steps import (
    BY_NAME,
    ROUTES,
    Preflight,
    Step,
    estimates,
    planned,
    route_steps,
    size_text,
    stage_decision,
    units,
)
from console.procedure.store import Run, RunStore
from console.service.control import ReadyTimeout, ServiceError
from console.service.vram import VramError, describe_outcomes, others_used, wait_vram_free
from console.session import service_name
from console.ssh.hosts import HostDisconnected, HostError
from console.ssh.jobs import JobDead, JobExists, JobHandle, JobStalledError, job_message
from console.tasks import cancel_and_wait
from console.views.units import duration
from remote.prompts import DEFAULT_PROMPTS, load_prompts

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3
LINK_RETRIES = 3  # a step whose link drops is run again this many times
SETTLED = ("done", "skipped", "left-out")
START_SETTLE_S = 90.0  # a start cut off by a crash settles on the host within about a minute
LOCK_FILE = "dflash-ops.lock"  # in the service host's workdir: the run driving that host
QUIET_EVENTS = ("progress", "heartbeat")  # not worth a state write each (replaying them is harmless)
log = logging.getLogger(__name__)
CANCEL_AGAIN_S = 0.5  # a cancel the run has not taken yet is asked again this often (Engine.cancel)
CRASH_POINTS = ("staged", "cached", "stop-asked", "stop-ran", "holders", "go", "gpu-released", "start-issued",
                "ready", "evaluated", "reported")


class StepFailed(Exception):
    """A step could not do its work; the message says what and where (one line)."""

    def __init__(self, step: str, msg: str):
        super().__init__(f"{step}: {msg}")
        self.step = step
        self.msg = msg


class Paused(Exception):
    """One step was asked for and it is done (or the window was cut short at its budget): the run
    waits, resumable, for the next."""

    def __init__(self, step: str, why: str | None = None):
        super().__init__(f"paused after {step}")
        self.step = step
        self.why = why


class Refused(Exception):
    """The operator said no: the run ends there and nothing more is changed."""

    def __init__(self, step: str, action: str):
        super().__init__(f"{step}: the operator refused to {action}")
        self.step = step


class ResumeRefused(LookupError):
    """A resume that would be wrong (another route than the run was made for); the message says why."""


class SimulatedCrash(BaseException):
    """Raised by a crash-point hook in the crash-point sweep: the console "dies" right there. Nothing
    after it runs in this engine, no compensation and no finish, as after a SIGKILL."""


class Skip(str):
    """Nothing to do for the step (say why): it is recorded `skipped`."""

    @property
    def why(self) -> str:
        return str(self)


class LeftOut(Skip):
    """The plan leaves the step out (e.g. no staging without the RAM for it)."""


class Found(Skip):
    """The step's work is already on the hosts (verified there): it is recorded `done`."""


class Engine:
    """Drives one run (new or resumed) of the procedure over `hosts`."""

    def __init__(self, hosts: WindowHosts, config: Config, run: Run, decider: Decider, store: RunStore | None = None,
                 restart_on_failure: bool = True, route: str | None = None, plan_only: bool = False,
                 stage: bool | None = None, one_step: bool = False,
                 crash_at: Callable[[str], None] | None = None):
        self.hosts = hosts
        self.config = config
        self.connect_s = reconnect_wait(config)  # how long a step waits for a dropped host
        self.bus = hosts.bus
        self.run = run
        self.decider = decider
        self.store = store
        self.restart_on_failure = restart_on_failure
        self.plan_only = plan_only
        self.stage_override = stage  # None: the plan decides from the target host's RAM
        self.one_step = one_step  # run the next unsatisfied step (stage + cache together), then pause
        self.crash_at = crash_at  # the crash-point sweep's hook (raises SimulatedCrash at a named point)
        if route is not None and route not in ROUTES:
            raise ValueError(f"unknown route {route!r}: expected one of {', '.join(ROUTES)}")
        if route is not None and run.state.started and run.state.route not in (None, route):
            raise ResumeRefused(f"run {run.run_id} was made for the {run.state.route} route: a resume keeps "
                                f"its route (asked for {route})")
        self.route = route or run.state.route or "window"
        self.facts = Preflight()
        self.fits: list[HostFit] = []
        self.plan: PlanReady | None = None
        self.earlier = estimates(s.state.to_json() for s in self._earlier_runs())
        self._gpu_released = asyncio.Event()
        self._restart_task: asyncio.Task | None = None
        self._restart_lock = asyncio.Lock()
        self._unsubscribe_telemetry: Callable[[], None] | None = None
        self._decision_s: dict[str, float] = {}
        self._irreversible: dict[str, str] = {}  # step -> detail, once its change on the host is made
        self._stopped_mono: float | None = None
        self._ran: set[str] = set()  # steps this engine ran (not found satisfied)
        self._resumed = False
        self._window_forecast: tuple[fc.Forecast, fc.ForecastInputs] | None = None
        self._progress = fc.ExtractionProgress()
        self._budget_asked = False
        self._budget_task: asyncio.Task | None = None
        self._task: asyncio.Task | None = None  # the one running `execute`, while it does
        self._driving = False  # in `_drive`: the steps run, a cancel is taken there
        self._cancel_asked = False  # while driving: a cancel came, taken or not yet
        self._cancel_taken = False
        self._cancel_again: asyncio.TimerHandle | None = None

    # --- bookkeeping --------------------------------------------------------------------------

    @property
    def state(self):
        return self.run.state

    def _earlier_runs(self) -> list[Run]:
        if self.store is None:
            return []
        return [r for r in self.store.readable() if r.run_id != self.run.run_id]

    def _crash(self, point: str) -> None:
        if self.crash_at is not None:
            self.crash_at(point)

    def journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.bus.publish(self.run.journal(step, message, **fields))

    def _publish_step(self, name: str, attempt_started: float | None = None) -> None:
        if self.plan_only:  # a preview keeps no run: the stepper shows the plan, not its ticks
            return
        rec = self.state.step(name)
        started = attempt_started if rec.status == "running" and attempt_started else rec.started_at
        self.bus.publish(StepUpdate(self.run.run_id, name, rec.status, started, rec.ended_at, rec.detail,
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
        if status != "running" or detail:
            self.journal(name, f"{name}: {status}" + (f": {detail}" if detail else ""),
                         level="error" if status == "failed" else "info")

    async def _ask(self, confirmation: Confirmation) -> bool:
        asked = time.monotonic()
        approved = await self.decider.decide(confirmation)
        self._decision_s[confirmation.step] = self._decision_s.get(confirmation.step, 0.0) + time.monotonic() - asked
        self.bus.publish(DecisionMade(confirmation, approved, self.decider.name))
        self.journal(confirmation.step, f"{'approved' if approved else 'refused'}: {confirmation.action}",
                     host=confirmation.host, decision=f"{'yes' if approved else 'no'} ({self.decider.name})",
                     argv=list(confirmation.argv))
        return approved

    def _publish_downtime(self) -> None:
        service = self.state.service
        self.bus.publish(Downtime(self.run.run_id, service.stopped_at if service.down else None, service.ready_at))

    @property
    def service_down_by_us(self) -> bool:
        return self.state.service.down

    async def _connected(self, name: str, step: str) -> None:
        try:
            await self.hosts.connect(name, self.connect_s)
        except TimeoutError:
            raise StepFailed(step, f"{name} is not connected after {self.connect_s:.0f} s "
                                   f"({self.hosts.link_state(name)})") from None

    # --- the run ------------------------------------------------------------------------------

    async def execute(self) -> RunFinished:
        """Run (or resume) the procedure to its end; never raises for a failed step (a
        `SimulatedCrash` from the sweep's hook passes through untouched)."""
        self._task = asyncio.current_task()
        try:
            return await self._execute()
        finally:
            self._task = None
            self._cancel_no_more()

    async def _execute(self) -> RunFinished:
        state = self.state
        if state.finished and not self.plan_only:
            return await self._restart_only()
        state.route = self.route
        if state.extraction.partial and state.service.stops and not state.service.down:
            self._next_window()
        state.status = "running"
        resumed = self._resumed = state.started
        state.started = True
        if not self.plan_only:
            state.owner = Owner.this_process()
        self.run.save()
        self.journal(None, ("resumed" if resumed else "started") + f" run {self.run.run_id} "
                     f"({self.route} route, config {self.config.source})")
        for step in route_steps(self.route):  # the views show where a resumed run stands
            if state.status_of(step.name) != "pending":
                self._publish_step(step.name)
        self._unsubscribe_telemetry = self.bus.subscribe(self._record_telemetry)
        if self.service_down_by_us:
            self._publish_downtime()
        status, message = await self._drive()
        return await self._end(status, message)

    def cancel(self) -> None:
        """Cancel the run (Ctrl-C, a signal, the console's quit): it then compensates.

        A cancel can be lost on its way: on Python 3.11 `asyncio.wait_for` (asyncssh waits on each
        command with it) returns the command's result instead when the cancel lands in the moment
        the command completes. So until the run has taken it, it is asked again every
        `CANCEL_AGAIN_S`; once taken (compensating), a cancel is one more interruption, which the
        compensation journals and waits through."""
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
            await self._do(BY_NAME["preflight"])
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
            message = f"{type(exc).__name__}: {exc}" if not isinstance(exc, HostError | ServiceError | VramError
                                                                         | ReadyTimeout | OSError) else str(exc)
            self.journal(None, f"the run failed: {message}", level="error")
            return "failed", message

    async def _end(self, status: str, message: str) -> RunFinished:
        if self._unsubscribe_telemetry:
            self._unsubscribe_telemetry()
        if status not in ("done", "paused"):
            if status not in ("failed",):  # a failed step journalled its own error
                self.journal(None, message, level="warning")
            await self._compensate_to_the_end(status)
        if not self.service_down_by_us and not self.plan_only:
            await self._release_host_lock()
        return self._finish(status, message)

    async def _compensate_to_the_end(self, why: str) -> None:
        """Compensation in a task of its own: a second Ctrl-C or signal is journalled and waited
        through, never abandoning a restart half-way."""
        task = asyncio.ensure_future(self._compensate(why))
        while True:
            try:
                await asyncio.shield(task)
                return
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                if task.done():
                    return
                self.journal(None, "interrupted again during the compensation: it goes on (the restart is "
                                   "not abandoned half-way)", level="warning")
            except Exception as exc:  # journalled: the finish below still runs
                self.journal(None, f"the compensation failed: {type(exc).__name__}: {exc}", level="error")
                return

    def _finish(self, status: str, message: str) -> RunFinished:
        down = self.service_down_by_us
        code = EXIT_DOWN if down else (EXIT_DONE if status in ("done", "paused") else EXIT_FAILED)
        if not self.plan_only:
            self.state.status = status
            self.state.exit_code = code
        self.state.message = message
        self.run.save()
        if down:
            since = self.state.service.stopped_at or time.time()
            message += f"; THE SERVICE IS STILL DOWN (since {time.strftime('%H:%M:%S', time.localtime(since))})"
        finished = RunFinished(self.run.run_id, status, code, not down, message, str(self.run.dir))
        self.journal(None, f"run {status} (exit {code}): {message}", exit=code)
        for line in self.run.write_errors:
            self.journal(None, f"not recorded on disk: {line}", level="error")
        self.bus.publish(finished)
        self.run.close()
        return finished

    async def _restart_only(self) -> RunFinished:
        """A finished run is never run again; one that left the service down may still restart it."""
        state = self.state
        if not state.service.down:
            raise ResumeRefused(f"run {self.run.run_id} has finished ({state.status}): a finished run is never "
                                f"resumed; start a new one (dflash-ops run)")
        self.journal(None, f"run {self.run.run_id} had finished {state.status} with the service down: only its "
                           f"restart is done")
        message = f"run {state.status} earlier; the restart was asked for"
        try:
            await self.restart_service(reason=f"run {self.run.run_id} ended {state.status} with the service down")
        except (Refused, StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError) as exc:
            self.journal("restart", f"the restart failed: {exc}", level="error")
            message = f"run {state.status} earlier; the restart failed: {exc}"
        down = state.service.down
        code = EXIT_DOWN if down else EXIT_FAILED if state.status != "done" else EXIT_DONE
        state.exit_code = code
        self.run.save()
        finished = RunFinished(self.run.run_id, state.status, code, not down, message, str(self.run.dir))
        self.bus.publish(finished)
        self.run.close()
        return finished

    async def _end_own_jobs(self) -> None:
        """A run that ends without finishing leaves no worker of its own behind: the staged extractor
        would wait for its go forever holding the weights in RAM, and an extraction still on the
        GPUs would fight the restarting server for them. Ended before the restart, every host at
        once; a host that cannot be reached is said once, its other jobs not tried (each would wait
        out the same timeout while the service stays down)."""
        by_host: dict[str, list[JobHandle]] = {}
        for key, record in self.state.jobs.items():
            if record.handle is None or key.startswith(("probe-", "provenance-", "check")):
                continue
            handle = JobHandle.from_json(record.handle)
            by_host.setdefault(handle.host, []).append(handle)

        async def end_on(host: str, handles: list[JobHandle]) -> None:
            for handle in handles:
                try:
                    status = await self.hosts.job_status(handle)
                    if status.state == "running":
                        status = await self.hosts.cancel_job(handle, grace=5.0)
                        self.journal(None, f"ended our {handle.worker} job on {host} (pid {handle.pid}): "
                                           f"{status.state}" + (f", {status.note}" if status.note else ""),
                                     host=host, level="warning")
                except (HostError, TimeoutError) as exc:
                    left = ", ".join(f"{h.worker} (pid {h.pid})" for h in handles[handles.index(handle):])
                    self.journal(None, f"could not end our jobs on {host}: {left}: {exc or 'no answer'}",
                                 host=host, level="error")
                    return

        await asyncio.gather(*(end_on(host, handles) for host, handles in by_host.items()))

    async def _compensate(self, why: str) -> None:
        """After a failure, refusal or cancel: end our jobs, and with the service down because of us,
        offer the restart."""
        await self._end_own_jobs()
        if self._restart_task is not None:
            try:
                await self._restart_task
            except Exception as exc:
                self.journal("restart", f"the restart begun at gpu_released failed: {exc}", level="error")
        if not self.service_down_by_us:
            return
        if not self.restart_on_failure:
            self.journal("restart", "the service is left down (--no-restart)", level="warning")
            return
        try:
            await self.restart_service(reason=f"the run {why} after the stop")
        except (Refused, StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError) as exc:
            self.journal("restart", f"the restart failed: {exc}", level="error")

    async def _steps(self) -> None:
        for unit in units(self.route)[1:]:
            if self._cancel_asked and not self._cancel_taken:  # asked, and lost on its way: taken now
                raise asyncio.CancelledError
            ran_before = set(self._ran)
            if len(unit) == 1:
                await self._do(unit[0])
            else:
                await self._side_by_side(unit)
            partial = self.state.extraction.partial
            if partial and unit[-1].name in ("restart", "extract") and not self.service_down_by_us:
                raise Paused(unit[-1].name, f"the window was cut short at its budget: {len(partial['done'])} prompts "
                                            f"extracted and kept, {len(partial['missing'])} missing; `run --resume "
                                            f"{self.run.run_id}` extracts only those in the next window, then evaluates")
            if self.one_step and self._ran - ran_before and unit[-1].name != ROUTES[self.route][-1]:
                raise Paused(unit[-1].name)

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
        self._decision_s[name] = 0.0
        detail: str | Skip | None = None
        running = False
        try:
            for attempt in range(LINK_RETRIES + 1):
                try:
                    verdict = await getattr(self, step.check)() if step.check else None
                    if verdict is not None:
                        detail = verdict
                        break
                    if not running:
                        self._set(name, "running", attempt_started=attempt_started)
                        running = True
                    self._ran.add(name)
                    detail = await getattr(self, step.run)()
                    if step.verify and not isinstance(detail, Skip):
                        await getattr(self, step.verify)()
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
            if name in self._irreversible:  # its change was made: cancelled after it, it is done
                self._set(name, "done", self._irreversible[name])
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
            self._set(name, "done", detail.why, found=self._resumed and before in ("running", "pending", "cancelled"))
        elif isinstance(detail, Skip):
            if before in SETTLED and not running:
                self._publish_step(name)
                return
            self._set(name, "skipped", detail.why)
        else:
            self._account(name, attempt_started)
            self._set(name, "done", detail)

    def _account(self, name: str, attempt_started: float) -> None:
        """Work time and decision time of this attempt, kept apart and added to the step's."""
        rec = self.state.step(name)
        decided = self._decision_s.pop(name, 0.0)
        rec.work_s += max(0.0, time.time() - attempt_started - decided)
        rec.decision_s += decided

    def _next_window(self) -> None:
        """A run cut short at its budget goes on in a new window: its service record and window steps
        start over (the earlier window kept in `windows`); the extractor, run again into the same
        output, keeps the verified prompts and extracts only the missing ones."""
        state = self.state
        window_steps = [s.name for s in route_steps(self.route) if s.while_down or s.name == "stage"]
        state.windows.append({"service": dataclasses.asdict(state.service),
                              "extraction": dataclasses.asdict(state.extraction),
                              "steps": {n: dataclasses.asdict(state.steps[n]) for n in window_steps if n in state.steps},
                              "forecast": state.forecast})
        missing = state.extraction.partial["missing"]
        state.service, state.extraction, state.forecast = ServiceState(), ExtractionState(), None
        for name in window_steps:
            state.steps.pop(name, None)
        self._new_attempt("extract")
        self.run.save()
        self.journal(None, f"window {len(state.windows) + 1} of run {self.run.run_id}: the {len(missing)} prompts "
                           f"missing ({', '.join(missing)}) are extracted now; the others are kept")

    async def _forecast_inputs(self, manager: Any | None = None) -> fc.ForecastInputs:
        facts = self.state.facts
        tokens = facts.get("prompt_tokens")
        if not tokens:  # before the cache: the prompts' length estimated from their text
            tokens = [longest_tokens([p]) for p in self._prompt_records()]
        history = None
        if manager is not None:  # the unit's last stop and start (None from a command manager)
            with contextlib.suppress(Exception):
                history = await manager.history()
        record = self.state.jobs.get("extract")
        staged_event = record.result if record is not None and "staged" in record.events_seen else None
        plan_stage = facts.get("plan_stage", {})
        return fc.ForecastInputs(
            run_id=self.run.run_id, service_host=self.config.service.host, extract_host=self._extract_host()[0],
            staged=self._acts("stage"), prompt_tokens=tuple(int(t) for t in tokens), model_bytes=self.facts.model_bytes,
            stop_grace_s=self.config.service.stop_grace_s, budget_s=self.config.window.max_downtime_s,
            systemd=history, speeds=self.facts.probes.get(self.config.target.host, {}).get("speeds"),
            staged_event=staged_event if isinstance(staged_event, dict) else None,
            earlier=[r.state.to_json() for r in self._earlier_runs()],
            stage_left_out=None if plan_stage.get("stage", True) else plan_stage.get("why"),
            zero_downtime=facts.get("proposal"))

    async def _forecast(self, manager: Any | None = None) -> tuple[fc.Forecast, fc.ForecastInputs]:
        """The window's downtime by phase, each with its basis; published and kept in the state."""
        inputs = await self._forecast_inputs(manager)
        made = fc.forecast(inputs)
        self.state.forecast = fc.to_state(made)
        self.run.save()
        self.bus.publish(made)
        self._window_forecast = (made, inputs)
        return made, inputs

    # --- preflight ----------------------------------------------------------------------------

    async def run_preflight(self) -> str:
        config = self.config
        for name in config.hosts:
            await self._connected(name, "preflight")
        if not self.plan_only:
            await self._take_host_lock()
        prompts = self._prompt_records()  # bad prompt files fail here, before anything else
        self.state.facts["prompt_ids"] = [p["id"] for p in prompts]
        # Facts from every host at once: probes (kernels, RAM, model size), drafter configs, the service.
        probes, drafters, view = await asyncio.gather(self._probe_all(), self._read_drafters(),
                                                      self.hosts.check_service())
        self.facts.probes = probes
        self.facts.drafters = drafters
        target_probe = probes.get(config.target.host, {})
        model = target_probe.get("model", {})
        if model.get("exists") is False:
            raise StepFailed("preflight", f"{config.target.model_path} does not exist on {config.target.host}")
        if model.get("error"):
            raise StepFailed("preflight", f"the target on {config.target.host}: {model['error']}")
        self.facts.model_bytes = model.get("tensor_bytes")
        self.facts.ram_available = target_probe.get("ram", {}).get("available")
        kernels = target_probe.get("kernels", {})
        if config.target.kernels == "fast" and not kernels.get("fast") and not self.hosts.simulated(config.target.host):
            raise StepFailed("preflight", f"kernels = \"fast\" but {config.target.host} binds "
                                          f"{', '.join(f'{k}={v}' for k, v in kernels.get('bound', {}).items()) or 'nothing'}")
        self.facts.layers = self._layers(drafters)
        for name, facts in drafters.items():
            overridden = facts.get("layers_source") == "override"
            self.journal("preflight", f"drafter {name} on {facts.get('host')}: target layers {facts.get('target_layer_ids')}"
                         + (f" from the config's override (the checkpoint says {facts.get('config_target_layer_ids')})"
                            if overridden else " from its config.json")
                         + f", fc width {facts.get('fc_width')}, block size {facts.get('block_size')}, "
                           f"mask token {facts.get('mask_token_id')}, hidden {facts.get('hidden_size')}",
                         level="warning" if overridden else "info")
        # The service must be up and serving the target before anything is cached from it (a resumed
        # run that stopped it already is the exception).
        if not self.service_down_by_us:
            if view.status is None:
                raise StepFailed("preflight", f"the service manager on {config.service.host} did not answer: {view.error}")
            if not view.status.active or view.health is None or not view.health.ready:
                why = view.error or (view.health.error if view.health else None) or view.status.state
                raise StepFailed("preflight", f"{service_name(config)} on {config.service.host} is not up and "
                                              f"ready ({why}); the window starts from a live server")
            self.facts.service_ready = True
            self.facts.service_model = view.health.model_path
            if view.health.model_path and not _same_model(view.health.model_path, config.target.model_path):
                raise StepFailed("preflight", f"the server serves {view.health.model_path}, the target is "
                                              f"{config.target.model_path}: completions would come from another model")
        await self._where_it_fits(prompts)
        self.state.facts["preflight"] = self.facts.to_json()
        self.state.facts["layers"] = self.facts.layers
        self.run.save()
        if not self.plan_only:
            (self.run.dir / "probes.json").write_text(json.dumps({"format": "dflash-ops.probes/1", "hosts": probes}))
        await self._choose_plan()
        return f"{len(self.config.hosts)} hosts, layers {self.facts.layers}"

    async def _lock_path(self) -> str:
        return f"{await self.hosts.workdir(self.config.service.host)}/{LOCK_FILE}"

    async def _take_host_lock(self) -> None:
        """One run per inference host: the lock in its workdir names the run and its console. A lock
        whose console is gone is taken over, saying so; a live (or unknowable) one refuses."""
        host = self.config.service.host
        path = await self._lock_path()
        mine = {"run_id": self.run.run_id, **(self.state.owner.__dict__ if self.state.owner else {})}
        try:
            held = json.loads(await self.hosts.read_text(host, path))
        except FileNotFoundError:
            held = None
        except (json.JSONDecodeError, UnicodeDecodeError):
            held = {"run_id": "?", "damaged": True}
        me = self.state.owner
        same_console = me is not None and (held or {}).get("pid") == me.pid and (held or {}).get("host") == me.host
        if isinstance(held, dict) and held.get("run_id") is not None and not same_console:
            owner = None
            with contextlib.suppress(TypeError):
                owner = Owner(**{k: held[k] for k in ("user", "host", "pid", "since", "start_ticks") if k in held})
            alive = owner.alive() if owner is not None else False
            who = ("this run's earlier console" if held.get("run_id") == self.run.run_id else
                   f"run {held.get('run_id')}") + (f" ({owner.describe()})" if owner else "")
            if alive is not False:
                raise StepFailed("preflight", f"{host} is driven by {who} ({path}): one run per inference host at "
                                              f"a time; wait for it, or watch it with dflash-ops console --read-only")
            self.journal("preflight", f"taking over the lock of {who} on {host}: its console is gone", host=host,
                         level="warning")
        await self.hosts.write_text(host, path, json.dumps(mine))

    async def _release_host_lock(self) -> None:
        host = self.config.service.host
        with contextlib.suppress(Exception):
            path = await self._lock_path()
            held = json.loads(await self.hosts.read_text(host, path))
            if held.get("run_id") == self.run.run_id:
                await self.hosts.run(host, ["rm", "-f", "--", path])

    async def _where_it_fits(self, prompts: list[dict[str, Any]]) -> None:
        """Which hosts could extract without the serving GPUs; the zero-downtime route needs one."""
        await self.hosts.wait_first_samples(15.0)
        samples = {name: self.hosts.telemetry(name).telemetry.latest for name in self.config.hosts}
        self.fits = where_it_fits(self.config, self.facts.probes, samples, longest_tokens(prompts),
                                  len(self.facts.layers))
        for fit in self.fits:
            self.journal("preflight", f"zero-downtime on {fit.host}: {'fits' if fit.proposed else 'no'}: {fit.why}")
        chosen = self.state.facts.get("extract_on")
        if self.route == "zero-downtime" and chosen is None:
            fit = next((f for f in self.fits if f.proposed), None)
            if fit is None:
                raise StepFailed("preflight", "the zero-downtime route needs a host with room, the weights and "
                                              "the same kernels; none has: " + "; ".join(f"{f.host}: {f.why}" for f in self.fits))
            gpus = list(fit.gpus or (fit.gpu,))
            sample = samples[fit.host]
            free = {g.index: (g.mem_total_mib or 0) - (g.mem_used_mib or 0) for g in sample.gpus}
            self.state.facts["extract_on"] = {"host": fit.host, "gpu": fit.gpu, "gpus": gpus,
                                              "model_path": fit.model_path, "need_mib": fit.need_mib,
                                              "free_mib": {str(i): free.get(i, 0) for i in gpus}}
            self.journal("preflight", f"route zero-downtime: extracting on {fit.host} GPU{fit.gpu}; the server is "
                                      f"never touched")

    def _extract_host(self) -> tuple[str, str]:
        """(host, model path) of the extraction: the target host, or the zero-downtime route's choice."""
        chosen = self.state.facts.get("extract_on")
        if self.route == "zero-downtime" and chosen:
            return chosen["host"], chosen["model_path"]
        return self.config.target.host, self.config.target.model_path

    def _prompt_records(self) -> list[dict[str, Any]]:
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

    async def _probe_all(self) -> dict[str, dict[str, Any]]:
        async def probe(name: str) -> tuple[str, dict[str, Any]]:
            args = ["--workdir", await self.hosts.workdir(name)]
            path = self.config.target.path_on(name)
            if path is not None:
                args += ["--model", path]
            outcome = await self._job(name, "probe", f"probe-{name}", args, step="preflight", fresh=True)
            if not isinstance(outcome.get("result"), dict):
                raise StepFailed("preflight", f"the probe on {name} gave no facts: {outcome.get('error')}")
            return name, outcome["result"]
        return dict(await asyncio.gather(*(probe(name) for name in self.config.hosts)))

    async def _read_drafters(self) -> dict[str, dict[str, Any]]:
        """Each drafter's provenance, checked where it lives (`remote.drafter --provenance`): every
        config field the forward uses, `target_layer_ids` (required, or the config's explicit
        override), the fc width from the weights, finite weights. One job per drafter host."""
        by_host: dict[str, list[Any]] = {}
        for drafter in self.config.drafters:
            by_host.setdefault(drafter.host, []).append(drafter)

        async def check(host_name: str, drafters: list[Any]) -> dict[str, dict[str, Any]]:
            args = [arg for d in drafters for arg in ("--provenance", f"{d.name}={d.path}")]
            args += [arg for d in drafters if d.layers for arg in ("--layers-override", layer_override(d))]
            outcome = await self._job(host_name, "drafter", f"provenance-{host_name}", args, step="preflight",
                                      fresh=True)
            found = (outcome.get("result") or {}).get("drafters")
            if not isinstance(found, dict):
                raise StepFailed("preflight", f"the drafter check on {host_name} gave no provenance")
            for drafter in drafters:
                found[drafter.name] = {**found[drafter.name], "host": host_name}
            return found

        results = await asyncio.gather(*(check(h, ds) for h, ds in by_host.items()))
        return {name: facts for found in results for name, facts in found.items()}

    def _layers(self, drafters: dict[str, dict[str, Any]]) -> list[int]:
        if self.config.target.layers != "auto":
            return sorted(set(self.config.target.layers))
        layers = sorted({int(i) for d in drafters.values() for i in d["target_layer_ids"]})
        if not layers:
            raise StepFailed("preflight", "layers = \"auto\" but no drafter is configured to take them from")
        return layers

    async def _choose_plan(self) -> None:
        acts: dict[str, tuple[bool, str]] = {}
        facts = self.state.facts
        if self.route == "window":
            stage, why = stage_decision(self.facts)
            if self.stage_override is False:
                stage, why = False, "left out: --no-stage (the weights are read inside the window)"
            if "stage" in facts.get("plan_stage", {}):  # a resumed run keeps its plan
                stage, why = facts["plan_stage"]["stage"], facts["plan_stage"]["why"]
            facts["plan_stage"] = {"stage": stage, "why": why}
            acts["stage"] = (stage, why)
        manager = await self.hosts.service_manager(self.connect_s)
        downtime = self.earlier.get("downtime")
        acts["stop"] = (True, f"{service_name(self.config)} on {self.config.service.host} goes down"
                              + (f"; earlier windows took {duration(downtime)}" if downtime else ""))
        role_hosts = {"hosts": None, "target": self.config.target.host, "service": self.config.service.host,
                      "extract": self._extract_host()[0], "eval": self.config.eval.host, "console": None}
        hosts = {s.name: role_hosts[s.host_role] for s in route_steps(self.route) if role_hosts[s.host_role]}
        argvs = {"stop": manager.stop_argv(), "restart": manager.start_argv()}
        steps = planned(self.route, acts, hosts, argvs, self.earlier)
        fit = next((f for f in self.fits if f.proposed), None)
        proposal = None
        if fit is not None:
            proposal = (f"zero-downtime: extract on {fit.host} GPU{fit.gpu} ({fit.why}); the window route would "
                        f"stop the server" + (f" for ~{duration(downtime)} (earlier windows)" if downtime else ""))
            self.journal("preflight", f"proposed route: {proposal}; chosen: {self.route}"
                         + (" (--route zero-downtime to take it)" if self.route == "window" else ""))
        facts["proposal"] = proposal
        self.plan = PlanReady(self.run.run_id, self.route, steps, tuple(self.fits), proposal, preview=self.plan_only)
        self.state.plan = [{"name": s.name, "acts": s.acts, "why": s.why, "host": s.host, "argv": list(s.argv),
                            "estimate_s": s.estimate_s} for s in steps]
        self.run.save()
        self.bus.publish(self.plan)
        if self.route == "window" and not self.state.service.stops:
            made, _ = await self._forecast(manager)
            self.journal("preflight", f"forecast downtime: {fc.summary(made)}"
                         + "".join(f"; {p.name}: {p.basis}" for p in made.phases))
        for step in steps:
            self.journal("preflight", f"plan: {step.name}: {'acts' if step.acts else 'left out'}: {step.why}"
                         + (f" ({shlex.join(step.argv)} on {step.host})" if step.argv else ""))

    def _acts(self, name: str) -> bool:
        if self.plan is not None:
            return any(s.name == name and s.acts for s in self.plan.steps)
        return any(s.get("name") == name and s.get("acts") for s in self.state.plan)

    # --- paths on the hosts -------------------------------------------------------------------

    async def _window_dir(self, name: str) -> str:
        """This run's directory on host `name` (created private)."""
        path = f"{await self.hosts.workdir(name)}/windows/{self.run.run_id}"
        await self.hosts.run(name, ["mkdir", "-p", "-m", "700", path])
        return path

    # --- jobs ---------------------------------------------------------------------------------

    def _handle(self, key: str) -> JobHandle | None:
        record = self.state.jobs.get(key)
        return JobHandle.from_json(record.handle) if record is not None and record.handle else None

    async def _job_state(self, key: str) -> str | None:
        """"running", "exited" or "dead" for job `key` as its host says now; None when never started."""
        record = self.state.jobs.get(key)
        if record is None:
            return None
        handle = self._handle(key) or await self.hosts.find_job(record.host, record.job_id)
        if handle is None:
            return None
        record.handle = json.loads(handle.to_json())
        return (await self.hosts.job_status(handle)).state

    def _new_attempt(self, key: str) -> None:
        """The worker of `key` is gone: the next start is a new attempt under a new id."""
        record = self.state.jobs.get(key)
        if record is None:
            return
        attempt = record.attempt + 1
        self.state.jobs[key] = JobRecord(f"{self.run.run_id}-{key}-a{attempt}", record.host, record.worker,
                                         record.args, attempt=attempt)
        self.run.save()

    async def _job(self, host_name: str, worker: str, key: str, args: list[str], step: str,
                   fresh: bool = False, until: str | None = None,
                   on_event: Callable[[dict[str, Any]], Any] | None = None,
                   env: dict[str, str] | None = None, started: Callable[[JobHandle], Any] | None = None
                   ) -> dict[str, Any]:
        """Start (or find again) job `key` on `host_name` and follow it from its persisted offset
        until it exits (or until an event of type `until`; then the job keeps running).

        The job's id is recorded in the state before it starts, so a console killed in between
        finds it by id on resume instead of starting a second one. `fresh`: a read-only job
        (probes) is simply run again on resume. `started(handle)` is called once the job exists.
        """
        jobs = self.state.jobs
        record = jobs.get(key)
        handle: JobHandle | None = None
        if record is not None and not fresh:
            handle = self._handle(key) or await self.hosts.find_job(host_name, record.job_id)
        if handle is None:
            if record is None or fresh:
                job_id = f"{self.run.run_id}-{key}" + ("" if not fresh else f"-{int(time.time() * 1000) % 100000}")
                record = jobs[key] = JobRecord(job_id, host_name, worker, list(args))
                self.run.save()  # before the start: found again by id after a crash
            handle = await self._start_once(host_name, worker, args, env, record.job_id)
            self.journal(step, f"started {worker} on {host_name} (pid {handle.pid})", host=host_name,
                         argv=["python", "-m", f"remote.{worker}", *args])
        else:
            self.journal(step, f"found {worker} job {handle.job_id} on {host_name} again (pid {handle.pid}); "
                               f"following it from byte {record.offset}", host=host_name)
        record.handle = json.loads(handle.to_json())
        self.run.save()
        if started is not None:
            started(handle)
        return await self._follow(handle, record, step, until=until, on_event=on_event)

    async def _start_once(self, host: str, worker: str, args: list[str], env: dict[str, str] | None,
                          job_id: str) -> JobHandle:
        """Start job `job_id`, or find it: a console killed during a start leaves the start half done
        on the host; the job then either appears under its id or is given up there (JobRunner's
        start protocol), and is found or started again, never twice."""
        deadline = time.monotonic() + START_SETTLE_S
        while True:
            try:
                return await self.hosts.start_job(host, worker, args, env, job_id)
            except JobExists:
                found = await self.hosts.find_job(host, job_id)
                if found is not None:
                    return found
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def _follow(self, handle: JobHandle, record: JobRecord, step: str, until: str | None = None,
                      on_event: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        """Follow from the record's offset: every event handled is handled once, across crashes. An
        event already seen (`until` among `events_seen`) stands for a live process only once the
        host says the job still runs."""
        outcome: dict[str, Any] = {"handle": handle, "artifacts": [], "result": record.result}
        if record.error:
            outcome["error"] = record.error
        if until is not None and until in record.events_seen:
            status = await self.hosts.job_status(handle)
            if status.state == "running":
                outcome["until"] = {"type": until, **(record.result if isinstance(record.result, dict) else {})}
                return outcome
            raise StepFailed(step, f"{handle.worker} on {handle.host} (pid {handle.pid}) said `{until}` but is "
                                   f"{status.state} now" + (f": {status.stderr_tail[-300:]}" if status.stderr_tail else ""))
        if record.exit_code is not None:  # its `exit` was handled before a crash: nothing follows it
            outcome["exit"] = record.exit_code
        events = self.hosts.follow_job(handle, record.offset, self.connect_s) if record.exit_code is None else _none()
        try:
            async for offset, event in events:
                kind = event.get("type")
                self._publish_event(handle, event)
                record.offset = offset
                if kind == "result":
                    outcome["result"] = record.result = event.get("data")
                elif kind == "error":
                    outcome["error"] = record.error = event.get("msg")
                elif kind == "artifact":
                    outcome["artifacts"].append(event)
                elif kind == "exit":
                    outcome["exit"] = record.exit_code = event.get("code")
                if kind == until:  # what the step waited for, kept for a resume that finds the job again
                    record.result = {k: v for k, v in event.items() if k not in ("type", "seq")}
                if kind not in QUIET_EVENTS:
                    if kind not in record.events_seen:
                        record.events_seen.append(kind)
                    self.run.save()
                if on_event is not None:
                    result = on_event(event)
                    if asyncio.iscoroutine(result):
                        await result
                if until is not None and kind == until:
                    outcome["until"] = event
                    return outcome
        except (JobDead, JobStalledError) as exc:
            raise StepFailed(step, str(exc)) from None
        except TimeoutError:
            raise StepFailed(step, f"{handle.host} did not reconnect within {self.connect_s:.0f} s while "
                                   f"following {handle.worker}") from None
        if until is not None:
            raise StepFailed(step, f"{handle.worker} on {handle.host} exited ({outcome.get('exit')}) before "
                                   f"`{until}`: {outcome.get('error') or 'no error reported'}")
        if outcome.get("exit") not in (0, None) or outcome.get("error"):
            tail = "" if outcome.get("error") else await self.hosts.stderr_tail(handle)
            raise StepFailed(step, f"{handle.worker} on {handle.host} failed (exit {outcome.get('exit')}): "
                                   f"{outcome.get('error') or 'no error event'}" + (f"; stderr: {tail[-300:]}" if tail else ""))
        return outcome

    def _publish_event(self, handle: JobHandle, event: dict[str, Any]) -> None:
        message = job_message(handle, event)
        if message is not None:
            self.bus.publish(message)
        if event.get("type") == "log":
            self.journal(None, f"{handle.host} {handle.worker}: {event.get('msg')}", host=handle.host,
                         level=event.get("level", "info") if event.get("level") in ("warning", "error") else "info")

    # --- stage and cache ----------------------------------------------------------------------

    def _extract_args(self, window_dir: str, staged: bool) -> list[str]:
        target = self.config.target
        args = ["--model", target.model_path, "--completions", f"{window_dir}/completions.json",
                "--out", f"{window_dir}/states", "--layers", ",".join(map(str, self.facts.layers)),
                "--kernels", target.kernels]
        args += ["--stop-file", f"{window_dir}/stop"]  # the operator's stop at the budget
        if staged:
            args += ["--staged", "--go-file", f"{window_dir}/go"]
        return args

    async def check_stage(self) -> Skip | None:
        if not self._acts("stage"):
            return LeftOut(self.state.facts["plan_stage"]["why"])
        if await self._extraction_complete():
            return Found("the extraction already finished")
        if self.state.service.stops:
            return Skip("the service was stopped already: the extraction reads the weights itself if the staged "
                        "worker is gone")
        record = self.state.jobs.get("extract")
        if record is not None and "staged" in record.events_seen:
            if await self._job_state("extract") == "running":
                return Found(f"staged worker pid {record.pid} alive on {record.host}, waiting for the go")
            self.journal("stage", f"the staged worker pid {record.pid} on {record.host} is gone: staging again",
                         host=record.host, level="warning")
            self._new_attempt("extract")
        elif record is not None and await self._job_state("extract") in ("dead", "exited"):
            self._new_attempt("extract")
        return None

    async def run_stage(self) -> str:
        window = await self._window_dir(self.config.target.host)
        await self.hosts.run(self.config.target.host, ["rm", "-f", "--", f"{window}/stop", f"{window}/go"])
        outcome = await self._job(self.config.target.host, "extract", "extract", self._extract_args(window, True),
                                  step="stage", until="staged")
        staged = outcome["until"]
        self.state.extraction.staged_pid = outcome["handle"].pid
        self.run.save()
        self._crash("staged")
        return (f"{size_text(staged.get('bytes', 0))} in host RAM, kernels warmed "
                f"({staged.get('warmup_s', 0):.1f} s); waiting for the go")

    def _completions_path(self, window: str) -> str:
        return f"{window}/completions.json"

    async def check_cache(self) -> Skip | None:
        """Satisfied when the completions on the service host verify, a copy is on the target host
        (when it is another) and the extractor's check against the target passed."""
        host, target = self.config.service.host, self.config.target.host
        window = await self._window_dir(host)
        verified = await self._verify_completions(host, self._completions_path(window), strict=False)
        if verified is None:
            if self.service_down_by_us:
                raise StepFailed("cache", f"no verified completions at {host}:{self._completions_path(window)} and "
                                          f"the service is down: restart it and run again")
            return None
        if target != host and await self._verify_completions(
                target, self._completions_path(await self._window_dir(target))) is None:
            return None
        if not self.state.facts.get("checked_against_target"):
            return None
        return Found(f"already cached and verified: {verified}")

    async def run_cache(self) -> str:
        service_host = self.config.service.host
        window = await self._window_dir(service_host)
        completions = self._completions_path(window)
        if await self._verify_completions(service_host, completions, strict=False) is None:
            prompts = "\n".join(json.dumps(r) for r in self._prompt_records()) + "\n"
            await self.hosts.write_text(service_host, f"{window}/prompts.jsonl", prompts)
            args = ["--server", self.config.service.url, "--out", completions, "--prompts", f"{window}/prompts.jsonl",
                    "--tokenizer", self.config.target.model_path]
            key = self.config.service.api_key()  # through the environment, never argv nor the journal
            await self._job(service_host, "completions", "cache", args, step="cache",
                            env={"DFLASH_SGLANG_API_KEY": key} if key else None)
        if self.config.target.host != service_host:
            target_window = await self._window_dir(self.config.target.host)
            await self._relay_file(service_host, completions, self.config.target.host,
                                   f"{target_window}/completions.json", "cache")
        checked = await self._check_against_target()
        self.state.facts["checked_against_target"] = True
        self.run.save()
        self._crash("cached")
        return f"{len(self.state.facts['prompt_ids'])} completions cached and verified; {checked}"

    async def verify_cache(self) -> None:
        window = await self._window_dir(self.config.service.host)
        if await self._verify_completions(self.config.service.host, self._completions_path(window)) is None:
            raise StepFailed("cache", f"{self.config.service.host}:{self._completions_path(window)} was not written")

    async def _check_against_target(self) -> str:
        """The extractor's own check phase, run now while the server serves (no GPU): token ids inside
        the target's vocabulary, lengths within its context, finish reasons, the layers."""
        window = await self._window_dir(self.config.target.host)
        args = ["--check-only", "--model", self.config.target.model_path, "--completions",
                f"{window}/completions.json", "--layers", ",".join(map(str, self.facts.layers))]
        outcome = await self._job(self.config.target.host, "extract", "check", args, step="cache", fresh=True)
        result = outcome.get("result") or {}
        return (f"checked against the target: {result.get('prompts', '?')} prompts, {result.get('tokens', '?')} "
                f"tokens within vocab {result.get('vocab_size', '?')} and context {result.get('max_position_embeddings', '?')}")

    async def _verify_completions(self, host: str, path: str, strict: bool = True) -> str | None:
        """None when there is no cache; else raises unless it matches the prompts and the target.
        Not `strict`: a cache with incomplete generations is None too (the worker run again asks the
        server for those alone, keeping the complete ones)."""
        try:
            text = await self.hosts.read_text(host, path)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StepFailed("cache", f"{host}:{path}: not JSON ({exc})") from None
        if not isinstance(data, dict) or not isinstance(data.get("prompts"), list):
            raise StepFailed("cache", f"{host}:{path}: not a completions file (no `prompts` list)")
        ids = [p.get("id") for p in data["prompts"]]
        want = self.state.facts["prompt_ids"]
        if ids != want:
            raise StepFailed("cache", f"{host}:{path} holds prompts {ids}, expected {want}")
        # remote.completions marks an aborted, failed or empty generation incomplete (never complete).
        incomplete = [p for p in data["prompts"] if p.get("complete") is False or not p.get("completion_ids")]
        if incomplete and not strict and not self.service_down_by_us:
            return None
        if incomplete:
            why = "; ".join(f"{p.get('id')}: {p.get('incomplete_reason') or 'no completion tokens'}" for p in incomplete)
            raise StepFailed("cache", f"{host}:{path}: incomplete generations ({why}); the server must answer "
                                      f"them in full before it is stopped")
        model = data.get("model_path")
        if model and not _same_model(model, self.config.target.model_path):
            raise StepFailed("cache", f"{host}:{path} was made by a server serving {model}, not the target "
                                      f"{self.config.target.model_path}")
        self.state.facts["completion_tokens"] = sum(len(p["completion_ids"]) for p in data["prompts"])
        self.state.facts["prompt_tokens"] = [len(p.get("prompt_ids") or ()) + len(p["completion_ids"])
                                             for p in data["prompts"]]
        return f"{len(ids)} prompts, {self.state.facts['completion_tokens']} completion tokens"

    # --- stop and free VRAM -------------------------------------------------------------------

    async def check_stop(self) -> Skip | None:
        """Satisfied once this run stopped the service; the host is asked, never the saved flag alone."""
        service = self.state.service
        if not service.stops:
            return None
        since = time.strftime('%H:%M:%S', time.localtime(service.stopped_at or time.time()))
        if not service.down:
            return Found(f"stopped by this run at {since}; back since "
                         f"{time.strftime('%H:%M:%S', time.localtime(service.ready_at or time.time()))}")
        manager = await self.hosts.service_manager(self.connect_s)
        status = await manager.status()
        if not status.active:
            service.stop_confirmed = True
            self.run.save()
            return Found(f"stopped by this run at {since}; {manager.name} is {status.state} on "
                         f"{self.config.service.host} (asked now)")
        if service.start_issued_at is not None:  # our own restart is under way: the restart step waits for it
            return Found(f"stopped by this run at {since}; our start is under way ({status.state})")
        if service.stop_returned_at is None:
            self.journal("stop", f"the stop began at {since} but {manager.name} still runs ({status.state}): the "
                                 f"console died before the stop took effect; stopping it now", level="warning")
            return None
        service.down = False
        service.restarted_outside_at = time.time()
        self.run.save()
        self._publish_downtime()
        raise StepFailed("stop", f"{manager.name} on {self.config.service.host} is running again ({status.state}), "
                                 f"started outside this run after its stop at {since}: the extraction would fight it "
                                 f"for the GPUs; nothing more is done")

    def _alternative(self) -> str:
        proposal = self.state.facts.get("proposal")
        return f"; the alternative: {proposal} (dflash-ops run --route zero-downtime)" if proposal else ""

    async def run_stop(self) -> str:
        service = self.config.service
        if self.state.status_of("cache") not in ("done", "skipped"):
            raise StepFailed("stop", "refused: the completions are not cached and verified")
        if self._acts("stage") and self.state.status_of("stage") not in ("done", "skipped"):
            raise StepFailed("stop", "refused: the staged extractor has not reported `staged`")
        manager = await self.hosts.service_manager(self.connect_s)
        argv = manager.stop_argv()
        made, inputs = await self._forecast(manager)
        refused = fc.refusal(made, inputs)
        if refused and not self.state.service.stops:
            raise StepFailed("stop", refused)
        impact = (f"{service_name(self.config)} on {service.host} goes down; forecast downtime {fc.summary(made)}"
                  + (f" (budget {made.budget_s:g} s)" if made.budget_s is not None else "") + self._alternative())
        if not self.state.service.stops and not await self._ask(
                Confirmation("stop", "stop the service", service.host, tuple(argv), impact, True, made.downtime_s,
                             "forecast")):
            raise Refused("stop", "stop the service")
        self._crash("stop-asked")
        stream = self.hosts.telemetry(service.host)
        svc = self.state.service
        svc.pids_before_stop = sorted(getattr(stream.telemetry, "seen_service_pids", ()) or ())
        svc.stopped_at = svc.stopped_at or time.time()
        svc.down = True
        svc.stops += 1
        self._stopped_mono = time.monotonic()
        self.run.keep_going_on_write_errors = True  # from here on a full disk must not keep it down
        self.run.save()  # before the command: a crash during the stop still knows the service may be down
        self._publish_downtime()
        started = time.monotonic()
        try:
            await manager.stop()
            svc.stop_returned_at = time.time()
            self._irreversible["stop"] = f"stopped in {time.monotonic() - started:.1f} s"
            self.run.save()
        finally:
            self.journal("stop", "stop command ran", host=service.host, argv=list(argv),
                         duration_s=round(time.monotonic() - started, 3))
            self.hosts.poke_service()
        self._crash("stop-ran")
        return self._irreversible["stop"]

    async def verify_stop(self) -> None:
        manager = await self.hosts.service_manager(self.connect_s)
        status = await manager.status()
        if status.active:
            raise StepFailed("stop", f"`{shlex.join(manager.stop_argv())}` returned but {manager.name} is still "
                                     f"{status.state}")
        self.state.service.stop_confirmed = True
        self.run.save()

    def _staged_exclude(self) -> list[int]:
        pid = self.state.extraction.staged_pid
        return [pid] if pid and self.config.target.host == self.config.service.host else []

    async def check_free_vram(self) -> Skip | None:
        if self.state.extraction.begun_at or await self._extraction_complete():
            return Found("the extraction already started")
        svc = self.state.service
        if svc.start_issued_at is not None:  # the compensation restarted it (a refusal, then a crash): no window now
            raise StepFailed("free-vram", f"the service was started again at "
                                          f"{time.strftime('%H:%M:%S', time.localtime(svc.start_issued_at))}, before "
                                          f"the extraction began: this window is over; nothing more is done")
        return None

    async def run_free_vram(self) -> str:
        service = self.config.service
        stream = self.hosts.telemetry(service.host)
        exclude = self._staged_exclude()
        after = self._stopped_mono if self._stopped_mono is not None else time.monotonic()  # a new process: fresh samples
        known = self.state.service.pids_before_stop
        result = await wait_vram_free(stream, service.gpus, service.vram_free_mib, service.vram_wait_s, stopped_at=after,
                                      service_pids=known, exclude=exclude)
        if result.free:
            self._vram_free_now()
            return f"free after {result.waited_s:.1f} s ({result.used})"
        holders = result.holders
        self.bus.publish(HoldersFound(service.host, holders, result.used, service.vram_free_mib))
        self.journal("free-vram", f"VRAM still held after {result.waited_s:.0f} s ({result.used}): "
                     + "; ".join(f"pid {h.pid} {h.mib} MiB {h.command or '?'}" for h in holders), level="warning")
        hidden = [h for h in holders if not h.visible]
        holders = tuple(h for h in holders if h.visible)  # a pid that names no GPU process here is never signalled
        for h in hidden:
            self.journal("free-vram", f"pid {h.pid} ({h.mib} MiB) is not visible from this namespace "
                                      f"({h.visible_reason or 'no /dev/nvidia* file open'}): left alone", level="warning")
        if not holders:
            raise StepFailed("free-vram", f"VRAM still held ({result.used}) and no process that holds it can be "
                                          f"ended from here" + (f" ({len(hidden)} not visible from this namespace: "
                                                                f"end them on the host itself)" if hidden else ""))
        argv = await self.hosts.endpids_argv(service.host, holders, service.stop_grace_s, service.sudo)
        action = f"end {len(holders)} process{'es' if len(holders) > 1 else ''} holding VRAM"
        impact = ", ".join(f"pid {h.pid} ({h.mib} MiB, {h.command or '?'}"
                           + (", was the service's" if h.was_service else "") + ")" for h in holders)
        if not await self._ask(Confirmation("free-vram", action, service.host, tuple(argv),
                                            f"SIGTERM, then SIGKILL after {service.stop_grace_s:g} s: {impact}", True)):
            raise Refused("free-vram", action)
        outcomes = await self.hosts.end_holders(service.host, holders, service.stop_grace_s, service.sudo)
        for line in describe_outcomes(outcomes):
            self.journal("free-vram", line, host=service.host)
        self._crash("holders")
        result = await wait_vram_free(stream, service.gpus, service.vram_free_mib, service.vram_wait_s,
                                      stopped_at=time.monotonic(), service_pids=known, exclude=exclude)
        if not result.free:
            raise StepFailed("free-vram", f"VRAM still held after ending the holders ({result.used})")
        self._vram_free_now()
        return f"free after ending {len(outcomes)} holder(s) ({result.used})"

    def _vram_free_now(self) -> None:
        self.state.service.vram_free_at = time.time()
        self.run.save()

    # --- extract ------------------------------------------------------------------------------

    async def _extraction_complete(self) -> bool:
        """The states' manifest on the extraction host is complete and its files match their sha256."""
        if self.state.extraction.complete:
            return True
        if "extract" not in self.state.jobs:
            return False
        host_name, _ = self._extract_host()
        window = await self._window_dir(host_name)
        if await self.hosts.manifest_complete(host_name, f"{window}/states"):
            self.state.extraction.complete = True
            self.run.save()
            return True
        return False

    async def check_extract(self) -> Skip | None:
        if await self._extraction_complete():
            host_name, _ = self._extract_host()
            self._gpu_released.set()
            return Found(f"already extracted (manifest complete, sha256 verified): "
                         f"{host_name}:{await self._window_dir(host_name)}/states")
        return None

    async def verify_extract(self) -> None:
        if self.state.extraction.partial:
            return  # a partial extraction is published as such (manifest.partial.json), never as complete
        self.state.extraction.complete = False  # asked of the host, not taken from the run
        if not await self._extraction_complete():
            host_name, _ = self._extract_host()
            raise StepFailed("extract", f"the extractor finished but {host_name}:{await self._window_dir(host_name)}/states "
                                        f"has no complete, sha256-verified manifest")

    def _on_extract_event(self, event: dict[str, Any]) -> None:
        if event.get("type") == "progress" and event.get("key") == "tokens":
            self._project(event)
        if event.get("type") != "gpu_released":
            return
        extraction = self.state.extraction
        extraction.gpu_released_at = extraction.gpu_released_at or time.time()
        extraction.window = {k: v for k, v in event.items() if k not in ("type", "seq")}
        self.run.save()
        self._gpu_released.set()
        self._crash("gpu-released")
        self._begin_restart()

    def _project(self, event: dict[str, Any]) -> None:
        """The window's end re-projected from the extraction's rate; past the budget, the operator is
        offered to stop the extraction now (keeping every prompt extracted) and restart."""
        svc = self.state.service
        if self._window_forecast is None or svc.stopped_at is None or not svc.down:
            return
        made, inputs = self._window_forecast
        self._progress.add(time.time(), event.get("done") or 0, event.get("total"))
        projection = fc.project(made, inputs, svc.stopped_at, time.time(), self._progress)
        self.bus.publish(projection)
        if fc.passes_budget(projection) and not self._budget_asked and self._progress.left:
            self._budget_asked = True
            self._budget_task = asyncio.create_task(self._offer_budget_stop(projection), name="budget-stop")

    async def _offer_budget_stop(self, projection: Any) -> None:
        target = self.config.target.host
        window = await self._window_dir(target)
        stop_file = f"{window}/stop"
        argv = ["sh", "-c", f"umask 077; : > {shlex.quote(stop_file)}"]
        late = projection.expected_ready_at - (projection.budget_ends_at or projection.expected_ready_at)
        if not await self._ask(Confirmation(
                "extract", "stop the extraction now and restart the service", target, tuple(argv),
                f"the window would end {duration(late)} past its budget ({projection.basis}); every prompt already "
                f"extracted is kept (complete, verified files) and `run --resume` extracts the rest in the next "
                f"window", False, None)):
            return
        self.state.extraction.stop_asked_at = time.time()
        self.run.save()
        await self.hosts.run(target, argv)
        self.journal("extract", "the extraction stops after the prompt in hand (the budget): the rest in the next "
                                "window", host=target, level="warning")

    def _begin_restart(self) -> None:
        """The restart begins the moment the GPUs are released, not after the files are flushed."""
        if self.route == "window" and self.service_down_by_us and self._restart_task is None:
            self.state.service.restart_begun_at = self.state.service.restart_begun_at or time.time()
            self.run.save()
            self._restart_task = asyncio.create_task(self.restart_service(reason="the extraction released the GPUs"),
                                                     name="restart-at-gpu-released")

    async def run_extract(self) -> str:
        if self.route == "zero-downtime":
            return await self._extract_elsewhere()
        if self._window_forecast is None and self.state.forecast:  # resumed: the stop's forecast stands
            self._window_forecast = (fc.from_state(self.run.run_id, self.state.forecast), await self._forecast_inputs())
        target = self.config.target.host
        window = await self._window_dir(target)
        extraction = self.state.extraction
        record = self.state.jobs.get("extract")
        staged = self._acts("stage") and record is not None
        if record is not None and "gpu_released" in record.events_seen:
            self._begin_restart()  # released before a crash: the restart need not wait for the follow
        if staged:
            state = await self._job_state("extract")
            if state != "running" and extraction.begun_at is None and "staged" in record.events_seen:
                self.journal("extract", f"the staged extractor (pid {record.pid}) is gone before the go: extracting "
                                        f"from disk instead", host=target, level="warning")
                self._new_attempt("extract")
                staged = False
            elif state == "running" and extraction.go_sent_at is None:
                extraction.begun_at = extraction.begun_at or time.time()
                self.run.save()
                await self.hosts.run(target, ["sh", "-c", f"umask 077; : > {shlex.quote(window + '/go')}"])
                extraction.go_sent_at = time.time()
                self.run.save()
                self.journal("extract", "go: the staged extractor copies the weights to the GPU", host=target)
                self._crash("go")
            elif state is None or (state != "running" and "staged" not in record.events_seen):
                staged = False
        if not staged:
            if self.state.jobs.get("extract") is None or self.state.jobs["extract"].handle is None:
                await self.hosts.run(target, ["rm", "-f", "--", f"{window}/stop"])  # a new window: no old stop

            def begun(_: JobHandle) -> None:
                extraction.begun_at = extraction.begun_at or time.time()
                self.run.save()
                self._crash("go")
            outcome = await self._job(target, "extract", "extract", self._extract_args(window, False), step="extract",
                                      on_event=self._on_extract_event, started=begun)
        else:
            outcome = await self._job(target, "extract", "extract", self._extract_args(window, True), step="extract",
                                      on_event=self._on_extract_event)
        result = outcome.get("result") or {}
        window_facts = result.get("window", {})
        if result.get("complete") is False:  # cut short at the budget: kept, never taken as complete
            missing = [str(x) for x in result.get("prompts_missing", [])]
            done = [str(x) for x in self.state.facts.get("prompt_ids", []) if str(x) not in missing]
            self.state.extraction.partial = {"done": done, "missing": missing}
            self.run.save()
            return (f"partial at the budget: {result.get('prompts', '?')} prompts kept, {len(missing)} missing: "
                    f"the rest in the next window (run --resume)")
        return (f"{result.get('prompts', '?')} prompts, {result.get('tokens', '?')} tokens, layers "
                f"{result.get('layers')}; window {window_facts.get('window_s', '?')} s")

    async def _extract_elsewhere(self) -> str:
        """The zero-downtime route: extract on the host with room while the server keeps serving."""
        host_name, model_path = self._extract_host()
        chosen = self.state.facts["extract_on"]
        window = await self._window_dir(host_name)
        if host_name != self.config.service.host:
            service_window = await self._window_dir(self.config.service.host)
            await self._relay_file(self.config.service.host, f"{service_window}/completions.json", host_name,
                                   f"{window}/completions.json", "extract")
        args = self._extract_args(window, False)
        args[args.index("--model") + 1] = model_path
        gpus = chosen.get("gpus") or [chosen["gpu"]]
        if len(gpus) > 1:  # a device_map split, each GPU capped at what it had free (renumbered from 0)
            caps = ",".join(f"{n}={int(chosen['free_mib'][str(g)] * SPLIT_FILL)}MiB" for n, g in enumerate(gpus))
            args += ["--device-map", "auto", "--max-memory", caps]
        env = {} if self.hosts.simulated(host_name) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        watching: list[asyncio.Task] = []
        job_started = asyncio.Event()

        def watch(handle: JobHandle) -> None:  # from the moment our job exists, its memory is ours
            self.state.extraction.begun_at = self.state.extraction.begun_at or time.time()
            self.run.save()
            watching.append(asyncio.create_task(self._gpu_taken(host_name, gpus, chosen["need_mib"])))
            job_started.set()

        job = asyncio.create_task(self._job(host_name, "extract", "extract", args, step="extract", env=env,
                                            started=watch), name="zero-downtime-extract")
        try:
            started = asyncio.create_task(job_started.wait())
            await asyncio.wait({job, started}, return_when=asyncio.FIRST_COMPLETED)
            started.cancel()
            if watching:
                await asyncio.wait({job, watching[0]}, return_when=asyncio.FIRST_COMPLETED)
            if watching and watching[0].done() and not watching[0].cancelled() and watching[0].exception() is None:
                # Taken: stopped now, whatever the job says later (a cancel can be swallowed mid-SSH call).
                with contextlib.suppress(Exception):  # the job's own failure is not the news here
                    await cancel_and_wait(job)
                await self._end_own_jobs()  # stopped cleanly, before the other process meets an OOM
                raise StepFailed("extract", f"{watching[0].result()} during the extraction: it was stopped before "
                                            f"an OOM. The window route remains: dflash-ops run --route window")
            outcome = await job
        finally:
            for task in (job, *watching):
                task.cancel()
        result = outcome.get("result") or {}
        return (f"on {host_name} GPU{chosen['gpu']} with the server serving: {result.get('prompts', '?')} prompts, "
                f"{result.get('tokens', '?')} tokens, layers {result.get('layers')}")

    async def _gpu_taken(self, host: str, gpus: list[int], need_mib: int) -> str:
        """Returns (says why) once other processes leave the chosen GPUs less room than the extraction
        needs. Our own job's memory is not counted: its pid is read anew for every sample."""
        stream = self.hosts.telemetry(host)
        fill = 1.0 if len(gpus) == 1 else SPLIT_FILL

        def ours() -> list[int]:
            record = self.state.jobs.get("extract")
            return [record.pid] if record is not None and record.pid else []

        def room(sample: TelemetrySample) -> int | None:
            readings = [g for g in sample.gpus if g.index in gpus and g.mem_total_mib is not None]
            if len(readings) != len(gpus):
                return None
            used = others_used(sample, gpus, ours())
            if any(used.get(g.index) is None for g in readings):
                return None
            return sum(int((g.mem_total_mib - used[g.index]) * fill) for g in readings)

        def short(sample: TelemetrySample) -> bool:
            left = room(sample)
            return left is not None and left < need_mib

        latest = stream.telemetry.latest
        sample = latest if latest is not None and short(latest) else await stream.wait_for(short, timeout=1e9)
        names = "+".join(f"GPU{g}" for g in gpus)
        mine = ours()
        others = [f"pid {p.pid} ({p.mib} MiB)" for p in sample.processes if p.gpu in gpus and p.pid not in mine]
        return (f"{names} on {host} was taken by {', '.join(others) or 'another process'}: "
                f"{room(sample)} MiB left, ~{need_mib} MiB needed")

    # --- restart ------------------------------------------------------------------------------

    async def check_restart(self) -> Skip | None:
        service = self.state.service
        if not service.stops:
            return Skip("the service was not stopped by this run")
        if not service.down and self._restart_task is None:
            return Found(f"ready {(service.ready_at or 0) - (service.stopped_at or 0):.1f} s after the stop")
        return None

    async def run_restart(self) -> str:
        if self._restart_task is not None:
            task, self._restart_task = self._restart_task, None
            try:
                await task  # begun at gpu_released
            except (Refused, StepFailed, HostError, ServiceError, ReadyTimeout) as exc:
                self.journal("restart", f"the restart begun at gpu_released failed: {exc}", level="error")
        if self.service_down_by_us:
            await self.restart_service(reason="the extraction finished")
        service = self.state.service
        return f"ready {(service.ready_at or 0) - (service.stopped_at or 0):.1f} s after the stop"

    async def restart_service(self, reason: str) -> None:
        """Start the service (asking first) and wait until it is ready; the downtime ends then.

        One start per down period: the manager is asked first, and a service already active or
        activating (our start cut off by a crash, a quit modal's restart, another console) is
        waited for, never started again. Calls are serialized."""
        async with self._restart_lock:
            if not self.service_down_by_us:
                return
            service = self.config.service
            svc = self.state.service
            manager = await self.hosts.service_manager(self.connect_s)
            status = await manager.status()
            started = time.monotonic()
            try:
                if status.active or status.state in ("activating", "reloading"):
                    self.journal("restart", f"{manager.name} is already {status.state}: waiting until it is ready, "
                                            f"not starting it again", host=service.host)
                    health = await self.hosts.wait_service_ready(service.ready_timeout_s)
                    svc.ready_seen_late = svc.start_issued_at is not None and self._restart_task is None
                else:
                    argv = manager.start_argv()
                    down = svc.stopped_at
                    so_far = f"down {duration(time.time() - down)} so far" if down else "not stopped by this run"
                    failed_before = f"; the last start failed: {svc.restart_error}" if svc.restart_error else ""
                    if not await self._ask(Confirmation("restart", "start the service", service.host, tuple(argv),
                                                        f"{reason}: brings {service_name(self.config)} back "
                                                        f"({so_far}){failed_before}", False,
                                                        self.earlier.get("restart"))):
                        raise Refused("restart", "start the service")
                    svc.start_issued_at = time.time()
                    svc.starts += 1
                    self.run.save()
                    self._crash("start-issued")
                    health = await self.hosts.start_service_and_wait(service.ready_timeout_s, self.bus.publish)
            except (ServiceError, ReadyTimeout, HostError, TimeoutError) as exc:
                svc.restart_error = str(exc) or type(exc).__name__
                self.run.save()
                raise
            svc.down = False
            svc.ready_at = time.time()
            svc.restart_error = None
            self.run.save()
            self.journal("restart", f"ready after {time.monotonic() - started:.1f} s ({health.model or 'model ?'})",
                         host=service.host, argv=manager.start_argv(), duration_s=round(time.monotonic() - started, 3))
            self._publish_downtime()
            self.hosts.poke_service()
            await self._release_host_lock()
            self._crash("ready")

    # --- evaluate and report ------------------------------------------------------------------

    async def check_evaluate(self) -> Skip | None:
        ev = self.config.eval
        window = await self._window_dir(ev.host)
        if await self.hosts.manifest_complete(ev.host, f"{window}/eval"):
            return Found(f"already evaluated (manifest complete): {ev.host}:{window}/eval")
        if not self.config.drafters:
            return Skip("no drafters configured")
        return None

    async def run_evaluate(self) -> str:
        ev = self.config.eval
        window = await self._window_dir(ev.host)
        out = f"{window}/eval"
        extract_host, extract_model = self._extract_host()
        states = f"{await self._window_dir(extract_host)}/states"
        target_model = self.config.target.path_on(ev.host)
        if ev.host != extract_host:
            states = await self._relay_tree(extract_host, states, ev.host, "evaluate")
        if target_model is None:  # the eval host has no copy: the heads alone, exported where one is
            target_model = await self._relay_heads(extract_host, extract_model, ev.host)
        args = ["--states", states, "--target", target_model, "--out", out, "--device", ev.device,
                "--budgets", ",".join(map(str, ev.budgets)), "--topk", str(ev.topk)]
        for drafter in self.config.drafters:
            path = drafter.path
            if drafter.host != ev.host:
                path = await self._relay_tree(drafter.host, path, ev.host, "evaluate")
            args += ["--drafter", f"{drafter.name}={path}"]
            if drafter.layers:
                args += ["--layers-override", layer_override(drafter)]
        if self.config.reference:
            args += ["--reference", self.config.reference.name]
        await self._job(ev.host, "evaluate", "evaluate", args, step="evaluate")
        self._crash("evaluated")
        return f"{len(self.config.drafters)} drafters evaluated on {ev.host}"

    async def verify_evaluate(self) -> None:
        ev = self.config.eval
        window = await self._window_dir(ev.host)
        if not await self.hosts.manifest_complete(ev.host, f"{window}/eval"):
            raise StepFailed("evaluate", f"the evaluator finished but {ev.host}:{window}/eval has no complete manifest")

    async def run_report(self) -> str:
        from console.views.report import write_report

        ev = self.config.eval
        window = await self._window_dir(ev.host)
        results_dir = self.run.results_dir
        await self.hosts.fetch_tree(ev.host, f"{window}/eval", results_dir, self._relay_progress("report"))
        probes = self.run.dir / "probes.json"
        if probes.exists():
            (results_dir / "probes.json").write_text(probes.read_text())
        results, paths = write_report(results_dir, self.run.dir)
        headline = {name: (d.get("tau", {}).get("vanilla") or {}).get("macro")
                    for name, d in results.get("drafters", {}).items()}
        self.state.headline = headline
        self.run.save()
        self.bus.publish(ResultsReady(self.run.run_id, str(self.run.dir)))
        self._crash("reported")
        return "; ".join(f"{k} tau {v:.2f}" for k, v in headline.items() if v is not None) + f"; {paths[0]}"

    async def check_crosscheck(self) -> Skip | None:
        from console.procedure.crosscheck import load

        with contextlib.suppress(Exception):
            done = load(self.run.dir)
            if done is not None:
                return Found(f"already cross-checked: {done.line()}")
        return None

    async def run_crosscheck(self) -> str:
        """Bounded (a prompt count and a time budget) and after the service is ready: it never slows
        the restart. A server that does not decode speculatively gives a one-line "no online check";
        a check that cannot be made is said, and the run (its work done) still ends done."""
        from console.views.report import write_report

        try:
            result = await self.hosts.crosscheck(self.config, self.run.dir, self.run.run_id, self.state.facts)
        except (HostError, ServiceError, TimeoutError, OSError, ValueError) as exc:
            self.journal("crosscheck", f"no online check: {exc}", level="warning")
            return f"no online check: {exc}"
        self.state.facts["headline_online"] = result.headline()
        self.run.save()
        if (self.run.results_dir / "results.json").exists():
            write_report(self.run.results_dir, self.run.dir)  # report.json's `online`, report.md's "Online"
        return result.line()

    # --- data between hosts -------------------------------------------------------------------

    async def _relay_file(self, src: str, src_path: str, dst: str, dst_path: str, step: str) -> None:
        await self._connected(src, step)
        await self._connected(dst, step)
        await self.hosts.relay_file(src, src_path, dst, dst_path, self._relay_progress(step))

    async def _relay_tree(self, src: str, src_path: str, dst: str, step: str) -> str:
        """Copy directory `src_path` from host `src` to host `dst` through the console, content-addressed
        (an unchanged tree is not sent twice) and sha256-verified; returns its path on `dst`."""
        await self._connected(src, step)
        await self._connected(dst, step)
        path, sent = await self.hosts.relay_tree(src, src_path, dst, self._relay_progress(step))
        self.journal(step, f"{src}:{src_path} -> {dst}:{path} ({'sent ' + str(sent) + ' bytes' if sent else 'already there'})")
        return path

    async def _relay_heads(self, source: str, model_path: str, dst: str) -> str:
        """The target's embed_tokens/lm_head on the eval host (exported once where the weights are)."""
        heads = f"{await self._window_dir(source)}/target-heads"
        await self.hosts.export_heads(source, model_path, heads)
        return await self._relay_tree(source, heads, dst, "evaluate")

    def _relay_progress(self, step: str) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:
            self.bus.publish(relay_message(self.run.run_id, step, done, total))
        return progress

    # --- telemetry ----------------------------------------------------------------------------

    def _record_telemetry(self, message: Any) -> None:
        from console.messages import TelemetryUpdate

        if isinstance(message, TelemetryUpdate) and message.sample is not None:
            self.run.record_telemetry(message.host, message.sample, {"service_down": self.service_down_by_us})


async def _none() -> Any:
    """No events (an async iterator that ends at once)."""
    return
    yield


def layer_override(drafter: Any) -> str:
    """`NAME=1,2,3`: the config's explicit layers for a drafter (`[[drafters]] layers`)."""
    return f"{drafter.name}={','.join(map(str, drafter.layers))}"


def _same_model(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/") or Path(a).name == Path(b).name and Path(a).name != ""


def relay_message(run_id: str, step: str, done: int, total: int) -> JobProgress:
    """Progress of a copy between hosts through the console, shown like a job's."""
    return JobProgress(job_id=f"{run_id}-relay-{step}", worker="relay", host="console", done=done, total=total,
                       unit="bytes", phase=step, message="copying between hosts", key="relay")


