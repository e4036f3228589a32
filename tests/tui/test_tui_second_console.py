"""A run another live console drives, seen from a second console (issue 27, item 1): the console
offers neither its resume nor `r` (that console restarts the service itself), and says who drives
it: the run, the user, the host and the pid."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from console.procedure.state import Owner, current_user
from console.procedure.store import RunStore
from screens.modals.confirm import QuestionModal
from tests.tui.standin import T0
from tests.tui.test_tui_operator import Clock, console, until
from tests.tui.test_tui_walk import WIDE, banner_text, serving


def live_console() -> tuple[subprocess.Popen, Owner]:
    """Another console: a real process that runs, named as the run's owner (pid and start ticks)."""
    proc = subprocess.Popen(["sleep", "120"])
    with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return proc, Owner(current_user(), os.uname().nodename, proc.pid, time.time() - 60, ticks)


async def test_r_and_the_resume_are_not_offered_while_another_live_console_drives_the_run(tmp_path: Path) -> None:
    proc, owner = live_console()
    try:
        run = RunStore(tmp_path / "runs").create(None, None)
        state = run.state
        state.started, state.status, state.route, state.owner = True, "running", "window", owner
        state.service.stopped_at, state.service.down, state.service.stops = T0, True, 1
        for name in ("preflight", "stage", "cache", "stop", "free-vram"):
            state.step(name).status = "done"
        state.step("extract").status = "running"
        run.save()
        op = serving(runs_dir=tmp_path / "runs")
        op.unfinished = run.run_id
        async with console(op, WIDE, clock=Clock()) as (app, pilot):
            await until(pilot, lambda: app.state.live is not None and app.state.down_since is not None)
            await pilot.pause()
            assert not any(isinstance(s, QuestionModal) for s in app.screen_stack), "its resume was offered"
            said = " ".join(n.message for n in app._notifications)
            assert f"run {run.run_id} is running, driven by {owner.describe()}" in said
            assert "it is not resumed from here" in said
            app.refresh_banners()
            text = banner_text(app)
            assert f"run {run.run_id} by {current_user()}@{owner.host} pid {proc.pid}" in text, text
            assert "r restarts it" not in text
            assert not app.can_restart()
            assert not any(c.title == "Restart the service" for c in app.get_system_commands(app.screen))
            await pilot.press("r")
            await pilot.pause()
            why = app.why_no_restart()
            assert f"run {run.run_id} is driven by another console" in why and f"pid {proc.pid}" in why
            assert any(why in n.message for n in app._notifications)
            assert app.state.down_since == T0  # nothing restarted it
            # Its console gone, the run is this console's to resume: r comes back.
            proc.kill()
            proc.wait()
            await until(pilot, lambda: app.state.live is not None and app.state.live.console_gone)
            assert app.can_restart()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
