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
import shlex
import sys
from collections.abc import Callable
from typing import Protocol, TextIO

from console.messages import Confirmation


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
        lines.append(f"  estimate: {c.estimate_s:.0f} s (earlier runs)")
    return "\n".join(lines)


class TerminalDecider:
    """Asks on the terminal: y (yes), n (no), c (yes, and continue without asking)."""

    name = "terminal"

    def __init__(self, read_line: Callable[[], str] | None = None, out: TextIO | None = None):
        self._read_line = read_line or sys.stdin.readline
        self._out = out or sys.stderr
        self.continue_all = False

    async def decide(self, confirmation: Confirmation) -> bool:
        if self.continue_all:
            return True
        self._out.write(confirmation_text(confirmation) + "\n")
        while True:
            self._out.write("Proceed? [y]es / [n]o / [c]ontinue without asking: ")
            self._out.flush()
            line = await asyncio.get_running_loop().run_in_executor(None, self._read_line)
            if line == "":  # end of input: nobody is there to say yes
                self._out.write("\n(no answer: refused)\n")
                return False
            answer = line.strip().lower()
            if answer in ("y", "yes"):
                return True
            if answer in ("n", "no"):
                return False
            if answer in ("c", "continue"):
                self.continue_all = True
                return True
