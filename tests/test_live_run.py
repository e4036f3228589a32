"""Watching and owning a live run, on the drill with real consoles (processes) killed for real:
any console follows a run another one drives (steps, jobs, DOWN timer, owner); one run per
inference host at a time (the host-side lock); a killed console's run is offered, never a new one
over a server it left down, and never under another route."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

from console import messages as m
from console.operator import Operator
from console.procedure.engine import EXIT_DONE, LOCK_FILE
from console.procedure.follower import RunFollower
from console.procedure.store import RunStore, RunSummary
from tests.small_fs import fill, small_filesystem
from tests.window_fixtures import Drill, drill, kill  # noqa: F401 - the fixture

EXIT_USAGE = 2


def lock_path(d: Drill) -> Path:
    return Path(d.config.hosts["ct129"].lock_dir) / LOCK_FILE


async def test_a_second_console_follows_the_run_and_a_second_run_is_refused(drill: Drill) -> None:  # noqa: F811
    console = drill.start_cli("run", "--headless", "--yes")
    operator = Operator(drill.config, runs_dir=drill.runs, read_only=True)
    seen: list = []
    stop_done, bars, exited = asyncio.Event(), asyncio.Event(), asyncio.Event()

    def watch(message) -> None:
        seen.append(message)
        if isinstance(message, m.StepUpdate) and message.step == "stop" and message.status == "done":
            stop_done.set()
        if isinstance(message, m.JobProgress) and message.worker in ("extract", "completions"):
            bars.set()
        if isinstance(message, m.JobExit) and message.worker.startswith("extract"):
            exited.set()

    operator.bus.subscribe(watch)
    operator.start()
    follower = asyncio.create_task(RunFollower(operator.store, operator.bus, operator.session, interval=0.2).run())
    try:
        await asyncio.to_thread(drill.wait_journal, lambda e: e["message"].startswith("preflight: done"), 240,
                                console)
        # One run per inference host: a second run meets the first one's lock, naming it.
        run_id = RunStore(drill.runs).run_ids()[0]
        second = await asyncio.to_thread(drill.run_cli, "run", "--headless", "--yes")
        # Refused before anything is written or sent (issue 27, items 1 and 8), naming who drives it.
        assert second.returncode == EXIT_USAGE, second.stdout + second.stderr
        said = " ".join(second.stderr.split())
        assert f"run {run_id} is in progress" in said and f"pid {console.pid}" in said
        assert RunStore(drill.runs).run_ids() == [run_id]
        async with asyncio.timeout(240):
            await stop_done.wait()
            await bars.wait()
        # Issue 27, item 1: its resume (and `status`) from a second console while the first one lives.
        # Refused before anything is written or sent: the owner and the host lock stay the first's.
        state_file = drill.runs / run_id / "state.json"
        lock_before = lock_path(drill).read_bytes()
        resume = await asyncio.to_thread(drill.run_cli, "run", "--headless", "--yes", "--resume", run_id)
        assert resume.returncode == EXIT_USAGE, resume.stdout + resume.stderr
        said = " ".join(resume.stderr.split())
        assert "driven by" in said and f"pid {console.pid}" in said and "nothing was written or sent" in said
        assert json.loads(state_file.read_text())["owner"]["pid"] == console.pid
        assert lock_path(drill).read_bytes() == lock_before
        status = await asyncio.to_thread(drill.run_cli, "status")
        assert "--resume" not in status.stdout and f"pid {console.pid}" in " ".join(status.stdout.split()), status.stdout
        live = [x for x in seen if isinstance(x, m.LiveRun)]
        assert live and live[-1].run_id == run_id and f"pid {console.pid}" in live[-1].owner and not live[-1].ours
        assert any(isinstance(x, m.Downtime) and x.run_id == run_id and x.down_since for x in seen)
        assert any(isinstance(x, m.JournalEntry) and x.run_id == run_id for x in seen)
        # The extractor's last events are relayed to its exit, even once its step has ended: never
        # left showing "waiting for the go" after the run (the tmux walk of a read-only console).
        async with asyncio.timeout(240):
            await exited.wait()
    finally:
        follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await follower
        await operator.stop()
    out, _ = await asyncio.to_thread(console.communicate, timeout=300)
    assert console.returncode == EXIT_DONE, out
    assert not lock_path(drill).exists()  # released once the run finished with the service up
    # Held until the run ended (item 2), not released at the ready moment: a second run could
    # otherwise stop the service during the evaluation and offer to end its evaluator.
    said = [e["message"] for e in drill.journal()]
    released = [i for i, line in enumerate(said) if line.startswith("released the host lock")]
    assert len(released) == 1 and released[0] > max(i for i, line in enumerate(said) if line.startswith("evaluate: done"))


def test_a_killed_consoles_run_comes_first_and_keeps_its_route(drill: Drill) -> None:  # noqa: F811
    console = drill.start_cli("run", "--headless", "--yes")
    drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
    kill(console)
    store = RunStore(drill.runs)
    (summary,) = store.summaries()
    assert isinstance(summary, RunSummary) and summary.console_gone and summary.service_down
    # A new run would start from a server that is down: refused, naming the run that left it down.
    fresh = drill.run_cli("run", "--headless", "--yes")
    assert fresh.returncode == EXIT_USAGE and f"run {summary.run_id} left the service down" in fresh.stderr
    # A resume keeps the route the run was made for.
    other = drill.run_cli("run", "--headless", "--yes", "--resume", summary.run_id, "--route", "zero-downtime")
    assert other.returncode == EXIT_USAGE and "a resume keeps its route" in other.stderr
    assert len(store.run_ids()) == 1
    held = json.loads(lock_path(drill).read_text())
    assert held["run_id"] == summary.run_id and held["pid"] == console.pid
    resumed = drill.run_cli("run", "--headless", "--yes", "--resume")
    assert resumed.returncode == EXIT_DONE, resumed.stdout + resumed.stderr
    state = store.open(summary.run_id).state
    assert state.status == "done" and state.service.stops == 1 and state.service.starts == 1
    assert any("taking over the lock of this run's earlier console" in e["message"] and "its console is gone" in e["message"]
               for e in drill.journal())
    assert not lock_path(drill).exists()
    # A finished run is never run again.
    again = drill.run_cli("run", "--headless", "--yes", "--resume", summary.run_id)
    assert again.returncode == EXIT_USAGE and "a finished run is never resumed" in again.stderr
    assert store.open(summary.run_id).state.service.stops == 1


def test_a_resume_with_the_run_store_on_a_full_disk_brings_the_service_back(drill: Drill, tmp_path: Path) -> None:  # noqa: F811
    """Issue 27, item 12: the console killed with the service down; the run store's disk is full when
    `run --resume` comes. Its first save used to end it there (exit 2, the service left down). It
    goes on instead, saying once what it cannot write: the service back, our jobs ended, the lock
    released."""
    with small_filesystem(tmp_path / "small", size_kib=16384) as mount:
        store = Drill(drill.dir, drill.config_path, mount / "runs")
        console = store.start_cli("run", "--headless", "--yes")
        store.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
        kill(console)
        assert store.service_pid() is None
        fill(mount)
        resumed = store.run_cli("run", "--headless", "--yes", "--resume")
        on_disk = RunStore(mount / "runs").open(store.only_run()[0]).state
    assert resumed.returncode not in (2, 3), resumed.stdout + resumed.stderr
    assert "Traceback" not in resumed.stderr
    assert "No space left on device" in resumed.stderr and "the run goes on" in resumed.stderr
    assert store.service_pid() is not None, "the service was left down"
    assert not lock_path(drill).exists()
    for key, job in on_disk.jobs.items():  # the killed console's jobs: none left running
        pid = (job.handle or {}).get("pid")
        if pid and not key.startswith(("probe-", "provenance-", "check")):
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower() \
                or "remote." not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"), (key, pid)
