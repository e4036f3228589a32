"""Issue 43: a key that would act, in a console that may not act, says so briefly and does nothing:
a read-only console (`--read-only`, a browser's view of `dflash-ops serve`, a replay) says it is
read-only and which kind it is; a console that follows a run another console drives says who drives
(screens/refusals.py). Before, the keys were silently ignored."""

from __future__ import annotations

from pathlib import Path

import pytest

from console.procedure.replay import read_recording
from console.sharing import SharedSession
from screens.replay import ReplayApp
from tests.tui.standin import fixed_clock
from tests.tui.test_tui_operator import console, until
from tests.tui.test_tui_replay import RECORDED
from tests.tui.test_tui_second_console import live_console
from tests.tui.test_tui_walk import WIDE, serving

SAYS = {"g": "runs nothing", "n": "runs no step", "p": "plans nothing", "c": "cancels nothing"}


def said(app) -> list[str]:
    return [str(n.message) for n in app._notifications]


async def press_and_read(app, pilot, key: str) -> str:
    before = len(said(app))
    await pilot.press(key)
    await until(pilot, lambda: len(said(app)) > before)
    return said(app)[-1]


@pytest.mark.parametrize("served", [False, True], ids=["--read-only", "served"])
async def test_each_acting_key_of_a_read_only_console_says_read_only_and_does_nothing(tmp_path: Path, served: bool):
    op = serving(runs_dir=tmp_path / "runs", read_only=True)
    if served:  # a browser's console of `dflash-ops serve`: its session is a view of the hub's
        op.session = SharedSession(op.config, tmp_path / "hub.sock")
    kind = "a browser view of `dflash-ops serve`" if served else "opened with --read-only"
    async with console(op, WIDE, clock=fixed_clock) as (app, pilot):
        await pilot.pause()
        for key, doing in SAYS.items():
            text = await press_and_read(app, pilot, key)
            assert text == f"read-only: this console {doing} ({kind})", text
        text = await press_and_read(app, pilot, "r")
        assert text.startswith("read-only: this console restarts nothing") and kind in text, text
        assert not app.state.running and op.decisions == [] and app.screen.id == "dashboard"
        await pilot.press("h")  # the runs: their c compares, and says nothing of read-only
        await until(pilot, lambda: type(app.screen).__name__ == "RunsScreen")
        before = len(said(app))
        await press_and_read(app, pilot, "c")
        await pilot.pause(0.1)
        assert said(app)[before:] == ["mark two runs with space first"], said(app)[before:]


async def test_a_replays_acting_keys_say_it_is_a_replay():
    app = ReplayApp(read_recording(RECORDED), playing=False, clock=lambda: 0.0, frame_s=3600)
    async with app.run_test(size=WIDE) as pilot:
        await pilot.pause()
        text = await press_and_read(app, pilot, "g")
        assert text == "read-only: this console runs nothing (a replay of a past run)", text


async def test_a_console_that_follows_another_consoles_run_says_who_drives(tmp_path: Path):
    from console.procedure.store import RunStore

    proc, owner = live_console()
    try:
        run = RunStore(tmp_path / "runs").create(None, None)
        state = run.state
        state.started, state.status, state.route, state.owner = True, "running", "window", owner
        state.step("preflight").status = "running"
        run.save()
        op = serving(runs_dir=tmp_path / "runs")
        async with console(op, WIDE, clock=fixed_clock) as (app, pilot):
            await until(pilot, lambda: app.live_elsewhere() is not None)
            for key in ("g", "n", "c"):
                text = await press_and_read(app, pilot, key)
                assert text.startswith(f"run {run.run_id} is driven by {owner.describe()}: this console follows it "
                                       f"and {SAYS[key]}"), text
            # The palette's "Run the procedure" (offered: this console may run once that run ends) says the same.
            before = len(said(app))
            await pilot.press("ctrl+p")
            await until(pilot, lambda: type(app.screen).__name__ == "CommandPalette")
            await pilot.press(*"Run the procedure")
            await pilot.pause(0.3)
            await pilot.press("enter")
            await until(pilot, lambda: len(said(app)) > before)
            assert said(app)[-1].startswith(f"run {run.run_id} is driven by {owner.describe()}: this console follows"), \
                said(app)[-1]
            assert not app.state.running and op.decisions == []
    finally:
        proc.kill()
        proc.wait()


async def test_an_acting_console_says_nothing_of_read_only(tmp_path: Path):
    op = serving(runs_dir=tmp_path / "runs")
    async with console(op, WIDE, clock=fixed_clock) as (app, pilot):
        await pilot.press("p")  # it plans
        await until(pilot, lambda: app.screen.id != "dashboard" or app.state.plan is not None)
        assert not any("read-only" in s for s in said(app))
