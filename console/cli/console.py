"""`dflash-ops console`: the dashboard (Textual) over the configured hosts.

The Textual app lives in `screens/`; it is imported only when the command runs, so the rest of
`console/` never imports Textual.
"""

from __future__ import annotations

import argparse
import sys

from console.cli.usage import UsageError
from console.config import DEFAULT_CONFIG_NAME


def run(args: argparse.Namespace) -> int:
    """Open the console; its exit status is the finished run's (0, or 1 / 3 when one failed)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the console needs a terminal; for scripts use `dflash-ops run --headless`")
    from console.operator import Operator
    from console.request import Refused, Request, choose
    from screens.app import run_app

    try:  # a fleet's replica: the one a run to resume recorded (a DRAINED one: `r` puts it back), else the least loaded
        config = choose(Request("console", config=args.config, runs=args.runs, read_only=args.read_only)).config
    except Refused as exc:
        raise UsageError(str(exc)) from None
    operator = Operator(config, runs_dir=args.runs, read_only=args.read_only)
    return run_app(operator)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `console` on the top-level subparsers."""
    parser = sub.add_parser(
        "console", help="the dashboard: hosts, GPUs, service, steps, jobs, events; run the window from it",
        description="Open the console on the configured hosts: per host its link and GPUs, the service, the "
                    "procedure's steps, the current job and the event log; run the window, answer each "
                    "confirmation, read the results. An unfinished run is offered for resume.")
    parser.add_argument("--config", default=DEFAULT_CONFIG_NAME, metavar="FILE",
                        help=f"config file (default ./{DEFAULT_CONFIG_NAME})")
    parser.add_argument("--read-only", action="store_true",
                        help="only watch: no key stops, starts or ends anything")
    parser.add_argument("--runs", metavar="DIR", default=None,
                        help="the run store (default: the user data dir's runs/, or $DFLASH_OPS_RUNS)")
    parser.set_defaults(run=run)
