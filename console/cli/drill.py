"""`dflash-ops drill [--headless] [--yes]` and `drill up|down|status`: the window rehearsed here.

`drill` alone brings the rehearsal hosts up (building the assets once) and runs the real procedure
against them: in the console (TUI), or with `--headless` on the terminal (prompts, or none with
`--yes`). With `--replicas N` (N > 1) that is the fleet window: one replica drained out of SGLang's
router (smg, or `--router sglang-router`), its window, its rejoin, while the others serve. `up` prints progress on stderr and the config's path alone on stdout, as its last line, so
that `dflash-ops run --config "$(dflash-ops drill up | tail -n1)"` works.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

if TYPE_CHECKING:
    from console.drill.hosts import DrillStatus


def _gpu(args: argparse.Namespace) -> bool:
    """--gpu, or automatic where CUDA is present (--simulated keeps simulated GPUs)."""
    from console.drill.hosts import cuda_present

    if getattr(args, "simulated", False):
        return False
    return bool(getattr(args, "gpu", False)) or cuda_present()


def cmd_up(args: argparse.Namespace) -> int:
    from console.drill.assets import AssetsError
    from console.drill.hosts import DrillError, up

    try:
        path = up(args.dir, fresh=args.fresh, gpu=_gpu(args), memory_saver=not args.no_memory_saver,
                  replicas=args.replicas, router=args.router, crowded=args.crowded, replace=False)
    except (DrillError, AssetsError) as exc:
        print(f"dflash-ops drill up: {exc}", file=sys.stderr)
        return 1
    print(path, flush=True)
    return 0


def cmd_drill(args: argparse.Namespace) -> int:
    """Bring the drill up and run the procedure on it (the TUI unless --headless)."""
    from console.cli import run as cmd_run
    from console.drill.assets import AssetsError
    from console.drill.hosts import DrillError, up

    gpu = _gpu(args)
    try:
        config = up(args.dir, fresh=args.fresh, gpu=gpu, memory_saver=not args.no_memory_saver,
                    replicas=args.replicas, router=args.router, crowded=args.crowded, replace=False)
    except (DrillError, AssetsError) as exc:
        print(f"dflash-ops drill: {exc}", file=sys.stderr)
        return 1
    fleet = (f", {args.replicas} rehearsal servers behind SGLang's router ({args.router}): the fleet window drains "
             f"one, runs its window there and puts it back") if args.replicas > 1 else ""
    # wrapped between words at any width (at 80 columns never "dflash" then "-ops" on the next line)
    told = Console(stderr=True, highlight=False)
    told.print(Text(f"drill hosts up ({'REAL GPU' if gpu else 'SIMULATED GPUs'}{fleet}); config {config} "
                    f"(`dflash-ops drill down` ends them)"), soft_wrap=not told.is_terminal)
    args.config = str(config)
    args.plan, args.step, args.no_restart = False, False, False
    status = cmd_run.run(args)
    for line in after_the_drill(args.runs, args.dir, config):
        told.print(Text(line), soft_wrap=not told.is_terminal)  # piped: one line each, for grep and logs
    return status


def after_the_drill(runs: str | None, drill_dir: str | None, config: object) -> list[str]:
    """What a new operator does next once the drill's run (or console) ends: the run's results, and
    the rehearsal hosts, still up, ended by `drill down`."""
    from console.procedure.store import RunStore, RunSummary

    lines = []
    summaries = [s for s in RunStore(runs).summaries() if isinstance(s, RunSummary)]
    if summaries:
        latest = summaries[-1]
        report = latest.dir / "report.md"
        store = f" --runs {runs}" if runs else ""
        lines.append(f"run {latest.run_id} {latest.status}: "
                     + (f"its report is {report} (`dflash-ops report {latest.run_id}{store}` shows its tables; "
                        f"`dflash-ops runs{store}` lists every run)" if report.is_file()
                        else f"no report yet (`dflash-ops runs{store}` lists every run)"))
    where = f" --dir {drill_dir}" if drill_dir else ""
    lines.append(f"the drill's hosts are still up (config {config}): `dflash-ops drill down{where}` ends them")
    return lines


def cmd_down(args: argparse.Namespace) -> int:
    from console.drill.hosts import down, status

    before = status(args.dir)  # what was up: what the last line says was ended
    outcomes = down(args.dir)
    left = [o for o in outcomes if o["outcome"] in ("survived", "not_permitted")]
    for o in outcomes:
        print(f"ended pid {o['pid']}: {o['outcome']} ({o['detail']})", file=sys.stderr)
    line = down_line(before, outcomes)
    print(line if not left else f"{line}; but {len(left)} process(es) could not be ended")
    return 1 if left else 0


def down_line(before: DrillStatus, outcomes: list[dict]) -> str:
    """'drill down: ended the rehearsal hosts (pid 4100), the rehearsal server (pid 4123) and ...
    (DIR)', or 'drill down: nothing was up (DIR)': what `drill down` ended, from the drill's status
    just before and the outcomes of the processes ended after the hosts' own ending."""
    ended = []
    if before.up:
        ended.append(f"the rehearsal hosts (pid {before.pid})")
        if before.router_url:
            ended.append(f"the router ({before.router or 'sglang-router'}) and {len(before.replica_urls)} "
                         f"rehearsal servers")
        elif before.service_pid:
            ended.append(f"the rehearsal server (pid {before.service_pid})")
        if before.trainer_pid:
            ended.append(f"the training run (pid {before.trainer_pid})")
    elif before.starting:
        ended.append(f"the rehearsal hosts, still starting (pid {before.pid})")
    rest = sum(o["outcome"] in ("terminated", "killed") for o in outcomes)
    if rest:
        ended.append(f"{rest} process(es) {'the hosts left' if ended else 'an earlier drill left'} running")
    if not ended:
        return f"drill down: nothing was up ({before.dir})"
    listed = ", ".join(ended[:-1]) + (" and " if len(ended) > 1 else "") + ended[-1]
    return f"drill down: ended {listed} ({before.dir})"


