"""A run's results: the summary (drafters side by side, ratio to the reference; a ratio under 1 in
red), the warnings, the layer provenance per drafter and the feature soundness per layer; per
prompt (the prompt column pinned, `d` picks whose columns show); the per-position acceptance chart;
parity; the kernels of every host; and the window's timeline (VRAM and the service's state over
the run). Number keys pick the tab, the arrows scroll it at once (the tab's table has the focus).
`e` writes report.md and report.json into the run dir."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import DataTable, Footer, Header, Static, TabbedContent, TabPane
from textual_plotext import PlotextPlot

from console.procedure.store import JOURNAL, STATE, TELEMETRY, for_replay_only, read_jsonl
from console.views.probe_table import probe_table
from console.views.report import forecast_error_line, window_rows, window_table
from console.views.tables import (
    drafter_order,
    parity_soundness_table,
    parity_table,
    per_prompt_rows,
    provenance_table,
    soundness_table,
    summary_table,
    warning_lines,
    warnings_block,
)
from console.views.units import duration
from screens.errors import StaysUp
from screens.format import clock
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.online import OnlinePanel, read_online

if TYPE_CHECKING:
    from screens.window import ConsoleWindow

RESULTS = "results"
COLOURS = ("cyan", "yellow", "blue", "white", "magenta", "green")  # red and green mark the stop and the ready


@dataclass
class RunData:
    """What a run directory holds, read once."""

    run_dir: Path
    results: dict[str, Any]
    parity: dict[str, Any] | None
    probes: dict[str, dict] | None
    state: dict[str, Any] = field(default_factory=dict)
    telemetry: list[dict[str, Any]] = field(default_factory=list)


def read_run_dir(run_dir: Path) -> RunData:
    """The results (complete, by their manifest), the state and the telemetry log of a run directory.
    A results directory given directly works too (no timeline then). Raises the report's UsageError."""
    from console.procedure.results import read_run

    results_dir = run_dir / RESULTS if (run_dir / RESULTS).is_dir() else run_dir
    results, parity, probes = read_run(results_dir)
    state: dict[str, Any] = {}
    if (run_dir / STATE).is_file():
        try:
            state = json.loads((run_dir / STATE).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError):
            state = {}
    return RunData(run_dir, results, parity, probes, state, read_jsonl(run_dir / TELEMETRY))


# --- the window timeline ------------------------------------------------------------------------

def vram_series(records: list[dict[str, Any]], scale: float = 60.0
                ) -> tuple[float | None, dict[str, tuple[list[float], list[float]]]]:
    """Per host (time since the first sample in units of `scale` seconds, % of all its GPUs'
    memory in use): hosts of different sizes share one axis."""
    t0 = min((r["t"] for r in records if "sample" in r), default=None)
    series: dict[str, tuple[list[float], list[float]]] = {}
    for r in records:
        sample = r.get("sample")
        if not sample or t0 is None:
            continue
        gpus = sample.get("gpus", [])
        used = sum((g.get("mem_used_mib") or 0) for g in gpus)
        total = sum((g.get("mem_total_mib") or 0) for g in gpus)
        if not total:
            continue
        xs, ys = series.setdefault(r["host"], ([], []))
        xs.append((r["t"] - t0) / scale)
        ys.append(100 * used / total)
    return t0, series


def held(state: dict[str, Any]) -> tuple[float | None, float | None, str]:
    """When this run held the service, and the word for it: stopped to ready ("down"), or on the
    pause route, where the server is never stopped, paused to continued ("paused")."""
    service = state.get("service") or {}
    if state.get("route") == "pause":
        return service.get("paused_at"), service.get("continued_at"), "paused"
    return service.get("stopped_at"), service.get("ready_at"), "down"


