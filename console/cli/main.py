"""The `dflash-ops` command line.

Subcommands are listed in `COMMANDS`: each entry adds its parser and names the function that runs
it, so `drill`, `run` and `probe` slot in beside `config` without touching `main`. A problem the
user can fix (bad config, file exists, bad arguments: `UsageError`, console/cli/usage.py) is one
line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import NoReturn

from console.cli.drill import add_parser as add_drill
from console.cli.usage import EXIT_USAGE, UsageError
from console.config import DEFAULT_CONFIG_NAME, ConfigError, example_config_text
from console.procedure.results import ResultsError
from remote.artifacts import atomic_path


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (the full usage is a `--help` away)."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


# --------------------------------------------------------------------------------------------
# config


def cmd_config_init(args: argparse.Namespace) -> int:
    """Write the commented example config; refuse to overwrite unless --force."""
    path = Path(args.path)
    if path.is_dir():
        raise UsageError(f"{path}: is a directory; give a file name, e.g. {path / DEFAULT_CONFIG_NAME}")
    if path.exists() and not args.force:
        raise UsageError(f"{path}: already exists; use --force to overwrite it")
    # Written beside the target and renamed, so a crash never leaves half a config behind.
    with atomic_path(path) as tmp:
        tmp.write_text(example_config_text(), encoding="utf-8")
    print(f"wrote {path}: edit the hosts and paths, then run `dflash-ops config check --config {path}`")
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    """Validate the config and print the resolved plan."""
    from rich.console import Console

    from console.config_source import load_pointing_to_drill
    from console.views.plan import render_plan

    config = load_pointing_to_drill(args.config)
    console = Console()
    console.print(render_plan(config))
    console.print(f"{args.config}: OK", style="green")
    return 0


def _add_config(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("config", help="write an example config, or check one and print its plan",
                            description="Write an example config, or validate one and print the resolved plan.")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True, parser_class=_Parser)
    init = actions.add_parser("init", help="write a commented example config (two-host setup)",
                              description="Write a commented example config for the two-host setup.")
    init.add_argument("path", nargs="?", default=DEFAULT_CONFIG_NAME, metavar="PATH",
                      help=f"where to write it (default {DEFAULT_CONFIG_NAME})")
    init.add_argument("--force", action="store_true", help="overwrite PATH if it exists")
    init.set_defaults(run=cmd_config_init)
    check = actions.add_parser("check", help="validate the config and print the resolved plan",
                               description="Validate the config and print the resolved plan.")
    _add_config_option(check)
    check.set_defaults(run=cmd_config_check)


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=DEFAULT_CONFIG_NAME, metavar="FILE",
                        help=f"config file (default ./{DEFAULT_CONFIG_NAME})")


# --------------------------------------------------------------------------------------------
# probe, status, report: each command's work lives in its own module, imported when it runs.


def _cmd_probe(args: argparse.Namespace) -> int:
    from console.cli import probe as cmd_probe

    return cmd_probe.run(args)


def _cmd_status(args: argparse.Namespace) -> int:
    from console.cli import status as cmd_status

    return cmd_status.run(args)


def _cmd_report(args: argparse.Namespace) -> int:
    from console.cli import report as cmd_report

    return cmd_report.run(args)


def _add_probe(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "probe", help="compare the hosts' environments and kernels side by side",
        description="Run the environment probe on every configured host at once and print them side by "
                    "side, asymmetries flagged. Exit status 1 when a probe failed or the hosts bind "
                    "different kernels.")
    _add_config_option(parser)
    parser.add_argument("--timeout", type=float, default=300.0, metavar="S",
                        help="seconds one host's probe may take (default 300)")
    parser.add_argument("--out", metavar="FILE",
                        help="also save the probes as JSON (put probes.json beside an evaluation for its report)")
    parser.add_argument("--cached", action="store_true",
                        help="take torch, the packages and the kernel binding from the host's last probe while its "
                             "environment's fingerprint is unchanged, as a window's preflight does (default: probe "
                             "everything anew)")
    parser.set_defaults(run=_cmd_probe)


def _add_status(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "status", help="show the hosts' links and GPUs and the service's state and health (read-only)",
        description="Show each host's connection and latency, its GPUs (memory, utilisation, holders) and "
                    "the service's state and health. Read-only: nothing is stopped or started. Exit "
                    "status 0 when every host is connected and the service is ready, else 1.")
    _add_config_option(parser)
    parser.add_argument("--watch", action="store_true", help="redraw every second until Ctrl-C")
    _add_runs_option(parser)
    parser.set_defaults(run=_cmd_status)


def _add_report(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "report", help="print an evaluation's result tables and export them as Markdown and JSON",
        description="Print the result tables of an evaluation output directory (results.json, with "
                    "parity.json and probes.json when beside it) and write report.md and report.json there; "
                    "or of a run (RUNS/<id>, or its id, as `dflash-ops runs` lists it): its results/, the "
                    "report written in the run's directory.")
    parser.add_argument("run_dir", metavar="RUN_DIR", nargs="?", default=None,
                        help="the evaluation's output directory (or its results.json), or a run's directory or id "
                             "(default: the latest run of the store)")
    _add_runs_option(parser)
    parser.set_defaults(run=_cmd_report)


def _cmd_run(args: argparse.Namespace) -> int:
    from console.cli import run as cmd_run

    return cmd_run.run(args)


def _cmd_runs(args: argparse.Namespace) -> int:
    from console.cli import run as cmd_run

    return cmd_run.runs(args)


def _add_runs_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", metavar="DIR", default=None,
                        help="the run store (default: the user data dir's runs/, or $DFLASH_OPS_RUNS)")


def _add_run(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "run", help="run the downtime window: preflight, stage, cache, stop, free VRAM, extract, restart, evaluate, report",
        description="Run the procedure against the configured hosts, asking before every step that changes a "
                    "host. Exit status 0 done; 1 failed with the service up; 2 usage or config; 3 failed with "
                    "the service still down; 4 paused with the service up (run --resume continues it); 5 degraded: "
                    "done, but the window left the served drafter degraded (a restart reloads it).")
    _add_config_option(parser)
    parser.add_argument("--plan", action="store_true", help="print every step with its exact command and whether "
                                                            "it would act; change nothing")
    parser.add_argument("--headless", action="store_true", help="no TUI: progress and tables on the terminal")
    parser.add_argument("--yes", action="store_true", help="approve every confirmation (scripts, CI)")
    parser.add_argument("--step", action="store_true", help="ask before each step: y / n / c (continue without asking)")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN",
                        help="continue the latest unfinished run (or RUN) from its first unsatisfied step")
    parser.add_argument("--discard", nargs="?", const=True, default=None, metavar="RUN",
                        help="mark the unfinished run (or RUN) discarded, never resumed, and say what it leaves on "
                             "the hosts (its jobs, files, lock); a run that left the service down is resumed instead")
    parser.add_argument("--no-restart", action="store_true",
                        help="after a failure with the service down, leave it down (exit 3) instead of restarting it")
    parser.add_argument("--route", choices=("window", "pause", "zero-downtime", "auto"), default=None,
                        help="the route: window (the default: stop the server, extract, restart), pause (the server "
                             "started with --enable-memory-saver pauses, releases the GPU memory the extraction "
                             "needs, then resumes and continues: never stopped, requests held, none failed) or "
                             "zero-downtime (extract on a host with a free GPU, a copy of the weights and the "
                             "drafters' kernels; the plan proposes it when one has, and the stop's question names it); auto takes the "
                             "least harm these hosts allow: zero-downtime, else pause, else window")
    parser.add_argument("--replica", metavar="NAME", default=None,
                        help="a [fleet] config: run the window on this replica (default: the least loaded; the "
                             "preflight refuses one that cannot take the window and names those that can); still "
                             "refused while a replica is unhealthy or the others cannot take the load")
    _add_runs_option(parser)
    parser.set_defaults(run=_cmd_run)


def _add_runs(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("runs", help="list earlier runs (date, route, downtime, headline tau per drafter)",
                            description="List the runs in the run store, newest last.")
    _add_runs_option(parser)
    parser.set_defaults(run=_cmd_runs)


# --------------------------------------------------------------------------------------------
# The command table: (name, adds its parser). Later: drill, run.


@dataclass(frozen=True)
class Subcommand:
    name: str
    add: Callable[[argparse._SubParsersAction], None]


COMMANDS: list[Subcommand] = [
    Subcommand("config", _add_config),
    Subcommand("probe", _add_probe),
    Subcommand("status", _add_status),
    Subcommand("report", _add_report),
    Subcommand("run", _add_run),
    Subcommand("runs", _add_runs),
    Subcommand("crosscheck", lambda sub: __import__("console.cli.crosscheck", fromlist=["add_parser"]).add_parser(sub)),
    Subcommand("drill", add_drill),
    Subcommand("console", lambda sub: __import__("console.cli.console", fromlist=["add_parser"]).add_parser(sub)),
    Subcommand("serve", lambda sub: __import__("console.cli.serve", fromlist=["add_parser"]).add_parser(sub)),
    Subcommand("replay", lambda sub: __import__("console.cli.replay", fromlist=["add_parser"]).add_parser(sub)),
]


def _version() -> str:
    try:
        return version("dflash-ops")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser, one subparser per entry of `COMMANDS`."""
    parser = _Parser(
        prog="dflash-ops",
        description="Operations console for the DFlash drafter downtime window: "
                    "cache, stop, extract, restart, evaluate.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands", parser_class=_Parser)
    for command in COMMANDS:
        command.add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `dflash-ops` console script; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (ConfigError, UsageError, ResultsError) as exc:
        print(f"dflash-ops: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as exc:
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"dflash-ops: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("dflash-ops: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
