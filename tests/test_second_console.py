"""A second console, the host lock and a full disk, over the engine's fakes (issue 27: items 1, 2 and
12, and a signal during the lock's release), where the timing must be exact.

The class of the defect, swept: at every crash point the console dies, and a second console then
meets (a) the run still owned by a live console (or one on another machine: cannot be told), or (b)
the host lock held by another live console's run. Either way it is refused before it changes
anything: no owner written, no host call at all in (a); in (b) no job ended, no service command, the
other console's lock kept. Once that console is gone the next one ends with every promise.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import console.procedure.engine as engine_module
from console.procedure.engine import CRASH_POINTS, EXIT_DOWN, LOCK_FILE, Engine, ResumeRefused
from console.procedure.state import Owner, current_user
from console.procedure.store import RunStore
from tests.engine_fakes import INFERENCE, Producers, ScriptedDecider
from tests.engine_sweep import Crasher, Window, assert_promises, make_window
from tests.fake_hosts import FakeHosts
from tests.small_fs import fill, small_filesystem


@pytest.fixture
def other_console() -> Iterator[Owner]:
    """Another console that runs: a real live process, named by pid and start ticks."""
    proc = subprocess.Popen(["sleep", "300"])
    with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    yield Owner(current_user(), os.uname().nodename, proc.pid, time.time() - 60, ticks)
    proc.kill()
    proc.wait()


def lock_of(w: Window) -> Path:
    return Path(w.world.config.hosts[INFERENCE].lock_dir) / LOCK_FILE


def jobs_seen(w: Window) -> list[tuple[str, str]]:
    return [(j.handle.job_id, j.state) for j in w.world.job_order]


# --- (a) the run's owner is alive ------------------------------------------------------------------------


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_a_run_another_live_console_owns_is_refused_before_anything(window: Window, point: str,
                                                                          other_console: Owner) -> None:
    assert await window.console(Crasher(point)) is None
    run = window.store.open(window.run_id)
    for owner in (other_console, Owner("op", "another-machine", 4242, time.time())):  # alive; cannot be told
        run.state.owner = owner
        run.save()
        state_before = (window.store.root / window.run_id / "state.json").read_bytes()
        journal_before = run.read_journal()
        lock_before = lock_of(window).read_bytes() if lock_of(window).exists() else None
        commands, jobs = list(window.world.service.commands), jobs_seen(window)
        with pytest.raises(ResumeRefused, match=f"driven by {owner.user}@{owner.host} pid {owner.pid}") as refused:
            await window.console()
        assert "nothing was written or sent" in str(refused.value)
        if owner.host == "another-machine":
            assert "cannot tell from here whether it still runs" in str(refused.value)
        # `r` goes through the same engine: refused the same way.
        with pytest.raises(ResumeRefused):
            Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                   ScriptedDecider(window.world.clock), window.store)
        assert (window.store.root / window.run_id / "state.json").read_bytes() == state_before
        assert window.store.open(window.run_id).read_journal() == journal_before
        assert (lock_of(window).read_bytes() if lock_of(window).exists() else None) == lock_before
        assert window.world.service.commands == commands and jobs_seen(window) == jobs
    # That console gone (it was killed), this one resumes and keeps every promise.
    run.state.owner = Owner(current_user(), os.uname().nodename, os.getpid(), time.time(), None)
    run.save()
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    assert_promises(window, finished)


# --- (b) the host lock is held by another live console's run ---------------------------------------------


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_a_host_lock_another_live_console_holds_is_never_touched(window: Window, point: str,
                                                                       other_console: Owner) -> None:
    assert await window.console(Crasher(point)) is None
    theirs = json.dumps({"run_id": "20261201-000000-0ther", **other_console.__dict__})
    lock_of(window).parent.mkdir(exist_ok=True)
    lock_of(window).write_text(theirs)
    commands, jobs = list(window.world.service.commands), jobs_seen(window)
    ended = list(window.world.ended)
    refused = await window.console()
    assert refused.status == "failed" and "20261201-000000-0ther" in refused.message
    assert f"pid {other_console.pid}" in refused.message, refused.message
    assert lock_of(window).read_text() == theirs, "the other console's lock was touched"
    assert window.world.service.commands == commands, "the service was stopped or started under another run"
    assert jobs_seen(window) == jobs and window.world.ended == ended, "a job was ended"
    if window.state().service.down:
        assert refused.exit_code == EXIT_DOWN and window.store.left_down().run_id == window.run_id
    assert window.state().status == "running", "the refused resume left the run other than as it was"
    # The other run over (its lock gone), the next console resumes this one to the end.
    lock_of(window).unlink()
    finished = await window.until_finished([])
    assert finished.exit_code == 0, finished.message
    assert_promises(window, finished)
    assert not lock_of(window).exists()


# --- the lock itself ---------------------------------------------------------------------------------------


class Interleaving(FakeHosts):
    """A host whose every file and command call lets the other console run in between (the link's
    round trip), so that two consoles' lock takes interleave as over SSH."""

    async def read_text(self, host: str, path: str) -> str:
        await asyncio.sleep(0)
        return await super().read_text(host, path)

    async def write_text(self, host: str, path: str, text: str) -> None:
        await asyncio.sleep(0)
        await super().write_text(host, path, text)

    async def run(self, host: str, argv: list[str], timeout: float | None = None) -> None:
        await asyncio.sleep(0)
        await super().run(host, argv, timeout)

    async def lock_file(self, host: str, op: str, args: list[str]) -> dict:
        await asyncio.sleep(0)
        return await super().lock_file(host, op, args)


