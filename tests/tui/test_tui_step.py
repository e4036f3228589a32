"""Issue 43.1, `run --step` in the console: one step, then `n` for the next. Driven by keys (Pilot)
over a stand-in operator that does one step a run, as the engine's `one_step` does (the engine's own
walk, step by step to the end, is `tests/test_engine_sweep.py`: test_step_mode_...)."""

from __future__ import annotations

from textual.widgets import Static

from console import messages as m
from screens.modals.confirm import ConfirmModal, RestartOrLeaveModal
from screens.modals.holders import HoldersModal
from screens.widgets.stepper import Stepper
from tests.tui.standin import (
    StandinOperator,
    holders_confirmation,
    holders_found,
    stop_confirmation,
    stuck_telemetry,
)
from tests.tui.test_tui_operator import Clock, console, footer_keys, on_top, text_of, until

WIDE = (120, 40)


class SteppedRun(StandinOperator):
    """Each run does the next step of the window and ends paused, as `run --step` drives the console;
    the third says no to the holders, and the restart then offered says what a no leaves (the
    engine's compensation: `ending.declined_while_down`)."""

    def __init__(self) -> None:
        super().__init__()
        self.seed(history=5)
        self.calls: list[tuple[object, bool]] = []

    async def run(self, decider, resume=None, route=None, no_restart=True, one_step=False) -> m.RunFinished:
        self.calls.append((resume, one_step))
        await self.plan()
        if len(self.calls) == 1:
            for name in ("preflight", "stage", "cache"):
                self._step(name, "running", self.now)
                self._step(name, "done", self.now)
            self.unfinished = self.run_id
            return self._finish("paused", 4, True, "paused after cache (one step at a time)")
        if len(self.calls) == 2:
            self._step("stop", "running", self.now)
            assert await self._ask(decider, stop_confirmation())
            self.publish(m.Downtime(self.run_id, self.now))
            self._step("stop", "done", self.now)
            return self._finish("paused", 3, False, "paused after stop (one step at a time)")
        self._step("free-vram", "running", self.now)
        self.publish(stuck_telemetry(self.now))
        self.publish(holders_found())
        assert not await self._ask(decider, holders_confirmation())
        self._step("free-vram", "refused", self.now, detail="holders left running")
        leaves = (f"the service stays DOWN, stopped by run {self.run_id} at 09:35:00; "
                  f"`dflash-ops run --resume {self.run_id}` restarts it later (exit 3)")
        restart = m.Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang-qwen"),
                                 "free-vram: the operator refused to end 2 processes holding VRAM; free-vram must run "
                                 "while the service is down, so this window cannot go on: brings sglang-qwen back",
                                 False, leaves=leaves)
        if await self._ask(decider, restart):
            self.publish(m.Downtime(self.run_id, None, restarted_at=self.now))
            return self._finish("refused", 1, True, "the restart was approved")
        return self._finish("refused", 3, False, "free-vram refused; THE SERVICE IS STILL DOWN")


def stepper_text(app) -> str:
    return " ".join(text_of(app.screen.query_one(Stepper)).split())


async def test_n_runs_the_next_step_named_in_the_footer_and_a_no_while_down_offers_restart_or_leave():
    op = SteppedRun()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await pilot.pause()
        assert "n" not in footer_keys(app)  # no step waits: n still starts one (a new run's first step)
        await pilot.press("n")
        await until(pilot, lambda: app.state.finished is not None and not app.state.running)
        assert op.calls == [(None, True)]
        # Paused after a step: the footer names n, and the steps say which step it runs.
        await until(pilot, lambda: "n" in footer_keys(app) and "n runs the next step, stop" in stepper_text(app))
        await pilot.press("n")  # the stop's question, then paused with the service down
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: len(op.calls) == 2 and app.state.finished is not None and not app.state.running)
        assert op.calls[-1] == (op.run_id, True)  # the run resumed, one step: the next it has not settled
        await until(pilot, lambda: {"n", "r", "q"} <= footer_keys(app)  # next step, restart now, quit
                    and "n runs the next step, free-vram" in stepper_text(app))
        await pilot.press("n")
        await until(pilot, lambda: on_top(app, HoldersModal))
        await pilot.press("n")  # no to a step that must run while the service is down
        await until(pilot, lambda: on_top(app, RestartOrLeaveModal))
        said = " ".join(" ".join(text_of(w) for w in app.screen.query(Static)).split())
        assert "restart it on ct129 now, or leave it down for later?" in said
        assert "$ systemctl start sglang-qwen" in said  # what "restart now" runs, literally
        assert f"Leave it down for later (l): the service stays DOWN, stopped by run {op.run_id}" in said
        assert f"`dflash-ops run --resume {op.run_id}` restarts it later (exit 3); this console quits." in said
        assert {"y", "l", "n"} <= footer_keys(app) and app.focused.id == "yes"
        await pilot.press("l")
        await until(pilot, lambda: not app.is_running)
    assert op.decisions[-1] == ("restart", False)
    assert app.return_code == 3
    assert app.farewell == f"ct129 DOWN since 09:35:{int(app.state.down_since - 1_764_581_700):02d} " \
                           f"(run {op.run_id}); restart: dflash-ops run --resume"
