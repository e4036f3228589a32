"""The fleet window's crash-point sweep: the whole engine (the window route: drain, stop … restart,
rejoin) over the sweep's fake world, its service being replica r1 behind a fake of SGLang's router
(tests/fake_router.py; the steps against the real router: tests/test_fleet_steps.py). At every point
the console dies; the next consoles finish the run. The promises: the window's own (every case of
tests/engine_sweep.py's `assert_promises`), and the replica ends in the router, listed, with one
removal and one add, and the service ends serving."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from console.config import config_to_dict, dump_toml, load_config
from console.procedure.engine import EXIT_DONE
from console.procedure.fit import CUDA_CONTEXT_MIB
from tests import engine_fakes, engine_sweep
from tests.engine_fakes import FakeWorld, Producers, ScriptedDecider, install_clock, write_config
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
