"""Issue 27, "numbers the operator decides on are right", over the engine fakes (tests/engine_fakes.py):
the real engine and store, a fake unit, fake jobs whose workers write real events, the world's clock.

- a stop that failed while the server stayed up records no downtime (item 16);
- the live re-projection runs on the worker's clock (item 14);
- after a budget cut, the next window's forecast counts only the missing prompts (item 13);
- `run --plan`'s plan carries the forecast by phase before any run begins."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from console.procedure import forecast as fc
from console.procedure.engine import EXIT_FAILED
from console.procedure.store import summary_of
from tests.engine_fakes import Fault
from tests.engine_sweep import Window  # its fixtures (producers, window) come through tests/conftest.py


async def test_a_stop_that_failed_with_the_server_up_records_no_downtime(window: Window) -> None:
    """`sudo -n systemctl stop` refused (a password): the unit never left active. Nothing is down, so
    nothing is restarted, and neither the run nor `runs` nor a later forecast sees a downtime."""
    window.world.faults.append(Fault("stop", "sudo"))
    finished = await window.console()
    assert finished is not None and finished.exit_code == EXIT_FAILED and finished.service_up, finished
    world = window.world
    assert world.service.state == "active" and world.service.start_commands == 0
    state = window.state()
    assert state.status == "failed" and state.step("stop").status == "failed"
    assert not state.service.down and state.service.stopped_at is None and state.service.ready_at is None
    assert summary_of(window.store.open(window.run_id)).downtime_s is None
    assert window.store.left_down() is None


# --- item 14: the re-projection on the worker's clock ----------------------------------------------

class ProjectingWindow:
    """What `steps/extract.py`'s event handler reads of the window, and nothing else (a stand-in: the
    handler is tested alone, with events as the real worker writes them, replayed late)."""

    from console.procedure.window import Window

    began = Window.began  # the real one: when the window's downtime began

    def __init__(self, stopped_at: float, budget_s: float):
        from console.procedure import forecast as fc
        from console.procedure.state import RunState, ServiceState
        from console.session.bus import MessageBus

        self.route = "pause"  # the restart at gpu_released is the stop route's: not under test here
        self.state = RunState("r", stopped_at - 60)
        self.state.service = ServiceState(down=True, stopped_at=stopped_at, stops=1)
        inputs = fc.ForecastInputs(run_id="r", service_host="ct129", extract_host="ct129", staged=True,
                                   prompt_tokens=(1000,), budget_s=budget_s,
                                   staged_event={"forward_tokens_per_s": 5.0})  # the warm-up's rate: slow
        start = fc.ForecastPhase("start", 10.0, "median of 2 earlier runs on ct129")
        made = fc.Forecast("r", 210.0, (fc.ForecastPhase("extract", 200.0, "warm-up"), start), budget_s)
        self.forecast_made = (made, inputs)
        self.progress = fc.ExtractionProgress()
        self.budget_asked, self.budget_task = False, None
        self.gpu_released = asyncio.Event()
        self.restart_task = None
        self.bus = MessageBus()
        self.asked: list = []
        self.run = self

    service_down_by_us = True
    server_held_by_us = False  # nor the pause route's give-back at gpu_released

    def save(self) -> None:
        pass

    def crash_point(self, point: str) -> None:
        pass

    async def ask(self, confirmation, holds: bool = True) -> bool:
        self.asked.append(confirmation)
        return False


def tokens_event(t: float, done: int, total: int = 1000) -> dict:
    return {"seq": 1, "t": t, "type": "progress", "key": "tokens", "done": done, "total": total, "unit": "tokens"}


async def test_the_reprojection_runs_on_the_workers_clock_not_when_the_console_reads_it() -> None:
    """A resumed console reads the worker's events in a burst, long after they happened. The rate,
    the projection and gpu_released_at are the worker's own: a stale first sample (projected from the
    slow warm-up rate: past the budget) asks nothing when the newest sample of the burst fits."""
    from console.messages import WindowProjection
    from console.procedure.steps import extract

    stopped_at = time.time() - 3600.0  # the window began an hour before this console reads its events
    engine = ProjectingWindow(stopped_at, budget_s=120.0)
    seen: list[WindowProjection] = []
    engine.bus.subscribe(lambda m: seen.append(m) if isinstance(m, WindowProjection) else None)
    burst = [tokens_event(stopped_at + 20.0, 100), tokens_event(stopped_at + 30.0, 600),
             tokens_event(stopped_at + 35.0, 900)]
    for event in burst:
        extract._on_extract_event(engine, event)
    # 500 tokens in the worker's 10 s, then 300 in 5 s: 800 tokens in 15 s.
    assert engine.progress.tokens_per_s == pytest.approx(800 / 15)
    newest = seen[-1]
    assert newest.expected_ready_at == pytest.approx(stopped_at + 35.0 + 100 / (800 / 15) + 10.0)
    assert newest.expected_ready_at < newest.budget_ends_at == stopped_at + 120.0
    # The first sample alone (1000 - 100 tokens at the warm-up's 5 tok/s) was past the budget: an offer
    # was begun, and withdrawn once the burst's newest sample said the window fits.
    assert seen[0].expected_ready_at > seen[0].budget_ends_at
    if engine.budget_task is not None:
        await engine.budget_task
    assert engine.asked == [] and not engine.budget_asked
    extract._on_extract_event(engine, {"seq": 9, "t": stopped_at + 37.5, "type": "gpu_released", "tokens": 1000})
    assert engine.state.extraction.gpu_released_at == stopped_at + 37.5


# --- item 13: after a budget cut, only the missing prompts are forecast ---------------------------

async def test_the_next_windows_forecast_counts_only_the_missing_prompts(window: Window) -> None:
    """A window cut short at its budget kept 2 of 3 prompts; the next window extracts the one missing,
    and its forecast (the stop's budget check, `prompts_that_fit`) counts that one alone."""
    from console.procedure.engine import Engine
    from tests.engine_fakes import ScriptedDecider
    from tests.fake_hosts import FakeHosts

    run = window.store.open(window.run_id)
    state = run.state
    state.facts.update(prompt_ids=["fizzbuzz", "merge_sort", "graph_bfs"], prompt_tokens=[300, 5000, 700])
    state.windows = [{"service": {}, "steps": {}, "forecast": None,
                      "extraction": {"partial": {"done": ["fizzbuzz", "graph_bfs"], "missing": ["merge_sort"]}}}]
    run.save()
    engine = Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                    ScriptedDecider(window.world.clock), window.store)
    inputs = await engine.window.forecast_inputs()
    assert inputs.prompt_tokens == (5000,)
    state.windows = []  # the first window: every prompt
    assert fc.tokens_left(state, [300, 5000, 700]) == (300, 5000, 700)


