"""The console app: a thin shell over the `Operator`.

It bridges the core's bus into Textual messages (telemetry ticks replace each other in the queue),
folds them into `ConsoleState`, repaints the screen on top (not a screen hidden under a modal: it is
redrawn whole when it comes back), runs the operator's coroutines in async workers on its own loop
(asyncssh lives there), and routes every worker and host error to the one error modal.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from textual import events, work
from textual._context import active_message_pump
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.screen import ModalScreen, Screen
from textual.worker import Worker, WorkerState

from console import messages as m
from console.procedure.follower import downtime_of
from console.session.bus import replace_key
from screens.dashboard import DashboardScreen
from screens.decider import ModalDecider
from screens.errors import StaysUp
from screens.fleet import drained_by, replica_name
from screens.format import clock
from screens.modals.confirm import QUESTION_GUARD_S, QuestionModal
from screens.modals.error import ErrorModal, ErrorReport, bug_report, report_of, tail
from screens.modals.help import HelpModal
from screens.quitting import QUIT_DIALOGS, QuitGuard
from screens.refusals import acting_action, refusal
from screens.state import ConsoleState, StepView, default_rows
from screens.widgets.downtime_banner import DowntimeBanner

STOP_TIMEOUT_S = 10.0
NARROW_COLUMNS = 110  # under this the side panels go above the hosts (console.tcss: .narrow)


def coalesce_key(payload: Any) -> Any:
    """The bus's replace key, but per counter for job progress (a job reports several at once:
    weights in tensors and in bytes, prompts), so no counter hides another."""
    if isinstance(payload, m.JobProgress):
        return ("progress", payload.job_id, payload.key or payload.unit)
    return replace_key(payload)


class CoreMessage(Message):
    """A message the core published on the bus. While one with a replace key (a host's telemetry
    tick, its link state, the service view) waits in the app's queue, a newer one of the same key
    only updates its payload: a burst costs one repaint, and the newest state is the one drawn.
    `published` is when the first of them arrived (the repaint delay is measured from there)."""

    def __init__(self, payload: Any, local: bool = False) -> None:
        super().__init__()
        self.payload = payload
        self.local = local  # made by the console itself (from a run's stored state), not the core
        self.key = coalesce_key(payload)
        self.published = time.perf_counter()

    def can_replace(self, message: Message) -> bool:
        return self.key is not None and isinstance(message, CoreMessage) and message.key == self.key


class ProcedureStarted(Message):
    def __init__(self, resume: str | bool | None) -> None:
        super().__init__()
        self.resume = resume


class ProcedureEnded(Message):
    def __init__(self, finished: m.RunFinished | None) -> None:
        super().__init__()
        self.finished = finished


class ErrorShown(Message):
    def __init__(self, report: ErrorReport) -> None:
        super().__init__()
        self.report = report


class ConsoleApp(QuitGuard, StaysUp, App[int]):
    """`dflash-ops console`: the dashboard over an `Operator` (console/operator.py)."""

    CSS_PATH = "console.tcss"
    TITLE = "dflash-ops"
    BINDINGS = [
        Binding("g", "run_procedure", "Run"),
        # n runs the next step; the footer names it while one waits (a run paused after a step),
        # and the second, unnamed binding keeps n working when none waits (a new run's first step).
        Binding("n", "next_step('waits')", "Next step"),
        Binding("n", "next_step", "Next step", show=False),
        Binding("p", "plan", "Plan"),
        Binding("c", "cancel_run", "Cancel run"),
        Binding("r", "restart_service", "Restart", priority=True),
        Binding("o", "open_results", "Results"),
        Binding("h", "runs", "Runs"),
        Binding("slash", "events", "Events", key_display="/"),
        Binding("question_mark", "help", "Help"),
        Binding("q", "quit", "Quit"),
        # Textual's ctrl+c only says "press ctrl+q", and its ctrl+q is refused under a question: here both
        # take the console's one guarded quit, from every screen and question.
        Binding("ctrl+q,ctrl+c", "quit_anywhere", "Quit", show=False, priority=True),
    ]
    question_guard_s = QUESTION_GUARD_S  # a question ignores keys and clicks this long when it comes on top
    ACTING = {"run_procedure", "plan", "cancel_run", "restart_service", "next_step", "zero_downtime"}

    def __init__(self, operator: Any, *, autostart: bool = False, resume: str | bool | None = None,
                 clock: Callable[[], float] = time.time, tick_s: float = 1.0, start_operator: bool = True) -> None:
        super().__init__()
        self.operator = operator
        self.resume = resume
        self.read_only = bool(getattr(operator, "read_only", False))
        self.autostart = autostart
        self.now = clock
        self.tick_s = tick_s
        self.start_operator = start_operator
        rows = default_rows(getattr(operator.config, "fleet", None) is not None)
        self.state = ConsoleState(rows=rows, steps={n: StepView(n) for n in rows})
        self.decider = ModalDecider(self)
        self.repaint_probe: Callable[[float], None] | None = None  # bench: seconds from publish to repaint
        self._unsubscribe: Callable[[], None] | None = None
        self._thread = threading.get_ident()
        self._stopped = False
        self._host_errors: dict[str, str] = {}
        self._queued: dict[Any, CoreMessage] = {}  # replace key -> its message still in the queue
        self._down_from_store: str | None = None  # the downtime was read from an unfinished run's state
        self._quit_when_up = False  # "wait until ready, then quit" was chosen
        self._quit_after_run = False  # "leave it down for later" was chosen while the run finishes
        self._reporting = False  # a bug of the console is being shown: one more there ends it as Textual would
        self.farewell: str | None = None  # printed on the terminal once the screen is gone
        self.sub_title = ("read-only  " if self.read_only else "") + ", ".join(operator.config.hosts)

    @property
    def service_name(self) -> str:
        """"server (replica r2)": read from the operator's config each time, so a fleet run that goes on
        to its next replica is shown on that one."""
        service = self.operator.config.service
        name = service.unit if service.manager == "systemd" else "server"
        replica = replica_name(self.operator.config)
        return f"{name} (replica {replica})" if replica is not None else name

    # --- lifecycle ------------------------------------------------------------------------------

    def on_mount(self) -> None:
        for message in list(self.operator.bus.last.values()):
            self.state.apply(message)
        self._unsubscribe = self.operator.bus.subscribe(self._from_bus)
        self.show_screen(DashboardScreen(id="dashboard"))
        if self.start_operator:
            self.operator.start()
        self.set_interval(self.tick_s, self._tick)
        self.follow_live_run()  # a run another console (or `run --headless`) drives shows here too
        self._banner_from_store()
        if self.autostart and not self.read_only and (self.resume is not None or not self.operator.unfinished_run()):
            self.run_procedure(resume=self.resume)
        elif not self.read_only:  # `drill` and `run` too: an unfinished run is offered before anything new
            self._offer_resume()

    def on_resize(self, event: events.Resize) -> None:
        narrow = event.size.width < NARROW_COLUMNS
        if narrow != self.has_class("narrow"):
            self.set_class(narrow, "narrow")
            # Textual restyles only the screen on top, and not one it goes back to: the dashboard under
            # the plan or the results would come back in the layout of the old width, crushed.
            for screen in self.screen_stack[:-1]:
                screen.update_node_styles(animate=False)
            if isinstance(self.screen, DashboardScreen):
                self.screen.refresh_part("steps")

    def _banner_from_store(self) -> None:
        """A run left the service down or paused (this console resumes it now, or not): the banner says
        so from the first second, before any engine speaks, as the driving console said it."""
        with contextlib.suppress(Exception):  # an unreadable store is said by _offer_resume
            run = self.operator.left_down()
            said = downtime_of(run.run_id, run.state.service) if run is not None else None
            if said is not None and said.down_since is not None:
                self._down_from_store = run.run_id
                self.post_message(CoreMessage(said, local=True))

    def _offer_resume(self) -> None:
        try:
            run_id = self.operator.unfinished_run()
        except Exception as exc:  # noqa: BLE001 - an unreadable runs dir is worth saying, not fatal
            self.show_error(report_of("the runs directory", exc))
            return
        if not run_id:
            return
        driven = self.operator.driven_elsewhere(run_id)
        if driven is not None:  # another live console's run: nothing to offer here, only who drives it
            self.notify(f"{driven}; it is not resumed from here, and r restarts nothing while it runs",
                        title="run driven by another console", severity="warning", timeout=15)
            return
        question = (f"Unfinished run {run_id}: resume / discard. Resume it from its first unsatisfied step? "
                    f"(Not now: no new window starts while it is unfinished; `dflash-ops run --discard {run_id}` "
                    "discards it and says what it leaves on the hosts.)")
        said = self._left_down(run_id)
        if said is not None:  # the banner says so from now on, and r restarts it (or gives it back)
            self._down_from_store = run_id
            self.post_message(CoreMessage(said, local=True))
            left, back = (("the server PAUSED (its requests held)", "r gives the server its memory back")
                          if said.paused else ("the service DOWN", "r restarts the service"))
            question = (f"Run {run_id} did not finish and left {left} since {clock(said.down_since)}. "
                        f"Resume it from its first unsatisfied step? (Not now: {back}.)")

        def answered(resume: bool | None) -> None:
            if resume:
                self.run_procedure(resume=run_id)

        self.show_screen(QuestionModal(question, yes="Resume", no="Not now", id="resume",
                                       refusal="nothing runs; the run stays resumable (run --resume, or later here)"),
                         callback=answered)

    def _left_down(self, run_id: str) -> m.Downtime | None:
        """The run left the service down (stopped, never ready again) or paused (never continued): as
        its own console said it (the store's one question, whatever the run's status)."""
        run = self.operator.left_down()
        said = downtime_of(run_id, run.state.service) if run is not None and run.run_id == run_id else None
        return said if said is not None and said.down_since is not None else None

    async def _stop_console(self) -> None:
        if self._stopped:
            return
        self._stopped = True  # from here the decider refuses: nobody is left to answer
        if self._unsubscribe is not None:
            self._unsubscribe()
        self.workers.cancel_all()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.workers.wait_for_complete(), STOP_TIMEOUT_S)
        if self.start_operator:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.operator.stop(), STOP_TIMEOUT_S)

    async def on_unmount(self) -> None:
        await self._stop_console()

    # --- the bus --------------------------------------------------------------------------------

    def _from_bus(self, payload: Any) -> None:
        if threading.get_ident() != self._thread:  # a publisher on another thread: to the app's loop
            self.call_from_thread(self._from_bus, payload)
            return
        key = coalesce_key(payload)
        if key is not None:
            queued = self._queued.get(key)
            if queued is not None:  # one still waits in the queue: it carries the newest state instead
                queued.payload = payload
                return
        message = CoreMessage(payload)
        if key is not None:
            self._queued[key] = message
        self.post_message(message)

    def on_core_message(self, message: CoreMessage) -> None:
        if message.key is not None:
            self._queued.pop(message.key, None)
        payload = message.payload
        if self._down_from_store and isinstance(payload, m.ServiceView) and payload.health and payload.health.ready:
            # Someone started it since: what the run's state said is out of date.
            self.post_message(CoreMessage(m.Downtime(self._down_from_store, None), local=True))
            self._down_from_store = None
        elif self._down_from_store and isinstance(payload, m.Downtime) and not message.local and self.state.running:
            # The engine of this console's run speaks for itself now. (The live-run follower only
            # repeats the same store: a server seen ready still ends that downtime.)
            self._down_from_store = None
        kind = self.state.apply(payload, self.now())
        self._errors_in(payload)
        if kind == "downtime":
            self.refresh_bindings()
            self.refresh_banners()  # on every screen, under a modal too: the banner shows through
            if self._quit_when_up and self.state.down_since is None:
                self.call_later(self._quit_now)
        elif kind == "job" and self.state.down_since is not None:
            self.refresh_banners()  # the extraction's rate moves the expected time back
        elif isinstance(payload, m.PlanReady):
            self.refresh_bindings()  # p reads the run's plan from now on
        if kind is None or not self.screen_stack:  # (no screen left: the console is closing)
            return
        screen = self.screen
        if isinstance(screen, ModalScreen):  # the screen under it is redrawn whole when it resumes
            return
        if isinstance(screen, DashboardScreen):
            screen.refresh_part(kind, payload)
        if self.repaint_probe is not None and isinstance(payload, m.TelemetryUpdate):
            published, probe = message.published, self.repaint_probe
            self.call_after_refresh(lambda: probe(time.perf_counter() - published))

    def _errors_in(self, payload: Any) -> None:
        """Host and job errors the core publishes go to the error modal (a host once per outage)."""
        if isinstance(payload, m.HostState):
            if payload.status == "down" and payload.last_error:
                if self._host_errors.get(payload.host) != payload.last_error:
                    self._host_errors[payload.host] = payload.last_error
                    self.show_error(ErrorReport(f"{payload.host} is down", payload.last_error))
            elif payload.status == "connected":
                self._host_errors.pop(payload.host, None)
        elif type(payload).__name__ == "JobError":
            where = getattr(payload, "where", None) or getattr(payload, "host", None)
            title = f"job {getattr(payload, 'job_id', '?')} failed" + (f" ({where})" if where else "")
            stderr = getattr(payload, "stderr_tail", None) or getattr(payload, "stderr", None)
            text = str(getattr(payload, "msg", None) or getattr(payload, "message", None) or "failed")
            self.show_error(ErrorReport(title, text, tail(stderr)))
        elif isinstance(payload, m.RunFinished) and payload.status == "failed":  # (done: said under the steps)
            down = "  The service is up." if payload.service_up else "  The service is DOWN: r restarts it."
            self.show_error(ErrorReport(f"run {payload.run_id} failed", payload.message + down))

    def _tick(self) -> None:
        if not self.is_running or not self.screen_stack:  # shutting down: its screens are being taken down
            return
        screen = self.screen
        if isinstance(screen, DashboardScreen):
            screen.tick()
        else:  # under a modal: the service's DOWN timer still counts, like the banner
            for dashboard in self.screen_stack:
                if isinstance(dashboard, DashboardScreen):
                    dashboard.refresh_part("service")
        self.refresh_banners()

    def refresh_banners(self) -> None:
        """The DOWN banner of every screen and modal, with the time that moved on."""
        for screen in self.screen_stack:
            for banner in screen.query(DowntimeBanner):  # under a question r does not restart: not said there
                banner.show(self.state, self.now(), self.can_restart() and not isinstance(screen, ModalScreen))

    def on_screen_resume(self) -> None:
        self.refresh_banners()

    # --- screens --------------------------------------------------------------------------------

    def show_screen(self, screen: Screen, callback: Callable[[Any], None] | None = None) -> bool:
        """The one way the console shows a screen or a dialog, so that showing one twice is harmless.
        (Textual refuses a second screen with an id already on the stack: `h`, `o`, `h` raised
        DuplicateIds, which ended the console and, with it, the run it drove.)

        A screen (results, runs, plan) comes on top in place of the one of its kind already there,
        which goes with the screens above it: `h`, `o`, `h` is the runs list again, and the stack
        never grows. It never goes over a dialog: a question or an error is answered first. A dialog
        already open (the same id, or the same kind when it has none) is not opened twice.
        Returns whether `screen` was shown."""
        def same(shown: Screen) -> bool:
            return shown.id == screen.id if screen.id is not None else type(shown) is type(screen)

        stack = self.screen_stack
        earlier = next((i for i, shown in enumerate(stack) if same(shown)), None)
        if isinstance(screen, ModalScreen):
            if earlier is not None:
                return False
            self.make_way_for(screen)
        elif stack and isinstance(self.screen, ModalScreen):
            return False
        elif earlier is not None:
            # A popped screen leaves the app's widgets only after this handler, so one with an id
            # (the dashboard) is gone back to, never replaced; the others have no id.
            kept = screen.id is not None
            for _ in range(len(stack) - earlier - kept):
                self.pop_screen()
            if kept:
                return False
        self.push_screen(screen, callback=callback)
        return True

    def make_way_for(self, dialog: Screen) -> None:
        """A quit dialog on top gives way to any other dialog (a question, an error), taken away as
        "stay". Left under it, the quit keys did nothing visible over the question (a quit dialog was
        open already), and it came back once the question was answered, saying what was true when it
        was asked. q, ctrl+q and ctrl+c ask again, at once, on the state then."""
        top = self.screen if self.screen_stack else None
        if top is not None and top.id in QUIT_DIALOGS and top.id != dialog.id:
            top.dismiss(None)

    # --- errors ---------------------------------------------------------------------------------

    def show_error(self, report: ErrorReport) -> None:
        """The one error modal: opened, or the report added to the one already open."""
        self.post_message(ErrorShown(report))
        for screen in self.screen_stack:
            if isinstance(screen, ErrorModal):
                screen.add(report)
                return
        self.show_screen(ErrorModal(report))

    def stay_up_after(self, error: Exception) -> None:
        """What a screen's handler let out (screens/errors.py): to the one error modal, as Textual's
        own way in for it (`_handle_exception`, below) sends it."""
        self._handle_exception(error)

    def _handle_exception(self, error: Exception) -> None:
        """Textual's one way in for an exception nobody caught (a handler, a screen's compose, a
        timer, the drawing): Textual ends the app there, cancelling the run its worker drives. Here it
        goes to the one error modal, and the console and the run go on (screens/errors.py).

        Textual's own ending stays for what the modal cannot show: a failure before the dashboard is
        up (the CSS, the first screen), while the console closes, while the error itself is being
        shown, or in the error modal."""
        up = any(isinstance(screen, DashboardScreen) for screen in self.screen_stack)
        if not up or self._stopped or self._reporting or self._in_error_modal():
            super()._handle_exception(error)
            return
        self.log.error(error)
        if self._exception is None:  # kept as Textual keeps it: `run_test` raises it at its end (a test fails)
            self._exception = error
        self._reporting = True
        try:
            self.show_error(bug_report(error))
        except Exception:  # noqa: BLE001 - the error modal itself cannot be shown
            super()._handle_exception(error)
        finally:
            self._reporting = False

    def _in_error_modal(self) -> bool:
        """The exception was raised by the error modal or a widget of it."""
        node = active_message_pump.get(None)
        while node is not None and not isinstance(node, ErrorModal):
            node = getattr(node, "_parent", None)
        return node is not None

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        worker = event.worker
        if event.state == WorkerState.ERROR and worker.error is not None:
            self.show_error(report_of(f"{worker.description or worker.name} failed", worker.error))
        if worker.group in ("procedure", "service") and event.state in (
                WorkerState.SUCCESS, WorkerState.ERROR, WorkerState.CANCELLED):
            self.state.running = bool([w for w in self.workers if w.group == "procedure" and not w.is_finished])
            self.refresh_bindings()
            if self._quit_after_run and worker.group == "procedure" and not self.state.running:
                self.call_later(self._quit_now)  # the run has recorded its end: the console goes, exit 3
            if self._quit_when_up and self.state.down_since is not None and not self.restarting():
                self._quit_when_up = False  # the restart ended without the service back: say so, stay
                self.show_error(ErrorReport("not quitting: the service is still down",
                                            "The restart ended without the service ready. r restarts it."))

    # --- actions --------------------------------------------------------------------------------

    @property
    def quitting(self) -> bool:
        return self._stopped

    def can_restart(self) -> bool:
        """The restart key: while the service is down because of a run and no procedure is going
        (a running one restarts it itself, and c cancels it, which offers the restart)."""
        return not self.read_only and self.state.down_since is not None and not self.state.running \
            and self.live_elsewhere() is None

    def live_elsewhere(self) -> Any:
        """The run another live console drives (it restarts the service itself), or None."""
        elsewhere = self.state.driven_elsewhere()
        live = elsewhere is not None and elsewhere.status == "running" and not elsewhere.console_gone
        return elsewhere if live else None

    def help_first(self) -> tuple[str, list[tuple[str, str]]] | None:
        """Keys of this kind of console that `?` lists first (a replay's), or None."""
        return None

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.ACTING and self.read_only:
            return False  # read-only: no key that acts is offered
        if action == "quit_anywhere":
            return True  # from every screen and question: action_quit asks first when it must
        if isinstance(self.screen, ModalScreen) and action in self.ACTING | {"open_results", "runs", "help", "events"}:
            return False  # a modal's footer names its own keys; these do nothing there
        here = type(self.screen).__name__
        if here != "DashboardScreen" and action in self.ACTING:
            return False  # results, runs and the plan are read there; escape goes back to act
        if (action == "open_results" and here in ("ResultsScreen", "RunsScreen")) or (action == "runs" and here == "RunsScreen"):
            return False  # already there (the runs screen opens the highlighted run): escape goes back
        busy = self.state.running
        if action == "plan":
            return not busy or self.state.plan is not None  # during a run: the run's plan, to read
        if action == "next_step" and parameters == ("waits",):
            return self.next_step_waits()  # named in the footer only then
        if action in ("run_procedure", "next_step", "zero_downtime"):
            return not busy and self.live_elsewhere() is None  # another console drives: this one follows
        if action == "cancel_run":
            return busy
        if action == "restart_service":
            return (self.can_restart() or self.can_rejoin()) and not self._service_busy()
        return True

    def can_rejoin(self) -> bool:
        """`r` with a fleet: a replica a run left DRAINED (out of the router, no console driving that
        run) is put back by that run's resume (its window finished first when it had not)."""
        return not self.read_only and drained_by(self) is not None and self.state.down_since is None \
            and not self.state.running

    def _service_busy(self) -> bool:
        return any(w.group == "service" and not w.is_finished for w in self.workers)

    @work(exclusive=True, exit_on_error=False, group="procedure", description="the procedure")
    async def run_procedure(self, resume: str | bool | None = None, one_step: bool = False,
                            route: str | None = None) -> m.RunFinished:
        self.state.running = True
        if not resume:  # a new run: its own rows from the first second, never the last run's ticks
            self.state.new_run()
            if isinstance(self.screen, DashboardScreen):
                self.screen.refresh_all()
        self.refresh_bindings()
        self.post_message(ProcedureStarted(resume))
        finished = None
        try:
            finished = await self.operator.run(self.decider, resume=resume, one_step=one_step, route=route)
            return finished
        finally:
            self.state.running = False
            self.refresh_bindings()
            self.post_message(ProcedureEnded(finished))

    def another_drives(self) -> bool:
        """Another live console drives the hosts now: a key that would start a run says who, and does
        nothing (never the error modal, never this console's step table wiped)."""
        elsewhere = self.live_elsewhere()
        if elsewhere is None:
            return False
        self.notify(f"run {elsewhere.run_id} is driven by {elsewhere.owner or 'another console'}: this console "
                    f"follows it (its steps, its jobs); a new run waits until it ends", severity="warning")
        return True

    def action_run_procedure(self) -> None:
        if self.read_only or self.state.running or self.another_drives():
            return
        self.run_procedure()

    def next_step_waits(self) -> bool:
        """A run this console drove paused after a step (`run --step`, `n`, or cut short at its budget),
        nothing going: `n` runs its next step, and the footer says so."""
        finished = self.state.finished
        return not self.read_only and not self.state.running and finished is not None \
            and finished.status == "paused" and self.live_elsewhere() is None

    def action_next_step(self, waits: str = "") -> None:
        """The next step only (of the unfinished run, or of a new one), then pause: resumable. The
        run's state says which steps are done: the next is the first it has not settled."""
        if self.read_only or self.state.running or self.another_drives():
            return
        self.run_procedure(resume=self.operator.unfinished_run(), one_step=True)

    def action_zero_downtime(self) -> None:
        if self.read_only or self.state.running or self.another_drives():
            return
        self.run_procedure(route="zero-downtime")

    @work(exclusive=True, exit_on_error=False, group="follow", description="the live run")
    async def follow_live_run(self) -> None:
        await self.operator.follow_live_run()

    @work(exclusive=True, exit_on_error=False, group="procedure", description="the plan")
    async def plan_procedure(self) -> m.PlanReady:
        plan = await self.operator.plan()
        self.show_plan(plan)
        return plan

    def show_plan(self, plan: m.PlanReady) -> None:
        from screens.plan import PlanScreen

        self.show_screen(PlanScreen(plan))  # (not over a question that came up meanwhile: it goes first)

    def action_plan(self) -> None:
        """Plan (preflight only) and show it; during a run, the run's plan as it stands."""
        if self.read_only:
            return
        if self.state.running:
            if self.state.plan is not None:
                self.show_plan(self.state.plan)
            return
        self.plan_procedure()

    def action_cancel_run(self) -> None:
        if not self.read_only and self.state.running:
            self.operator.cancel()
            self.notify("cancelling: the run stops at the next safe point and offers the restart")

    @work(exclusive=True, exit_on_error=False, group="service", description="the restart")
    async def restart(self) -> None:
        await self.operator.restart_service(self.decider)

    def action_restart_service(self) -> None:
        if self.can_rejoin() and not self._service_busy():  # a DRAINED replica: its run's resume rejoins it
            self.run_procedure(resume=drained_by(self))
            return
        if self.can_restart() and not self._service_busy():
            self.restart()

    def why_no_restart(self) -> str:
        """What `r` says when it cannot act."""
        if self.read_only:
            return refusal(self, "restart_service") or "read-only: this console restarts nothing"
        if self.state.down_since is None:
            return "the service is not down because of this run: nothing to restart"
        elsewhere = self.live_elsewhere()
        if elsewhere is not None:
            return (f"run {elsewhere.run_id} is driven by another console ({elsewhere.owner or 'cannot tell whose'}): "
                    "it restarts the service itself; this console only watches it")
        if self.decider.asking is not None and self.decider.asking.step == "restart":
            return "the run is asking to restart it: stay and answer its question (y)"
        if self.state.running:
            return "the run restarts the service itself once the extraction is done (c cancels it, then offers the restart)"
        return "a restart is already under way"

    def on_key(self, event: events.Key) -> None:
        """A key whose binding cannot act here reaches the app: `r` says why rather than nothing, and
        every acting key of a read-only or following console says so (screens/refusals.py)."""
        if isinstance(self.screen, ModalScreen):
            return
        if event.key == "r":
            event.stop()
            self.notify(self.why_no_restart(), title="r: no restart", severity="warning", timeout=6)
            return
        # (the dashboard's keys only: another screen's own binding of the key, as the runs' c, acts there)
        action = acting_action(self, event.key) if isinstance(self.screen, DashboardScreen) else None
        said = refusal(self, action) if action is not None else None
        if said is not None:
            event.stop()
            self.notify(said, title=f"{event.key}: read-only" if self.read_only else f"{event.key}: not here",
                        severity="warning", timeout=5)

    def action_events(self) -> None:
        """The events whole, filtered as a word is typed; the dashboard's log keeps the filter."""
        from screens.modals.events import EventsModal
        from screens.widgets.event_log import EventLog

        if isinstance(self.screen, ModalScreen):
            return

        logs = [log for screen in self.screen_stack if isinstance(screen, DashboardScreen)
                for log in screen.query(EventLog)]

        def filtered(word: str | None) -> None:
            for log in logs:
                log.show_only(word or "")

        self.show_screen(EventsModal(self.state.journal, logs[0].word if logs else ""), callback=filtered)

    def action_help(self) -> None:
        self.show_screen(HelpModal(self.read_only, self.help_first()))

    def results_dir(self) -> Path | None:
        """The run to show: the one this console just ran, else the newest with results."""
        for source in (self.state.results, self.state.finished):
            if source is not None and (Path(source.run_dir) / "results").is_dir():
                return Path(source.run_dir)
        with contextlib.suppress(Exception):
            for summary in sorted(self.operator.runs(), key=lambda r: r.created_at, reverse=True):
                if (Path(summary.dir) / "results").is_dir():
                    return Path(summary.dir)
        return None

    def action_open_results(self) -> None:
        run_dir = self.results_dir()
        if run_dir is None:
            self.notify("no run with results yet", severity="warning")
            return
        self.open_results(run_dir)

    def open_results(self, run_dir: Path) -> None:
        """The results screen of `run_dir`; an incomplete or unreadable one goes to the error modal."""
        from screens.results import ResultsScreen, read_run_dir

        try:
            data = read_run_dir(run_dir)
        except Exception as exc:  # noqa: BLE001 - the report's UsageError names the file and the problem
            self.show_error(report_of(f"the results of {run_dir.name}", exc))
            return
        self.show_screen(ResultsScreen(data))

    def action_runs(self) -> None:
        from screens.runs import RunsScreen

        self.show_screen(RunsScreen())

    def action_read_only(self) -> None:
        """One way: a console can stop acting, not start (restart it without --read-only for that)."""
        self.read_only = True
        self.sub_title = "read-only  " + ", ".join(self.operator.config.hosts)
        self.refresh_bindings()
        self.refresh_banners()
        self.notify("read-only: no key acts now")

    def restarting(self) -> bool:
        """A restart is under way: the restart key's, or the procedure's restart step."""
        step = self.state.steps.get("restart")
        asked = self.decider.asking is not None and self.decider.asking.step == "restart"  # asked, not under way
        return self._service_busy() or (self.state.running and step is not None and step.status == "running"
                                        and not asked)

    # --- command palette ------------------------------------------------------------------------

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        acting = not self.read_only
        if acting and not self.state.running:
            yield SystemCommand("Run the procedure", "preflight, stage, cache, stop, free VRAM, extract, "
                                "restart, evaluate, report (asks before each change)", self.action_run_procedure)
            yield SystemCommand("Run the next step", "only the next unsatisfied step (stage and cache together), "
                                "then pause; run again to go on", self.action_next_step)
            yield SystemCommand("Run the zero-downtime route", "extract on a host with a free GPU and the weights "
                                "(the plan says which); the server is never stopped", self.action_zero_downtime)
            yield SystemCommand("Plan", "preflight only: what each step would do; touches nothing",
                                self.action_plan)
        if acting and self.state.running:
            yield SystemCommand("Cancel the run", "stop at the next safe point; the restart is offered",
                                self.action_cancel_run)
        if self.can_restart():
            yield SystemCommand("Restart the service", "start it again now (asks first)",
                                self.action_restart_service)
        yield SystemCommand("Open results", "the newest run's tables, chart and window timeline",
                            self.action_open_results)
        yield SystemCommand("Compare runs", "earlier runs side by side: pick two", self.action_runs)
        if acting:
            yield SystemCommand("Read-only", "stop offering anything that acts, for the rest of this session",
                                self.action_read_only)
        yield SystemCommand("Help", "the keys", self.action_help)
        yield SystemCommand("Quit", "as q: asks first while the service is down or a run is going", self.action_quit)
        # Textual's own "Keys" panel says the same as Help, less well; its "Quit the application as soon as
        # possible" is not how this console quits: one of each. Its "Screenshot" writes a file: read-only
        # writes nothing.
        left_out = ("Keys", "Quit", "Screenshot") if self.read_only else ("Keys", "Quit")
        yield from (c for c in super().get_system_commands(screen) if c.title not in left_out)


def run_app(operator: Any, *, autostart: bool = False, resume: str | bool | None = None) -> int:
    """Open the console on `operator` (started and stopped by the app); with `autostart`, run the
    procedure at once (resuming `resume`: a run id, or True for the newest unfinished run).
    Returns the exit status: 0, or the finished run's (1 failed with the service up, 3 failed
    with it still down)."""
    app = ConsoleApp(operator, autostart=autostart, resume=resume)
    result = app.run()
    return int(result if result is not None else (app.return_code or 0))
