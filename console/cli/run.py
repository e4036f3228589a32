"""`dflash-ops run` (the procedure, headless or with terminal prompts) and `dflash-ops runs`.

Exit codes: 0 done; 1 failed (or refused), the service up; 2 usage or config; 3 failed (or paused)
with the service down; 4 paused with the service up (`run --resume` continues it); 5 degraded: the
work done, but the window left the served drafter degraded (its acceptance length before and after
said; a restart of the server reloads it: `console/procedure/steps/drafter.py`). Ctrl-C cancels the procedure; after the stop the restart is then performed (unless
`--no-restart`), and the exit code says whether the service is still down. SIGTERM (`kill`) and
SIGHUP (the terminal closed) are handled as Ctrl-C is, journalled; a second signal while the run
compensates is journalled too and changes nothing, so a restart is never abandoned half-way. A
stdout or stderr whose reader dies or stops reading never ends nor blocks the run
(`console.cli.terminal_output`).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

from rich.console import Console
from rich.text import Text

from console import messages as m
from console.cli.terminal_output import terminal_output
from console.config import Config
from console.operator import Operator
from console.procedure.decider import ApproveAll, Decider, RefuseAll, TerminalDecider
from console.procedure.store import RunStore, RunStoreError, RunSummary, UnfinishedRun, UnreadableRun
from console.request import Choice, Refused, Request, choose
from console.views.headless import HeadlessView
from console.views.plan import plan_view
from console.views.status import unreadable_run_line
from console.views.tables import FittedTable
from console.views.units import duration

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


def choose_decider(args: argparse.Namespace) -> Decider:
    """--yes approves all; --step (or a terminal) asks y / n / c; no terminal and no --yes refuses."""
    if getattr(args, "yes", False) and not getattr(args, "step", False):
        return ApproveAll()
    return TerminalDecider()


async def run_procedure(operator: Operator, decider: Decider, resume: str | bool | None, no_restart: bool,
                        route: str | None, console: Console) -> int:
    view = HeadlessView(operator.bus, console)
    operator.start()
    try:
        finished = await operator.run(decider, resume=resume, route=route, no_restart=no_restart)
    finally:
        view.close()
        await operator.stop()
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
    view = HeadlessView(operator.bus, console, show_progress=False, warnings_only=True)
    operator.start()
    try:
        plan = await operator.plan(route)
    except RuntimeError as exc:
        console.print(Text(f"no plan: {exc}", style="bold red"), soft_wrap=True)
        return 1
    finally:
        view.close()
        await operator.stop()
    Console().print(plan_view(plan), crop=False)  # commands whole, however wide
    return 0


class CommandLineRun(Operator):
    """The operator of `dflash-ops run` on a terminal, which opens the console: every run started
    from it takes the command line's --route and --no-restart, and --step runs one step at a time
    (the console's `n` runs the next), which the console's keys cannot say."""

    def __init__(self, config: Config, runs_dir: str | None, route: str | None, no_restart: bool, step: bool):
        super().__init__(config, runs_dir=runs_dir)
        self.route_given, self.no_restart, self.step = route, no_restart, step

    async def run(self, decider: Decider, resume: str | bool | None = None, route: str | None = None,
                  no_restart: bool = False, stage: bool | None = None, one_step: bool = False) -> m.RunFinished:
        return await super().run(decider, resume=resume, route=route or self.route_given,
                                 no_restart=no_restart or self.no_restart, stage=stage, one_step=one_step or self.step)


def open_console(operator: CommandLineRun, resume: str | None) -> int:
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


def request_of(args: argparse.Namespace) -> Request:
    """The one request this command line makes (`console/request.py` answers it)."""
    action = "discard" if getattr(args, "discard", None) else "plan" if args.plan else "resume" if args.resume else "run"
    named = args.discard if action == "discard" else args.resume
    return Request(action, None if named is True else named, args.config, args.runs, getattr(args, "replica", None))


def discard(chosen: Choice) -> int:
    """`run --discard [RUN]`: mark the unfinished run discarded and say what it leaves on the hosts."""
    config = chosen.config
    workdirs = {name: host.workdir for name, host in config.hosts.items()} if config is not None else {}
    service = config.hosts.get(config.service.host) if config is not None else None
    discarded, left = chosen.store.discard(chosen.run.run_id, workdirs, config.service.host if config else None,
                                           service.lock_dir if service is not None else None)
    out = Console()
    out.print(Text(f"discarded run {discarded.run_id}: it is never resumed nor offered again. Left on the hosts "
                   f"(nothing there was touched):"), soft_wrap=True)
    for line in left:
        out.print(Text(f"  - {line}"), soft_wrap=True)
    return 0


def run(args: argparse.Namespace) -> int:
    """`dflash-ops run [--plan] [--headless] [--yes] [--step] [--resume [RUN]] [--discard [RUN]]`."""
    err = Console(stderr=True)
    say = lambda line: err.print(Text(f"dflash-ops: {line}", style="yellow"), soft_wrap=True)  # noqa: E731
    request = request_of(args)
    on_terminal = request.action in ("run", "resume") and not args.headless and not args.yes and sys.stdin.isatty()
    try:
        chosen = choose(request, say)  # the run, its config and replica, checked: before anything connects
        if chosen.unfinished is not None and not on_terminal:  # (the console offers it: resume / discard)
            raise UnfinishedRun(chosen.unfinished)
        if request.action == "discard":
            return discard(chosen)
        if request.action == "plan":
            return asyncio.run(print_plan(Operator(chosen.config, runs_dir=args.runs), args.route, err))
        resume = chosen.run.run_id if chosen.run is not None else None
        if on_terminal:
            operator = CommandLineRun(chosen.config, args.runs, args.route, args.no_restart, args.step)
            return open_console(operator, resume)
        decider = choose_decider(args)
        if isinstance(decider, TerminalDecider) and not sys.stdin.isatty() and not args.step:
            err.print("dflash-ops: no terminal to ask on: pass --yes to approve every step, or --step", style="red")
            return 2
        operator = Operator(chosen.config, runs_dir=args.runs)
        guard = SignalGuard(operator, say=lambda line: err.print(Text(f"dflash-ops: {line}", style="yellow")))
        with terminal_output(), guard:  # a reader gone or stalled never ends nor blocks the window
            return asyncio.run(run_procedure(operator, decider, resume, args.no_restart, args.route, err))
    except (Refused, RunStoreError, LookupError) as exc:
        err.print(f"dflash-ops: error: {exc}", style="red", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # a signal before the run began or after it ended
        err.print("dflash-ops: interrupted", style="red")
        return EXIT_INTERRUPTED


def runs_rows(summaries: list[RunSummary | UnreadableRun]) -> tuple[list[str], list[list[str]], list[str]]:
    """The rows of `runs`: ids, taus and downtimes whole; an unreadable run as such."""
    headers = ["run", "date", "status", "route", "downtime (forecast)", "vanilla tau (macro)", "online tau"]
    rows, styles = [], []
    for summary in summaries:
        if isinstance(summary, UnreadableRun):
            rows.append([summary.run_id, "-", "UNREADABLE", "-", "-", "-", "-"])
            styles.append("bold red")
            continue
        status = summary.status
        if summary.console_gone:
            status += " (console gone)"
        if summary.service_down:
            status += ", SERVICE DOWN"
        if summary.server_paused:
            status += ", SERVER PAUSED"
        if summary.drained:
            status += f", DRAINED ({summary.drained} out of the router)"
        if summary.drafter_fell is not None:  # both figures: the served drafter's acceptance length
            before, after = summary.drafter_fell
            status += f"\ndrafter acceptance {before:.2f} -> {after:.2f}"
        taus = "\n".join(f"{name} {tau:.2f}" for name, tau in summary.headline.items() if tau is not None) or "-"
        online = "\n".join(f"{name} {tau:.2f}" for name, tau in summary.online.items() if tau is not None) or "-"
        downtime = duration(summary.downtime_s, tenths=True)
        if summary.forecast_s is not None:
            downtime += f" ({duration(summary.forecast_s, tenths=True)})"
        downtime += forecast_error_lines(summary)
        if summary.windows > 1:  # a line of its own: the column stays as wide as one window's figures
            downtime += f"\n{summary.windows} windows"
        rows.append([summary.run_id, time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.created_at)), status,
                     summary.route or "-", downtime, taus, online])
        styles.append("bold red" if summary.service_down or summary.server_paused or summary.drained
                      else "yellow" if summary.drafter_fell else "")
    return headers, rows, styles


def forecast_error_lines(summary: RunSummary) -> str:
    """Under the downtime, the forecast's error on it, seen and not assumed: 'forecast +55%' is
    (forecast - measured) / measured, the measured without the time the window waited on the
    operator's answers (as the forecast is), that time said on a line of its own when there was any:
    the downtime above holds it."""
    if summary.forecast_error is None:
        return ""
    lines = f"\nforecast {summary.forecast_error:+.0%}"
    if summary.answers_s:
        lines += f"\nanswering {duration(summary.answers_s, tenths=True)}\nleft out"  # (the column stays narrow)
    return lines


def runs(args: argparse.Namespace) -> int:
    """`dflash-ops runs`: earlier runs, newest last; each unreadable one named with its path and why."""
    store = RunStore(args.runs)
    summaries = store.summaries()
    console = Console()
    # the status is a phrase ("refused (console gone), SERVICE DOWN"): it wraps between its words, so
    # that the table still fits 120 columns; ids, dates, downtimes and taus stay whole
    console.print(FittedTable(runs_rows(summaries), f"runs in {store.root}", justify="left", wrap=(2,)))
    for summary in summaries:
        if isinstance(summary, UnreadableRun):
            console.print(unreadable_run_line(summary.run_id, summary.dir, summary.why), soft_wrap=True)
    return 0
