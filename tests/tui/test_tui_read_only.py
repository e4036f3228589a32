"""A read-only console (`console --read-only`, each browser of `dflash-ops serve`, a replay) writes
nothing: no key and no command of its palette exports a report or saves a screenshot (issue 42)."""

from __future__ import annotations

import asyncio
import hashlib
import io
from pathlib import Path

from rich.console import Console
from textual.widgets import Static

from screens.app import ConsoleApp
from screens.results import ResultsScreen
from tests.tui.standin import StandinOperator, fixed_clock


def tree(root: Path) -> dict[str, tuple[str, int, int]]:
    """Every file under `root`: its sha256, inode and modification time (a file rewritten whole, even
    with the same bytes, counts as written)."""
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_ino,
                                       p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*")) if p.is_file()}


# Every command a read-only console's palette may offer: none acts or writes (the browser test runs each).
READ_ONLY_COMMANDS = {"Open results", "Compare runs", "Help", "Quit", "Theme", "Maximize", "Minimize"}


def shown_in(screen) -> str:
    """What a screen's Statics show, as plain text."""
    out = Console(width=200, file=io.StringIO(), record=True, color_system=None)
    for widget in screen.query(Static):
        out.print(widget.content)
    return out.export_text()


async def until(pilot, condition, timeout: float = 20.0) -> None:
    async with asyncio.timeout(timeout):
        while not condition():
            await pilot.pause(0.02)


async def test_read_only_results_export_nothing_and_say_why(runs_root: Path) -> None:
    op = StandinOperator(runs_dir=runs_root, read_only=True)
    op.seed()
    app = ConsoleApp(op, clock=fixed_clock)
    before = tree(runs_root)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("o")
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        offered = {key for key, active in app.active_bindings.items() if active.enabled}
        assert "d" in offered and "e" not in offered  # the footer offers no export
        await pilot.press("e")
        await until(pilot, lambda: any("read-only" in str(n.message) for n in app._notifications))
        assert not app.screen.query_one("#exported", Static).display
        titles = {c.title for c in app.get_system_commands(app.screen)}
        assert "Open results" in titles and titles <= READ_ONLY_COMMANDS, titles  # no Screenshot: it writes a file
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.id == "help")
        shown = shown_in(app.screen)
        assert "1..7" in shown and "export report.md" not in shown and "writes a file" in shown
    assert tree(runs_root) == before  # nothing written: no report.md, no report.json


async def test_an_acting_console_still_exports(runs_root: Path) -> None:
    op = StandinOperator(runs_dir=runs_root)
    op.seed()
    app = ConsoleApp(op, clock=fixed_clock)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("o")
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        assert "Screenshot" in {c.title for c in app.get_system_commands(app.screen)}
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.id == "help")
        assert "export report.md" in shown_in(app.screen)
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        await pilot.press("e")
        await until(pilot, lambda: (app.screen.data.run_dir / "report.md").is_file())


async def test_a_read_only_console_opened_on_a_paused_server_says_paused_by_which_run_and_what_is_released(
        tmp_path: Path) -> None:
    """Issue 40 item 6: the pause route's server, paused by a run another console drives, read from
    the store alone: the banner and the service panel say PAUSED since the pause, by that run, with
    the memory it released; never DOWN, never stopped."""
    from console.procedure.state import Owner
    from console.procedure.store import RunStore
    from screens.widgets.downtime_banner import DowntimeBanner
    from screens.widgets.service_panel import ServicePanel
    from tests.tui.standin import T0

    run = RunStore(tmp_path).create(None, None)
    run.state.route, run.state.owner = "pause", Owner.this_process()
    svc = run.state.service
    svc.paused, svc.paused_at, svc.pauses = True, T0 - 60, 1
    svc.released, svc.released_tags, svc.released_at, svc.releases = ["kv_cache"], ["kv_cache"], T0 - 55, 1
    run.save()
    op = StandinOperator(runs_dir=tmp_path, read_only=True)
    app = ConsoleApp(op, clock=fixed_clock)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.screen.query_one(DowntimeBanner).has_class("down"))
        await until(pilot, lambda: "released" in shown_in(app.screen))
        banner = Console(width=200, file=io.StringIO(), record=True, color_system=None)
        banner.print(app.screen.query_one(DowntimeBanner).content)
        said = banner.export_text()
        assert said.startswith("SERVER PAUSED 1 min 30 s since 09:34:00") and f"run {run.run_id}" in said
        assert "released: kv_cache" in said
        panel = Console(width=200, file=io.StringIO(), record=True, color_system=None)
        panel.print(app.screen.query_one(ServicePanel).content)
        shown = panel.export_text()
        assert f"paused by run {run.run_id} since 09:34:00" in shown and "released: kv_cache" in shown
        assert "DOWN" not in shown and "stopped by" not in shown
        await pilot.press("q")  # the quit question says paused too: never "down", never "stopped"
        await until(pilot, lambda: app.screen.id == "quit-while-down")
        asked = shown_in(app.screen)
        assert f"The server is paused: its requests held by run {run.run_id}" in asked, asked
        assert "leaves it paused until someone gives it back" in asked and "stopped" not in asked
        from textual.widgets import Button

        assert str(app.screen.query_one("#leave", Button).label) == "Leave it paused (l)"


async def test_a_console_opened_on_a_run_that_left_the_server_paused_offers_it_as_paused(tmp_path: Path) -> None:
    """Issue 40 item 6: a run whose console is gone left the server paused. A new console's offer to
    resume it says the server is PAUSED (its requests held) and that r gives it back, and its banner
    says paused from the first second: never "DOWN", never "Unfinished run ...: resume / discard"."""
    import os
    import subprocess
    import time

    from console.procedure.state import Owner, current_user
    from console.procedure.store import RunStore
    from screens.widgets.downtime_banner import DowntimeBanner
    from tests.tui.standin import T0

    console = subprocess.Popen(["sleep", "30"])  # the console that paused it, killed since
    with open(f"/proc/{console.pid}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    console.kill()
    console.wait()
    run = RunStore(tmp_path).create(None, None)
    run.state.route, run.state.started, run.state.status = "pause", True, "running"
    run.state.owner = Owner(current_user(), os.uname().nodename, console.pid, time.time() - 60, ticks)
    svc = run.state.service
    svc.paused, svc.paused_at, svc.pauses = True, T0 - 60, 1
    svc.released, svc.released_tags, svc.released_at, svc.releases = ["kv_cache"], ["kv_cache"], T0 - 55, 1
    run.save()
    op = StandinOperator(runs_dir=tmp_path)
    op.unfinished = run.run_id  # the store's answer (the stand-in's, as `Operator.unfinished_run`)
    app = ConsoleApp(op, clock=fixed_clock)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, lambda: app.screen.id == "resume")
        asked = shown_in(app.screen)
        assert f"Run {run.run_id} did not finish and left the server PAUSED (its requests held) since 09:34:00" \
            in asked, asked
        assert "r gives the server its memory back" in asked and "DOWN" not in asked
        banner = next(s for s in app.screen_stack if s.query(DowntimeBanner)).query_one(DowntimeBanner)
        assert banner.has_class("down") and str(banner.content).startswith("SERVER PAUSED"), banner.content
