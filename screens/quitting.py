"""How the console is left: `q`, ctrl+q and ctrl+c guarded alike (the app's `QuitGuard`).

With the service down (stopped or paused by a run), quitting asks: leave it down (exit 3, the
terminal keeps the line that names the run and the command that restarts it), restart it first, or
wait until it is ready. With a run going, it asks before cancelling it. Otherwise it quits at once.
Kept apart from `screens/app.py` so that the app's file stays about its bus, screens and actions.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from rich.text import Text
from textual import work

from console import messages as m
from screens.format import clock
from screens.modals.confirm import QuestionModal
from screens.modals.quit import QuitWhileDownModal

QUIT_DIALOGS = ("quit-while-down", "quit-while-running")  # the ids of the dialogs q, ctrl+q and ctrl+c open


class QuitGuard:
    """The console app's quit (a mixin of `ConsoleApp`, whose state, decider and operator it reads)."""

    state: Any
    operator: Any
    farewell: str | None
    _quit_when_up: bool
    _quit_after_run: bool

    async def action_quit_anywhere(self) -> None:
        """ctrl+q and ctrl+c: the same guarded quit as q, also over a question or a dialog."""
        await self.action_quit()

    async def action_quit(self) -> None:
        if self.state.down_since is not None:
            def answered(answer: str | None) -> None:
                if answer == "leave":
                    self.leave_down_and_quit()
                elif answer == "restart":
                    self._restart_then_quit()
                elif answer == "wait":
                    self._quit_when_up = True
                    self.notify("quitting once the service is ready", timeout=10)

            restarting = self.restarting()
            elsewhere = self.state.driven_elsewhere()
            self.show_screen(QuitWhileDownModal(self.state.down_since, self.now(),
                                                self.can_restart() and not restarting, restarting=restarting,
                                                why_not=self.why_no_restart(),
                                                by=f"run {elsewhere.run_id}" if elsewhere else "this run",
                                                paused=bool(self.state.downtime and self.state.downtime.paused)),
                             callback=answered)
            return
        if self.state.running and not self.read_only:
            step = next((s.name for s in self.state.steps.values() if s.status == "running"), None)

            def confirmed(quit_anyway: bool | None) -> None:
                if quit_anyway:
                    self.call_later(self._quit_now)

            self.show_screen(QuestionModal(
                f"A run is in progress{f' ({step})' if step else ''}. Quit and cancel it? The service is up; "
                "nothing is stopped by quitting, and the run can be resumed later.",
                yes="Quit", no="Stay", id="quit-while-running", refusal="the run goes on"), callback=confirmed)
            return
        await self._quit_now()

    def leave_down_and_quit(self, after_run: bool = False) -> None:
        """Leave the service down and quit, exit 3, leaving on the terminal the line that names the run
        and the command that restarts it (`left_down_line`). `after_run`: the run going is finishing
        (the restart it offered after a no while down was answered `l`): the console goes once it has
        recorded its end; the quit dialog's `l` goes at once."""
        self.farewell = self.left_down_line()
        if after_run and self.state.running:
            self._quit_after_run = True
        else:
            self.call_later(self._quit_now)

    @work(exclusive=True, exit_on_error=False, group="service", description="the restart")
    async def _restart_then_quit(self) -> None:
        await self.operator.restart_service(self.decider)
        still_down = any(isinstance(x, m.Downtime) and x.down_since is not None
                         for x in self.operator.bus.last.values())
        if not still_down:  # (the bus knows before our queue does)
            self.call_later(self._quit_now)

    def left_down_line(self) -> str:
        """The last line left on the terminal when the operator quits with the service down:
        'ct129 DOWN since 02:52:04 (run 20261202-025000-0660); restart: dflash-ops run --resume'."""
        from console.config import DEFAULT_CONFIG_NAME
        from console.procedure.store import default_runs_dir

        config, downtime = self.operator.config, self.state.downtime
        command = ["dflash-ops", "run", "--resume"]
        source = getattr(config, "source", None)
        if source is not None and Path(source).resolve() != (Path.cwd() / DEFAULT_CONFIG_NAME).resolve():
            command += ["--config", str(source)]
        store = getattr(getattr(self.operator, "store", None), "root", None)
        if store is not None and Path(store).resolve() != default_runs_dir().resolve():
            command += ["--runs", str(store)]
        run = f" (run {downtime.run_id})" if downtime is not None and downtime.run_id else ""
        return (f"{config.service.host} DOWN since {clock(self.state.down_since)}{run}; "
                f"restart: {shlex.join(command)}")

    async def _quit_now(self) -> None:
        await self._stop_console()
        code = self.exit_status()
        # Once the screen is gone, the terminal keeps what was left down and how to restart it.
        self.exit(code, return_code=code, message=Text(self.farewell) if self.farewell else None)

    def exit_status(self) -> int:
        """0; or the finished run's: 1 failed with the service up, 3 failed with it still down
        (a failed run whose service was restarted from here since then counts as up)."""
        finished = self.state.finished
        if self.farewell is not None:  # the operator left the service down: as a run that failed down
            return 3
        if finished is None:
            return 0
        if finished.exit_code == 3 and self.state.down_since is None:
            return 1
        return finished.exit_code
