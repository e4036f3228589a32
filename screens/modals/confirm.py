"""Confirm a step before it changes a host: first the host and the literal command (wrapped, never
cut), then the impact and the estimate. y approves; n or escape refuses; for a destructive step
Cancel has the focus, so a stray Enter refuses. The body scrolls with the arrows and PageUp/Down."""

from __future__ import annotations

import asyncio
import re
import shlex

from rich.text import Text
from textual import events
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.timer import Timer
from textual.widgets import Button, Static

from console.messages import Confirmation
from console.views.units import duration
from screens.modals.base import ConsoleModal

# How long a question that has just appeared (or come back from under a dialog) ignores keys and clicks:
# a key meant for what was on screen before (Esc for a quit dialog's Stay) never answers it (issue 43).
QUESTION_GUARD_S = 0.5

# The engine's frozen count in a restart's impact, as units.duration wrote it ("down 1 min 30 s so far").
SO_FAR = re.compile(r"down (?:\d+(?:\.\d+)? (?:d|h|min|s) )+so far")


class QuestionModal(ConsoleModal[bool]):
    """A yes/no question with its own buttons; the base of the confirm and holders modals.

    Each time it comes on top (pushed, or back from under a dialog) it ignores its keys and clicks for
    the app's `question_guard_s` (`QUESTION_GUARD_S`): its buttons are disabled (dimmed, no focus) and
    its footer keys off until the guard passes; `answerable` is set then."""

    DEFAULT_CSS = """
    QuestionModal { align: center middle; }
    QuestionModal > Vertical { width: 90; max-width: 95%; height: auto; max-height: 100%;
                               border: thick $primary; background: $surface; padding: 1 2; }
    QuestionModal.short > Vertical { padding: 0 1; }
    QuestionModal.short .title { margin-bottom: 0; }
    QuestionModal .body { height: auto; }
    QuestionModal.destructive > Vertical { border: thick $error; }
    QuestionModal .title { text-style: bold; margin-bottom: 1; }
    QuestionModal .label { color: $text-muted; }
    QuestionModal .command { background: $boost; padding: 0 1; margin-bottom: 1; }
    QuestionModal .buttons { height: auto; align-horizontal: right; margin-top: 1; }
    QuestionModal .refusal { color: $text-muted; margin-top: 1; }
    QuestionModal.short .refusal { margin-top: 0; }
    QuestionModal.short .buttons { margin-top: 0; }
    QuestionModal Button { margin-left: 2; }
    """
    ANSWERS = frozenset({"answer", "refuse", "leave"})  # the actions a key meant for another screen must not reach
    BINDINGS = [Binding("y", "answer(True)", "Yes"), Binding("n", "answer(False)", "No"),
                Binding("escape", "refuse", "No", show=False)]

    def __init__(self, title: str, yes: str = "Yes", no: str = "Cancel", destructive: bool = False,
                 id: str | None = None, refusal: str = "") -> None:
        super().__init__(id=id, classes="destructive" if destructive else "")
        self.title_text = title
        self.yes_label, self.no_label = yes, no
        self.refusal = refusal  # what `n` leaves behind, said above the buttons
        # The footer names the keys with the buttons' own words: "y Proceed  n Cancel".
        self._bindings.key_to_bindings["y"] = [Binding("y", "answer(True)", yes)]
        self._bindings.key_to_bindings["n"] = [Binding("n", "answer(False)", no)]
        self.destructive = destructive
        self.AUTO_FOCUS = "#no" if destructive else "#yes"  # the screen's own focus pass agrees
        # Guarded from the start: a key queued as it is pushed is checked before its first resume.
        self.answerable = asyncio.Event()
        self._guard_timer: Timer | None = None

    def body(self) -> ComposeResult:
        yield from ()

    def dialog(self) -> ComposeResult:
        with Vertical():
            yield Static(Text(self.title_text), classes="title")
            body = VerticalScroll(classes="body")  # scrolls on a short terminal; the buttons stay
            body.can_focus = False  # the focus belongs to the safe button, never to the text
            with body:
                yield from self.body()
            if self.refusal:
                yield Static(self.refusal_text(), classes="refusal")
            with Horizontal(classes="buttons"):
                yield Button(f"{self.yes_label} (y)", id="yes", variant="error" if self.destructive else "primary")
                yield from self.more_buttons()
                yield Button(f"{self.no_label} (n)", id="no")

    def refusal_text(self) -> Text:
        """What `n` leaves behind, above the buttons."""
        return Text(f"{self.no_label} (n): {self.refusal}")

    def more_buttons(self) -> ComposeResult:
        """Answers between yes and no (the restart offered after a no while down: leave it down for later)."""
        yield from ()

    def on_mount(self) -> None:
        self._fit(self.app.size.height)

    def on_screen_resume(self) -> None:
        self.guard()

    def guard(self) -> None:
        """Ignore keys and clicks for the guard time (again, when it comes back on top)."""
        guard_s = getattr(self.app, "question_guard_s", QUESTION_GUARD_S)
        if self._guard_timer is not None:
            self._guard_timer.stop()
            self._guard_timer = None
        if guard_s <= 0:
            self._arm()
            return
        self.answerable.clear()
        self.add_class("guarded")
        for button in self.query(Button):
            button.disabled = True
        self.refresh_bindings()
        self._guard_timer = self.set_timer(guard_s, self._arm)

    def _arm(self) -> None:
        self._guard_timer = None
        self.remove_class("guarded")
        for button in self.query(Button):
            button.disabled = False
        self.query_one("#no" if self.destructive else "#yes", Button).focus()  # the safe one for a destructive step
        self.answerable.set()
        self.refresh_bindings()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        return self.answerable.is_set() or action not in self.ANSWERS

    def on_resize(self, event: events.Resize) -> None:
        self._fit(event.size.height)

    def _fit(self, height: int) -> None:
        short = height < 32
        self.set_class(short, "short")
        # The header's row, the banner and the footer; the border, the title, the buttons and their margin (and, when
        # tall, the padding and the title's margin): the body gets the rest.
        extra = len(self.refusal_text().plain.splitlines()) if self.refusal else 0  # what n leaves behind
        self.query_one(".body").styles.max_height = max(3, height - (10 if short else 14) - extra)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if self.answerable.is_set():  # (a disabled button posts none; a press already queued is dropped)
            self.dismiss(event.button.id == "yes")

    def action_answer(self, approved: bool) -> None:
        if self.answerable.is_set():
            self.dismiss(approved)

    def action_refuse(self) -> None:
        if self.answerable.is_set():
            self.dismiss(False)


