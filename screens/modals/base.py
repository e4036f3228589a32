"""What every modal shares: the DOWN banner above it (a question asked while the service is down
says so, and the time ticks), its own footer naming the keys that work in it, and a body that
scrolls with the keyboard (the focus stays on the buttons)."""

from __future__ import annotations

from typing import TypeVar

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Footer

from screens.errors import StaysUp
from screens.widgets.downtime_banner import DowntimeBanner

Answer = TypeVar("Answer")


class ConsoleModal(StaysUp, ModalScreen[Answer]):
    DEFAULT_CSS = """
    ConsoleModal > DowntimeBanner { dock: top; margin-top: 1; }  /* over the screen's own, under its header */
    """
    BINDINGS = [
        Binding("down", "scroll_body(1)", "Scroll", key_display="↑↓"),
        Binding("up", "scroll_body(-1)", "Scroll up", show=False),
        Binding("pagedown", "scroll_body(10)", "Page down", show=False),
        Binding("pageup", "scroll_body(-10)", "Page up", show=False),
    ]

    def dialog(self) -> ComposeResult:
        """The modal's own content (its bordered box)."""
        yield from ()

    def compose(self) -> ComposeResult:
        yield DowntimeBanner()
        yield from self.dialog()
        yield Footer()

    def action_scroll_body(self, lines: int) -> None:
        for body in self.query(VerticalScroll):
            body.scroll_relative(y=lines, animate=False)
            return
