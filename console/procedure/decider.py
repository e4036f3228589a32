"""Deciders: who says yes before the engine changes a host.

The engine asks `await decider.decide(confirmation)` before every stop, start, ending of holders
and overwrite of a run's artifacts; the confirmation carries the host, the literal argv exactly as
it will run, the impact and whether it is destructive. A refusal changes nothing (the engine ends
the run there and journals it). Three deciders share the protocol:

- `ApproveAll` (`--yes`): approves everything, saying so in the journal;
- `TerminalDecider` (`--step`, and the headless default when stdin is a terminal): Ansible-style
  y / n / c (c = yes to this and every later question), one question at a time (prompt_toolkit);
- the TUI's modals (`screens/`), which implement the same protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import shutil
import signal
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TextIO

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


def confirmation_text(c: Confirmation, width: int | None = None) -> str:
    """The question as the terminal shows it; with `width` (a terminal's), each part wrapped between
    words under its label (at 80 columns a path or a word was cut at the edge: "/tm" then "p/walk")."""
    lines = [(f"{c.step}: {c.action} on {c.host}" + ("  [DESTRUCTIVE]" if c.destructive else ""), 2),
             (f"  command: {shlex.join(c.argv) or '(none: the console acts itself)'}", 11), (f"  impact:  {c.impact}", 11)]
    estimate = c.estimate_apart()  # the stop's forecast is in its impact already: one figure per question
    if estimate is not None:
        lines.append((f"  estimate: {duration(estimate)} ({c.estimate_basis})", 12))
    if c.leaves:  # what n leaves behind, when the engine says it (the restart after a no while down)
        lines.append((f"  no:      {c.leaves}", 11))
    if width is None:
        return "\n".join(line for line, _ in lines)
    return "\n".join(textwrap.fill(line, width, subsequent_indent=" " * indent, break_on_hyphens=False)
                     for line, indent in lines)


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


PROMPT = "Proceed? [y]es / [n]o / [c]ontinue without asking: "
PROMPT_END_S = 2.0  # a cancelled prompt's own end (its half-typed line dropped) is waited this long


async def _read_line(prompt: Any) -> str:
    """The prompt's line; a cancel (Ctrl-C, a signal) is the run's at once. The prompt reads in a
    task of its own, shielded: a cancel landing while prompt_toolkit sets up its reader was taken
    by it and lost (CI saw the run wait on a question nobody could answer), so the prompt is then
    ended apart, and the cancel goes on to the run."""
    reading = asyncio.ensure_future(prompt)
    try:
        return await asyncio.shield(reading)
    except asyncio.CancelledError:
        reading.cancel()
        await asyncio.wait({reading}, timeout=PROMPT_END_S)
        if reading.done() and not reading.cancelled():
            reading.exception()  # retrieved: its own end is no news
        raise


class TerminalDecider:
    """Asks on the terminal: y (yes), n (no), c (yes, and continue without asking). The question
    stands on its own lines, with the command, the live display paused until it is answered.

    One question at a time: a question asked while another waits (the budget offer and the
    restart's question) waits its turn, so an answer always goes to the question it was typed for.
    The answer is read by prompt_toolkit's `prompt_async` (line editing on a terminal); a question
    cancelled under it (Ctrl-C) takes its half-typed line with it. `input`: a prompt_toolkit input
    (tests: `create_pipe_input()`); default the process's stdin, a pipe or file too (scripts)."""

    name = "terminal"

    def __init__(self, input: Any = None, out: TextIO | None = None):
        self._input = input
        self._out = out
        self._turn = asyncio.Lock()
        self.continue_all = False

    async def decide(self, confirmation: Confirmation) -> bool:
        if self.continue_all:
            return True
        async with self._turn:
            if self.continue_all:  # said while this question waited its turn
                return True
            with live_displays_paused():
                return await self._ask(confirmation, self._out or sys.stderr)

    async def _ask(self, confirmation: Confirmation, out: TextIO) -> bool:
        from prompt_toolkit import PromptSession
        from prompt_toolkit.input import create_input
        from prompt_toolkit.output import DummyOutput, create_output

        terminal = self._input is None and sys.stdin.isatty()
        source = self._input if self._input is not None else create_input(sys.stdin)
        # On a terminal prompt_toolkit draws the prompt and edits the line; elsewhere (a pipe, a
        # test) the prompt is plain text and prompt_toolkit only reads the line.
        session = PromptSession(input=source, output=create_output(stdout=out) if terminal else DummyOutput())
        width = shutil.get_terminal_size().columns - 1 if terminal else None
        out.write("\n" + confirmation_text(confirmation, width) + "\n")
        out.flush()
        while True:
            if not terminal:
                out.write(PROMPT)
                out.flush()
            try:
                # handle_sigint=False: a SIGINT stays the run's (asyncio.run cancels it and the
                # compensation asks its own question), not a Ctrl-C key for this prompt to re-ask.
                line = await _read_line(session.prompt_async(PROMPT if terminal else "", handle_sigint=False))
            except EOFError:  # end of input: nobody is there to say yes
                out.write("\n(no answer: refused)\n")
                return False
            except KeyboardInterrupt:  # Ctrl-C read as a key (the terminal in raw mode): the signal it means
                signal.raise_signal(signal.SIGINT)
                continue
            answer = line.strip().lower()
            if answer in ("y", "yes"):
                return True
            if answer in ("n", "no"):
                return False
            if answer in ("c", "continue"):
                self.continue_all = True
                return True