def command_text(argv: tuple[str, ...] | list[str]) -> Text:
    """The literal command, exactly as it will run (quoted as a shell would need it), never markup."""
    return Text(f"$ {shlex.join(argv)}" if argv else "(no command: the console acts itself)")


# What a refusal leaves behind, by the step asking (engine: a refusal changes nothing and is journalled).
REFUSALS = {
    "stop": "nothing changes; the service keeps serving and the run ends",
    "restart": "the service stays down; r restarts it",
    "free-vram": "the VRAM stays held and the service down; r restarts it",
}


class ConfirmModal(QuestionModal):
    """What the engine asks before a stop, a start or an overwrite."""

    def __init__(self, confirmation: Confirmation, title: str | None = None, yes: str = "Proceed",
                 no: str = "Cancel") -> None:
        c = confirmation
        super().__init__(title or f"{c.step}: {c.action} on {c.host}?", yes=yes, no=no, destructive=c.destructive,
                         refusal=c.leaves or REFUSALS.get(c.step, "nothing is run; the refusal is journalled"))
        self.confirmation = c

    def body(self) -> ComposeResult:
        c = self.confirmation
        yield Static(Text(f"on {c.host}, runs:"), classes="label")
        yield Static(command_text(c.argv), classes="command")
        yield Static(self.impact_text(), classes="impact")
        if c.estimate_s is not None and c.estimate_basis != "forecast":  # the forecast is in the impact, with its basis
            what = "estimated downtime" if c.destructive else "estimate"
            yield Static(Text(f"{what}: {duration(c.estimate_s)} ({c.estimate_basis})"), classes="estimate")
        if c.destructive:
            yield Static(Text("Destructive: Cancel has the focus.", style="bold red"))

    def on_mount(self) -> None:
        super().on_mount()
        if SO_FAR.search(self.confirmation.impact):
            self.set_interval(1.0, self._tick)

    def impact_text(self) -> Text:
        """The impact; a 'down N s so far' in it counts on while the question waits."""
        impact = self.confirmation.impact
        down_since = getattr(getattr(self.app, "state", None), "down_since", None)
        if down_since is not None:
            impact = SO_FAR.sub(f"down {duration(self.app.now() - down_since)} so far", impact)
        return Text(f"impact: {impact}")

    def _tick(self) -> None:
        self.query_one(".impact", Static).update(self.impact_text())


class RestartOrLeaveModal(ConfirmModal):
    """The restart the run offers after a no to a step that must run while the service is down (the
    holders left running): the window cannot go on. As the quit dialog: restart now (y, r: the
    literal start command above), leave it down for later (l: this console quits, exit 3, leaving the
    run and `run --resume` on the terminal), or not now (n, escape: it stays down here, r restarts it).
    Dismissed with True, "leave" or False."""

    BINDINGS = [Binding("r", "answer(True)", "Restart now", show=False),
                Binding("l", "leave", "Leave it down for later")]

    def __init__(self, confirmation: Confirmation) -> None:
        super().__init__(confirmation, title=f"The service is down and this window cannot go on: restart it on "
                                             f"{confirmation.host} now, or leave it down for later?",
                         yes="Restart now", no="Not now")

    def refusal_text(self) -> Text:
        return Text(f"Leave it down for later (l): {self.refusal}; this console quits.\n"
                    f"{self.no_label} (n): it stays down here; r restarts it.")

    def more_buttons(self) -> ComposeResult:
        yield Button("Leave it down for later (l)", id="leave", variant="error")

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        if self.answerable.is_set():
            self.dismiss("leave" if event.button.id == "leave" else event.button.id == "yes")

    def action_leave(self) -> None:
        if self.answerable.is_set():
            self.dismiss("leave")
