"""Earlier runs: the list (date, status, route, downtime, headline tau per drafter), and two of them
side by side. Space marks a run (two at most), Enter opens its results, c compares the two marked."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static

from console.procedure.store import RunSummary
from console.views.units import duration
from screens.errors import StaysUp
from screens.widgets.downtime_banner import DowntimeBanner

if TYPE_CHECKING:
    from screens.window import ConsoleWindow


def _tau(run_dir: Path) -> dict[str, float | None]:
    """Vanilla tau (macro) per drafter from the run's results.json, else its headline."""
    path = Path(run_dir) / "results" / "results.json"
    try:
        drafters = json.loads(path.read_text(encoding="utf-8")).get("drafters", {})
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return {}
    return {name: ((d.get("tau") or {}).get("vanilla") or {}).get("macro") for name, d in drafters.items()}


def headline(run: RunSummary) -> dict[str, float | None]:
    return dict(run.headline) or _tau(run.dir)


def compare_table(a: RunSummary, b: RunSummary) -> Table:
    """Two runs side by side: status, route, downtime and each drafter's vanilla tau, with the change."""
    ta, tb = headline(a), headline(b)
    names = list(dict.fromkeys([*ta, *tb]))
    # the labels fold (a long drafter name), the run ids and the figures stay whole
    table = Table(title=f"{a.run_id}  vs  {b.run_id}", title_justify="left", header_style="bold")
    table.add_column("", style="bold", overflow="fold", min_width=8)
    for run in (a, b):
        table.add_column(run.run_id, justify="right", no_wrap=True,
                         min_width=max(len(run.run_id), len(run.status), len(duration(run.downtime_s))))
    table.add_column("change", justify="right", no_wrap=True, min_width=len("change"))
    table.add_row("status", a.status, b.status, "")
    table.add_row("route", a.route or "-", b.route or "-", "")
    change = ""
    if a.downtime_s is not None and b.downtime_s is not None:
        delta = b.downtime_s - a.downtime_s
        change = Text(f"{'+' if delta >= 0 else '-'}{duration(abs(delta))}", style="red" if delta > 0 else "green")
    table.add_row("downtime", duration(a.downtime_s), duration(b.downtime_s), change)
    for name in names:
        va, vb = ta.get(name), tb.get(name)
        delta = Text("")
        if va is not None and vb is not None:
            d = vb - va
            delta = Text(f"{d:+.2f}", style="green" if d > 0 else "red" if d < 0 else "")
        table.add_row(f"tau vanilla {name}", "-" if va is None else f"{va:.2f}", "-" if vb is None else f"{vb:.2f}",
                      delta)
    return table


class RunsScreen(StaysUp, Screen):
    app: ConsoleWindow
    DEFAULT_CSS = """
    RunsScreen DataTable { height: 1fr; }
    RunsScreen #compare { height: auto; max-height: 50%; border-top: solid $primary-darken-1; }
    RunsScreen .hint { color: $text-muted; height: 1; }
    """
    BINDINGS = [
        # short names: the line above the table says what they do, and at 80 columns every key shows
        Binding("escape", "back", "Back"),
        Binding("space", "mark", "Mark"),
        Binding("enter", "open", "Open", priority=True),
        Binding("o", "open", "Open", show=False),  # as everywhere, o opens results: here the highlighted run's
        Binding("c", "compare", "Compare"),
    ]

    def __init__(self) -> None:
        super().__init__()  # no id: shown again, it replaces itself (ConsoleApp.show_screen)
        self.runs: list[RunSummary] = []
        self.marked: list[str] = []

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield DowntimeBanner()
        yield Static("space marks a run (two at most), c compares them, enter opens a run's results",
                     classes="hint")
        yield DataTable(cursor_type="row", zebra_stripes=True)
        yield VerticalScroll(Static(id="compare-table"), id="compare")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = "earlier runs"
        try:
            self.runs = sorted(self.app.operator.runs(), key=lambda r: r.created_at, reverse=True)
        except Exception as exc:  # noqa: BLE001 - an unreadable store is said, not raised
            from screens.modals.error import report_of

            self.app.show_error(report_of("the runs directory", exc))
        table = self.query_one(DataTable)
        drafters: list[str] = []
        for run in self.runs:
            drafters += [n for n in headline(run) if n not in drafters]
        self.drafters = drafters
        # one row of a few lines per run, so that it fits 80 columns with every value whole: the run's
        # id over its date, its status over its route, each drafter's tau on a line of its own
        table.add_columns("", "run, when", "status, route", "downtime", "tau vanilla (macro)")
        for run in self.runs:
            row = self._row(run)
            table.add_row(*row, key=run.run_id, height=max(cell.count("\n") + 1 for cell in row))
        self.query_one("#compare").display = False
        if not self.runs:
            self.query_one(".hint", Static).update("no runs yet in the run store")

    def _row(self, run: RunSummary) -> list[str]:
        tau = headline(run)
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(run.created_at)) if run.created_at else "?"
        taus = "\n".join(f"{n} {'-' if tau.get(n) is None else f'{tau[n]:.2f}'}" for n in self.drafters) or "-"
        return ["●" if run.run_id in self.marked else " ", f"{run.run_id}\n{when}",
                f"{run.status}\n{run.route or '-'}", duration(run.downtime_s), taus]

    def _current(self) -> RunSummary | None:
        table = self.query_one(DataTable)
        if not self.runs or table.cursor_row is None or table.cursor_row >= len(self.runs):
            return None
        return self.runs[table.cursor_row]

    def action_mark(self) -> None:
        run = self._current()
        if run is None:
            return
        if run.run_id in self.marked:
            self.marked.remove(run.run_id)
        else:
            self.marked = [*self.marked[-1:], run.run_id]
        table = self.query_one(DataTable)
        for r in self.runs:
            table.update_cell(r.run_id, table.ordered_columns[0].key, "●" if r.run_id in self.marked else " ")

    def action_compare(self) -> None:
        if len(self.marked) != 2:
            self.notify("mark two runs with space first", severity="warning")
            return
        by_id = {r.run_id: r for r in self.runs}
        a, b = sorted((by_id[i] for i in self.marked), key=lambda r: r.created_at)
        self.query_one("#compare-table", Static).update(compare_table(a, b))
        self.query_one("#compare").display = True

    def action_open(self) -> None:
        run = self._current()
        if run is not None:
            self.app.open_results(Path(run.dir))

    def action_back(self) -> None:
        self.app.pop_screen()
