"""The run's journal as it is written: time, step, host, message; decisions and exits included.

Long paths are shortened to their last two parts (`…/results/results.json`) so an event takes one
line and more of them fit; `enter` on the focused log opens the events whole (every path in full).
`/` filters by a word: only the events that contain it are shown, until the filter is emptied."""

from __future__ import annotations

import re
import shlex

from rich.text import Text
from textual.binding import Binding
from textual.widgets import RichLog

from console.messages import JournalEntry
from console.views.units import duration
from screens.format import clock

LEVEL_STYLE = {"warning": "yellow", "error": "bold red"}
LONG_PATH = re.compile(r"(?<![\w.~])(?:/[^\s/:'\"]+){3,}")  # three or more parts: /root/dflash-ops/runs/…


def short_paths(text: str) -> str:
    """'/root/dflash-ops/runs/20251201/results/results.json' -> '…/results/results.json'."""
    return LONG_PATH.sub(lambda match: "…/" + "/".join(match.group(0).rsplit("/", 2)[-2:]), text)


def journal_line(entry: JournalEntry, whole: bool = False) -> Text:
    """One event on a line; `whole`: with its paths in full (the detail view)."""
    keep = (lambda text: text) if whole else short_paths
    text = Text(clock(entry.t), style="dim")
    text.append(" ")
    if entry.step:
        text.append(f"{entry.step:<9} ", style="cyan")
    if entry.host:
        text.append(f"{entry.host}: ", style="bold")
    text.append(keep(entry.message), style=LEVEL_STYLE.get(entry.level, ""))
    if entry.decision:
        text.append(f" [{entry.decision}]", style="magenta")
    if entry.argv:
        text.append(f"  $ {keep(shlex.join(entry.argv))}", style="dim")
    if entry.exit is not None:
        text.append(f"  exit {entry.exit}", style="green" if entry.exit == 0 else "red")
    if entry.duration_s is not None:
        # compact ('2.7s'): a wrapped line never parts a figure from its unit
        text.append(f"  {duration(entry.duration_s, compact=True, tenths=True)}", style="dim")
    return text


def matches(entry: JournalEntry, word: str) -> bool:
    """Whether the event contains `word` (any case), paths in full included."""
    return not word or word.lower() in journal_line(entry, whole=True).plain.lower()


class EventLog(RichLog):
    DEFAULT_CSS = """
    EventLog { border: round $primary-darken-1; height: 1fr; min-height: 4; scrollbar-size-vertical: 1; }
    EventLog:focus { border: round $accent; }
    """
    BINDINGS = [Binding("enter", "app.events", "Events whole")]

    def __init__(self) -> None:
        super().__init__(id="events", wrap=True, markup=False, highlight=False, max_lines=1000)
        self.border_title = "Events"
        self.can_focus = True
        self.word = ""  # the `/` filter

    def catch_up(self, journal, count: int) -> None:
        """Write the entries not shown yet (those that came while a modal or another screen was on
        top included): `count` is how many the state has seen in all, `journal` the newest of them."""
        new = min(count - getattr(self, "_written", 0), len(journal))
        for entry in list(journal)[len(journal) - new:] if new > 0 else []:
            if matches(entry, self.word):
                self._write(entry)
        self._written = count

    def _write(self, entry: JournalEntry) -> None:
        # The width given, not measured: measuring is capped by the app console's width, which is
        # not the terminal's everywhere (80 columns headless).
        width = self.scrollable_content_region.width
        self.write(journal_line(entry), width=width if width > 0 else None)

    def show_only(self, word: str) -> None:
        """Filter by `word` ('' shows every event again)."""
        self.word = word.strip()
        self.border_title = f"Events matching {self.word!r} (/ changes it)" if self.word else "Events"
        self._rewrite()

    def _rewrite(self) -> None:
        self.clear()
        for entry in self.app.state.journal:
            if matches(entry, self.word):
                self._write(entry)
        self._written = self.app.state.journal_count

    def on_resize(self, event) -> None:
        """Lines are wrapped when written: wrap them again at the new width."""
        if event.size.width != getattr(self, "_wrapped_at", None):
            self._wrapped_at = event.size.width
            self._rewrite()
