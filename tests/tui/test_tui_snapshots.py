"""Snapshots of the console (pytest-textual-snapshot): fixed terminal sizes, fixed telemetry
published as real message objects on a real bus, a fixed clock, no blinking cursor, no ETA, no
indeterminate bar. Update the baselines with `--snapshot-update` after looking at them."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from screens.app import ConsoleApp
from screens.modals.confirm import ConfirmModal
from screens.modals.holders import HoldersModal
from screens.modals.quit import QuitWhileDownModal
from screens.plan import PlanScreen
from screens.results import ResultsScreen
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

WIDE, NARROW = (120, 40), (80, 24)


def serving(runs_dir: Path | None = None) -> StandinOperator:
    op = StandinOperator(runs_dir=runs_dir)
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


@SIZES
def test_dashboard_mid_window(snap_compare, size):
    """Down, the extraction going: the banner with the expected time back, the job's time left."""
    op = serving()

    async def window(pilot) -> None:
        await pilot.pause()
        mid_window(op)  # published to the running console, as the engine would
        await settle(pilot)

    assert snap_compare(ConsoleApp(op, clock=fixed_clock), terminal_size=size, run_before=window)


@SIZES
def test_dashboard_serving(snap_compare, size):
    op = serving()
    assert snap_compare(ConsoleApp(op, clock=fixed_clock), terminal_size=size, run_before=settle)


@SIZES
def test_confirm_stop_modal(snap_compare, size):
    op = serving()
    app = ConsoleApp(op, clock=fixed_clock)

    async def ask(pilot) -> None:
        await op.plan()
        asyncio.ensure_future(app.decider.decide(stop_confirmation()))
        await settle(pilot, lambda: isinstance(app.screen, ConfirmModal))

    assert snap_compare(app, terminal_size=size, run_before=ask)


@SIZES
def test_holders_modal(snap_compare, size):
    """The command first; at 80 x 24 the body scrolls and the buttons stay on screen."""
    op = serving()
    app = ConsoleApp(op, clock=fixed_clock)

    async def ask(pilot) -> None:
        await pilot.pause()
        mid_window(op)
        op.publish(stuck_telemetry())
        op.publish(holders_found())
        await settle(pilot)
        asyncio.ensure_future(app.decider.decide(holders_confirmation()))
        await settle(pilot, lambda: isinstance(app.screen, HoldersModal))

    assert snap_compare(app, terminal_size=size, run_before=ask)


@SIZES
def test_restart_modal_while_down(snap_compare, size):
    """The restart's impact under the command, the DOWN banner above the modal."""
    op = serving()
    app = ConsoleApp(op, clock=fixed_clock)

    async def ask(pilot) -> None:
        await pilot.pause()
        mid_window(op)
        await settle(pilot, lambda: app.state.down_since is not None)
        asyncio.ensure_future(app.decider.decide(restart_confirmation()))
        await settle(pilot, lambda: isinstance(app.screen, ConfirmModal))

    assert snap_compare(app, terminal_size=size, run_before=ask)


@SIZES
def test_quit_while_down_modal(snap_compare, size):
    op = serving()
    app = ConsoleApp(op, clock=fixed_clock)

    async def quit_(pilot) -> None:
        await pilot.pause()
        mid_window(op)
        await settle(pilot, lambda: app.state.down_since is not None)
        await pilot.press("q")
        await settle(pilot, lambda: isinstance(app.screen, QuitWhileDownModal))

    assert snap_compare(app, terminal_size=size, run_before=quit_)


@SIZES
def test_plan_screen(snap_compare, size):
    op = serving()
    app = ConsoleApp(op, clock=fixed_clock)

    async def plan(pilot) -> None:
        await pilot.press("p")
        await settle(pilot, lambda: isinstance(app.screen, PlanScreen))

    assert snap_compare(app, terminal_size=size, run_before=plan)


@SIZES
def test_results_summary(snap_compare, size, runs_root: Path):
    app = ConsoleApp(serving(runs_root), clock=fixed_clock)

    async def open_results(pilot) -> None:
        await pilot.press("o")
        await settle(pilot, lambda: isinstance(app.screen, ResultsScreen))

    assert snap_compare(app, terminal_size=size, run_before=open_results)


@SIZES
def test_results_per_prompt(snap_compare, size, runs_root: Path):
    app = ConsoleApp(serving(runs_root), clock=fixed_clock)

    async def per_prompt(pilot) -> None:
        await pilot.press("o")
        await settle(pilot, lambda: isinstance(app.screen, ResultsScreen))
        await pilot.press("2")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=per_prompt)


@SIZES
def test_results_window_timeline(snap_compare, size, runs_root: Path):
    app = ConsoleApp(serving(runs_root), clock=fixed_clock)

    async def open_window(pilot) -> None:
        await pilot.press("o")
        await settle(pilot, lambda: isinstance(app.screen, ResultsScreen))
        await pilot.press("6")
        await settle(pilot)

    assert snap_compare(app, terminal_size=size, run_before=open_window)
