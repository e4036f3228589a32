"""Issue 43, item 2: the operator's answer time is no step's work and no phase of the window's.

The same runs over the engine's fakes, in two worlds: one whose operator answers at once, one whose
operator answers every question `DELAY_S` of the world's time after it is asked (`SlowOperator`:
whatever can go on without the answer goes on first, as on a real console). Every step's recorded
work, every measured phase, the next run's forecast and the banner's lateness must be the same in
both: only the waits differ, by the delay of each question the window waited on. Event-driven (the
world's logical clock): no test here sleeps."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from console.cli.run import runs_rows
from console.messages import StepUpdate, WindowProjection
from console.procedure import forecast as fc
from console.procedure.answer_waits import AnswerWaits, overlap
from console.procedure.state import RunState
from console.views.report import forecast_error_line
from console.views.units import duration
from tests.engine_fakes import Producers, SlowOperator
from tests.engine_sweep import Crasher, Window, assert_promises, make_window

DELAY_S = 40.0
# The questions each run's window waits on (after its stop or pause, before the server is back): the
# first stop of the fake world leaves VRAM held, so its first window asks to end the holders.
WINDOW_QUESTIONS = {"window": [("free-vram", "restart"), ("restart",)],
                    "pause": [("release", "resume", "continue"), ("release", "resume", "continue")]}


@dataclass
class World:
    """One world's runs, oldest first, and what their consoles published."""

    windows: list[Window]
    seen: list[list[Any]] = field(default_factory=list)

    def states(self) -> list[RunState]:
        return [w.state() for w in self.windows]


async def runs(root: Path, producers: Producers, route: str, delay_s: float, count: int = 2) -> World:
    """`count` runs one after the other on one fake world, each to its end, by an operator who answers
    `delay_s` after each question."""
    root.mkdir()
    with pytest.MonkeyPatch.context() as monkeypatch:  # the engine reads this world's clock, until it is done
        first = make_window(root, producers, monkeypatch)
        world = World([])
        for n in range(count):
            run_id = first.run_id if n == 0 else first.store.create(str(first.world.config.source), None).run_id
            window = Window(root, first.world, first.store, run_id, route=route)
            seen: list[Any] = []
            finished = await window.console(decider=SlowOperator(first.world.clock, delay_s=delay_s), seen=seen)
            assert finished is not None and finished.exit_code == 0, finished
            if n == 0:  # (its promises count the world's stops and extractions: one run's)
                assert_promises(window, finished)
            world.windows.append(window)
            world.seen.append(seen)
    return world


def work(state: RunState) -> dict[str, float]:
    return {name: step.work_s for name, step in state.steps.items()}


def measured(state: RunState) -> dict[str, float | None]:
    """Each row of the window's timeline as measured, the operator's answers apart."""
    return {row.phase: row.measured_s for row in fc.against(state) if row.phase != fc.ANSWERS}


def answers_s(state: RunState) -> float:
    return fc.error_of(state)[1]


def forecast_of(state: RunState) -> dict[str, Any]:
    made = state.facts.get("pause_forecast") if state.route == "pause" else state.forecast
    return {name: phase["seconds"] for name, phase in made["phases"].items()}


@pytest.mark.parametrize("route", ["window", "pause"])
async def test_a_slow_operator_moves_no_recorded_work_no_phase_and_no_forecast(
        route: str, tmp_path: Path, producers: Producers) -> None:
    """On the pause route "resume measured 6.0 s" held the wait on the continue question and the next
    plan forecast "7 s paused"; on the stop route the forecast climbed run after run. With a budget
    such a forecast refuses good windows: here the next run's forecast does not move at all."""
    prompt = await runs(tmp_path / "prompt", producers, route, 0.0)
    slow = await runs(tmp_path / "slow", producers, route, DELAY_S)
    for n, (at_once, late) in enumerate(zip(prompt.states(), slow.states(), strict=True)):
        assert work(late) == pytest.approx(work(at_once), abs=1e-6), f"run {n + 1}: a step's work holds an answer"
        assert measured(late) == pytest.approx(measured(at_once), abs=1e-6), f"run {n + 1}: a phase holds an answer"
        # The slow operator did make the window wait: each of its questions, the whole delay.
        asked = [c.step for c in slow.windows[n].deciders[-1].asked]
        assert all(step in asked for step in WINDOW_QUESTIONS[route][n]), asked
        assert answers_s(late) == pytest.approx(DELAY_S * len(WINDOW_QUESTIONS[route][n]))
        assert answers_s(at_once) == 0.0
    assert forecast_of(slow.states()[1]) == pytest.approx(forecast_of(prompt.states()[1]), abs=1e-6), \
        "the operator's answers moved the next run's forecast"
    # The forecast's error is shown, not assumed: `runs` and the Window tab say it, the answers apart.
    first, second = slow.windows
    error = fc.error_of(second.state())[0].error
    _, rows, _ = runs_rows(first.store.summaries())
    (downtime,) = [row[4] for row in rows if row[0] == second.run_id]
    answering = duration(answers_s(second.state()), tenths=True)
    assert f"forecast {error:+.0%}\nanswering {answering}\nleft out" in downtime, downtime
    line = forecast_error_line(second.store.root / second.run_id)
    assert line is not None and f"off by {error:+.0%}" in line and "of your answers left out of both" in line, line


