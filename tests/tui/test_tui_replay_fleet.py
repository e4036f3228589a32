"""Issue 42: `replay` of a fleet run shows the drained replica as the live console's fleet panel did:
r1 out of the router (draining, in window, rejoining) from its drain to its rejoin, r2 serving, and a
replica the run left out "DRAINED by run X". The stores are written by the real engine over the fleet
sweep's world (tests/test_fleet_sweep.py: the window route on replica r1 behind a fake of SGLang's
router), then replayed as `dflash-ops replay` reads them (console/procedure/replay_fleet.py)."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest

from console import messages as m
from console.procedure.replay import read_recording
from console.views.fleet import fleet_lines
from screens.replay import ReplayApp
from screens.widgets.fleet_panel import FleetPanel
from tests.engine_fakes import ScriptedDecider
from tests.test_fleet_sweep import fleet_window
from tests.tui.test_tui_console import text_of
from tests.tui.test_tui_operator import plain

SIZE = (120, 40)


def fleet_run(root: Path, producers, refuse: set[str] = frozenset()) -> Path:
    """A fleet window run by the real engine (`refuse`: the questions its operator refuses); its run directory."""
    with pytest.MonkeyPatch.context() as patch:
        w, _router = fleet_window(root, producers, patch)
        if refuse:
            asyncio.run(w.console(decider=ScriptedDecider(w.world.clock, refuse=refuse)))
        else:
            asyncio.run(w.until_finished([]))
    return w.store.root / w.run_id


@pytest.fixture(scope="module")
def finished_fleet_run(tmp_path_factory, producers) -> Path:
    return fleet_run(tmp_path_factory.mktemp("fleet"), producers)


def views(run_dir: Path) -> list[str]:
    return [plain(fleet_lines(e.message)) for e in read_recording(run_dir).events if isinstance(e.message, m.FleetView)]


def test_the_recording_draws_r1_out_of_the_router_from_its_drain_to_its_rejoin(finished_fleet_run: Path):
    run_id = finished_fleet_run.name
    shown = views(finished_fleet_run)
    assert shown, "a fleet run replays no fleet view"
    assert f"r1  draining (run {run_id})" in shown[0] and "2 of 2 replicas healthy" in shown[0]
    out = next(v for v in shown if f"r1  in window (run {run_id})" in v)
    assert "1 of 2 replicas healthy" in out and "router not listed" in out and "r2  serving" in out
    assert "(sglang-router)" in out  # the gateway, as the drain's journal line named it
    assert "ct129 GPU all" in out  # each replica's host and GPUs, from the run's config ([fleet])
    assert any(f"r1  rejoining (run {run_id})" in v for v in shown)
    assert "r1  serving" in shown[-1] and "r2  serving" in shown[-1] and "2 of 2 replicas healthy" in shown[-1]


def test_replay_print_says_each_change_of_the_fleet(finished_fleet_run: Path):
    from console.cli.replay import describe

    run_id = finished_fleet_run.name
    said = [describe(e) for e in read_recording(finished_fleet_run).events if isinstance(e.message, m.FleetView)]
    assert f"fleet: r1 in window (run {run_id}), out of the router; r2 serving" in said, said
    assert said[-1] == "fleet: r1 serving; r2 serving"


def test_the_journal_and_state_alone_draw_it_when_the_config_is_gone(finished_fleet_run: Path, tmp_path: Path):
    copy = tmp_path / finished_fleet_run.name
    shutil.copytree(finished_fleet_run, copy)
    state = read_recording(copy).state
    Path(state.config).rename(tmp_path / "moved.toml")  # the run's config file is gone
    try:
        shown = views(copy)
    finally:
        (tmp_path / "moved.toml").rename(state.config)
    out = next(v for v in shown if "r1  in window" in v)
    assert "router http://127.0.0.1:30000 (sglang-router) up, 1 of 2 replicas healthy" in out and "r2  serving" in out
    assert "host not recorded" in out and "GPU all" not in out  # never a claim the store cannot back


def test_a_replica_the_run_left_out_is_drained_by_it_at_the_end(tmp_path: Path, producers):
    run_dir = fleet_run(tmp_path, producers, refuse={"free-vram", "restart"})  # left down, and drained
    shown = views(run_dir)
    assert f"r1  DRAINED by run {run_dir.name}" in shown[-1] and "r2  serving" in shown[-1]


async def test_the_replay_console_shows_the_fleet_panel_as_the_run_went(finished_fleet_run: Path):
    app = ReplayApp(read_recording(finished_fleet_run), playing=False, clock=lambda: 0.0, frame_s=3600)
    run_id = finished_fleet_run.name
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        panel = app.screen.query_one(FleetPanel)
        app.seek_step("stop")  # the replica is out of the router for the window
        await pilot.pause()
        text = text_of(panel)
        assert f"r1  in window (run {run_id})" in text and "router not listed" in text, text
        assert "r2  serving" in text and "1 of 2 replicas healthy" in text
        app.seek_step("rejoin")
        await pilot.pause()
        assert f"r1  rejoining (run {run_id})" in text_of(panel)
        app.seek_step("evaluate")  # back in the router
        await pilot.pause()
        text = text_of(panel)
        assert "r1  serving" in text and "2 of 2 replicas healthy" in text, text
        app.seek_step("drain")  # a seek back: the panel follows
        await pilot.pause()
        assert f"r1  draining (run {run_id})" in text_of(panel)
