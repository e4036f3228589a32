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
