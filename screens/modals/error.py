"""The one error modal: errors from workers, jobs and hosts, each with its stderr tail, never a
traceback. A second error while it is open is added to it rather than stacked."""

from __future__ import annotations

import traceback
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Button, Static

from screens.modals.base import ConsoleModal

TAIL_LINES = 20


@dataclass(frozen=True)
class ErrorReport:
    title: str  # "extract failed on inference"
    message: str  # the first line: what went wrong, in the core's words
    detail: str | None = None  # the stderr tail, or the rest of the message


def tail(text: str | None, lines: int = TAIL_LINES) -> str | None:
    if not text:
        return None
    kept = text.rstrip().splitlines()[-lines:]
    return "\n".join(kept) or None


def report_of(title: str, error: BaseException) -> ErrorReport:
    """An exception as the operator should read it: its message, and the stderr tail it carries."""
    text = str(error).strip() or type(error).__name__
    first, _, rest = text.partition("\n")
    stderr = getattr(error, "stderr_tail", None) or getattr(error, "stderr", None)
    detail = tail(stderr if isinstance(stderr, str) and stderr.strip() else rest)
    if detail and detail in first:
        detail = None
    return ErrorReport(title, first, detail)


def bug_report(error: BaseException) -> ErrorReport:
    """A bug of the console as the operator reads it: what it says and where it was raised (the
    innermost frame, for the bug report), never a traceback."""
    text = str(error).strip() or type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    where = f"{type(error).__name__}"
    if frames:
        frame = frames[-1]
        where += f" at {'/'.join(frame.filename.split('/')[-2:])}:{frame.lineno} ({frame.name})"
    return ErrorReport("a bug in the console: it stays up, and any run goes on",
                       text.splitlines()[0], where)


class ErrorModal(ConsoleModal[None]):
    DEFAULT_CSS = """
    ErrorModal { align: center middle; }
    ErrorModal > Vertical { width: 100; max-width: 95%; height: auto; max-height: 90%;
                            border: thick $error; background: $surface; padding: 1 2; }
    ErrorModal VerticalScroll { height: auto; max-height: 60vh; }
    ErrorModal .error-title { text-style: bold; color: $error; }
    ErrorModal .error-detail { background: $boost; padding: 0 1; margin-bottom: 1; color: $text-muted; }
    ErrorModal .buttons { height: auto; align-horizontal: right; }
    """
    BINDINGS = [Binding("escape,enter,q", "close", "Close")]
    AUTO_FOCUS = "#close"

    def __init__(self, report: ErrorReport) -> None:
        super().__init__(id="error")
        self.reports: list[ErrorReport] = [report]

    def dialog(self) -> ComposeResult:
        with Vertical():
            reports = VerticalScroll(classes="reports")
            reports.can_focus = False
            with reports:
                for report in self.reports:
                    yield from self._widgets(report)
            with Vertical(classes="buttons"):
                yield Button("Close (esc)", id="close", variant="error")

    @staticmethod
    def _widgets(report: ErrorReport) -> list[Static]:
        shown = [Static(Text(report.title), classes="error-title"), Static(Text(report.message))]
        if report.detail:
            shown.append(Static(Text(report.detail), classes="error-detail"))
        return shown

    def on_mount(self) -> None:
        for button in self.query("#close"):
            button.focus()

    def add(self, report: ErrorReport) -> None:
        """Another error while this one is open: shown below the others."""
        self.reports.append(report)
        boxes = self.query(".reports")
        if boxes:  # else compose, still to come, draws it
            boxes.first().mount_all(self._widgets(report))

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(None)

    def action_close(self) -> None:
        self.dismiss(None)
