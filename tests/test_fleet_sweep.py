"""The fleet window's crash-point sweep: the whole engine (the window route: drain, stop … restart,
rejoin) over the sweep's fake world, its service being replica r1 behind a fake of SGLang's router
(tests/fake_router.py; the steps against the real router: tests/test_fleet_steps.py). At every point
the console dies; the next consoles finish the run. The promises: the window's own (every case of
tests/engine_sweep.py's `assert_promises`), and the replica ends in the router, listed, with one
removal and one add, and the service ends serving. A prompt set over one window's budget takes r1
then r2, each extracting the next missing prompts (issue 29's large prompt sets)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from console.config import config_to_dict, dump_toml, load_config
from console.procedure.engine import EXIT_DONE, EXIT_PAUSED
from console.procedure.fit import CUDA_CONTEXT_MIB
from remote.extract_check import PARTIAL_MANIFEST
from tests import engine_fakes, engine_sweep
from tests.engine_fakes import INFERENCE, FakeWorld, Producers, ScriptedDecider, install_clock, write_config
from tests.engine_sweep import Crasher, Window, assert_promises
from tests.fake_hosts import FakeHosts
from tests.fake_router import R2, FakeRouter, attach

ROUTER = "http://127.0.0.1:30000"


def fleet_window(root: Path, producers: Producers, monkeypatch: pytest.MonkeyPatch, r1_gpus: list[int] | None = None,
                 r2_gpus: list[int] | None = None) -> tuple[Window, FakeRouter]:
    import os

    from console.procedure.store import RunStore

    monkeypatch.setattr(os, "fsync", lambda fd: None)
    one = write_config(root, producers)
    data = config_to_dict(one)
    service = data.pop("service")
    r1 = {**service, "url": "http://127.0.0.1:30001", **({"gpus": r1_gpus} if r1_gpus is not None else {})}
    r2 = {**service, "url": R2, **({"gpus": r2_gpus} if r2_gpus is not None else {})}
    data["fleet"] = {"router": ROUTER, "drain_timeout_s": 30,
                     "replicas": [{"name": "r1", **r1}, {"name": "r2", **r2}]}
    path = root / "dflash-ops.toml"
    path.write_text(dump_toml(data))
    config = load_config(path)
    world = FakeWorld(root, config, producers, stuck_holder=True)
    install_clock(monkeypatch, world.clock)
    router = FakeRouter(world, r1["url"])

    class RoutedHosts(FakeHosts):  # each console's hosts reach the same router
        def __init__(self, world: FakeWorld):
            super().__init__(world)
            attach(self, router)

    monkeypatch.setattr(engine_sweep, "FakeHosts", RoutedHosts)
    store = RunStore(root / "runs")
    run = store.create(str(config.source), None)
    return Window(root, world, store, run.run_id, route="window"), router


def assert_fleet_promises(w: Window, router: FakeRouter, finished) -> None:
    assert_promises(w, finished)
    svc = w.state().service
    assert router.r1 in router.workers and R2 in router.workers, router.workers
    assert len(router.removals) == 1 and len(router.adds) == 1, (router.removals, router.adds)
    assert svc.drained is None and svc.drains == 1 and svc.rejoins == 1
    assert w.world.service.state == "active" and w.world.service.ready


def test_a_fleet_window_without_a_crash(tmp_path, producers, monkeypatch):
    w, router = fleet_window(tmp_path, producers, monkeypatch)
    finished = asyncio.run(w.until_finished([]))
    assert finished.exit_code == EXIT_DONE, finished.message
    steps = w.state().steps
    assert steps["drain"].status == "done" and steps["rejoin"].status == "done"
    assert_fleet_promises(w, router, finished)
    assert router.served[router.r1] > 0  # the rejoin's verify saw requests through the router reach it


POINTS = ("before-drain-recorded", "drain-recorded", "draining", "stop-ran", "ready", "before-add", "added")


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_each_point_ends_with_the_replica_back_in_the_router(tmp_path, producers, monkeypatch, point):
    w, router = fleet_window(tmp_path, producers, monkeypatch)
    finished = asyncio.run(w.until_finished([Crasher(point)]))
    assert point in w.crashes
    assert_fleet_promises(w, router, finished)


def test_a_refusal_after_the_drain_restarts_then_rejoins(tmp_path, producers, monkeypatch):
    w, router = fleet_window(tmp_path, producers, monkeypatch)
    finished = asyncio.run(w.console(decider=ScriptedDecider(w.world.clock, refuse={"free-vram"})))
    assert finished is not None and finished.status == "refused" and finished.service_up
    assert router.r1 in router.workers and (router.removals, router.adds) == ([router.r1], [router.r1])
    assert w.state().service.drained is None and w.store.left_down() is None


def test_a_replica_left_down_and_drained_is_named_then_restarted_and_rejoined_by_the_next_console(
        tmp_path, producers, monkeypatch):
    w, router = fleet_window(tmp_path, producers, monkeypatch)
    finished = asyncio.run(w.console(decider=ScriptedDecider(w.world.clock, refuse={"free-vram", "restart"})))
    assert finished is not None and not finished.service_up
    left = w.store.left_down()
    assert left is not None and left.state.service.drained and router.r1 not in router.workers
    again = asyncio.run(w.console())  # `run --resume`: the restart, then the rejoin
    assert again is not None and again.service_up, again.message
    assert router.r1 in router.workers and w.state().service.drained is None and w.store.left_down() is None
    assert (len(router.removals), len(router.adds)) == (1, 1)


@pytest.mark.parametrize("point", ("draining", "paused", "continued", "before-add"))
def test_the_pause_route_on_a_replica_ends_back_in_the_router_after_a_crash(tmp_path, producers, monkeypatch, point):
    w, router = fleet_window(tmp_path, producers, monkeypatch)
    w.route = "pause"  # drain, pause … continue on the replica, rejoin: the server is never stopped
    finished = asyncio.run(w.until_finished([Crasher(point)]))
    assert point in w.crashes
    assert_fleet_promises(w, router, finished)
    assert w.world.service.stop_commands == 0 and w.state().steps["continue"].status == "done"


def test_a_replica_whose_gpus_cannot_hold_the_extraction_is_refused_before_the_drain(tmp_path, producers,
                                                                                        monkeypatch):
    """r1 serves on GPU0 alone, r2 on GPU0+GPU1; each GPU holds 1 MiB less than the CUDA context the
    extraction needs besides the tiny target: it fits two GPUs, not one. The run on r1 is refused at its preflight, naming
    the numbers and r2; the router and the server are untouched."""
    monkeypatch.setattr(engine_fakes, "GPU_TOTAL_MIB", CUDA_CONTEXT_MIB - 1)
    w, router = fleet_window(tmp_path, producers, monkeypatch, r1_gpus=[0], r2_gpus=[0, 1])
    finished = asyncio.run(w.console())
    assert finished is not None and finished.status == "failed" and finished.service_up
    assert "the fleet window is refused: replica r1 cannot take it: its GPUs (GPU0 on ct129) hold 599 MiB, the " \
           "extraction needs ~" in finished.message
    assert "; r2 can: `dflash-ops run --replica NAME` runs the window there; nothing was changed" in finished.message
    fits = w.state().facts["fleet_fits"]
    assert fits["r1"]["fits"] is False and fits["r2"]["fits"] is True
    assert "its GPUs (GPU0+GPU1 on ct129) hold 1078 MiB" in fits["r2"]["why"]
    assert (router.removals, router.adds) == ([], []) and w.world.service.stop_commands == 0
    assert w.state().service.drains == 0 and w.store.left_down() is None


# --- a prompt set larger than one window's budget: successive replicas in turn --------------------


def two_windows(tmp_path: Path, producers: Producers, monkeypatch: pytest.MonkeyPatch) -> tuple[Window, FakeRouter]:
    """The fleet window whose budget fits half the prompts (5 of 10: the operator's stop at the
    budget, `FakeWorld.budget_prompts`); each console's config narrowed to its window's replica as
    `run` narrows it (`fleet.fleet_config`: the recorded replica, or at a window's end the next one)."""
    from console.procedure.steps.fleet import fleet_config

    w, router = fleet_window(tmp_path, producers, monkeypatch)
    w.world.budget_prompts = 5

    async def config_of(state, hosts):
        placed, _ = await fleet_config(w.world.config, state if state.started else None, None,
                                       [run.state for run in w.store.readable()], via=hosts)
        return placed

    w.config_of = config_of
    return w, router


def assert_two_windows(w: Window, router: FakeRouter, finished) -> None:
    """The promises of one run over two windows (r1's five prompts, then r2's five): done, every
    prompt extracted once into one complete manifest, verified and evaluated once; each window on its
    own replica with one drain and one rejoin; both replicas listed at the end; one stop and one start
    per window, the service serving."""
    assert finished.exit_code == EXIT_DONE, finished.message
    state, ids = w.state(), [str(r["id"]) for r in json.loads(
        (w.world.workdir(INFERENCE) / "windows" / w.run_id / "completions.json").read_text())["prompts"]]
    assert w.world.extracted == ids and len(ids) == 10  # every prompt once, r1's five then r2's
    states = w.world.workdir(INFERENCE) / "windows" / w.run_id / "states"
    assert (states / "manifest.json").is_file() and not (states / PARTIAL_MANIFEST).exists()
    assert state.extraction.complete and state.extraction.partial is None
    assert sum(j.kind == "evaluate" for j in w.world.job_order) == 1  # the whole set evaluated once
    assert [window["replica"] for window in state.windows] == ["r1"] and state.facts["fleet_replica"] == "r2"
    assert [(x["service"]["drains"], x["service"]["rejoins"]) for x in state.windows] == [(1, 1)]
    assert (state.service.drains, state.service.rejoins, state.service.drained) == (1, 1, None)
    assert (router.removals, router.adds) == ([router.r1, R2], [router.r1, R2])
    assert router.r1 in router.workers and R2 in router.workers and router.served[R2] > 0
    periods = w.world.service.down_periods()
    assert len(periods) == 2 and all(ready is not None and starts == 1 for _, ready, starts in periods), periods
    assert w.world.service.state == "active" and w.world.service.ready and w.store.left_down() is None


def test_prompts_over_one_windows_budget_take_r1_then_r2_within_one_run(tmp_path, producers, monkeypatch):
    """Window 1 on r1 extracts 5 prompts and rejoins r1; the same run then drains r2 (not r1, just
    used; its drain asked as every drain is), extracts the 5 missing, rejoins r2, and evaluates the
    whole set once: one console, no `run --resume`."""
    w, router = two_windows(tmp_path, producers, monkeypatch)
    finished = asyncio.run(w.console())
    assert finished is not None
    assert_two_windows(w, router, finished)
    asked = [c.action for c in w.deciders[0].asked if c.step in ("drain", "rejoin")]
    assert asked == ["take replica r1 out of the router", "put replica r1 back in the router",
                     "take replica r2 out of the router", "put replica r2 back in the router"]
    said = [e["message"] for e in w.store.open(w.run_id).read_journal()]
    assert any("the run goes on with the next replica: r2" in m for m in said), said
    assert w.state().service_identity["router"] == ROUTER  # the run's identity is the fleet, not r1


# The points of a run's second window (its `nth` time reached): between the windows (`window-over`:
# r1 back, nothing chosen yet; `next-window`: r2's window recorded, nothing drained) and r2's own.
NEXT_WINDOW_POINTS = (("window-over", 1), ("next-window", 1), ("before-drain-recorded", 2), ("drain-recorded", 2),
                      ("draining", 2), ("stop-ran", 2), ("gpu-released", 2), ("ready", 2), ("before-add", 2),
                      ("added", 2))


@pytest.mark.parametrize(("point", "nth"), NEXT_WINDOW_POINTS)
def test_a_crash_in_a_runs_next_window_ends_with_every_replica_back_and_nothing_extracted_twice(
        tmp_path, producers, monkeypatch, point, nth):
    """The console dies at each point of the run's second window; the next consoles (`run --resume`,
    narrowed as `run` narrows it: the recorded replica, or between the windows the next one) finish
    it. Whatever the point: the two-window promises hold."""
    w, router = two_windows(tmp_path, producers, monkeypatch)
    finished = asyncio.run(w.until_finished([Crasher(point, nth)]))
    assert point in w.crashes
    assert_two_windows(w, router, finished)


class Canceller:
    """The `crash_at` hook that cancels the run (as Ctrl-C does) the `nth` time it reaches `point`."""

    def __init__(self, point: str, nth: int):
        self.point, self.nth, self.seen, self.engine = point, nth, 0, None

    def __call__(self, reached: str) -> None:
        if reached == self.point:
            self.seen += 1
            if self.seen == self.nth:
                self.engine.cancel()


@pytest.mark.parametrize(("point", "nth"), (("window-over", 1), ("draining", 2), ("stop-ran", 2), ("added", 2)))
def test_a_cancel_in_a_runs_next_window_leaves_every_replica_in_the_router(tmp_path, producers, monkeypatch,
                                                                            point, nth):
    """Ctrl-C at a point of the second window: the run compensates (r2 restarted, then put back) and
    ends; both replicas are listed, each drain has its rejoin, and no run is left draining one."""
    from console.procedure.engine import Engine

    w, router = two_windows(tmp_path, producers, monkeypatch)

    async def cancelled():
        hosts = engine_sweep.FakeHosts(w.world)
        run = w.store.open(w.run_id)
        canceller = Canceller(point, nth)
        engine = canceller.engine = Engine(hosts, await w.config_of(run.state, hosts), run,
                                           ScriptedDecider(w.world.clock), w.store, route="window", crash_at=canceller)
        return await engine.execute()

    finished = asyncio.run(cancelled())
    state = w.state()
    assert finished.service_up and finished.status == "cancelled", finished
    assert router.r1 in router.workers and R2 in router.workers, router.workers
    assert len(router.removals) == len(router.adds) == state.service.drains + len(state.windows)
    assert state.service.drained is None and state.service.drains == state.service.rejoins
    assert w.world.service.state == "active" and w.world.service.ready and w.store.left_down() is None
    assert len(w.world.extracted) == len(set(w.world.extracted))  # nothing extracted twice


def test_a_refused_drain_of_the_next_replica_ends_the_run_paused_and_resumable(tmp_path, producers, monkeypatch):
    """The operator says no to r2's drain: the run ends paused (exit 4) with r1 back in the router and
    r2 never touched; every prompt extracted is kept, and `run --resume` drains r2 and extracts the rest."""

    class NoSecondDrain(ScriptedDecider):
        async def decide(self, confirmation):
            self.asked.append(confirmation)
            return confirmation.action != "take replica r2 out of the router"

    w, router = two_windows(tmp_path, producers, monkeypatch)
    first = asyncio.run(w.console(decider=NoSecondDrain(w.world.clock)))
    assert first is not None and first.exit_code == EXIT_PAUSED and first.service_up, first
    assert "take replica r2 out of the router" in first.message and "run --resume" in first.message
    assert (router.removals, router.adds) == ([router.r1], [router.r1]) and R2 in router.workers
    state = w.state()
    assert state.status == "paused" and state.service.drained is None and w.store.left_down() is None
    assert len(w.world.extracted) == 5
    finished = asyncio.run(w.until_finished([]))
    assert_two_windows(w, router, finished)


def test_a_one_server_run_cut_at_its_budget_still_pauses(tmp_path, producers, monkeypatch):
    """Without [fleet] nothing changes: the window cut short at its budget ends the run paused."""
    w = engine_sweep.make_window(tmp_path, producers, monkeypatch)
    w.world.budget_prompts = 5
    first = asyncio.run(w.console())
    assert first is not None and first.exit_code == EXIT_PAUSED and "cut short at its budget" in first.message
    assert len(w.world.extracted) == 5 and w.world.service.state == "active"


def test_the_next_window_goes_back_to_the_same_replica_when_no_other_can_take_it(tmp_path, producers, monkeypatch):
    """r2's GPUs cannot hold the extraction (the newest preflight said so): the next window is on r1
    again, said so, never refused for want of another."""
    from console.procedure.steps.fleet import fleet_config

    w, router = two_windows(tmp_path, producers, monkeypatch)
    first = asyncio.run(w.console(decider=ScriptedDecider(w.world.clock, refuse={"stop"})))  # fits recorded, no window
    assert first is not None and first.status == "refused"
    state = w.state()
    state.extraction.partial, state.service.stops = {"done": [], "missing": []}, 1  # as between two windows
    state.facts["fleet_fits"]["r2"] = {"fits": False, "why": "its GPUs hold less than the extraction needs"}
    hosts = engine_sweep.FakeHosts(w.world)
    placed, why = asyncio.run(fleet_config(w.world.config, state, None, [state], via=hosts))
    assert placed.service.url == router.r1 and "on r1 again: no other replica can take it" in why


def test_a_fleet_runs_identity_is_the_fleet_so_its_next_window_on_another_replica_is_its_own(
        tmp_path, producers, monkeypatch):
    """A resume narrowed to r2 addresses the run's own fleet; another router (another fleet) is
    refused naming both; a run recorded by its replica (before the fleet's identity) still by it."""
    import dataclasses

    from console.procedure import identity
    from console.procedure.steps.fleet import on_replica

    w, _ = fleet_window(tmp_path, producers, monkeypatch)
    config = w.world.config
    state = w.state()
    state.service_identity = identity.of(config)
    state.config, state.config_sha256 = identity.config_path(config), identity.config_sha256(config)
    on_r2 = on_replica(config, config.fleet.replica("r2"))
    assert identity.refusal(state, on_r2, w.run_id) is None
    other = dataclasses.replace(on_r2, fleet=dataclasses.replace(config.fleet, router="http://127.0.0.1:39999"))
    refused = identity.refusal(state, other, w.run_id)
    assert refused is not None and f"addresses the fleet behind the router {ROUTER} (replicas r1, r2)" in refused
    assert "this config addresses the fleet behind the router http://127.0.0.1:39999" in refused
    state.service_identity = identity.service_of(config)  # recorded by r1, before the fleet's identity
    assert identity.refusal(state, config, w.run_id) is None and identity.refusal(state, on_r2, w.run_id) is not None
    state.service_identity = identity.of(config)
    state.facts["fleet_replica"] = "r1"  # the window is on r1: resumed or restarted on r1 only
    refused = identity.refusal(state, on_r2, w.run_id)
    assert refused is not None and "window is on replica r1; this console addresses replica r2" in refused
    assert identity.refusal(state, config, w.run_id) is None


def test_the_pause_route_over_one_windows_budget_takes_r1_then_r2_within_one_run(tmp_path, producers, monkeypatch):
    """The pause route on the fleet, cut at its budget: r1 paused, its five prompts, resumed and
    continued, rejoined; the same run takes r2 for the five missing (paused, continued, rejoined)
    and evaluates the whole set once. Never a stop; one continue per pause, one rejoin per drain."""
    w, router = two_windows(tmp_path, producers, monkeypatch)
    w.route = "pause"
    finished = asyncio.run(w.console())
    assert finished is not None and finished.exit_code == EXIT_DONE, finished.message
    state, ids = w.state(), [str(r["id"]) for r in json.loads(
        (w.world.workdir(INFERENCE) / "windows" / w.run_id / "completions.json").read_text())["prompts"]]
    assert w.world.extracted == ids and len(ids) == 10  # every prompt once, r1's five then r2's
    assert state.extraction.complete and sum(j.kind == "evaluate" for j in w.world.job_order) == 1
    assert [window["replica"] for window in state.windows] == ["r1"] and state.facts["fleet_replica"] == "r2"
    for window in (state.windows[0]["service"], dataclasses.asdict(state.service)):  # the pause route, each its own
        assert (window["drains"], window["rejoins"], window["pauses"], window["continues"], window["stops"]) == \
            (1, 1, 1, 1, 0)
    assert (router.removals, router.adds) == ([router.r1, R2], [router.r1, R2])
    assert w.world.service.stop_commands == 0 and w.world.service.start_commands == 0
    assert w.store.left_down() is None
