"""`dflash-ops run` once its command line is read: one request (`console/request.py` chooses the
run) and how this terminal shows it (`RunOptions`), answered by one call, `answer`: the discard said,
the plan printed, the console opened on the terminal, or the procedure headless with its journal on
stdout. The command line only asks; nothing here reads its arguments.

Exit codes: 0 done; 1 failed (or refused), the service up; 2 usage or config; 3 failed (or paused)
with the service down; 4 paused with the service up (`run --resume` continues it); 5 degraded: the
work done, but the window left the served drafter degraded (its acceptance length before and after
said; a restart of the server reloads it: `console/procedure/steps/drafter.py`). Ctrl-C cancels the
procedure; after the stop the restart is then performed (unless `--no-restart`), and the exit code
says whether the service is still down. SIGTERM (`kill`) and SIGHUP (the terminal closed) are handled
as Ctrl-C is, journalled; a second signal while the run compensates is journalled too and changes
nothing, so a restart is never abandoned half-way. A stdout or stderr whose reader dies or stops
reading never ends nor blocks the run (`console.terminal_output`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

from rich.console import Console
from rich.text import Text

from console import messages as m
from console.operator import Asked, Operator
from console.procedure.decider import ApproveAll, Decider, RefuseAll, TerminalDecider
from console.procedure.store import RunStoreError
from console.request import Choice, Refused, Request, choose
from console.terminal_output import terminal_output
from console.views.headless import HeadlessView
from console.views.plan import plan_view

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
EXIT_INTERRUPTED = 130
EXIT_PAUSED = 4  # paused, the service up: `run --resume` continues it (a window cut short at its budget)


class SignalGuard:
    """SIGINT, SIGTERM and SIGHUP while a run is in progress, handled as Ctrl-C is: the first is
    journalled and cancels the run, whose compensation ends our jobs, offers (with --yes: does) the
    restart and finishes the run; later ones are journalled and change nothing. SIGHUP says the
    terminal is gone: see `hang_up`. Python's handlers (not the loop's) so that it covers the
    console's loop too, which Textual creates; each signal is handed to the running loop, where the
    run lives."""

    def __init__(self, operator: Operator, say: Callable[[str], None], when_idle: Callable[[str], None] | None = None):
        self.operator = operator
        self.say = say  # where a signal is told when no run journal is open
        self.when_idle = when_idle  # a signal with no run in progress (the console after its run)
        self.received: list[str] = []
        self._previous: dict[int, Any] = {}
        self._terminal_fds: list[int] = []
        self._detached = False

    def __enter__(self) -> SignalGuard:
        # Which of stdin/stdout/stderr are the terminal, asked now: once it has hung up it no
        # longer answers as one (isatty is False), yet writing to it fails.
        self._terminal_fds = [fd for fd in (0, 1, 2) if os.isatty(fd)]
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in SIGNALS}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGHUP:
            # At once, not on the loop: the kernel's SIGCONT follows a hang-up, on which Textual
            # starts drawing again; a write to the hung-up terminal would end its writer thread,
            # and the console would then block on its next write for good.
            self.detach_terminal()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # before the loop runs, or after: nothing of ours is in progress
            raise KeyboardInterrupt from None
        loop.call_soon_threadsafe(self.handle, signal.Signals(signum).name)

    def running(self) -> bool:
        """A run is in progress (compensating included): its engine's state is not finished yet."""
        engine = self.operator.engine
        return engine is not None and engine.state.status == "running"

    def _journal(self, message: str) -> None:
        if self.running():
            self.operator.engine.journal(None, message, level="warning")
        else:
            self.say(message)

    def detach_terminal(self) -> None:
        """Nobody reads the screen any more: what was drawn on the terminal goes to /dev/null from
        now on (a file or a pipe is kept), since writing to a terminal that is gone fails and
        Textual would wait on it forever."""
        if self._detached:
            return
        self._detached = True
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in self._terminal_fds:
            os.dup2(devnull, fd)
        os.close(devnull)

    def hang_up(self) -> str:
        """The terminal is gone (its screen detached, `detach_terminal`). Nobody can answer a
        question any more: one that would wait for an answer is refused from now on (`--yes` still
        approves), so no restart waits forever. Returns what the journal says of it."""
        self.detach_terminal()
        engine = self.operator.engine
        if engine is None or isinstance(engine.decider, ApproveAll):
            return ""
        engine.decider = RefuseAll()
        return "; the terminal is gone, so every question is refused from now on (a restart too)"

    def handle(self, name: str) -> None:
        """One signal, on the loop."""
        self.received.append(name)
        hung_up = self.hang_up() if name == "SIGHUP" else ""
        if not self.running():
            if self.when_idle is not None:
                self.when_idle(name)
            return
        if len(self.received) == 1:
            self._journal(f"{name} received: the run is cancelled as Ctrl-C does (with the service down, "
                          f"the restart comes first){hung_up}")
            self.operator.cancel()
        else:
            self._journal(f"{name} received again while the run finishes: ignored, the restart is not "
                          f"abandoned half-way (SIGKILL ends the console without it)")


def choose_decider(options: RunOptions) -> Decider:
    """--yes approves all; --step (or a terminal) asks y / n / c; no terminal and no --yes refuses."""
    if options.yes and not options.asked.one_step:
        return ApproveAll()
    return TerminalDecider()


@contextlib.asynccontextmanager
async def headless(operator: Operator, view: HeadlessView) -> AsyncIterator[None]:
    """The hosts connected for the block, `view` printing what the operator publishes; the view
    closed and the hosts let go after it, whatever its outcome (the plan and the headless run)."""
    operator.start()
    try:
        yield
    finally:
        view.close()
        await operator.stop()


