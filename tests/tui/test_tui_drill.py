"""The console on the drill, end to end by keys: the real Operator, the real engine, real SSH to the
rehearsal hosts, the real workers. Each modal is answered as an operator would.

In order (one drill for the module; its first stop leaves VRAM held by a leftover process):
refusing the stop changes nothing; the whole window walked by keys (the DOWN banner appears after
the stop and leaves after ready, the holders modal ends the leftover); refusing the restart leaves
the service down, and quitting then asks first (r restarts it, then the console quits).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from console import messages as m
from console.config import load_config
from console.drill.hosts import status
from console.drill.rearm import rearm
from console.operator import Operator
from screens.app import ConsoleApp, CoreMessage, ProcedureEnded
from screens.decider import DecisionAsked
from screens.modals.confirm import ConfirmModal
from screens.modals.error import ErrorModal
from screens.modals.holders import HoldersModal
from screens.modals.quit import QuitWhileDownModal
from screens.results import ResultsScreen, summary_of
from screens.widgets.downtime_banner import DowntimeBanner

SIZE = (120, 40)
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def drill_config(shared_drill_dir: Path) -> Path:
    """The test process's drill (tests/window_fixtures.py) as `up` leaves it, for this module's tests in turn."""
    return Path(rearm(shared_drill_dir, say=lambda _: None))


class Seen(list):
    def __call__(self, message) -> None:
        self.append(message)

    def core(self, kind: type) -> list:
        return [x.payload for x in self if isinstance(x, CoreMessage) and isinstance(x.payload, kind)]


async def until(pilot, condition, timeout: float = 120.0, what: str = "") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause(0.05)


def banner_down(app: ConsoleApp) -> bool:
    dashboard = next(s for s in app.screen_stack if s.id == "dashboard")
    return dashboard.query_one(DowntimeBanner).has_class("down")


def console(config: Path, runs: Path) -> ConsoleApp:
    return ConsoleApp(Operator(load_config(config), runs_dir=runs))


async def test_refusing_the_stop_changes_nothing(drill_config: Path, tmp_path: Path):
    seen = Seen()
    app = console(drill_config, tmp_path / "runs")
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await until(pilot, lambda: app.state.service is not None and app.state.service.health is not None
                    and app.state.service.health.ready, what="the service ready")
        await pilot.press("g")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal) and app.focused is not None
                    and app.focused.screen is app.screen, what="the stop's confirmation")
        assert app.screen.confirmation.step == "stop" and app.focused.id == "no"
        await pilot.press("n")
        await until(pilot, lambda: any(isinstance(x, ProcedureEnded) for x in seen), what="the run's end")
        finished = next(x for x in seen if isinstance(x, ProcedureEnded)).finished
        assert finished.status == "refused" and finished.service_up
        assert all(d.down_since is None for d in seen.core(m.Downtime))
        assert not banner_down(app)
        await pilot.press("q")
    drill = status(drill_config.parent)
    assert drill.up and "running" in "\n".join(drill.lines())


async def test_the_window_by_keys(drill_config: Path, tmp_path: Path):
    seen = Seen()
    app = console(drill_config, tmp_path / "runs")
    answered: list[str] = []
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.press("g")
        while not any(isinstance(x, ProcedureEnded) for x in seen):
            await until(pilot, lambda: isinstance(app.screen, ConfirmModal | HoldersModal | ErrorModal)
                        or any(isinstance(x, ProcedureEnded) for x in seen), what="a question or the end")
            screen = app.screen
            if isinstance(screen, ErrorModal):
                raise AssertionError(f"error during the window: {[r.message for r in screen.reports]}")
            if isinstance(screen, ConfirmModal | HoldersModal):
                step = screen.confirmation.step
                answered.append(step)
                if step == "stop":
                    assert not banner_down(app)
                if step == "free-vram":
                    assert isinstance(screen, HoldersModal) and screen.found is not None
                    assert screen.found.holders and "remote.endpids" in " ".join(screen.confirmation.argv)
                    assert banner_down(app)  # the stop happened
                if step == "restart":
                    assert banner_down(app)
                await pilot.press("y")
                await until(pilot, lambda s=screen: app.screen is not s, what="the modal to close")
        finished = next(x for x in seen if isinstance(x, ProcedureEnded)).finished
        assert finished.status == "done", finished.message
        await until(pilot, lambda: not banner_down(app), what="the banner to leave")
        assert [s for s in answered if s in ("stop", "free-vram", "restart")] == ["stop", "free-vram", "restart"]
        assert [d.confirmation.step for d in seen if isinstance(d, DecisionAsked)] == answered
        assert {s.name: s.status for s in app.state.steps.values()}["report"] == "done"
        await pilot.press("o")
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen), what="the results")
        summary = summary_of(app.screen.query_one("#summary-table Static").content)
        assert "reference (reference)" in str(summary.columns[1].header)
        await pilot.press("escape", "q")


async def test_refused_restart_leaves_it_down_and_quit_asks(drill_config: Path, tmp_path: Path):
    seen = Seen()
    app = console(drill_config, tmp_path / "runs")
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.press("g")
        while not any(isinstance(x, ProcedureEnded) for x in seen):
            await until(pilot, lambda: isinstance(app.screen, ConfirmModal | HoldersModal | ErrorModal)
                        or any(isinstance(x, ProcedureEnded) for x in seen), what="a question or the end")
            screen = app.screen
            if isinstance(screen, ConfirmModal | HoldersModal):
                await pilot.press("n" if screen.confirmation.step == "restart" else "y")
                await until(pilot, lambda s=screen: app.screen is not s, what="the modal to close")
            elif isinstance(screen, ErrorModal):
                await pilot.press("escape")
        finished = next(x for x in seen if isinstance(x, ProcedureEnded)).finished
        assert not finished.service_up and finished.exit_code == 3
        await until(pilot, lambda: app.state.down_since is not None, what="the downtime")
        while isinstance(app.screen, ErrorModal):  # the failed run is reported
            await pilot.press("escape")
            await pilot.pause()
        assert banner_down(app)
        await pilot.press("q")
        await until(pilot, lambda: isinstance(app.screen, QuitWhileDownModal), what="the question on quit")
        await pilot.press("r")
        await until(pilot, lambda: isinstance(app.screen, ConfirmModal), what="the restart's confirmation")
        assert app.screen.confirmation.step == "restart"
        await pilot.press("y")
        await until(pilot, lambda: not app.is_running, timeout=180, what="the console to quit after the restart")
    assert app.state.down_since is None
    assert seen.core(m.Downtime)[-1].down_since is None
    assert app.return_code == 1  # the run failed; the service is up again
