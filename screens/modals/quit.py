"""Quitting while this console holds the service down asks first: restart it, leave it down, or stay."""

from __future__ import annotations

from typing import Literal

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from screens.format import clock, duration

QuitAnswer = Literal["restart", "quit", "stay"]


class QuitWhileDownModal(ModalScreen[str]):
    DEFAULT_CSS = """
    QuitWhileDownModal { align: center middle; }
    QuitWhileDownModal > Vertical { width: 76; max-width: 95%; height: auto; border: thick $error;
                                    background: $surface; padding: 1 2; }
    QuitWhileDownModal .title { text-style: bold; color: $error; margin-bottom: 1; }
    QuitWhileDownModal .buttons { height: auto; align-horizontal: right; margin-top: 1; }
    QuitWhileDownModal Button { margin-left: 1; }
    """
    BINDINGS = [Binding("r", "answer('restart')", "Restart first"), Binding("q", "answer('quit')", "Quit anyway"),
                Binding("escape,n", "answer('stay')", "Stay")]

    def __init__(self, down_since: float, now: float, can_restart: bool = True) -> None:
        super().__init__(id="quit-while-down")
        self.down_since, self.now, self.can_restart = down_since, now, can_restart
        self.AUTO_FOCUS = "#restart" if can_restart else "#stay"  # never "quit" by a stray Enter

    def compose(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(f"The service is down: stopped by this run {duration(self.now - self.down_since)} "
                              f"ago ({clock(self.down_since)})."), classes="title")
            yield Static(Text("Quitting leaves it down until someone starts it. Restart it first?"))
            with Horizontal(classes="buttons"):
                if self.can_restart:
                    yield Button("Restart, then quit (r)", id="restart", variant="primary")
                yield Button("Quit, leave it down (q)", id="quit", variant="error")
                yield Button("Stay (esc)", id="stay")

    def on_mount(self) -> None:
        self.query_one("#restart" if self.can_restart else "#stay", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(str(event.button.id))

    def action_answer(self, answer: str) -> None:
        if answer == "restart" and not self.can_restart:
            return
        self.dismiss(answer)
