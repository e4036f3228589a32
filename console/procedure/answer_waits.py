"""The waits on the operator's answers: the one place that tells a step's work from its waits.

Every question the engine asks (`Engine._ask`) is one wait here, from the question to its answer,
kept with the task that asked it. A wait holds up the step that asked it, and every step that joins
the task that asked it: the restart (or, on the pause route, the give-back) begins at `gpu_released`
beside the extraction and asks there; the restart, resume and continue steps (and a resumed
extraction, which brings the server back before verifying) join it later and wait on its answers
from then on. A step's work is its attempt's time less the time it was held so (`held`). Work that
goes on beside a question is work: the extractor flushing its files while the restart's question
waits (nothing joined the restart yet), the extraction while the offer to stop it at the budget
waits (that offer holds nothing: the engine does not record it here).

Times are the engine's clock (epoch seconds), as the run's other stamps.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass


@dataclass
class Wait:
    """One question, from when it was asked until it was answered (None: still open)."""

    asked_at: float
    answered_at: float | None
    task: asyncio.Task | None  # the task that asked it: held up until the answer


@dataclass
class Join:
    """A step's task waiting on another task (the restart, the give-back) from `since` to `until`."""

    task: asyncio.Task | None
    joined: asyncio.Task
    since: float
    until: float | None


def overlap(intervals: Iterable[Sequence[float]], begin: float, end: float) -> float:
    """Seconds of [begin, end] covered by `intervals` ((start, end) pairs), each second counted once
    however many intervals cover it."""
    cut = sorted((max(a, begin), min(b, end)) for a, b in intervals if b > a and b > begin and a < end)
    total, reach = 0.0, begin
    for a, b in cut:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


class AnswerWaits:
    """The engine's ledger of waits on the operator, and of which step each one held up."""

    def __init__(self, clock: Callable[[], float]):
        self._clock = clock
        self._waits: list[Wait] = []
        self._joins: list[Join] = []

    def asked(self) -> Wait:
        """A question is asked now, by the current task: it waits until `answered`."""
        wait = Wait(self._clock(), None, asyncio.current_task())
        self._waits.append(wait)
        return wait

    def answered(self, wait: Wait) -> float:
        """The question is answered (or given up: cancelled); returns how long it waited."""
        wait.answered_at = self._clock()
        return wait.answered_at - wait.asked_at

    @contextlib.contextmanager
    def joined(self, task: asyncio.Task) -> Iterator[None]:
        """While in it, the current task (a step) waits on `task`: the questions `task` asks hold it up."""
        join = Join(asyncio.current_task(), task, self._clock(), None)
        self._joins.append(join)
        try:
            yield
        finally:
            join.until = self._clock()

    def held(self, since: float, until: float, task: asyncio.Task | None = None) -> float:
        """Seconds of [since, until] during which `task` (default: the current one) could not go on
        before an answer: its own questions, and those of the tasks it joined while it joined them."""
        task = task if task is not None else asyncio.current_task()
        now = self._clock()
        spans = [(w.asked_at, w.answered_at if w.answered_at is not None else now)
                 for w in self._waits if w.task is task]
        for join in self._joins:
            if join.task is not task:
                continue
            end = join.until if join.until is not None else now
            spans += [(max(w.asked_at, join.since), min(w.answered_at if w.answered_at is not None else now, end))
                      for w in self._waits if w.task is join.joined]
        return overlap(spans, since, until)
