"""Ending the background task of a monitor (host supervisor, telemetry stream, service monitor)."""

from __future__ import annotations

import asyncio


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait until it has ended. Its CancelledError is the expected ending; a
    cancel of the caller itself while it waits is not swallowed with it."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