async def test_two_consoles_starting_together_cannot_both_take_the_lock(tmp_path: Path, producers: Producers,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    w = make_window(tmp_path, producers, monkeypatch)
    first, second = w.store.open(w.run_id), w.store.create(str(w.world.config.source), None)
    consoles = {}  # each engine's console: live processes, one each

    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(2)]
    try:
        owners = []
        for proc in procs:
            with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
                ticks = int(f.read().rsplit(")", 1)[1].split()[19])
            owners.append(Owner(current_user(), os.uname().nodename, proc.pid, time.time(), ticks))

        class Consoles:  # Owner.this_process as each engine's own console
            @staticmethod
            def this_process() -> Owner:
                return consoles[asyncio.current_task().get_name()]

        monkeypatch.setattr(engine_module, "Owner", Consoles)
        engines = [Engine(Interleaving(w.world), w.world.config, run, ScriptedDecider(w.world.clock), w.store)
                   for run in (first, second)]
        tasks = []
        for name, engine, owner in zip(("one", "two"), engines, owners, strict=True):
            consoles[name] = owner
            tasks.append(asyncio.create_task(engine.execute(), name=name))
        results = await asyncio.gather(*tasks)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    statuses = sorted(r.status for r in results)
    assert statuses == ["done", "failed"], [r.message for r in results]
    loser = next(r for r in results if r.status == "failed")
    winner = next(r for r in results if r.status == "done")
    assert f"driven by run {winner.run_id}" in loser.message and "one run per inference host" in loser.message
    assert w.world.service.stop_commands == 1 and w.world.service.start_commands == 1
    assert not lock_of(w).exists()


async def test_the_lock_is_held_until_the_run_ends(window: Window) -> None:
    """Not released at the ready moment: during the evaluation and the report a second run must
    not stop the service, nor offer to end this run's evaluator."""
    seen: dict[str, str | None] = {}

    def look(point: str) -> None:
        seen[point] = json.loads(lock_of(window).read_text())["run_id"] if lock_of(window).exists() else None

    engine = Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                    ScriptedDecider(window.world.clock), window.store, crash_at=look)
    finished = await engine.execute()
    assert finished.exit_code == 0, finished.message
    assert seen["ready"] == seen["evaluated"] == seen["reported"] == window.run_id, seen
    assert not lock_of(window).exists()


