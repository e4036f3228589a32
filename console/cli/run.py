"""`dflash-ops run` and `dflash-ops runs`: the command line read into one request and how it is
shown, handed to `console/runner.py` (which answers it: exit codes there); `runs` lists the store.
"""

from __future__ import annotations

import argparse
import time

from rich.console import Console

from console.operator import Asked
from console.procedure.store import RunStore, RunSummary, UnreadableRun
from console.request import Request
from console.runner import RunOptions, answer
from console.views.status import unreadable_run_line
from console.views.tables import FittedTable
from console.views.units import duration


def request_of(args: argparse.Namespace) -> Request:
    """The one request this command line makes (`console/request.py` answers it)."""
    action = "discard" if getattr(args, "discard", None) else "plan" if args.plan else "resume" if args.resume else "run"
    named = args.discard if action == "discard" else args.resume
    return Request(action, None if named is True else named, args.config, args.runs, getattr(args, "replica", None))


def run(args: argparse.Namespace) -> int:
    """`dflash-ops run [--plan] [--headless] [--yes] [--step] [--resume [RUN]] [--discard [RUN]]`."""
    request = request_of(args)
    asked = Asked(route=args.route, no_restart=args.no_restart, one_step=getattr(args, "step", False))
    options = RunOptions(headless=args.headless, yes=getattr(args, "yes", False), asked=asked)
    return answer(request, options)


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