async def run_procedure(operator: Operator, decider: Decider, resume: str | None, console: Console) -> int:
    async with headless(operator, HeadlessView(operator.bus, console)):
        finished = await operator.run(decider, resume=resume)
    if finished.status in ("done", "degraded"):
        show_results(operator, finished.run_id, Console())
    return exit_status(finished)


def exit_status(finished: m.RunFinished) -> int:
    """The run's exit status; a run paused with the service up (a window cut short at its budget,
    one step done) is not done: EXIT_PAUSED, so that a script tells it from a finished run and
    resumes it (paused with the service down stays 3)."""
    if finished.status == "paused" and finished.exit_code == 0:
        return EXIT_PAUSED
    return finished.exit_code


def show_results(operator: Operator, run_id: str, console: Console) -> None:
    """The result tables of a finished run (the same as `dflash-ops report` shows)."""
    from console.procedure.results import read_run
    from console.views.report import report_renderables

    results_dir = operator.run_dir(run_id) / "results"
    if not (results_dir / "results.json").exists():
        return
    for part in report_renderables(*read_run(results_dir)):
        console.print(part)
    console.print(Text(f"report: {operator.run_dir(run_id) / 'report.md'}"))


async def print_plan(operator: Operator, route: str | None, console: Console) -> int:
    async with headless(operator, HeadlessView(operator.bus, console, show_progress=False, warnings_only=True)):
        try:
            plan = await operator.plan(route)
        except RuntimeError as exc:
            console.print(Text(f"no plan: {exc}", style="bold red"), soft_wrap=True)
            return 1
    Console().print(plan_view(plan), crop=False)  # commands whole, however wide
    return 0


def open_console(operator: Operator, resume: str | None) -> int:
    """The console on a terminal, running the procedure at once: the run (`resume`, or a new one) was
    chosen before the screen changes (`console/request.py`), so that an unreadable run or nothing to
    resume is one line and exit 2; None with an unfinished run: the console offers it first. A signal
    ends the console once its run has finished."""
    from screens.app import ConsoleApp  # the TUI, unless asked for the terminal

    app = ConsoleApp(operator, autostart=True, resume=resume)
    guard = SignalGuard(operator, say=lambda line: app.notify(line, severity="warning"),
                        when_idle=lambda name: app.exit(app.return_code or 0))

    def exit_after(finished: Any) -> None:
        if guard.received and isinstance(finished, m.RunFinished):
            app.exit(finished.exit_code)

    unsubscribe = operator.bus.subscribe(exit_after)
    try:
        with guard:
            result = app.run()
    finally:
        unsubscribe()
    return int(result if result is not None else (app.return_code or 0))


@dataclass(frozen=True)
class RunOptions:
    """How the run is shown and approved on this terminal (the request says which run)."""

    headless: bool = False  # the journal on stdout, never the console
    yes: bool = False  # approve every step (no terminal needed)
    asked: Asked = Asked()  # --route, --no-restart, --step: every run this command starts takes them

    def on_terminal(self, request: Request) -> bool:
        """The console opens: a run or resume asked on a terminal, neither --headless nor --yes."""
        return request.action in ("run", "resume") and not self.headless and not self.yes and sys.stdin.isatty()


def discard(chosen: Choice) -> int:
    """`run --discard [RUN]`: mark the unfinished run discarded and say what it leaves on the hosts."""
    left = chosen.store.discard(chosen.run, chosen.config)
    out = Console()
    out.print(Text(f"discarded run {chosen.run.run_id}: it is never resumed nor offered again. Left on the hosts "
                   f"(nothing there was touched):"), soft_wrap=True)
    for line in left:
        out.print(Text(f"  - {line}"), soft_wrap=True)
    return 0


def answer(request: Request, options: RunOptions) -> int:
    """Carry out `request` on this terminal; returns the exit status (see the module's docstring)."""
    err = Console(stderr=True)
    say = lambda line: err.print(Text(f"dflash-ops: {line}", style="yellow"), soft_wrap=True)  # noqa: E731
    on_terminal = options.on_terminal(request)
    try:
        # the run, its config and replica, checked: before anything connects (an unfinished run: the
        # console offers it, resume / discard; a script is refused it)
        chosen = choose(request, say, offered=on_terminal)
        if request.action == "discard":
            return discard(chosen)
        # Headless, --step asks before each step (y / n / c, the decider's); only the console runs one
        # step and pauses (its `n` runs the next), so the run itself is not one step there.
        asked = options.asked if on_terminal else dataclasses.replace(options.asked, one_step=False)
        operator = Operator(chosen.config, runs_dir=request.runs, asked=asked)
        resume = chosen.run.run_id if chosen.run is not None else None
        if on_terminal:
            return open_console(operator, resume)
        if request.action == "plan":
            return asyncio.run(print_plan(operator, options.asked.route, err))
        decider = choose_decider(options)
        if isinstance(decider, TerminalDecider) and not sys.stdin.isatty() and not options.asked.one_step:
            err.print("dflash-ops: no terminal to ask on: pass --yes to approve every step, or --step", style="red")
            return 2
        guard = SignalGuard(operator, say=lambda line: err.print(Text(f"dflash-ops: {line}", style="yellow")))
        with terminal_output(), guard:  # a reader gone or stalled never ends nor blocks the window
            return asyncio.run(run_procedure(operator, decider, resume, err))
    except (Refused, RunStoreError, LookupError) as exc:
        err.print(f"dflash-ops: error: {exc}", style="red", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # a signal before the run began or after it ended
        err.print("dflash-ops: interrupted", style="red")
        return EXIT_INTERRUPTED
