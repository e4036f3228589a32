"""Ending the background task of a monitor (host supervisor, telemetry stream, service monitor)."""

from __future__ import annotations

import asyncio
import contextlib


async def cancel_and_wait(task: asyncio.Task | None) -> None:
    """Cancel `task` and wait until it has ended (its CancelledError is the expected ending)."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