# --- run --plan: the forecast before any run begins -------------------------------------------------

async def test_the_plan_carries_the_forecast_by_phase_before_any_run_begins(window: Window, tmp_path) -> None:
    """`run --plan` (and the console's `p`) is preflight alone: no stop, no run kept. Its plan carries
    the downtime by phase with each basis, the window steps' estimates are their phases (one figure
    each, "unknown" where nothing tells it, never "-" nor 0 s), and the stop's row names the downtime."""
    import io

    from rich.console import Console

    from console.procedure.decider import RefuseAll
    from console.procedure.engine import Engine
    from console.procedure.store import RunStore
    from console.views.plan import plan_view
    from tests.fake_hosts import FakeHosts

    world = window.world
    scratch = RunStore(tmp_path / "scratch").create(str(world.config.source), None)
    engine = Engine(FakeHosts(world), world.config, scratch, RefuseAll(), window.store, restart_on_failure=False,
                    plan_only=True)
    await engine.execute()
    plan = engine.plan
    assert plan is not None and plan.forecast is not None and world.service.stop_commands == 0
    made = plan.forecast
    assert [p.name for p in made.phases] == ["stop", "free-vram", "extract", "start"]
    assert all(p.basis for p in made.phases)
    # No staged worker has measured a forward rate yet, and nothing else tells one: unknown, said so.
    assert fc.phase(made, "extract").seconds is None and "unknown" in fc.phase(made, "extract").basis
    steps = {s.name: s for s in plan.steps}
    assert steps["stop"].estimate_s == fc.phase(made, "stop").seconds is not None
    assert steps["free-vram"].estimate_s == fc.phase(made, "free-vram").seconds
    assert f"forecast downtime {fc.figure(made)}" in steps["stop"].why and "earlier windows" not in steps["stop"].why
    screen = io.StringIO()
    Console(file=screen, width=200, no_color=True).print(plan_view(plan))
    text = screen.getvalue()
    assert f"forecast downtime: {fc.figure(made)}" in text
    plan_part = text[:text.index("forecast downtime:")]  # the steps' table, then the phases' own
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[1:-1]]
            for line in plan_part.splitlines() if line.count("│") >= 4}
    assert rows["extract"][-1] == "unknown" and rows["stop"][-1] not in ("-", "0 s")
    for p in made.phases:  # each basis whole, config keys and all ("[service] stop_grace_s")
        assert p.basis.split(";")[0][:40] in text
    assert "(no [fleet] router)" in text


