"""What a screen sees of the console app: the narrow window the screens and the decider are written
against (STYLE.md: a part sees a narrow public window, not the whole of what it lives in).

`ConsoleApp` (screens/app.py) is the one implementation; the screens name this protocol rather than
the app, so the app can import its screens without the screens importing the app back.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from textual.geometry import Size
from textual.message import Message
from textual.screen import Screen

from screens.modals.error import ErrorReport
from screens.state import ConsoleState


class ConsoleWindow(Protocol):
    """The console as its screens use it."""

    # the console's own
    operator: Any  # console/operator.py's Operator (its config, its bus, its runs)
    state: ConsoleState  # what the core said last, folded (screens/state.py)
    read_only: bool  # a follower or `--read-only`: no key that acts
    now: Callable[[], float]  # the console's clock (a test's, in pilot tests)

    @property
    def service_name(self) -> str: ...

    @property
    def quitting(self) -> bool: ...

    def can_restart(self) -> bool: ...

    def make_way_for(self, dialog: Screen) -> None: ...

    def leave_down_and_quit(self, after_run: bool = False) -> None: ...

    def show_error(self, report: ErrorReport) -> None: ...

    def open_results(self, run_dir: Path) -> None: ...

    # Textual's App, the part the screens use
    @property
    def screen(self) -> Screen: ...

    @property
    def screen_stack(self) -> list[Screen]: ...

    @property
    def size(self) -> Size: ...

    def push_screen(self, screen: Screen, callback: Any = None, wait_for_dismiss: bool = False) -> Any: ...

    def pop_screen(self) -> Any: ...

    def post_message(self, message: Message) -> bool: ...

    def refresh_bindings(self) -> None: ...

    def has_class(self, *class_names: str) -> bool: ...
