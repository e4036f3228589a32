"""`console.tasks.cancel_and_wait`: ending a monitor's task never swallows a cancel of the caller."""

from __future__ import annotations

import asyncio

import pytest

from console.tasks import cancel_and_wait


async def test_the_tasks_own_cancel_is_its_expected_ending() -> None:
    task = asyncio.create_task(asyncio.Event().wait())
    await cancel_and_wait(task)
    assert task.cancelled()


async def test_a_cancel_of_the_caller_while_it_waits_is_not_swallowed() -> None:
    """The monitor takes a while to end (its cleanup awaits); the caller (a step of the run) is
    cancelled meanwhile (Ctrl-C): the caller must see its own cancel."""
    cleanup_began, may_end = asyncio.Event(), asyncio.Event()

    async def monitor() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleanup_began.set()
            await may_end.wait()

    task = asyncio.create_task(monitor())
    await asyncio.sleep(0)  # the monitor runs up to its wait
    caller = asyncio.create_task(cancel_and_wait(task))
    await cleanup_began.wait()
    caller.cancel()
    may_end.set()
    with pytest.raises(asyncio.CancelledError):
        await caller
    assert caller.cancelled()


async def test_a_task_that_failed_still_raises_its_error() -> None:
    async def fails() -> None:
        raise ValueError("broken")

    task = asyncio.create_task(fails())
    await asyncio.sleep(0)
    with pytest.raises(ValueError, match="broken"):
        await cancel_and_wait(task)


async def test_a_task_that_lost_its_cancel_is_cancelled_again() -> None:
    """The monitor's first cancel lands inside a call that drops it (Python 3.11's wait_for does,
    under asyncssh): it goes on as if nothing came. Ending it must not hang."""
    lost = []

    async def monitor() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            lost.append(True)  # dropped, as wait_for drops it
        await asyncio.Event().wait()

    task = asyncio.create_task(monitor())
    await asyncio.sleep(0)
    async with asyncio.timeout(10):
        await cancel_and_wait(task, ask_again_s=0.05)
    assert lost and task.cancelled()