# --- issue 28, item 3: the operator's hesitation never enters an estimate ----------------------------

def test_the_operators_answers_never_enter_an_estimate() -> None:
    """An earlier window whose restart was refused (started by `r` 70 s after the GPUs' release) and
    whose holders' question waited 20 s: the downtime estimate is the sum of its measured phases (the
    hosts' work), the steps' are their work, never the 90 s spent deciding."""
    from console.procedure.state import ExtractionState, RunState, ServiceState, StepState
    from console.procedure.steps import estimates

    t0 = 1_795_000_000.0
    state = RunState("20261201-030000-aaaa", t0 - 60, status="done", route="window",
                     service=ServiceState(stopped_at=t0, stop_returned_at=t0 + 1, vram_free_at=t0 + 26,
                                          start_issued_at=t0 + 101, ready_at=t0 + 111),
                     extraction=ExtractionState(gpu_released_at=t0 + 31, complete=True),
                     steps={"free-vram": StepState("done", t0 + 1, t0 + 26, work_s=5.0, decision_s=20.0),
                            "restart": StepState("done", t0 + 31, t0 + 111, work_s=10.0, decision_s=70.0),
                            "evaluate": StepState("done", t0 + 120, t0 + 150, decision_s=0.0)})
    raw = state.to_json()
    made = estimates([raw])
    phases = fc.measured_phases(raw)
    assert phases == {"stop": 1.0, "free-vram": 5.0, "extract": 5.0, "start": 10.0}
    assert made["downtime"] == sum(phases.values()) == 21.0  # not ready - stopped = 111 s
    assert made["free-vram"] == 5.0 and made["restart"] == 10.0 and made["evaluate"] == 30.0
    # A step recorded without work time (an older store): its span less the answers it waited for.
    raw["steps"]["evaluate"] = {"status": "done", "started_at": t0 + 120, "ended_at": t0 + 150, "decision_s": 12.0}
    assert estimates([raw])["evaluate"] == 18.0
    # A window that did not measure every phase (the console away at ready) gives no downtime estimate.
    raw["service"]["ready_seen_late"] = True
    assert "downtime" not in estimates([raw])


# --- item 15: the cross-check never fails a finished run; its verdict compares like with like --------

async def test_a_cross_check_that_cannot_be_made_ends_the_run_done_saying_why(window: Window, monkeypatch) -> None:
    """The server answers the replay with something the check cannot read (CrossCheckError): the
    run's work is done, so it ends done (exit 0), and crosscheck.json says "no online check: why"."""
    from console.procedure import crosscheck as cc
    from tests.fake_hosts import FakeHosts

    async def bad_answer(self, config, run_dir, run_id, facts):
        raise cc.CrossCheckError("prompt fizzbuzz: meta_info has no spec_verify_ct although /server_info says "
                                 "the server decodes speculatively")
    monkeypatch.setattr(FakeHosts, "crosscheck", bad_answer)  # the one call the fake server cannot answer here
    finished = await window.console()
    assert finished is not None and finished.exit_code == 0 and finished.status == "done", finished
    state = window.state()
    assert state.step("crosscheck").status == "done"
    assert state.step("crosscheck").detail.startswith("no online check: prompt fizzbuzz: meta_info has no")
    saved = cc.load(window.store.root / window.run_id)
    assert saved.status == "no-check" and saved.tau is None and saved.line().startswith("no online check: ")