@pytest.mark.parametrize("text", ["[]", "null", '"ct129"', "7", "{}", '{"run_id": 7}', "{not json", ""])
async def test_a_damaged_lock_is_named_never_taken_for_a_crash(window: Window, text: str) -> None:
    lock_of(window).parent.mkdir(exist_ok=True)
    lock_of(window).write_text(text)
    finished = await window.console()
    assert finished.status == "failed" and window.state().steps["preflight"].status == "failed"
    assert f"the host lock {INFERENCE}:{lock_of(window)} is damaged" in finished.message, finished.message
    assert "AttributeError" not in finished.message and "Traceback" not in finished.message
    assert lock_of(window).read_text() == text  # not taken over, not removed
    assert window.world.service.stop_commands == 0


async def test_a_signal_during_the_locks_release_does_not_escape_the_runs_end(window: Window) -> None:
    """SIGINT (Engine.cancel, as the signal guard calls it) lands while the lock is being released:
    the run still finishes (its state not left "running"), the lock released, no exception."""
    box: list[Engine] = []

    class Releasing(FakeHosts):
        async def lock_file(self, host: str, op: str, args: list[str]) -> dict:
            if op == "remove" and window.state().steps.get("report") is not None \
                    and window.state().steps["report"].status == "done":
                box[0].cancel()  # the signal comes now; the release's answer is still on its way
                await asyncio.sleep(0)
            return await super().lock_file(host, op, args)

    engine = Engine(Releasing(window.world), window.world.config, window.store.open(window.run_id),
                    ScriptedDecider(window.world.clock), window.store)
    box.append(engine)
    finished = await engine.execute()
    assert finished.status == "done" and finished.exit_code == 0, finished.message
    assert window.state().status == "done"
    assert not lock_of(window).exists()
    assert any("interrupted while releasing the host lock" in e["message"]
               for e in window.store.open(window.run_id).read_journal())


# --- a full disk (item 12): the run store on a real small filesystem, filled at an exact moment ---------


async def filled_at(w: Window, mount: Path, point: str):
    """One console whose run store's disk fills up the moment it reaches `point`."""
    engine = Engine(FakeHosts(w.world), w.world.config, w.store.open(w.run_id), ScriptedDecider(w.world.clock),
                    w.store, crash_at=lambda reached: fill(mount) if reached == point else None)
    return await engine.execute()


def on_small_store(w: Window, mount: Path) -> None:
    """The window's run store moved onto the small filesystem (the hosts' files stay where they are)."""
    w.store = RunStore(mount / "runs")
    w.run_id = w.store.create(str(w.world.config.source), None).run_id


async def test_a_full_disk_before_the_stop_ends_the_staged_worker_and_releases_the_lock(window: Window,
                                                                                        tmp_path: Path) -> None:
    with small_filesystem(tmp_path / "small", size_kib=4096) as mount:
        on_small_store(window, mount)
        finished = await filled_at(window, mount, "staged")
    assert finished is not None and finished.status == "failed", finished
    assert "No space left on device" in finished.message, finished.message
    assert window.world.service.stop_commands == 0
    assert not any(j.state == "running" for j in window.world.job_order), "a job of ours was left running"
    staged = [j for j in window.world.extraction_jobs() if j.kind == "extract-staged"]
    assert staged and staged[0].exit_code == 143, "the staged worker was not ended"
    assert not lock_of(window).exists()


@pytest.mark.parametrize("point", ["stop-ran", "go", "gpu-released"])
async def test_a_full_disk_after_the_stop_never_leaves_the_service_down(window: Window, tmp_path: Path,
                                                                        point: str) -> None:
    with small_filesystem(tmp_path / "small", size_kib=4096) as mount:
        on_small_store(window, mount)
        finished = await filled_at(window, mount, point)
    assert finished is not None and finished.exit_code != EXIT_DOWN, finished
    assert window.world.service.state == "active" and window.world.service.ready
    assert window.world.service.stop_commands == 1 and window.world.service.start_commands == 1
    assert not any(j.state == "running" for j in window.world.job_order)
    assert not lock_of(window).exists()


