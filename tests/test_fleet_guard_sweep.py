"""The fleet degraded while a replica is out, over the whole engine (issue 41 section 2): the sweep's
fake world (tests/engine_fakes.py) with r1 and r2 behind the router's fake (tests/fake_router.py;
the guard against SGLang's real router and rehearsal servers: tests/test_fleet_guard.py).

r2 falls (the router lists it unhealthy) or the router goes down and comes back restarted, in the
middle of r1's extraction or of its drain. The operator's yes (the `--yes` default) ends the window
early: the extraction stops after the prompt in hand, the server comes back, r1 rejoins, and the run
ends paused saying why; once r2 is back, `run --resume` extracts only the missing prompts on the next
replica. A no lets the window go on. Crossed with a console's death at each point of the window: every
replica ends in the router, each drain with its rejoin, and no prompt is extracted twice."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from console.messages import FleetAtRisk
from console.notify.events import Watcher
from console.procedure.engine import EXIT_DONE, EXIT_PAUSED
from console.procedure.steps import fleet_guard
from remote.extract_check import PARTIAL_MANIFEST
from tests.engine_fakes import INFERENCE, ScriptedDecider
from tests.engine_sweep import Crasher, Window
from tests.fake_router import R2, FakeRouter
from tests.test_fleet_sweep import ROUTER, two_windows

DEADLINE_S = 30.0
UNHEALTHY = f"the router {ROUTER} lists no healthy worker: the requests through it fail"  # r2 fallen, r1 out
ROUTER_DOWN = f"the router {ROUTER} cannot be read: router fake: connection refused (the router is down)"


def guarded(tmp_path: Path, producers: Any, monkeypatch: pytest.MonkeyPatch) -> tuple[Window, FakeRouter]:
    """The fleet window whose next window (after an early end) goes to the next replica, as `run`
    chooses it; the extractor goes prompt by prompt (its stop file read before each), with no budget."""
    w, router = two_windows(tmp_path, producers, monkeypatch)
    w.world.budget_prompts = 99
    monkeypatch.setattr(fleet_guard, "WATCH_S", 0.01)
    return w, router


async def until(check: Any, what: str) -> None:
    ends = time.monotonic() + DEADLINE_S
    while not check():
        if time.monotonic() > ends:
            raise AssertionError(f"not within {DEADLINE_S:g} s: {what}")
        await asyncio.sleep(0.01)


def journal_said(w: Window) -> list[str]:
    return [e["message"] for e in w.store.open(w.run_id).read_journal()]


def said_at_risk(w: Window) -> bool:
    return any(said.startswith("THE FLEET IS AT RISK") for said in journal_said(w))


def ended(w: Window) -> bool:
    return w.state().service.ended_early is not None


def offered(w: Window) -> bool:
    return any(c.step == "fleet" for d in w.deciders for c in d.asked)


def fault_mid_extraction(w: Window, router: FakeRouter, fault: str, answered: Any = ended, at: str = "forward",
                         seen_back: Any = None) -> None:
    """At the extraction's first prompt (once, whichever console reaches it): r2 falls ("flap": and
    comes back once the operator answered) or the router goes down ("restart": and comes back
    restarted, listing r2 alone); the extractor goes on only once the operator answered, and, with
    `seen_back`, once the console has seen r2 back (its watch's pace never races the window's end)."""
    point = w.world.point
    fired: list[bool] = []

    async def hooked(job: Any, name: str) -> None:
        await point(job, name)
        if name != at or fired:
            return
        fired.append(True)
        if at == "gpu_released":  # the console has seen the release (its state says so) before the fall
            await until(lambda: w.state().extraction.gpu_released_at is not None, "the release seen")
        if fault == "flap":
            router.sick.add(R2)
            await until(lambda: answered(w), "the operator's answer")
            router.sick.discard(R2)
            if seen_back is not None:
                await until(lambda: seen_back(w), "the fleet seen healthy again")
        else:
            router.down = True
            await until(lambda: answered(w), "the operator's answer")
            router.workers = {R2: str(uuid.uuid4())}  # restarted from a configuration: r1 is out, r2 listed
            router.down = False

    w.world.point = hooked


def prompt_ids(w: Window) -> list[str]:
    completions = w.world.workdir(INFERENCE) / "windows" / w.run_id / "completions.json"
    return [str(r["id"]) for r in json.loads(completions.read_text())["prompts"]]


def assert_ended_early(w: Window, router: FakeRouter, finished: Any, why: str, extracted: int) -> None:
    """The window ended early: paused and resumable, saying why; the server serving and r1 back in the
    router (one removal, one add); the prompts extracted kept, the rest missing."""
    assert finished.exit_code == EXIT_PAUSED and finished.status == "paused", finished.message
    assert finished.message == (f"the window ended early: {why}; every prompt extracted is kept, and `run --resume "
                                f"{w.run_id}` extracts the rest (on a replica chosen again)"), finished.message
    state = w.state()
    assert state.service.ended_early["why"] == why
    assert (router.removals, router.adds) == ([router.r1], [router.r1]) and router.r1 in router.workers
    assert len(w.world.extracted) == extracted
    assert state.extraction.partial["done"] == w.world.extracted
    assert len(state.extraction.partial["missing"]) == 10 - extracted
    assert w.world.service.state == "active" and w.world.service.ready and w.store.left_down() is None


def assert_every_prompt_once_and_every_replica_back(w: Window, router: FakeRouter, finished: Any) -> None:
    assert finished.exit_code == EXIT_DONE, finished.message
    state = w.state()
    assert sorted(w.world.extracted) == sorted(prompt_ids(w)) and len(w.world.extracted) == 10  # each once
    states = w.world.workdir(INFERENCE) / "windows" / w.run_id / "states"
    assert (states / "manifest.json").is_file() and not (states / PARTIAL_MANIFEST).exists()
    assert state.extraction.complete and state.extraction.partial is None
    assert router.r1 in router.workers and R2 in router.workers and not router.sick and not router.down
    windows = [x["service"] for x in state.windows] + [{"drains": state.service.drains,
                                                       "rejoins": state.service.rejoins}]
    assert all(x["drains"] == 1 for x in windows), windows  # one drain per window
    assert len(router.removals) == len(router.adds) == len(windows)  # each drain's rejoin, one add each
    assert state.service.drained is None and state.service.ended_early is None
    assert w.world.service.state == "active" and w.world.service.ready and w.store.left_down() is None


@pytest.mark.parametrize(("fault", "why"), [("flap", UNHEALTHY), ("restart", ROUTER_DOWN)])
def test_the_fleet_degraded_mid_extraction_ends_the_window_early_then_the_resume_extracts_the_rest(
        tmp_path, producers, monkeypatch, fault, why):
    w, router = guarded(tmp_path, producers, monkeypatch)
    fault_mid_extraction(w, router, fault)
    seen: list[Any] = []
    finished = asyncio.run(w.console(seen=seen))
    assert finished is not None
    assert_ended_early(w, router, finished, why, extracted=1)  # the prompt in hand finished, kept
    said = [e["message"] for e in w.store.open(w.run_id).read_journal()]
    assert f"THE FLEET IS AT RISK while r1 is out: {why}" in said  # at once, in the journal and every view
    risks = [x for x in seen if isinstance(x, FleetAtRisk)]
    assert [(x.replica, x.why) for x in risks] == [("r1", why)]  # once per change
    told = Watcher(w.world.config, lambda run_id: None, "sglang.service on ct129").on(risks[0])
    assert [(n.event, n.level, n.title) for n in told] == [
        ("fleet-at-risk", "failure", "dflash-ops: the fleet is at risk while r1 is out")]
    assert told[0].body.startswith(why) and "end the window early and put r1 back in the router" in told[0].body
    offer = next(c for c in w.deciders[0].asked if c.step == "fleet")
    assert offer.action == "end the window on r1 early and rejoin it" and offer.argv[:2] == ("sh", "-c")
    assert w.world.service.stop_commands == 1  # one window, stopped once and started once
    again = asyncio.run(w.console())  # `run --resume`, r2 serving again: the next window on r2
    assert again is not None
    assert_every_prompt_once_and_every_replica_back(w, router, again)
    assert w.state().windows[0]["service"]["ended_early"]["why"] == why  # the first window's record keeps it


def test_a_replica_fallen_while_r1_drains_ends_the_window_before_the_stop(tmp_path, producers, monkeypatch):
    """r1's requests never finish (its loads never answer idle) and its drain may take 30 s: r2 falls
    meanwhile; the yes ends the wait at once, nothing is stopped, and r1 rejoins."""
    w, router = guarded(tmp_path, producers, monkeypatch)

    async def fall_while_draining(url: str) -> None:  # r1's own loads, read once it is out of the router
        if url == router.r1 and router.r1 not in router.workers:
            router.sick.add(R2)
            await asyncio.Event().wait()  # its requests never end

    router.before_idle = fall_while_draining
    began = time.monotonic()
    finished = asyncio.run(asyncio.wait_for(w.console(), DEADLINE_S))
    assert finished is not None and time.monotonic() - began < 20  # not the drain's bound: ended at once
    assert_ended_early(w, router, finished, UNHEALTHY, extracted=0)
    assert w.world.service.stop_commands == 0  # never stopped: the window ended before its stop
    router.sick.clear()
    router.before_idle = None
    again = asyncio.run(w.console())
    assert again is not None
    assert_every_prompt_once_and_every_replica_back(w, router, again)


def test_a_no_lets_the_window_go_on_through_the_flap(tmp_path, producers, monkeypatch):
    w, router = guarded(tmp_path, producers, monkeypatch)
    back = "the fleet is healthy again (r1 still out for its window)"
    fault_mid_extraction(w, router, "flap", answered=offered, seen_back=lambda w: back in journal_said(w))
    finished = asyncio.run(w.console(decider=ScriptedDecider(w.world.clock, refuse={"fleet"})))
    assert finished is not None and offered(w)
    assert finished.exit_code == EXIT_DONE, finished.message
    said = journal_said(w)
    assert f"THE FLEET IS AT RISK while r1 is out: {UNHEALTHY}" in said
    assert said.index(back) > said.index(f"THE FLEET IS AT RISK while r1 is out: {UNHEALTHY}")
    assert sorted(w.world.extracted) == sorted(prompt_ids(w)) and len(w.world.extracted) == 10
    assert (router.removals, router.adds) == ([router.r1], [router.r1]) and w.state().service.ended_early is None


# The window's points, a console dying at each while the fleet flaps (or its router restarts) under it.
POINTS = ("drain-recorded", "draining", "stop-ran", "gpu-released", "ready", "before-add", "added")


@pytest.mark.parametrize("fault", ["flap", "restart"])
@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_each_point_with_the_fleet_degraded_ends_with_every_replica_back_and_nothing_twice(
        tmp_path, producers, monkeypatch, point, fault):
    w, router = guarded(tmp_path, producers, monkeypatch)
    fault_mid_extraction(w, router, fault)
    finished = asyncio.run(w.until_finished([Crasher(point)]))
    assert point in w.crashes
    assert_ended_early(w, router, finished, UNHEALTHY if fault == "flap" else ROUTER_DOWN, extracted=1)
    again = asyncio.run(w.console())
    assert again is not None
    assert_every_prompt_once_and_every_replica_back(w, router, again)


def test_the_pause_route_ended_early_gives_the_memory_back_then_rejoins(tmp_path, producers, monkeypatch):
    w, router = guarded(tmp_path, producers, monkeypatch)
    w.route = "pause"  # drain, pause … continue on r1, rejoin: the server is never stopped
    fault_mid_extraction(w, router, "flap")
    finished = asyncio.run(w.console())
    assert finished is not None
    assert_ended_early(w, router, finished, UNHEALTHY, extracted=1)
    state = w.state()
    assert w.world.service.stop_commands == 0 and state.steps["continue"].status == "done"
    assert not state.service.held
    again = asyncio.run(w.console())
    assert again is not None
    assert_every_prompt_once_and_every_replica_back(w, router, again)


def test_a_fall_once_the_gpus_are_released_is_said_but_nothing_is_offered(tmp_path, producers, monkeypatch):
    """The window ends by itself already (the server's return begun at gpu_released): the risk is said,
    ending early would gain nothing, and the run ends done in its one window."""
    w, router = guarded(tmp_path, producers, monkeypatch)
    fault_mid_extraction(w, router, "flap", answered=said_at_risk, at="gpu_released")
    finished = asyncio.run(w.console())
    assert finished is not None and finished.exit_code == EXIT_DONE, finished.message
    assert said_at_risk(w) and not offered(w) and w.state().service.ended_early is None
    assert sorted(w.world.extracted) == sorted(prompt_ids(w)) and len(w.world.extracted) == 10
    assert (router.removals, router.adds) == ([router.r1], [router.r1])


class AfterTheStop(Crasher):
    """Never crashes: says when the stop ran (the free-VRAM wait comes next)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.stopped = False

    def __call__(self, point: str) -> None:
        self.stopped = self.stopped or point == "stop-ran"


def test_a_fall_during_the_free_vram_wait_cuts_it_and_restarts(tmp_path, producers, monkeypatch):
    """r1 stopped, its VRAM never frees (the wait would last `vram_wait_s`): r2 falls meanwhile; the
    yes cuts the wait at once, the server is started again and r1 rejoins, nothing extracted."""
    from tests import engine_fakes

    w, router = guarded(tmp_path, producers, monkeypatch)
    hook = AfterTheStop()
    wait_for = engine_fakes._Watch.wait_for

    async def never_free(self: Any, predicate: Any, timeout: float, after: Any = None, eager: bool = False) -> Any:
        if hook.stopped and not router.sick:
            router.sick.add(R2)
            await asyncio.Event().wait()  # the GPUs never seen free
        return await wait_for(self, predicate, timeout, after, eager)

    monkeypatch.setattr(engine_fakes._Watch, "wait_for", never_free)
    finished = asyncio.run(asyncio.wait_for(w.console(crash=hook), DEADLINE_S))
    assert finished is not None
    assert_ended_early(w, router, finished, UNHEALTHY, extracted=0)
    assert w.world.service.stop_commands == 1 and w.state().steps["free-vram"].status == "failed"
    router.sick.clear()
    monkeypatch.setattr(engine_fakes._Watch, "wait_for", wait_for)
    again = asyncio.run(w.console())
    assert again is not None
    assert_every_prompt_once_and_every_replica_back(w, router, again)
