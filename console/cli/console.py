"""`dflash-ops console`: the dashboard (Textual) over the configured hosts.

The Textual app lives in `screens/`; it is imported only when the command runs, so the rest of
`console/` never imports Textual.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from console.cli.usage import UsageError
from console.config import DEFAULT_CONFIG_NAME, load_config


def run(args: argparse.Namespace) -> int:
    """Open the console; its exit status is the finished run's (0, or 1 / 3 when one failed)."""
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the console needs a terminal; for scripts use `dflash-ops run --headless`")
    config = load_config(args.config)
    if config.fleet is not None and not args.read_only:  # the replica the window runs on, before the screen
        config = fleet_replica(config, args.runs, UsageError)
    from console.operator import Operator
    from screens.app import run_app

    operator = Operator(config, runs_dir=args.runs, read_only=args.read_only)
    return run_app(operator)


def fleet_replica(config: Any, runs: str | None, error: type[Exception]) -> Any:
    """A fleet config addressed to the replica whose window this console runs: the one a run to resume
    recorded (a DRAINED replica: `r` puts it back), else the one chosen now (the least loaded; the
    refusals, with their numbers, raise `error` before anything changes)."""
    from console.cli.run import known_states
    from console.procedure.outcomes import StepFailed
    from console.procedure.steps.fleet import fleet_config
    from console.procedure.store import RunStore, RunStoreError

    try:
        recorded = RunStore(runs).to_resume()
    except RunStoreError:
        recorded = None  # the console's resume offer says what is wrong with the store
    try:
        placed, _why = asyncio.run(fleet_config(config, recorded.state if recorded is not None else None, None,
                                                known_states(runs)))
    except StepFailed as exc:
        raise error(f"{exc.msg} (--read-only watches the fleet)") from None
    return placed


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
