"""Quitting while this console holds the service down asks first: restart it, leave it down, or stay.
On the pause route the server is paused, not down: the same question says so (give it back, leave it
paused), never "stopped".

A second `q` never leaves the service down (it is the htop / k9s reflex, and here it means "stay"):
leaving it down has its own key, `l`. While a restart is under way the modal says so and offers to
wait until the service is ready, then quit; it never starts a second restart."""

from __future__ import annotations

from typing import Literal

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Button, Static

from console.views.units import duration
from screens.format import clock
from screens.modals.base import ConsoleModal

QuitAnswer = Literal["restart", "wait", "leave", "stay"]


class QuitWhileDownModal(ConsoleModal[str]):
    DEFAULT_CSS = """
    QuitWhileDownModal { align: center middle; }
    QuitWhileDownModal > Vertical { width: 76; max-width: 95%; height: auto; border: thick $error;
                                    background: $surface; padding: 1 2; }
    QuitWhileDownModal .title { text-style: bold; color: $error; margin-bottom: 1; }
    QuitWhileDownModal .buttons { height: auto; align-horizontal: right; margin-top: 1; }
    QuitWhileDownModal Button { margin-left: 1; }
    """
    BINDINGS = [Binding("r", "answer('restart')", "Restart, then quit"),
                Binding("w", "answer('wait')", "Wait until ready, then quit"),
                Binding("l", "answer('leave')", "Leave it down and quit"),
                Binding("escape,n,q", "answer('stay')", "Stay", key_display="esc")]

    def __init__(self, down_since: float, now: float, can_restart: bool = True, restarting: bool = False,
                 why_not: str = "", by: str = "this run", paused: bool = False) -> None:
        super().__init__(id="quit-while-down")
        self.down_since, self.now, self.paused = down_since, now, paused
        self.why_not, self.by = why_not, by  # why r cannot be offered here; which run stopped it
        self.restarting = restarting  # a restart is under way: wait for it, never start another
        self.can_restart = can_restart and not restarting
        self.AUTO_FOCUS = "#wait" if restarting else "#restart" if self.can_restart else "#stay"  # never "leave"

    def title_text(self) -> Text:
        now = self.app.now() if hasattr(self.app, "now") else self.now  # counts on while the question waits
        what = "The server is paused: its requests held" if self.paused else "The service is down: stopped"
        return Text(f"{what} by {self.by} {duration(now - self.down_since)} ago ({clock(self.down_since)}).")

    def dialog(self) -> ComposeResult:
        with Vertical():
            yield Static(self.title_text(), classes="title")
            # what a quit leaves, who brings it back, and what `run --resume` does of it
            left, back, resume = (("paused", "gives it back", "gives it back") if self.paused
                                  else ("down", "starts it", "restarts it"))
            if self.restarting:
                yield Static(Text(f"{'Giving it back' if self.paused else 'A restart'} is under way. Quit once the "
                                  "service is ready, or stay?"))
            elif self.can_restart:
                yield Static(Text(f"Quitting leaves it {left} until someone {back}. "
                                  f"{'Give it back' if self.paused else 'Restart it'} first?"))
            else:  # say why the restart is not offered, and what leaving does
                why = self.why_not or "this console cannot restart it"
                yield Static(Text(f"{why[0].upper()}{why[1:]}. Quitting leaves it {left} until someone {back} "
                                  f"(run --resume {resume})."))
            with Horizontal(classes="buttons"):
                if self.restarting:
                    yield Button("Wait until ready, then quit (w)", id="wait", variant="primary")
                elif self.can_restart:
                    yield Button(f"{'Give it back' if self.paused else 'Restart'}, then quit (r)", id="restart",
                                 variant="primary")
                yield Button(f"Leave it {left} (l)", id="leave", variant="error")
                yield Button("Stay (esc)", id="stay")

    def on_mount(self) -> None:
        self.query_one(f"#{self.AUTO_FOCUS.lstrip('#')}", Button).focus()
        self.set_interval(1.0, lambda: self.query_one(".title", Static).update(self.title_text()))

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "answer" and parameters:
            if parameters[0] == "restart":
                return self.can_restart
            if parameters[0] == "wait":
                return self.restarting
        return True

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(str(event.button.id))

    def action_answer(self, answer: str) -> None:
        if answer == "restart" and not self.can_restart or answer == "wait" and not self.restarting:
            return
        self.dismiss(answer)
