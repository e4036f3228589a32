"""`dflash-ops run` (the procedure, headless or with terminal prompts) and `dflash-ops runs`.

Exit codes: 0 done; 1 failed (or refused), the service up; 2 usage or config; 3 failed with the
service down. Ctrl-C cancels the procedure; after the stop the restart is then performed (unless
`--no-restart`), and the exit code says whether the service is still down.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time

from rich.console import Console
from rich.table import Table
from rich.text import Text

from console.config import load_config
from console.operator import Operator
from console.procedure.decider import ApproveAll, Decider, TerminalDecider
from console.procedure.store import RunStore, RunStoreError
from console.views.headless import HeadlessView, plan_view


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
    if finished.status == "done":
        show_results(operator, finished.run_id, Console())
    return finished.exit_code


def show_results(operator: Operator, run_id: str, console: Console) -> None:
    """The result tables of a finished run (the same as `dflash-ops report` shows)."""
    from console.cli.report import read_run
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
    Console().print(plan_view(plan))
    return 0


def run(args: argparse.Namespace) -> int:
    """`dflash-ops run [--plan] [--headless] [--yes] [--step] [--resume [RUN]]`."""
    config = load_config(args.config)
    operator = Operator(config, runs_dir=args.runs)
    err = Console(stderr=True)
    if args.plan:
        return asyncio.run(print_plan(operator, args.route, err))
    if not args.headless and not args.yes and sys.stdin.isatty():
        from screens.app import run_app  # the TUI, unless asked for the terminal

        return run_app(operator, autostart=True, resume=args.resume)
    decider = choose_decider(args)
    if isinstance(decider, TerminalDecider) and not sys.stdin.isatty() and not args.step:
        err.print("dflash-ops: no terminal to ask on: pass --yes to approve every step, or --step", style="red")
        return 2
    try:
        return asyncio.run(run_procedure(operator, decider, args.resume, args.no_restart, args.route, err))
    except (RunStoreError, LookupError) as exc:
        err.print(f"dflash-ops: error: {exc}", style="red", soft_wrap=True)
        return 2
    except KeyboardInterrupt:  # a second Ctrl-C during the compensation
        err.print("dflash-ops: interrupted", style="red")
        return 130


def runs(args: argparse.Namespace) -> int:
    """`dflash-ops runs`: earlier runs, newest last."""
    store = RunStore(args.runs)
    table = Table(title=f"runs in {store.root}", title_justify="left")
    for column in ("run", "date", "status", "route", "downtime", "vanilla tau (macro)"):
        table.add_column(column)
    for summary in store.summaries():
        taus = ", ".join(f"{name} {tau:.2f}" for name, tau in summary.headline.items() if tau is not None) or "-"
        table.add_row(summary.run_id, time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.created_at)),
                      summary.status, summary.route or "-",
                      f"{summary.downtime_s:.1f} s" if summary.downtime_s is not None else "-", taus)
    Console().print(table)
    return 0
