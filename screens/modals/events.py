"""`/` (or enter on the event log): the run's events whole, every path in full, filtered by a word as
it is typed. On close the dashboard's log keeps the filter (an empty one shows every event)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Input, Static

from screens.modals.base import ConsoleModal
from screens.widgets.event_log import journal_line, matches


class EventsModal(ConsoleModal[str]):
    DEFAULT_CSS = """
    EventsModal { align: center middle; }
    EventsModal > Vertical { width: 100%; height: 1fr; border: thick $primary; background: $surface; padding: 0 1; }
    EventsModal Input { margin-bottom: 1; }
    EventsModal VerticalScroll { height: 1fr; }
    """
    BINDINGS = [Binding("escape", "close", "Close"), Binding("enter", "close", "Keep the filter", show=False)]

    def __init__(self, journal: list, word: str = "") -> None:
        super().__init__(id="events-whole")
        self.journal = list(journal)
        self.word = word

    def dialog(self) -> ComposeResult:
        with Vertical():
            yield Input(value=self.word, placeholder="filter: a word (step, host, pid, path...)", id="filter")
            body = VerticalScroll(classes="body")
            body.can_focus = False  # the filter keeps the focus; the arrows scroll the events
            with body:
                yield Static(id="events-text")

    def on_mount(self) -> None:
        self.query_one(Input).focus()
        self._show()

    def on_input_changed(self, event: Input.Changed) -> None:
        self.word = event.value
        self._show()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.action_close()

    def _show(self) -> None:
        word = self.word.strip()
        shown = [journal_line(e, whole=True) for e in self.journal if matches(e, word)]
        if not self.journal:  # a fresh console: nothing to count yet
            text, title = Text("no event yet: a run's journal shows here as it is written", style="dim"), \
                "Events: none yet"
        else:
            text = Text("\n").join(shown) if shown else Text(f"no event contains {word!r}", style="dim")
            title = f"Events matching {word!r}: {len(shown)} of {len(self.journal)}" if word else \
                f"Events ({len(self.journal)})"
        self.query_one("#events-text", Static).update(text)
        self.query_one(Vertical).border_title = title

    def action_close(self) -> None:
        self.dismiss(self.word.strip())