class ServiceStrip:
    """The service over the run on one line: green while up, red while this run held it (down, or
    paused on the pause route), then for how long. The bar takes what the width leaves (at most 60
    cells), so that the time held and its clock times stay whole on the line."""

    def __init__(self, state: dict[str, Any], t0: float | None, t1: float | None) -> None:
        self.state, self.t0, self.t1 = state, t0, t1

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        tail = self.tail()
        room = options.max_width - len("service ") - cell_len(tail.plain)
        yield self.strip(max(10, min(60, room)))

    def tail(self) -> Text:
        stopped, ready, word = held(self.state)
        if self.t0 is None or self.t1 is None or self.t1 <= self.t0 or stopped is None:
            return Text("")
        not_back = "NOT CONTINUED" if word == "paused" else "NOT RESTARTED"
        took = f"{word} {duration(ready - stopped)}" if ready is not None else not_back
        return Text(f"  {took} ({clock(stopped)} to {clock(ready) if ready else '-'})",
                    style="red" if ready is None else "")

    def strip(self, width: int) -> Text:
        stopped, ready, _ = held(self.state)
        t0, t1 = self.t0, self.t1
        text = Text("service ", style="bold")
        if t0 is None or t1 is None or t1 <= t0:
            return text + Text("no telemetry recorded in this run", style="dim")
        for i in range(width):
            t = t0 + (t1 - t0) * (i + 0.5) / width
            down = stopped is not None and t >= stopped and (ready is None or t < ready)
            text.append("█", style="red" if down else "green")
        return text + self.tail()


def steps_table(state: dict[str, Any], t0: float | None) -> Table:
    table = Table(title="Steps", title_justify="left", box=None, header_style="bold", padding=(0, 2, 0, 0))
    for name in ("step", "status", "began", "took", "detail"):
        table.add_column(name, no_wrap=name != "detail", justify="right" if name in ("began", "took") else "left")
    steps = sorted((state.get("steps") or {}).items(),
                   key=lambda item: (item[1].get("started_at") is None, item[1].get("started_at") or 0))
    for name, step in steps:
        began, ended = step.get("started_at"), step.get("ended_at")
        offset = f"+{duration(began - t0)}" if began is not None and t0 is not None else ""
        # The time it worked over all its attempts (never ended - began: that holds the time no console
        # ran it after a crash); its waits on the operator's answers dim beside it, as the stepper does.
        took = Text(duration(step.get("work_s") or 0.0, tenths=True) if began is not None and ended is not None else "")
        if took and (step.get("decision_s") or 0.0) >= 1:
            took.append(f" +{duration(step['decision_s'])}", style="dim")
        table.add_row(name, step.get("status", "?"), offset, took, Text(step.get("detail") or step.get("why") or "",
                                                                          style="dim"))
    return table


TIMELINE_TITLE = "VRAM in use per host, % (red: the stop, green: ready)"
PAUSE_TIMELINE_TITLE = "VRAM in use per host, % (red: the pause, green: continued)"


class TimelinePlot(PlotextPlot):
    """GiB used per host over the run, with the stop and the ready marked."""

    def __init__(self, data: RunData) -> None:
        super().__init__(id="timeline-plot")
        self.data = data

    def on_mount(self) -> None:
        plt = self.plt
        times = [r["t"] for r in self.data.telemetry if "sample" in r]
        span = (max(times) - min(times)) if times else 0.0
        scale, unit = (1.0, "seconds") if span < 180 else (60.0, "minutes")
        t0, series = vram_series(self.data.telemetry, scale)
        for (host, (xs, ys)), colour in zip(series.items(), COLOURS, strict=False):
            plt.plot(xs, ys, label=host, color=colour, marker="braille")
        begin, end, word = held(self.data.state)
        if t0 is not None:
            for at, colour in ((begin, "red"), (end, "green")):
                if at:
                    plt.vline((at - t0) / scale, colour)
        plt.ylim(0, 100)
        # within 80 columns: plotext leaves out a title wider than the plot
        plt.title(PAUSE_TIMELINE_TITLE if word == "paused" else TIMELINE_TITLE)
        plt.xlabel(f"{unit} since the run began")


