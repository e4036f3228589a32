"""Issue 27, items 8 and 9: an unfinished run comes before any new window, and the recovery commands
find their config from the run store.

Through the installed entry point against two real SSH hosts (embedded servers on loopback); the
runs are written by the store itself, as the engine writes them, with an owner that is a real
process that has ended (a console killed)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.config import load_config
from console.procedure.state import JobRecord, Owner, current_user
from console.procedure.store import Run, RunStore
from tests.cli_hosts import ThreadedHosts, write_config

ENTRY_POINT = str(Path(sys.executable).parent / "dflash-ops")


def dflash_ops(*args: str, cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "400"}
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL, cwd=cwd)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ThreadedHosts]:
    rig = ThreadedHosts(tmp_path_factory.mktemp("hosts"), ["ct129", "ct200"])
    try:
        yield rig
    finally:
        rig.close()


@pytest.fixture
def config(hosts: ThreadedHosts, tmp_path: Path) -> Path:
    (tmp_path / "conf").mkdir()
    return write_config(tmp_path / "conf" / "dflash-ops.toml",
                        {name: hosts.host_table(name) for name in hosts.servers})


def gone_console() -> Owner:
    """The owner of a console that was killed: a real process, ended."""
    proc = subprocess.Popen(["sleep", "30"])
    with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    proc.kill()
    proc.wait()
    return Owner(current_user(), os.uname().nodename, proc.pid, time.time() - 60, ticks)


def quit_mid_run(store: RunStore, config: Path) -> Run:
    """What `w` (quit, leave the run) left: extraction done, evaluation not, the service ready again."""
    run = store.create(str(config.resolve()), None)
    state = run.state
    state.started, state.route, state.owner = True, "window", gone_console()
    for step in ("preflight", "stage", "cache", "stop", "free-vram", "extract", "restart"):
        state.step(step).status = "done"
    state.service.stops = state.service.starts = 1
    state.service.stopped_at, state.service.ready_at = time.time() - 50, time.time() - 30
    state.jobs["evaluate"] = JobRecord(f"{run.run_id}-evaluate", "ct200", "evaluate",
                                       handle={"host": "ct200", "pid": 4242, "run_dir": "/w/runs/x-evaluate"})
    run.save()
    return run


def test_a_new_run_is_refused_while_an_unfinished_one_waits_and_discard_says_what_it_leaves(
        config: Path, hosts: ThreadedHosts, tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs")
    old = quit_mid_run(store, config)
    fresh = dflash_ops("run", "--headless", "--yes", "--config", str(config), "--runs", str(store.root))
    assert fresh.returncode == 2, fresh.stdout + fresh.stderr
    assert f"unfinished run {old.run_id}: resume / discard" in fresh.stderr
    assert f"`dflash-ops run --resume {old.run_id}` continues it" in fresh.stderr
    assert f"`dflash-ops run --discard {old.run_id}` discards it" in fresh.stderr
    assert store.run_ids() == [old.run_id]  # no new run, nothing sent to the hosts
    assert store.open(old.run_id).state.status == "running"

    gone = dflash_ops("run", "--discard", "--config", str(config), "--runs", str(store.root))
    assert gone.returncode == 0, gone.stdout + gone.stderr
    out = " ".join(gone.stdout.split())
    assert f"discarded run {old.run_id}" in out
    assert f"job evaluate ({old.run_id}-evaluate) on ct200: pid 4242, maybe still running" in out
    assert "/w/runs/x-evaluate" in out
    for name in ("ct129", "ct200"):
        assert f"its window files on {name}: {hosts.workdir(name)}/windows/{old.run_id}" in out
    lock_dir = load_config(config).hosts["ct129"].lock_dir  # the config's own: named whole
    assert f"the host lock ct129:{lock_dir}/dflash-ops.lock if it still names this run" in out
    state = store.open(old.run_id).state
    assert state.status == "discarded" and "left on the hosts" in (state.message or "")
    assert any("discarded by" in e["message"] for e in store.open(old.run_id).read_journal())
    # Discarded: never offered, never resumed, and no longer in a new run's way.
    assert store.latest_unfinished() is None
    again = dflash_ops("run", "--headless", "--yes", "--resume", old.run_id, "--config", str(config),
                       "--runs", str(store.root))
    assert again.returncode == 2 and "a finished run is never resumed" in again.stderr


def test_discard_refuses_a_run_that_left_the_service_down_or_that_a_live_console_drives(
        config: Path, tmp_path: Path) -> None:
    store = RunStore(tmp_path / "runs")
    down = quit_mid_run(store, config)
    down.state.service.down, down.state.service.ready_at = True, None
    down.save()
    refused = dflash_ops("run", "--discard", down.run_id, "--config", str(config), "--runs", str(store.root))
    assert refused.returncode == 2 and "left the service down" in refused.stderr
    assert f"`dflash-ops run --resume {down.run_id}` restarts the service" in refused.stderr
    down.state.service.down = False
    down.state.owner = Owner.this_process()  # this test's process: a live console
    down.save()
    driven = dflash_ops("run", "--discard", down.run_id, "--config", str(config), "--runs", str(store.root))
    assert driven.returncode == 2 and f"pid {os.getpid()}" in driven.stderr and "not discarded" in driven.stderr
    assert store.open(down.run_id).state.status == "running"


def test_the_console_opens_on_the_unfinished_run_never_on_a_new_one(config: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """`run` and `drill` on a terminal open the console: with an unfinished run in the store it must
    open on the offer (resume / discard), never on a new run made before the screen opened."""
    from console import runner as cmd_run
    from console.config import load_config
    from console.operator import Operator
    from screens.app import ConsoleApp

    store = RunStore(tmp_path / "runs")
    old = quit_mid_run(store, config)
    opened: list[ConsoleApp] = []
    monkeypatch.setattr(ConsoleApp, "run", lambda app, *a, **k: opened.append(app) or 0)
    operator = Operator(load_config(config), runs_dir=str(store.root))
    assert cmd_run.open_console(operator, None) == 0
    (app,) = opened
    assert app.resume is None and operator.unfinished_run() == old.run_id  # the app offers it first
    assert store.run_ids() == [old.run_id]


def test_a_run_records_its_config_path_and_resume_and_status_find_it_from_anywhere(
        config: Path, tmp_path: Path) -> None:
    """Item 9: during an outage, in a directory without dflash-ops.toml, `status` and `run --resume`
    use the config the run was made with (its absolute path), saying so."""
    store = RunStore(tmp_path / "runs")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # A run made from the config's directory by its relative name records the absolute path.
    made = dflash_ops("run", "--plan", "--config", "dflash-ops.toml", "--runs", str(store.root), cwd=config.parent)
    assert "no such file" not in made.stderr
    left = quit_mid_run(store, config)
    left.state.status, left.state.service.down, left.state.service.ready_at = "failed", True, None
    left.save()
    status = dflash_ops("status", "--runs", str(store.root), cwd=elsewhere)
    assert "no such file" not in status.stderr, status.stderr
    assert f"using the config of run {left.run_id}: {config.resolve()}" in " ".join(status.stderr.split())
    assert f"stopped by run {left.run_id}" in status.stdout
    assert "`dflash-ops run --resume` continues it" not in status.stdout  # finished: it only restarts
    # The resume goes as far as the engine (which refuses another route: nothing is done on the hosts).
    resume = dflash_ops("run", "--headless", "--yes", "--resume", "--route", "zero-downtime", "--runs", str(store.root),
                        cwd=elsewhere)
    assert resume.returncode == 2 and "a resume keeps its route" in resume.stderr, resume.stderr
    assert f"using the config of run {left.run_id}: {config.resolve()}" in " ".join(resume.stderr.split())
    assert "no such file" not in resume.stderr, resume.stderr


def test_a_plan_leaves_no_run_behind_not_even_while_it_runs(config: Path, tmp_path: Path) -> None:
    """`run --plan` keeps no run in the store, at any moment: another console, `runs` or a resume
    would take one for an unfinished run (a plan killed half-way left one "running" for good)."""
    store = tmp_path / "runs"
    plan = subprocess.Popen([ENTRY_POINT, "run", "--plan", "--config", str(config), "--runs", str(store)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    seen: set[str] = set()
    while plan.poll() is None:
        seen |= set(RunStore(store).run_ids())
        time.sleep(0.01)
    seen |= set(RunStore(store).run_ids())
    assert seen == set()
