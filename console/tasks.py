"""Ending the background task of a monitor (host supervisor, telemetry stream, service monitor)."""

from __future__ import annotations

import asyncio

ASK_AGAIN_S = 0.5  # a task not ended this long after its cancel is cancelled again


async def cancel_and_wait(task: asyncio.Task | None, ask_again_s: float = ASK_AGAIN_S) -> None:
    """Cancel `task` and wait until it has ended. Its CancelledError is the expected ending; an
    error it ended with is raised. A cancel can be lost inside the task (on Python 3.11,
    `asyncio.wait_for`, under asyncssh's command waits, drops one that lands as the command
    completes), so a task still running `ask_again_s` later is cancelled again. A cancel of the
    caller itself while it waits is never swallowed."""
    if task is None:
        return
    task.cancel()
    while not task.done():
        done, _ = await asyncio.wait({task}, timeout=ask_again_s)
        if not done:
            task.cancel()
    if not task.cancelled():
        task.result()  # its own error, if it ended with one
