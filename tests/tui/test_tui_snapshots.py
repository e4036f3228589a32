"""Snapshots of the console (pytest-textual-snapshot): fixed terminal sizes, fixed telemetry
published as real message objects on a real bus, a fixed clock, no blinking cursor, no ETA, no
indeterminate bar. Update the baselines with `--snapshot-update` after looking at them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from console import messages as m
from screens.app import ConsoleApp
from screens.modals.confirm import ConfirmModal
from screens.modals.holders import HoldersModal
from screens.modals.quit import QuitWhileDownModal
from screens.plan import PlanScreen
from screens.results import ResultsScreen
from screens.widgets.asked_panel import AskedPanel
from tests.tui.standin import (
    StandinOperator,
    fixed_clock,
    holders_confirmation,
    holders_found,
    mid_window,
    restart_confirmation,
    stop_confirmation,
    stuck_telemetry,
)
from tests.tui.test_tui_walk import DRILL_START

WIDE, NARROW = (120, 40), (80, 24)


def serving(runs_dir: Path | None = None, read_only: bool = False) -> StandinOperator:
    op = StandinOperator(runs_dir=runs_dir, read_only=read_only)
    op.seed(history=600)
    return op


async def settle(pilot, condition=lambda: True) -> None:
    for _ in range(100):
        await pilot.pause(0.02)
        if condition():
            break
    await pilot.wait_for_scheduled_animations()
    await pilot.pause()


SIZES = pytest.mark.parametrize("size", [WIDE, NARROW], ids=["120x40", "80x24"])


def shot(snap_compare, size: tuple[int, int], scene, runs_dir: Path | None = None, read_only: bool = False) -> bool:
    """The console over the serving stand-in, `scene(app, op, pilot)` played, then compared."""
    op = serving(runs_dir, read_only)
    app = ConsoleApp(op, clock=fixed_clock)

    async def before(pilot) -> None:
        await pilot.pause()
        await scene(app, op, pilot)
        await settle(pilot)

    return snap_compare(app, terminal_size=size, run_before=before)


async def down_mid_window(app: ConsoleApp, op: StandinOperator, pilot) -> None:
    """The window 90 s after the stop, published to the running console as the engine would."""
    mid_window(op)
    await settle(pilot, lambda: app.state.down_since is not None)


async def nothing(app: ConsoleApp, op: StandinOperator, pilot) -> None:
    pass


async def asked(app: ConsoleApp, pilot, confirmation, kind: type) -> None:
    asyncio.ensure_future(app.decider.decide(confirmation))
    await settle(pilot, lambda: isinstance(app.screen, kind))


async def results_tab(app: ConsoleApp, pilot, key: str | None) -> None:
    await pilot.press("o")
    await settle(pilot, lambda: isinstance(app.screen, ResultsScreen))
    if key:
        await pilot.press(key)


@SIZES
def test_dashboard_mid_window(snap_compare, size):
    """Down, the extraction going: the banner with the expected time back, the job's time left."""
    assert shot(snap_compare, size, down_mid_window)


@SIZES
def test_dashboard_serving(snap_compare, size):
    assert shot(snap_compare, size, nothing)


@SIZES
def test_confirm_stop_modal(snap_compare, size):
    async def scene(app, op, pilot) -> None:
        await op.plan()
        await asked(app, pilot, stop_confirmation(), ConfirmModal)

    assert shot(snap_compare, size, scene)


@SIZES
def test_holders_modal(snap_compare, size):
    """The command first; at 80 x 24 the body scrolls and the buttons stay on screen."""
    async def scene(app, op, pilot) -> None:
        await down_mid_window(app, op, pilot)
        op.publish(stuck_telemetry())
        op.publish(holders_found())
        await settle(pilot)
        await asked(app, pilot, holders_confirmation(), HoldersModal)

    assert shot(snap_compare, size, scene)


@SIZES
def test_restart_modal_while_down(snap_compare, size):
    """The restart's impact under the command, the DOWN banner above the modal."""
    async def scene(app, op, pilot) -> None:
        await down_mid_window(app, op, pilot)
        await asked(app, pilot, restart_confirmation(), ConfirmModal)

    assert shot(snap_compare, size, scene)


@SIZES
def test_read_only_while_the_restart_is_asked(snap_compare, size):
    """A watching console while the driving one waits on the restart: the banner says what is asked
    and where (its rows hold it at 80 x 24); the block under it has the drill's long command whole."""
    async def scene(app, op, pilot) -> None:
        mid_window(op)
        op.publish(m.StepUpdate(op.run_id, "extract", "done", op.now - 75, op.now - 5))
        op.publish(m.StepUpdate(op.run_id, "restart", "running", op.now - 5))
        asked = m.AskedQuestion("start the service", "ct129", " ".join(DRILL_START))
        op.publish(m.LiveRun(op.run_id, "running", "op@ws1 pid 4242 since 09:30:00", False, True, ours=False,
                             question=asked))
        await settle(pilot, lambda: not app.screen.query_one(AskedPanel).has_class("idle"))

    assert shot(snap_compare, size, scene, read_only=True)


@SIZES
def test_quit_while_down_modal(snap_compare, size):
    async def scene(app, op, pilot) -> None:
        await down_mid_window(app, op, pilot)
        await pilot.press("q")
        await settle(pilot, lambda: isinstance(app.screen, QuitWhileDownModal))

    assert shot(snap_compare, size, scene)


@SIZES
def test_plan_screen(snap_compare, size):
    async def scene(app, op, pilot) -> None:
        await pilot.press("p")
        await settle(pilot, lambda: isinstance(app.screen, PlanScreen))

    assert shot(snap_compare, size, scene)


@SIZES
@pytest.mark.parametrize("tab", [None, "2", "6"], ids=["summary", "per-prompt", "window"])
def test_results(snap_compare, size, tab, runs_root: Path):
    async def scene(app, op, pilot) -> None:
        await results_tab(app, pilot, tab)

    assert shot(snap_compare, size, scene, runs_root)


@pytest.mark.parametrize("key", ["o", "h"], ids=["results", "runs"])
async def test_every_footer_key_shows_at_80_columns(key: str, runs_root: Path):
    """At 80x24 the results and runs screens' footers show every key they offer, up to `q Quit`,
    never cut at the edge (the tmux walk found "c Compare the two marked  o R" and no Quit)."""
    from textual.widgets._footer import FooterKey

    from screens.runs import RunsScreen

    app = ConsoleApp(serving(runs_root), clock=fixed_clock)
    async with app.run_test(size=NARROW) as pilot:
        await pilot.pause()
        await pilot.press(key)
        await settle(pilot, lambda: isinstance(app.screen, ResultsScreen if key == "o" else RunsScreen))
        keys = list(app.screen.query(FooterKey))
        assert keys and any(k.description == "Quit" for k in keys)
        palette = [k for k in keys if k.description == "palette"]  # docked at the right edge
        edge = palette[0].region.x if palette else NARROW[0]
        cut = [k.description for k in keys if k not in palette and k.region.right > edge]
        assert not cut, f"footer keys past the edge at 80 columns: {cut}"
