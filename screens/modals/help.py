"""`?`: what each key does, and what the console is doing for you."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from screens.modals.base import ConsoleModal

KEYS = [
    ("g", "run the procedure: preflight, stage, cache, stop, free VRAM, extract, restart, evaluate, report"),
    ("n", "the next step only, then pause (run again, or g, to go on)"),
    ("p", "plan only: preflight, touches nothing"),
    ("c", "cancel the running procedure (it then offers the restart)"),
    ("r", "restart the service (while this run holds it down); with a fleet, put a DRAINED replica back in the router"),
    ("o", "open the results of the newest run (or of the finished one)"),
    ("h", "earlier runs: pick two to compare, or open one's results"),
    ("tab", "move the focus between the hosts and the events; arrows / PageUp / PageDown scroll the focused one"),
    ("/", "filter the events by a word; enter on an event shows it whole"),
    ("ctrl+p", "command palette: every command by name"),
    ("?", "this help"),
    ("q", "quit (asks first while the service is down or a run is going; leaving it down has its own key, "
          "l); ctrl+q and ctrl+c quit the same way, from any screen"),
]
ACTING_KEYS = {"g", "n", "p", "c", "r", "e"}  # what read-only does not offer (e writes the report)
RESULT_KEYS = [
    ("1..7", "summary, per prompt, acceptance chart, parity, kernels, the window's timeline, the online cross-check"),
    ("d", "per prompt: the next drafter's columns (the prompt column stays)"),
    ("arrows", "scroll the table of the tab shown"),
    ("e", "export report.md and report.json into the run directory"),
    ("escape", "back to the dashboard"),
]


def keys_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", box=None, show_header=False, padding=(0, 2, 0, 0))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, text in rows:
        table.add_row(key, text)
    return table


class HelpModal(ConsoleModal[None]):
    DEFAULT_CSS = """
    HelpModal { align: center middle; }
    HelpModal > Vertical { width: 96; max-width: 95%; height: auto; max-height: 90%; border: thick $primary;
                           background: $surface; padding: 1 2; }
    HelpModal VerticalScroll { height: auto; max-height: 1fr; }
    """
    BINDINGS = [Binding("escape,q,question_mark", "dismiss_help", "Close")]

    def __init__(self, read_only: bool, first: tuple[str, list[tuple[str, str]]] | None = None) -> None:
        """`first`: a table of keys shown before the dashboard's (a replay's own: title, rows)."""
        super().__init__(id="help")
        self.read_only = read_only
        self.first = first

    def dialog(self) -> ComposeResult:
        with Vertical(), VerticalScroll():
            if self.read_only:
                yield Static(Text("Read-only: this console watches; no key stops, starts or ends anything, "
                                  "or writes a file.", style="bold yellow"))
            if self.first is not None:
                yield Static(keys_table(*self.first))
            yield Static(keys_table("Dashboard", [(k, t) for k, t in KEYS
                                                  if not (self.read_only and k in ACTING_KEYS)]))
            yield Static(keys_table("Results", [(k, t) for k, t in RESULT_KEYS
                                                if not (self.read_only and k in ACTING_KEYS)]))
            yield Static(Text("\nBefore anything changes a host you are asked, with the literal command. "
                              "Refusing changes nothing. While the service is down because of a run a red "
                              "banner says for how long, on every screen, and whether anything is bringing it "
                              "back. In Steps, a step's time is its own work; a dim +N beside it is how long "
                              "its questions waited for an answer (never counted in an estimate).", style="dim"))

    def action_dismiss_help(self) -> None:
        self.dismiss(None)
