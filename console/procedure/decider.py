"""Deciders: who says yes before the engine changes a host.

The engine asks `await decider.decide(confirmation)` before every stop, start, ending of holders
and overwrite of a run's artifacts; the confirmation carries the host, the literal argv exactly as
it will run, the impact and whether it is destructive. A refusal changes nothing (the engine ends
the run there and journals it). Three deciders share the protocol:

- `ApproveAll` (`--yes`): approves everything, saying so in the journal;
- `TerminalDecider` (`--step`, and the headless default when stdin is a terminal): Ansible-style
  y / n / c (c = yes to this and every later question);
- the TUI's modals (`screens/`), which implement the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TextIO

from console.messages import Confirmation
from console.views.units import duration


class Decider(Protocol):
    name: str  # how the journal names who decided: "--yes", "terminal", "tui"

    async def decide(self, confirmation: Confirmation) -> bool: ...


class ApproveAll:
    """`--yes`: every confirmation approved."""

    name = "--yes"

    async def decide(self, confirmation: Confirmation) -> bool:
        return True


class RefuseAll:
    """Refuses everything: `--plan` style dry runs and tests of the refusal path."""

    name = "refuse"

    async def decide(self, confirmation: Confirmation) -> bool:
        return False


def confirmation_text(c: Confirmation) -> str:
    """The question as the terminal shows it."""
    lines = [f"{c.step}: {c.action} on {c.host}" + ("  [DESTRUCTIVE]" if c.destructive else ""),
             f"  command: {shlex.join(c.argv)}", f"  impact:  {c.impact}"]
    if c.estimate_s is not None:
        lines.append(f"  estimate: {duration(c.estimate_s)} ({c.estimate_basis})")
    return "\n".join(lines)


class LiveDisplay(Protocol):
    """What a question pauses: a rich Live or Progress drawing on the same terminal."""

    def start(self) -> None: ...
    def stop(self) -> None: ...


_live_displays: list[LiveDisplay] = []  # one terminal per process: every display drawing on it


def register_live_display(display: LiveDisplay) -> Callable[[], None]:
    """A live display (the headless view's progress bars) that questions pause; returns the undo."""
    _live_displays.append(display)
    return lambda: _live_displays.remove(display) if display in _live_displays else None


@contextlib.contextmanager
def live_displays_paused() -> Iterator[None]:
    """While a question waits, no bar redraws over it: the displays stop (their last frame stays
    printed) and start again, below the answer, once it is given."""
    paused = list(_live_displays)
    for display in paused:
        display.stop()
        _forget_last_frame(display)
    try:
        yield
    finally:
        for display in paused:
            if display in _live_displays:
                display.start()


def _forget_last_frame(display: LiveDisplay) -> None:
    """A rich display stopped keeps its last frame's height, and on its next start moves the cursor
    up that many lines to redraw "in place": over the question and its answer printed meanwhile,
    which then vanished from the scrollback (issue 28). Its last frame stays printed above; the
    next one starts below the answer."""
    live = getattr(display, "live", display)  # a Progress drives a Live
    render = getattr(live, "_live_render", None)
    if render is not None and hasattr(render, "_shape"):
        render._shape = None


class LineReader:
    """The one reader of the answers: a daemon thread that reads a line when a question waits for
    one. A question cancelled under it (Ctrl-C) leaves the line it was reading to the next
    question, never to a reader nobody awaits; and nothing joins the thread at exit, so a
    blocked read never holds the process (the executor thread that `run_in_executor` used did both)."""

    def __init__(self, read_line: Callable[[], str]) -> None:
        self._read_line = read_line
        self._lock = threading.Lock()
        self._wanted = threading.Event()
        self._waiter: asyncio.Future[str] | None = None
        self._pending: list[str] = []  # read for a question that was cancelled meanwhile
        self._ended = False  # end of input: every later question reads ""
        self._thread: threading.Thread | None = None

    async def line(self) -> str:
        """The next line ('' at the end of input)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._pending:
                return self._pending.pop(0)
            if self._ended:
                return ""
            waiter = self._waiter = loop.create_future()
            self._wanted.set()
            if self._thread is None:
                self._thread = threading.Thread(target=self._read, name="answers", daemon=True)
                self._thread.start()
        try:
            return await waiter
        finally:
            with self._lock:
                if self._waiter is waiter:
                    self._waiter = None  # the read goes on; its line waits in _pending

    def _read(self) -> None:
        while True:
            self._wanted.wait()
            try:
                line = self._read_line()
            except (OSError, ValueError):  # stdin closed under us: nobody is there to answer
                line = ""
            with self._lock:
                self._wanted.clear()
                self._ended = line == ""
                waiter, self._waiter = self._waiter, None
                if waiter is None or waiter.done():
                    self._pending.append(line)
                else:
                    waiter.get_loop().call_soon_threadsafe(self._deliver, waiter, line)
            if line == "":
                return

    def _deliver(self, waiter: asyncio.Future[str], line: str) -> None:
        if waiter.done():  # cancelled between the read and this call: the next question has it
            with self._lock:
                self._pending.append(line)
        else:
            waiter.set_result(line)


_stdin_reader: LineReader | None = None


def stdin_reader() -> LineReader:
    """The process's one reader of stdin."""
    global _stdin_reader
    if _stdin_reader is None:
        _stdin_reader = LineReader(sys.stdin.readline)
    return _stdin_reader


class TerminalDecider:
    """Asks on the terminal: y (yes), n (no), c (yes, and continue without asking). The question
    stands on its own lines, with the command, the live display paused until it is answered."""

    name = "terminal"

    def __init__(self, read_line: Callable[[], str] | None = None, out: TextIO | None = None):
        self._reader = LineReader(read_line) if read_line is not None else stdin_reader()
        self._out = out
        self.continue_all = False

    async def decide(self, confirmation: Confirmation) -> bool:
        if self.continue_all:
            return True
        with live_displays_paused():
            return await self._ask(confirmation, self._out or sys.stderr)

    async def _ask(self, confirmation: Confirmation, out: TextIO) -> bool:
        out.write("\n" + confirmation_text(confirmation) + "\n")
        while True:
            out.write("Proceed? [y]es / [n]o / [c]ontinue without asking: ")
            out.flush()
            line = await self._reader.line()
            if line == "":  # end of input: nobody is there to say yes
                out.write("\n(no answer: refused)\n")
                return False
            answer = line.strip().lower()
            if answer in ("y", "yes"):
                return True
            if answer in ("n", "no"):
                return False
            if answer in ("c", "continue"):
                self.continue_all = True
                return True