def _prompt(i: int, online: float, offline: float, steps: int = 40, rounds: int = 38) -> object:
    from console.procedure.crosscheck import PromptCheck

    return PromptCheck(id=f"p{i}", completion_tokens=round(online * steps), verify_ct=steps,
                       online=round(online * steps) / steps, offline=offline, same_tokens=True, offline_rounds=rounds)


def test_the_verdict_compares_the_same_prompts_like_with_like() -> None:
    """Per-request mean beside macro, pooled beside micro, on the same prompts, each with a paired test
    on the difference; below MIN_COMPARED prompts, not compared."""
    from console.procedure.crosscheck import MIN_COMPARED, compare

    # The same drafter measured two ways: per prompt close, across prompts spread (easy and hard prompts).
    same = [_prompt(i, online, online + delta) for i, (online, delta) in
            enumerate([(2.0, 0.02), (5.5, -0.03), (3.1, 0.01), (7.0, -0.02), (4.2, 0.03), (2.6, -0.01)])]
    said = compare(same)
    assert said["prompts"] == 6 and said["agrees"] is True
    assert said["macro"]["ci95"][0] <= 0 <= said["macro"]["ci95"][1] and abs(said["macro"]["difference"]) < 0.05
    assert said["micro"]["online"] == pytest.approx(sum(c.completion_tokens for c in same) / sum(c.verify_ct for c in same))
    # Online a steady 0.3 above offline on every prompt, small beside the prompts' spread: the paired
    # difference says it.
    shifted = [_prompt(i, c.offline + 0.3, c.offline) for i, c in enumerate(same)]
    said = compare(shifted)
    assert said["agrees"] is False and said["macro"]["ci95"][0] > 0.2
    # Too few prompts with both figures: not compared, saying how many and the least.
    few = compare(same[:MIN_COMPARED - 1])
    assert few["agrees"] is None and "macro" not in few
    assert few["why"] == f"not compared: {MIN_COMPARED - 1} prompts with both figures, fewer than {MIN_COMPARED} " \
                        f"([crosscheck] prompts)"
    # A prompt with no offline figure is left out of the comparison, not counted as 0.
    partial = [*same[:3], dataclasses.replace(same[3], offline=None)]
    assert compare(partial)["prompts"] == 3 and compare(partial)["agrees"] is None


async def test_on_the_pause_route_the_window_is_projected_from_the_pause_and_the_offer_gives_the_memory_back() -> None:
    """The pause route's window runs from the pause until the continue: its projection starts at the
    pause and ends with the resume and continue as forecast; past the budget the operator is offered
    to stop the extraction and give the server its memory back (never a restart: it never stopped)."""
    import types

    from console.messages import WindowProjection
    from console.procedure.state import ServiceState
    from console.procedure.steps import extract

    paused_at = time.time() - 100.0
    engine = ProjectingWindow(paused_at, budget_s=30.0)
    engine.state.service = ServiceState(paused=True, paused_at=paused_at, pauses=1)
    made, inputs = engine.forecast_made
    tail = (fc.ForecastPhase("resume", 0.2, "measured on an H200"), fc.ForecastPhase("continue", 0.1, "estimate"))
    pause_made = fc.Forecast("r", 200.3, (fc.ForecastPhase("pause", 0.0, "estimate"), made.phases[0], *tail), 30.0)
    engine.forecast_made = (pause_made, inputs)
    engine.route = "pause"
    engine.config = types.SimpleNamespace(target=types.SimpleNamespace(host="ct129"))

    async def window_dir(host: str) -> str:
        return f"/work/{host}/windows/r"
    engine.dir_on = window_dir
    seen: list[WindowProjection] = []
    engine.bus.subscribe(lambda m: seen.append(m) if isinstance(m, WindowProjection) else None)
    for event in (tokens_event(paused_at + 5.0, 100), tokens_event(paused_at + 15.0, 200)):
        extract._on_extract_event(engine, event)  # 10 tokens a second, 800 left: 80 s more
    newest = seen[-1]
    assert newest.down_since == paused_at and newest.budget_ends_at == paused_at + 30.0
    assert newest.expected_ready_at == pytest.approx(paused_at + 15.0 + 800 / 10 + 0.3)
    assert newest.basis.endswith("then resume (0 s: measured on an H200) + continue (0 s: estimate)")
    await engine.budget_task
    assert [c.action for c in engine.asked] == ["stop the extraction now and give the server its memory back"]