async def test_the_banners_late_counts_from_the_answer(tmp_path: Path, producers: Producers) -> None:
    """The service's expected return (the banner's "back ~09:38 (12 s late)") moves by every answer the
    window waited on: at the ready moment it is as late (or early) as with an operator who answers at
    once, and after the restart's approval it is never before that approval plus the start."""

    def lateness(world: World) -> float:
        state, seen = world.states()[0], world.seen[0]
        ready = state.service.ready_at
        projections = [m for m in seen if isinstance(m, WindowProjection)]
        assert projections, "no projection of the service's return was published"
        return ready - projections[-1].expected_ready_at

    prompt = await runs(tmp_path / "prompt", producers, "window", 0.0, count=1)
    slow = await runs(tmp_path / "slow", producers, "window", DELAY_S, count=1)
    assert lateness(slow) == pytest.approx(lateness(prompt), abs=1e-6)
    state = slow.states()[0]
    last = [m for m in slow.seen[0] if isinstance(m, WindowProjection)][-1]
    approved = state.service.answer_waits[-1][1]  # the restart's answer, the window's last question
    start = fc.phase(fc.from_state(state.run_id, state.forecast), "start").seconds
    assert last.expected_ready_at >= approved + start - 1e-6


async def test_a_resumed_step_records_the_time_it_worked_and_nothing_else(tmp_path: Path, producers: Producers) -> None:
    """After a resume, "preflight was recorded as 41 s when 2 s was observed, and extract as 31 s when
    1 s was observed": the console was away, then the resumed extraction waited on the restart's
    question before verifying its files. A step's time is its work over all its attempts."""
    away_s = 300.0

    async def resumed(root: Path, delay_s: float) -> tuple[RunState, list[Any]]:
        root.mkdir()
        with pytest.MonkeyPatch.context() as monkeypatch:
            window = make_window(root, producers, monkeypatch)
            operator = SlowOperator(window.world.clock, delay_s=delay_s)
            assert await window.console(Crasher("gpu-released"), decider=operator) is None
            window.world.clock.advance(away_s)  # nobody runs a console for a while
            seen: list[Any] = []
            finished = await window.console(decider=SlowOperator(window.world.clock, delay_s=delay_s), seen=seen)
        assert finished is not None and finished.exit_code == 0, finished
        assert "restart" in [c.step for c in window.deciders[-1].asked]  # asked by the resumed console
        return window.state(), seen

    at_once, _ = await resumed(tmp_path / "prompt", 0.0)
    late, seen = await resumed(tmp_path / "slow", DELAY_S)
    assert work(late) == pytest.approx(work(at_once), abs=1e-6)
    for name in ("preflight", "extract"):
        step = late.steps[name]
        assert step.work_s < away_s / 10, (name, step)  # its attempts' work: not the time away, nor the answer
        # The line `run --headless` prints ("[extract] done (0.4 s)") says that same time.
        update = [m for m in seen if isinstance(m, StepUpdate) and m.step == name and m.status == "done"][-1]
        assert update.duration_s == pytest.approx(step.work_s)
    # The resumed extraction waited on the restart's question (it brings the server back before it
    # verifies the files): that wait is the step's, kept apart from its work.
    assert late.steps["extract"].decision_s == pytest.approx(DELAY_S)


async def test_a_question_holds_the_step_that_asked_it_and_a_step_from_when_it_joined() -> None:
    """The ledger alone, on a clock the test moves: a question asked beside a step (the restart's, at
    `gpu_released`, while the extractor flushes) holds nothing until a step joins its task; from then
    on it holds that step."""
    now = [0.0]
    waits = AnswerWaits(lambda: now[0])
    answer, joined = asyncio.Event(), asyncio.Event()

    async def restart() -> None:  # begun beside the extraction: asks at t=0, answered at t=30
        wait = waits.asked()
        await answer.wait()
        waits.answered(wait)

    async def step() -> float:  # the restart step: begins at t=10, joins the restart, ends at t=35
        task = asyncio.create_task(restart())
        await asyncio.sleep(0)
        beside = waits.held(0.0, 10.0)  # the extraction's time meanwhile: work, not a wait
        now[0] = 10.0
        with waits.joined(task):
            joined.set()
            await task
        now[0] = 35.0
        return beside + waits.held(10.0, 35.0)

    held = asyncio.create_task(step())
    await joined.wait()
    now[0] = 30.0
    answer.set()
    assert await held == pytest.approx(20.0)  # 10 -> 30: the join to the answer, no more


def test_overlap_counts_each_second_once() -> None:
    assert overlap([(0, 10), (5, 15), (20, 30)], 2, 25) == pytest.approx(18.0)
    assert overlap([(5, 3)], 0, 10) == 0.0  # an interval out of order is none
    assert fc.worked([[1.0, 4.0]], 0.0, 10.0) == pytest.approx(7.0)
    assert fc.worked([], None, 10.0) is None