def cmd_status(args: argparse.Namespace) -> int:
    from console.drill.hosts import status

    found = status(args.dir)
    print("\n".join(found.lines()))
    return 0 if found.up else 1


def _add_gpu_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--gpu", action="store_true",
                       help="on this machine's CUDA GPU (REAL GPU: its VRAM, NVML, the fast kernels; the default where "
                            "CUDA is present)")
    group.add_argument("--simulated", action="store_true", help="simulated GPUs even where CUDA is present")
    parser.add_argument("--replicas", type=_replica_count, default=1, metavar="N",
                        help="N rehearsal servers behind SGLang's real router (the fleet extra), the config with "
                             "[fleet] (default 1: one server, [service])")
    parser.add_argument("--router", choices=("smg", "sglang-router"), default="smg",
                        help="with --replicas: the router in front of them, smg 1.13 (SGLang's gateway, the default) "
                             "or the older sglang-router 0.3.2")
    parser.add_argument("--no-memory-saver", action="store_true",
                        help="the rehearsal server without SGLang's --enable-memory-saver (the pause route is then "
                             "not possible: the other case, rehearsed)")
    parser.add_argument("--crowded", action="store_true",
                        help="with --gpu: the card filled but for a little room once the server is up, so the "
                             "extraction fits only with the server's weights released (the pause route's weights case)")


def _replica_count(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of replicas, 1 or more, found {text!r}")
    return count


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `drill` and its actions on the top-level subparsers."""
    parser = sub.add_parser(
        "drill", help="rehearse the window on this machine (the console; --headless for the terminal); up, down, status",
        description="Rehearsal hosts on this machine (two embedded SSH servers, the rehearsal server as a "
                    "command-managed service, simulated GPUs, a tiny target and two drafters) for a first run "
                    "of the window and for the end-to-end test.")
    parser.add_argument("--headless", action="store_true", help="no TUI: the procedure on the terminal")
    parser.add_argument("--yes", action="store_true", help="approve every confirmation (scripts, CI)")
    parser.add_argument("--resume", nargs="?", const=True, default=None, metavar="RUN",
                        help="continue the latest unfinished drill run (or RUN)")
    parser.add_argument("--dir", default=None, metavar="DIR",
                        help="the drill's directory (default: $DFLASH_OPS_DRILL_DIR or the user state dir's drill)")
    parser.add_argument("--fresh", action="store_true", help="start new rehearsal hosts (re-arms the stuck-VRAM episode)")
    parser.add_argument("--route", choices=("window", "pause", "zero-downtime", "auto"), default=None,
                        help="the route to rehearse (run --route): window (the default), pause (the rehearsal server "
                             "releases its memory and takes it back, never stopped), zero-downtime, or auto")
    _add_gpu_options(parser)
    parser.add_argument("--runs", metavar="DIR", default=None,
                        help="the run store (default: the user data dir's runs/, or $DFLASH_OPS_RUNS)")
    parser.set_defaults(run=cmd_drill, action=None)
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=False, parser_class=type(parser))
    for name, run, text in (
        ("up", cmd_up, "start the rehearsal hosts (building the assets once); print the config's path last"),
        ("down", cmd_down, "stop the hosts, the service and every process the drill started"),
        ("status", cmd_status, "say whether the drill is up: pid, ports, service, config (exit 1 when down)"),
    ):
        action = actions.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        action.add_argument("--dir", default=None, metavar="DIR",
                            help="the drill's directory (default: $DFLASH_OPS_DRILL_DIR or the user state dir's drill)")
        if name == "up":
            action.add_argument("--fresh", action="store_true",
                                help="end a drill that is up and start a new one (re-arms the stuck-VRAM episode)")
            _add_gpu_options(action)
        action.set_defaults(run=run)