class AcceptancePlot(PlotextPlot):
    """Per drafter, the share of vanilla rounds that accept at least j slots."""

    def __init__(self, results: dict[str, Any]) -> None:
        super().__init__(id="acceptance-plot")
        self.results = results

    def on_mount(self) -> None:
        plt = self.plt
        longest = 0
        for name, colour in zip(drafter_order(self.results), COLOURS, strict=False):
            curve = [100 * (v or 0.0) for v in (self.results["drafters"][name].get("per_position") or [])]
            longest = max(longest, len(curve))
            if curve:
                plt.plot(list(range(1, len(curve) + 1)), curve, label=name, color=colour, marker="braille")
        plt.ylim(0, 100)
        if longest:
            plt.xticks(list(range(1, longest + 1, max(1, longest // 8))))
        plt.title("accepted at least j slots (% of vanilla rounds)")
        plt.xlabel("slot j")


RATIO = re.compile(r"(\d+\.\d+)x")
TOKENS_LEGEND = "tokens: prompt + completion.  d: the next drafter's columns (all, then one at a time)."


def regressions_in_red(table: Table) -> Table:
    """A ratio to the reference under 1 ('0.85x') in red, over 1 in green: a regression reads at a
    glance. (The table's cells are the shared report's text; only their colour changes here.)"""
    for column in table.columns[1:]:
        cells = column._cells  # rich keeps a column's cells here; restyled in place, order kept
        for i, cell in enumerate(cells):
            if isinstance(cell, str) and RATIO.search(cell):
                text = Text(cell)
                for match in RATIO.finditer(cell):
                    value = float(match.group(1))
                    if value != 1.0:
                        text.stylize("bold red" if value < 1 else "green", match.start(), match.end())
                cells[i] = text
    return table


def _wrappable(renderable: Any) -> Any:
    """A table's label column may wrap: on a narrow terminal the labels fold, the figures stay whole."""
    if isinstance(renderable, Table) and renderable.columns:
        renderable.columns[0].no_wrap = False
        renderable.columns[0].overflow = "fold"
    return renderable


def _scroll(renderable: Any, id: str, fit: bool = False) -> VerticalScroll:
    """A table in a scroll: at its natural width (scrolling sideways when wider than the screen), or,
    with `fit`, folded into the screen's width (the summary: long labels, few columns)."""
    shown = Static(_wrappable(renderable) if fit else renderable, classes="table fit" if fit else "table")
    return VerticalScroll(shown, id=id, classes="result-scroll")


def summary_of(view: Group) -> Table:
    """The drafters' summary table inside the summary tab's view (after the warnings, if any)."""
    return next(part for part in view.renderables if isinstance(part, Table))


def summary_view(results: dict[str, Any]) -> Group:
    """What `run --headless` shows above the per-prompt table: warnings first, the summary, the layer
    provenance per drafter and the feature soundness per extracted layer."""
    parts: list[Any] = []
    if warning_lines(results):
        parts.append(warnings_block(results))
    parts += [regressions_in_red(_wrappable(summary_table(results))), Text(""), _wrappable(provenance_table(results))]
    if results.get("soundness"):
        parts += [Text(""), _wrappable(soundness_table(results["soundness"]))]
    return Group(*parts)


def per_prompt_columns(results: dict[str, Any], drafter: str | None) -> tuple[list[str], list[list[str]]]:
    """The per-prompt table's headers and rows: the prompt and its tokens, then every drafter's
    columns (`drafter` None) or that one drafter's."""
    headers, rows, _ = per_prompt_rows(results)
    keep = [i for i, h in enumerate(headers) if i < 2 or drafter is None or h.startswith(f"{drafter} ")]
    return [headers[i] for i in keep], [[row[i] for i in keep] for row in rows]


class PerPromptTable(DataTable):
    """Per prompt, the prompt column pinned while the others scroll sideways."""

    def __init__(self, results: dict[str, Any]) -> None:
        super().__init__(id="per-prompt-table", zebra_stripes=True, cursor_type="row")
        self.results = results
        self.choices: list[str | None] = [None, *drafter_order(results)]
        self.drafter: str | None = None

    def on_mount(self) -> None:
        self.fixed_columns = 1
        self.show_drafter(self.fitting_choice(self.app.size.width))

    def fitting_choice(self, width: int) -> str | None:
        """Every drafter's columns where they fit the screen, else the first candidate's (the one
        being judged; the reference is its ratio's other half): `d` shows the others."""
        headers, rows = per_prompt_columns(self.results, None)
        needed = sum(max([len(h), *(len(r[i]) for r in rows)]) + 2 for i, h in enumerate(headers))
        candidates = [n for n in self.choices[1:] if n != self.results.get("reference")]
        return None if needed <= width or not candidates else candidates[0]

    def show_drafter(self, drafter: str | None) -> None:
        self.drafter = drafter
        headers, rows = per_prompt_columns(self.results, drafter)
        self.clear(columns=True)
        self.add_columns(*headers)
        self.add_rows(rows)
        self.border_title = f"Per prompt: {drafter or 'every drafter'}"

    def next_drafter(self) -> None:
        self.show_drafter(self.choices[(self.choices.index(self.drafter) + 1) % len(self.choices)])


class ResultsScreen(StaysUp, Screen):
    """One run's results; opened from the dashboard with `o`, or from the runs list."""

    app: ConsoleWindow
    DEFAULT_CSS = """
    ResultsScreen TabbedContent { height: 1fr; }
    ResultsScreen .result-scroll { height: 1fr; overflow-x: auto; border-left: blank; }
    ResultsScreen .result-scroll:focus, ResultsScreen DataTable:focus { border-left: vkey $accent; }
    ResultsScreen #per-prompt-table { height: 1fr; border-left: blank; }
    ResultsScreen .legend { color: $text-muted; height: auto; }
    ResultsScreen .table { width: auto; }
    ResultsScreen .table.fit { max-width: 100%; }
    ResultsScreen #window-pane PlotextPlot { height: 20; }
    ResultsScreen #window-pane .strip { height: auto; }
    ResultsScreen #window-pane .steps { margin-top: 1; }
    ResultsScreen #exported { height: auto; display: none; background: $boost; padding: 0 1; }
    """
    BINDINGS = [
        Binding("escape", "back", "Back"),  # short: at 80 columns every key of the footer shows
        Binding("e", "export", "Export"),
        Binding("1", "tab('summary')", "Summary", show=False),
        Binding("2", "tab('per-prompt')", "Per prompt", show=False),
        Binding("3", "tab('acceptance')", "Acceptance", show=False),
        Binding("4", "tab('parity')", "Parity", show=False),
        Binding("5", "tab('kernels')", "Kernels", show=False),
        Binding("6", "tab('window-pane')", "Window", show=False),
        Binding("7", "tab('online')", "Online", show=False),
        Binding("d", "next_drafter", "Drafter"),
    ]

    def __init__(self, data: RunData) -> None:
        super().__init__()  # no id: shown again, it replaces itself (ConsoleApp.show_screen)
        self.data = data

    def compose(self) -> ComposeResult:
        data = self.data
        yield Header(show_clock=False, icon="")
        yield DowntimeBanner()
        with TabbedContent(initial="summary"):
            with TabPane("1 Summary", id="summary"):
                yield _scroll(summary_view(data.results), "summary-table", fit=True)
            with TabPane("2 Per prompt", id="per-prompt"):
                yield Static(TOKENS_LEGEND, classes="legend")
                yield PerPromptTable(data.results)
            with TabPane("3 Acceptance", id="acceptance"):
                yield AcceptancePlot(data.results)
            with TabPane("4 Parity", id="parity"):
                yield _scroll(Group(parity_table(data.parity), *([Text(""), parity_soundness_table(data.parity)]
                                                                 if data.parity.get("soundness") else []))
                              if data.parity else
                              Text("no parity.json in this run: the parity check did not run", style="dim"),
                              "parity-table")
            with TabPane("5 Kernels", id="kernels"):
                yield _scroll(probe_table(data.probes, "Kernels and environment of every host") if data.probes else
                              Text("no probes.json in this run", style="dim"), "kernel-table", fit=True)
            with TabPane("6 Window", id="window-pane"):
                t0, _ = vram_series(data.telemetry)
                t1 = max((r["t"] for r in data.telemetry if "t" in r), default=None)
                window = window_rows(data.run_dir)  # the forecast against what the window measured
                error = forecast_error_line(data.run_dir)  # its error in one line, seen and not assumed
                # One scroll for the whole tab, the figures first: under the plot, the downtime's rows
                # were off an 80 x 24 screen, past the end of a scroll of their own.
                with VerticalScroll(id="window-scroll", classes="result-scroll"):
                    yield Static(ServiceStrip(data.state, t0, t1), classes="strip")
                    if error or window:
                        yield Static(Group(*([Text(error, style="bold")] if error else []),
                                           *([window_table(window)] if window else [])), classes="forecast")
                    yield TimelinePlot(data)
                    yield Static(steps_table(data.state, t0), classes="steps")
            with TabPane("7 Online", id="online"):  # the online cross-check (screens/widgets/online.py)
                yield OnlinePanel(read_online(data.run_dir))
        yield Static(id="exported")  # what `e` wrote: a line of its own, never a toast over the tables
        yield Footer()

    def on_mount(self) -> None:
        run_id = self.data.state.get("run_id") or self.data.run_dir.name
        self.sub_title = f"results of {run_id}"
        self.call_after_refresh(self._focus_pane)

    def action_tab(self, tab: str) -> None:
        self.query_one(TabbedContent).active = tab
        self.call_after_refresh(self._focus_pane)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        self.call_after_refresh(self._focus_pane)

    def _focus_pane(self) -> None:
        """The shown tab's table takes the focus: the arrows and PageUp/Down scroll it at once."""
        pane = self.query_one(TabbedContent).active_pane
        if pane is None:
            return
        for widget in pane.query("DataTable, .result-scroll"):
            if widget.focusable:
                widget.focus()
                return

    def action_next_drafter(self) -> None:
        self.action_tab("per-prompt")
        self.query_one(PerPromptTable).next_drafter()

    def action_back(self) -> None:
        self.app.pop_screen()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        # read-only writes nothing: the footer offers no export (on_key says why)
        return not (action == "export" and getattr(self.app, "read_only", False))

    def on_key(self, event: events.Key) -> None:
        if event.key == "e" and getattr(self.app, "read_only", False):
            event.stop()
            self.notify(f"read-only: this console writes nothing; `dflash-ops report {self.data.run_dir.name}` "
                        "writes the report, where the runs are kept", title="e: no export", severity="warning",
                        timeout=6)

    def action_export(self) -> None:
        from console.views.report import write_report

        if getattr(self.app, "read_only", False):  # (however it was reached: nothing written)
            return

        run_dir = self.data.run_dir
        results_dir = run_dir / RESULTS if (run_dir / RESULTS).is_dir() else run_dir
        try:
            _, (markdown, exported) = write_report(results_dir, run_dir)
        except Exception as exc:  # noqa: BLE001 - shown in the error modal, never a traceback
            from screens.modals.error import report_of

            self.app.show_error(report_of("export failed", exc))
            return
        line = self.query_one("#exported", Static)
        line.update(Text.assemble(("report exported: ", "bold"), f"{markdown}\n", " " * len("report exported: "),
                                  str(exported)))  # each path whole on its own line
        line.display = True


def journal_tail(run_dir: Path, lines: int = 10) -> Group:
    """The last lines of a run's journal (for the runs list)."""
    records = [r for r in read_jsonl(run_dir / JOURNAL) if not for_replay_only(r)][-lines:]
    return Group(*[Text(f"{clock(r.get('t'))} {r.get('step') or '':<9} {r.get('message', '')}") for r in records])