async def test_a_resume_on_a_full_disk_restarts_the_service(window: Window, tmp_path: Path) -> None:
    """The console died after the stop; the store's disk is full when the next one resumes: its first
    save must not end it there (exit 2, the service down)."""
    with small_filesystem(tmp_path / "small", size_kib=4096) as mount:
        on_small_store(window, mount)
        assert await window.console(Crasher("stop-ran")) is None
        fill(mount)
        finished = await window.console()
    assert finished is not None and finished.exit_code != EXIT_DOWN, finished
    assert window.world.service.state == "active" and window.world.service.start_commands == 1
    assert not any(j.state == "running" for j in window.world.job_order)
    assert not lock_of(window).exists()


# --- the staged worker's lease ----------------------------------------------------------------------------


def test_a_staged_worker_whose_console_is_gone_ends_itself(tmp_path: Path) -> None:
    """The worker's own wait (remote.extract): a lease renewed lately keeps it waiting for the go;
    one not renewed for longer than the stated time ends it, freeing the weights."""
    from remote.events import EventWriter, WorkerError
    from remote.extract import Lease, wait_for_file, wait_for_go

    events = EventWriter(str(tmp_path / "events.jsonl"))
    lease, go = tmp_path / "lease", tmp_path / "go"
    lease.touch()
    go.touch()
    assert wait_for_go(str(go), events, Lease(str(lease), 600.0)) >= 0  # renewed: the go is taken
    go.unlink()
    os.utime(lease, (time.time() - 601, time.time() - 601))  # the console last renewed it 601 s ago
    with pytest.raises(WorkerError, match=r"lease ran out: .*lease not renewed for 60\d s \(over 600 s\)"):
        wait_for_go(str(go), events, Lease(str(lease), 600.0))
    with pytest.raises(WorkerError, match="lease ran out"):
        wait_for_file(str(tmp_path / "completions.json"), str(go), events, Lease(str(lease), 600.0))


async def test_the_console_holds_the_staged_workers_lease_while_it_runs(window: Window) -> None:
    from console.procedure.steps.extraction import STAGE_LEASE_S

    assert await window.console(Crasher("staged")) is None
    (staged,) = window.world.extraction_jobs()
    lease = staged.arg("--lease-file")
    assert lease is not None and float(staged.arg("--lease-s")) == STAGE_LEASE_S
    assert Path(lease).is_file()
    os.utime(lease, (0, 0))
    finished = await window.console()  # the resume finds it alive and renews its lease at once
    assert finished.exit_code == 0, finished.message
    assert Path(lease).stat().st_mtime > 0


# --- what every view advises ------------------------------------------------------------------------------


@pytest.mark.parametrize("left", ["down", "paused", "drained"])
def test_status_never_advises_a_resume_of_a_run_another_live_console_drives(tmp_path: Path, other_console: Owner,
                                                                            left: str) -> None:
    """`status` (and the notifier, `run`, the console: one `what_next`) while another console's window
    has the service down, the server paused or a replica drained: who drives it, never `--resume`."""
    from console.cli.status import downtime_line

    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    state = run.state
    state.started, state.status, state.route, state.owner = True, "running", "window", other_console
    service = state.service
    service.stopped_at = service.paused_at = time.time() - 30
    service.down, service.paused = left == "down", left == "paused"
    service.drained = {"replica": "r1", "router": "http://router", "since": time.time()} if left == "drained" else None
    run.save()
    said = " ".join(downtime_line(store).plain.split())
    assert "--resume" not in said, said
    assert f"run {run.run_id} is running, driven by {other_console.describe()}" in said
    assert "dflash-ops console --read-only" in said
