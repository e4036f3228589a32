"""`dflash-ops replay RUN [--speed X] [--runs DIR]`: a finished (or interrupted) run played back in
the console from its store, as it went: the GPU panels, the steps, the DOWN banner, the jobs, the
questions with their answers; then its results. Nothing acts on a host (the read-only console).

RUN is a run's directory or its id as `dflash-ops runs` lists it. A damaged store (a cut journal
line, a bad telemetry line, a missing state.json) is played up to the damage, which is named (file
and line) on the screen and on stderr. `--print` writes the events on the terminal instead (the
same recording, one line each), for a script or a terminal without a screen.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from console.cli.usage import UsageError
from console.procedure.replay import Event, Player, Recording, ReplayError, damage_report, read_recording
from console.procedure.store import RunStore
from console.views.units import duration


def run_dir_of(given: str, runs: str | None = None) -> Path:
    """The directory of RUN: a path to a run directory, or a run id in the store."""
    path = Path(given).expanduser()
    if path.is_dir():
        return path
    store = RunStore(runs)
    if len(path.parts) == 1 and (store.root / given).is_dir():
        return store.root / given
    raise UsageError(f"no run {given!r}: neither a directory nor a run in {store.root} "
                     f"(`dflash-ops runs{' --runs ' + runs if runs else ''}` lists them)")


def describe(event: Event) -> str:
    """One event in words, for --print: what the console would show change."""
    from console import messages as m

    msg = event.message
    if isinstance(msg, m.JournalEntry):
        return f"journal: {msg.message}"
    if isinstance(msg, m.StepUpdate):
        return f"step {msg.step}: {msg.status}" + (f": {msg.detail}" if msg.detail else "")
    if isinstance(msg, m.DecisionMade):
        q = msg.confirmation
        return (f"asked: {q.action} on {q.host}: $ {' '.join(q.argv)} -> "
                f"{'approved' if msg.approved else 'refused'} ({msg.by})")
    if isinstance(msg, m.Confirmation):  # asked; its answer comes with the DecisionMade
        apart = msg.estimate_apart()  # the stop's forecast is in its impact already: one figure per question
        estimate = f" (estimate {duration(apart)}, {msg.estimate_basis})" if apart is not None else ""
        return f"asking: {msg.action} on {msg.host}: {msg.impact}{estimate}"
    if isinstance(msg, m.Downtime):
        if msg.paused:
            return "service PAUSED"
        return "service DOWN" if msg.down_since is not None else "service back"
    if isinstance(msg, m.FleetView):  # a fleet run's replicas (console/procedure/replay_fleet.py)
        from console.views.fleet import state_text

        return "fleet: " + "; ".join(f"{r.name} {state_text(r).plain}{'' if r.listed else ', out of the router'}"
                                     for r in msg.replicas)
    if isinstance(msg, m.TelemetryUpdate) and msg.sample is not None:
        used = ", ".join(f"GPU{g.index} {g.mem_used_mib} MiB" for g in msg.sample.gpus[:4])
        return f"telemetry {msg.host}: {used}" + (" ..." if len(msg.sample.gpus) > 4 else "")
    if isinstance(msg, m.RunFinished):
        return f"run {msg.status} (exit {msg.exit_code}): {msg.message}"
    if isinstance(msg, m.JobExit):
        return f"job {msg.worker} on {msg.host}: exit {msg.code}"
    if isinstance(msg, m.JobProgress):
        return f"job {msg.worker} on {msg.host}: {msg.key or msg.unit} {msg.done:g}/{msg.total or 0:g}"
    if isinstance(msg, m.JobLog):
        return f"job {msg.worker} on {msg.host}: {msg.message}"
    if isinstance(msg, m.HostState):
        return f"host {msg.host}: {msg.status} (its telemetry flows)"
    if isinstance(msg, m.PlanReady):
        return f"plan ({msg.route} route): " + ", ".join(s.name for s in msg.steps if s.acts)
    if isinstance(msg, m.Forecast):
        return f"forecast downtime {duration(msg.downtime_s)}"
    if isinstance(msg, m.ResultsReady):
        return f"results in {msg.run_dir}/results"
    return type(msg).__name__


def print_recording(recording: Recording) -> None:
    player = Player(recording, playing=False)
    while not player.at_end:
        for event in player.step():
            print(f"+{duration(event.t - recording.start, tenths=True):>10}  {event.source:<22} {describe(event)}")


def run(args: argparse.Namespace) -> int:
    """Replay RUN in the console (or print it); exit status 0, or 1 when its store is damaged."""
    if args.speed <= 0:
        raise UsageError(f"--speed: expected a number above 0, found {args.speed:g}")
    try:
        recording = read_recording(run_dir_of(args.target, args.runs))
    except ReplayError as exc:
        raise UsageError(str(exc)) from None
    if args.print:
        print_recording(recording)
    else:
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            raise UsageError("the replay needs a terminal; `--print` writes its events here instead")
        from screens.replay import run_replay

        run_replay(recording, speed=args.speed)
    for line in damage_report(recording):
        print(f"dflash-ops: {line}", file=sys.stderr)
    return 1 if recording.damage else 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `replay` on the top-level subparsers."""
    parser = sub.add_parser(
        "replay", help="play a past run back in the console: GPUs, steps, downtime, questions, then its results",
        description="Open the console on a finished or interrupted run and play it back from its journal and "
                    "telemetry: the GPU panels, the steps, the DOWN banner, the jobs, the questions with their "
                    "answers; its results at the end. Keys: space pause/play, . next event, ] and [ the next "
                    "and previous step, + and - the speed. Nothing acts on a host. Exit status 1 when the "
                    "run's store is damaged (it is replayed up to the damage, which is named).")
    parser.add_argument("target", metavar="RUN", help="the run's directory, or its id as `dflash-ops runs` lists it")
    parser.add_argument("--speed", type=float, default=1.0, metavar="X",
                        help="times real time (default 1; + and - change it while playing)")
    parser.add_argument("--print", action="store_true",
                        help="write the events on the terminal, one a line, instead of opening the console")
    parser.add_argument("--runs", metavar="DIR", default=None,
                        help="the run store (default: the user data dir's runs/, or $DFLASH_OPS_RUNS)")
    parser.set_defaults(run=run)
