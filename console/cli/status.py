"""`dflash-ops status [--watch]`: each host's link and GPUs, and the service's state and health.

Read-only: a view over the session core (`console.session`), which connects (one supervisor per
host), streams the telemetry agent, asks the service manager for its state and the server for its
health through a forwarded port. It never stops or starts anything (it does ship the worker code,
which the agent needs, into the host's workdir).

With `[fleet]`: the router's health and which gateway it is (smg or sglang-router), and each replica
(its state: serving, draining, in window, rejoining, DRAINED by run X; its requests, host and GPUs)
under the service.

Who holds the service host (the host lock, `[hosts.<name>] lock_dir`): the run and the console that
hold it, its file's account, or that it is free (the snapshot; a second operator refused at a
preflight is sent here to find who holds the host).

A drill host whose workdir holds `simulated-gpu.json` (`remote.drill.simgpu`) is read through that
file and shown SIMULATED. One snapshot by default (exit 0 when every host is connected and the
service is ready, and with `[fleet]` the router lists every replica healthy; else 1); `--watch` redraws every second until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from console.config import Config
from console.config_source import config_for
from console.procedure.host_lock import LOCK_FILE, owner_of
from console.procedure.remote_files import lock_file
from console.procedure.store import RunStore, UnreadableRun, left_line, paused_by, what_next
from console.service.fleet_watch import all_serving, with_runs
from console.session import Session, service_name
from console.views.fleet import fleet_renderable
from console.views.status import status_view, unreadable_run_line

FIRST_SAMPLE_WAIT_S = 15.0  # the first agent start may ship the worker code first
REFRESH_S = 1.0


def render(session: Session, runs: RunStore | None = None, held: Text | None = None) -> RenderableType:
    config = session.config
    view = status_view(session.states(), session.telemetry(), service_name(config), config.service.host,
                       session.service.last)
    if config.fleet is not None:  # the router and each replica, with what the runs do with them
        view = Group(view, fleet_renderable(with_runs(session.fleet, fleet_states(runs)) if session.fleet else None))
    if held is not None:  # who holds the host, under it
        view = Group(view, held)
    if runs is None:
        return view
    unreadable = [unreadable_run_line(u.run_id, u.dir, u.why) for u in runs.summaries() if isinstance(u, UnreadableRun)]
    return screen(view, downtime_line(runs), unreadable)


def fleet_states(runs: RunStore | None) -> list:
    """The runs' states, newest first: what a replica's state is read from (`fleet_watch.with_runs`)."""
    return [run.state for run in reversed(runs.readable())] if runs is not None else []


def screen(view: RenderableType, down: Text | None, unreadable: list[Text]) -> RenderableType:
    """The view, then the runs that cannot be read, then the verdict while a run has the service
    down: last, so that it is the line left above the prompt (and at the bottom of `--watch`)."""
    return Group(view, *unreadable, *([down] if down is not None else []))


def downtime_line(runs: RunStore) -> Text | None:
    """While a run of ours has the service down, every view says so, since when and by which run
    (the store's one question, whatever the run's status), and who drives that run."""
    run = runs.left_down()
    if run is None:
        return None
    return Text(f"{left_line(run)}; {what_next(run)}", style="bold white on red")


def hold_from_store(session: Session, runs: RunStore | None) -> None:
    """While a run holds this config's server paused, the session does not probe its /health (SGLang
    answers 503 for the whole pause, after its own check's wait): it names the run instead."""
    if runs is not None:
        session.held_paused(paused_by(runs.left_down(service=session.config)))


async def lock_line(session: Session) -> Text | None:
    """Who holds the service host: the host lock's run and console, or free; None while the host is
    not connected (its line says why)."""
    host = session.config.service.host
    directory = session.config.hosts[host].lock_dir
    where = f"host lock {host}:{directory}/{LOCK_FILE}"
    if session.states()[host].status != "connected":
        return None
    try:
        found = await lock_file(await session.host(host, timeout=5), "read", [directory])
    except Exception as exc:  # noqa: BLE001 - an unsafe path, a lost link: said, never raised from status
        why = getattr(exc, "stderr_tail", None) or str(exc) or type(exc).__name__
        return Text(f"{where}: cannot be read ({why.strip()})", style="yellow")
    if found.get("absent"):
        return Text(f"{where}: free (no run holds {host})")
    try:
        held = json.loads(found["text"])
    except ValueError:
        held = None
    owner = owner_of(held) if isinstance(held, dict) else None
    run_id = held.get("run_id") if isinstance(held, dict) else None
    if owner is None or not isinstance(run_id, str):
        return Text(f"{where}: damaged (not a lock naming a run and its console; file of account "
                    f"{found.get('account', '?')})", style="bold red")
    gone = "; its console is gone (its run's resume takes the lock over)" if owner.alive() is False else ""
    return Text(f"{where}: held by run {run_id} of {owner.describe()} (file of account {found['account']}){gone}",
                style="yellow" if gone else "")


async def snapshot(config: Config, console: Console, runs: RunStore | None = None) -> int:
    """Print one status view; 0 when every host is connected and the service ready, else 1."""
    session = Session(config)
    hold_from_store(session, runs)
    session.start(watch_service=False)
    try:
        await session.wait_first_states()
        *_, held = await asyncio.gather(session.check_service(), session.check_fleet(),
                                        session.wait_first_samples(FIRST_SAMPLE_WAIT_S), lock_line(session))
        console.print(render(session, runs, held), soft_wrap=True)  # an error line stays one line
        fleet_well = session.config.fleet is None or all_serving(session.fleet)
        return 0 if session.all_well() and fleet_well else 1
    finally:
        await session.stop()


async def watch(config: Config, console: Console, runs: RunStore | None = None) -> None:
    """Redraw every second until Ctrl-C; the session checks the service every few seconds.

    Ctrl-C ends the loop through an event, not by cancelling the task: a cancel landing while a
    link is being made can be lost (Python 3.11's wait_for, under asyncssh) and the watch went on
    as if nobody had asked. A second Ctrl-C cancels whatever the ending waits on."""
    ending = asyncio.Event()
    main = asyncio.current_task()

    def ctrl_c() -> None:
        if ending.is_set() and main is not None:
            main.cancel()
        ending.set()

    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGINT, ctrl_c)
    try:
        session = Session(config)
        hold_from_store(session, runs)  # before its first look at the service
        async with session:
            with Live(render(session, runs), console=console, refresh_per_second=4) as live:
                while not ending.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(ending.wait(), REFRESH_S)
                    hold_from_store(session, runs)
                    live.update(render(session, runs))
    finally:
        loop.remove_signal_handler(signal.SIGINT)


def run(args: argparse.Namespace) -> int:
    """`dflash-ops status [--watch]`."""
    runs = RunStore(getattr(args, "runs", None))
    err = Console(stderr=True)
    # During an outage, from any directory: the config of the run that left the service down.
    config = config_for(args.config, runs.left_down(), lambda line: err.print(f"dflash-ops: {line}", soft_wrap=True))
    console = Console()
    if not args.watch:
        return asyncio.run(snapshot(config, console, runs))
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
        asyncio.run(watch(config, console, runs))
    return 0
