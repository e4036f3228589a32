"""The run's claim (console/procedure/claim.py, issue 40 item 7): one console at a time acts on a run.
Many processes taking it at once: exactly one wins; a gone console's claim is taken over, a live
one's never. Over the engine's fakes: a console that finds the run claimed for its give-back waits,
reads the run again, sends nothing and names who gave the memory back and when (exit 0; `r` raises
GivenBack); a give-back that finds the process paused serving again (/ready 200) sends nothing.
(Two real `run --resume` processes racing on the drill: tests/test_give_back_race.py.)"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import subprocess
from pathlib import Path

import pytest

from console.procedure import claim
from console.procedure.engine import EXIT_DOWN, Engine, ResumeRefused
from console.procedure.state import Owner, _proc_start_ticks
from tests.engine_fakes import ScriptedDecider
from tests.engine_sweep import Window
from tests.fake_hosts import FakeHosts


def _take(run_dir: str, barrier: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    barrier.wait()
    try:
        out.put(("took", claim.take(Path(run_dir), Owner.this_process(), claim.GIVING_BACK), os.getpid()))
    except claim.ClaimHeld as exc:
        out.put(("held", exc.holder.pid, os.getpid()))


def test_many_processes_taking_the_claim_at_once_one_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    n = 6
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_take, args=(str(tmp_path), barrier, out)) for _ in range(n)]
    for p in procs:
        p.start()
    answers = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(60)
    took = [a for a in answers if a[0] == "took"]
    assert len(took) == 1 and took[0][1] is True, answers
    winner = took[0][2]
    assert all(a[1] == winner for a in answers if a[0] == "held"), answers  # each loser named the winner
    assert [p.name for p in tmp_path.iterdir()] == [claim.CLAIM]  # no private file left behind


def test_a_gone_consoles_claim_is_taken_over_a_live_ones_never(tmp_path: Path) -> None:
    me = Owner.this_process()
    assert claim.take(tmp_path, me, claim.DRIVING) is True
    assert claim.take(tmp_path, me, claim.DRIVING) is False  # this console's already: not taken twice
    claim.release(tmp_path, me)
    assert claim.holder(tmp_path) is None
    parent = os.getppid()
    live = Owner("bob", me.host, parent, 0.0, _proc_start_ticks(parent))
    (tmp_path / claim.CLAIM).write_text(json.dumps({**live.__dict__, "doing": claim.GIVING_BACK}))
    with pytest.raises(claim.ClaimHeld) as held:
        claim.take(tmp_path, me, claim.DRIVING)
    assert held.value.holder.pid == parent and held.value.doing == claim.GIVING_BACK
    claim.release(tmp_path, me)  # never another console's
    assert claim.holder(tmp_path)[0].pid == parent
    gone = subprocess.Popen(["true"])
    gone.wait()
    dead = Owner("bob", me.host, gone.pid, 0.0, 1)
    (tmp_path / claim.CLAIM).write_text(json.dumps({**dead.__dict__, "doing": claim.GIVING_BACK}))
    assert claim.take(tmp_path, me, claim.GIVING_BACK) is True  # its console is gone: taken over
    assert claim.holder(tmp_path)[0].pid == os.getpid()


async def left_paused(w: Window) -> None:
    """The pause run cancelled once its release answered, `--no-restart`: ended cancelled, exit 3, the
    server paused with its memory released, nobody driving it."""
    box: list[Engine] = []
    engine = Engine(FakeHosts(w.world), w.world.config, w.store.open(w.run_id), ScriptedDecider(w.world.clock),
                    w.store, route="pause", restart_on_failure=False,
                    crash_at=lambda reached: box[0].cancel() if reached == "released" else None)
    box.append(engine)
    finished = await engine.execute()
    assert finished.exit_code == EXIT_DOWN and finished.status == "cancelled", finished
    assert w.state().service.released and not w.world.server.serving()


def claimed_elsewhere(w: Window) -> Owner:
    """Another live console (this test's parent process) claims the run to give the server back."""
    parent = os.getppid()
    other = Owner("bob", Owner.this_process().host, parent, 0.0, _proc_start_ticks(parent))
    (w.store.root / w.run_id / claim.CLAIM).write_text(json.dumps({**other.__dict__, "doing": claim.GIVING_BACK}))
    return other


def gives_back(w: Window, other: Owner) -> None:
    """The other console's give-back: the server resumed and continued, the run saying so, its claim gone."""
    server = w.world.server
    run = w.store.open(w.run_id)
    svc = run.state.service
    server.resume(list(svc.released))
    server.continue_()
    svc.released, svc.paused = [], False
    svc.resumes, svc.continues = svc.resumes + 1, svc.continues + 1
    svc.continued_at, svc.given_back_by = 1_800_000_000.0, other.who()
    run.save()
    (w.store.root / w.run_id / claim.CLAIM).unlink()


@pytest.mark.parametrize("how", ["run --resume", "r"])
async def test_a_console_that_loses_the_claim_waits_and_names_who_gave_the_memory_back(window: Window,
                                                                                        how: str) -> None:
    window.route = "pause"
    await left_paused(window)
    other = claimed_elsewhere(window)
    hosts = FakeHosts(window.world)
    waiting = asyncio.Event()
    hosts.bus.subscribe(lambda m: waiting.set() if "is claimed by bob@" in str(getattr(m, "message", "")) else None)
    engine = Engine(hosts, window.world.config, window.store.open(window.run_id), ScriptedDecider(window.world.clock),
                    window.store, route="pause")
    task = asyncio.ensure_future(engine.execute() if how == "run --resume" else
                                 engine.restart_service("the operator asked for it"))
    await asyncio.wait_for(waiting.wait(), 30)
    assert not task.done()
    gives_back(window, other)
    said = f"run {window.run_id}'s memory was given back by {other.who()} at "
    if how == "r":
        with pytest.raises(claim.GivenBack, match=f"{said}.*: nothing to do"):
            await task
    else:
        finished = await task
        assert finished.exit_code == 0 and finished.service_up and said in finished.message, finished
    server = window.world.server
    assert server.count("resume_memory_occupation") == 1 and server.count("continue_generation") == 1
    assert server.serving() and not server.violations
    assert not (window.store.root / window.run_id / claim.CLAIM).exists()


async def test_a_give_back_that_finds_the_paused_process_serving_sends_nothing(window: Window) -> None:
    window.route = "pause"
    await left_paused(window)
    server = window.world.server
    server.resume(sorted(server.released))  # given back by hand, outside any console
    server.continue_()
    finished = await window.console()
    assert finished is not None and finished.service_up and finished.exit_code != EXIT_DOWN, finished
    assert server.count("resume_memory_occupation") == 1 and server.count("continue_generation") == 1
    assert server.serving() and not server.violations
    state = window.state()
    assert not state.service.held and state.service.resumes == 0 and state.service.continues == 0
    journal = (window.store.root / window.run_id / "journal.jsonl").read_text()
    assert "answers /ready 200 (it takes requests)" in journal and "nothing is resumed or continued" in journal


async def test_a_claim_held_by_a_console_driving_the_run_refuses_at_once_and_a_wait_can_be_cancelled(
        window: Window) -> None:
    window.route = "pause"
    await left_paused(window)
    other = claimed_elsewhere(window)
    path = window.store.root / window.run_id / claim.CLAIM
    path.write_text(json.dumps({**other.__dict__, "doing": claim.DRIVING}))
    engine = Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                    ScriptedDecider(window.world.clock), window.store, route="pause")
    with pytest.raises(ResumeRefused, match=f"claimed by {other.who()} .*driving the run.*nothing was written or sent"):
        await engine.execute()
    path.write_text(json.dumps({**other.__dict__, "doing": claim.GIVING_BACK}))
    hosts = FakeHosts(window.world)
    waiting = asyncio.Event()
    hosts.bus.subscribe(lambda m: waiting.set() if "is claimed by bob@" in str(getattr(m, "message", "")) else None)
    engine = Engine(hosts, window.world.config, window.store.open(window.run_id), ScriptedDecider(window.world.clock),
                    window.store, route="pause")
    task = asyncio.ensure_future(engine.execute())
    await asyncio.wait_for(waiting.wait(), 30)
    engine.cancel()  # Ctrl-C while it waits
    with pytest.raises(ResumeRefused, match="cancelled while .* nothing was written or sent"):
        await task
    assert window.world.server.count("resume_memory_occupation") == 0 and window.state().service.held
    assert claim.holder(path.parent)[0].pid == other.pid, "the other console's claim stands"
