"""Issue 28, item 8: `--step` on a real terminal. What was approved stays in the scrollback, whole: the
live bars redrawn after each answer must not overwrite the question above them.

A real pseudo-terminal: the child is the headless view (its rich bars, redrawn ten times a second)
and the terminal decider, as `run --headless --step` wires them, with the extraction's progress
ticking while the stop's and the restart's questions are asked and answered through the terminal.
Everything the child wrote is replayed by a terminal emulator (pyte) with a scrollback."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pyte

CHILD = r"""
import asyncio, sys
from rich.console import Console
from console.messages import Confirmation, JobProgress
from console.procedure.decider import TerminalDecider
from console.session import MessageBus
from console.views.headless import HeadlessView

async def main():
    bus = MessageBus()
    view = HeadlessView(bus, Console(stderr=True))
    decider = TerminalDecider()
    done = 0

    async def tick(n):
        nonlocal done
        for _ in range(n):
            done += 1
            for key in ("weights", "weights_bytes", "prompts"):  # three bars: a frame of three lines
                bus.publish(JobProgress("extract-1", "extract", "ct129", done, 400, key, rate=2.0, key=key))
            await asyncio.sleep(0.03)

    await tick(20)
    stop = Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang-qwen"),
                        "SGLang on ct129 goes down", True)
    print("stop answered", await decider.decide(stop), file=sys.stderr)
    await tick(40)
    start = Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang-qwen"),
                         "SGLang on ct129 comes back", False)
    print("restart answered", await decider.decide(start), file=sys.stderr)
    await tick(40)
    view.close()
    print("THE END", file=sys.stderr)

asyncio.run(main())
"""

COLUMNS, LINES = 100, 24


def test_what_was_approved_stays_in_the_scrollback_whole() -> None:
    master, slave = pty.openpty()
    os.set_blocking(master, True)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "COLUMNS": str(COLUMNS),
           "LINES": str(LINES), "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", LINES, COLUMNS, 0, 0))
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=slave, stdout=slave, stderr=slave, env=env,
                             start_new_session=True)
    os.close(slave)
    out = bytearray()
    answered = 0
    deadline = time.monotonic() + 120
    try:
        while b"THE END" not in out:
            assert time.monotonic() < deadline, out[-2000:]
            ready, _, _ = select.select([master], [], [], 1)
            if not ready:
                continue
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            out += chunk
            if out.count(b"Proceed?") > answered:
                answered += 1
                time.sleep(0.3)  # the operator reads, the bars stand still meanwhile
                os.write(master, b"y\r")
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        os.close(master)
    screen = pyte.HistoryScreen(COLUMNS, LINES, history=100000)
    screen.set_mode(pyte.modes.LNM)  # the terminal's onlcr: "\n" starts a line
    stream = pyte.ByteStream(screen)
    stream.feed(bytes(out))
    scrollback = ["".join(line[x].data for x in range(COLUMNS)) for line in screen.history.top]
    lines = [line.rstrip() for line in [*scrollback, *screen.display]]
    text = "\n".join(lines)
    for whole in ("stop: stop the service on ct129  [DESTRUCTIVE]",
                  "  command: systemctl stop sglang-qwen",
                  "  impact:  SGLang on ct129 goes down",
                  "restart: start the service on ct129",
                  "  command: systemctl start sglang-qwen"):
        assert whole in lines, f"{whole!r} is not whole in the scrollback:\n{text}"
    assert sum(line.startswith("Proceed? [y]es / [n]o / [c]ontinue without asking: y") for line in lines) == 2, text
    assert lines.index("  command: systemctl stop sglang-qwen") < lines.index("  command: systemctl start sglang-qwen")
