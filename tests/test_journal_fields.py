"""What the engine journals for a replay (docs/engine.md, "The journal"), over the engine's fakes:
each step's change with its status, every question whole, the jobs by id with their progress
(throttled, never short of where a bar got), their exits, the service's state on both routes; then
the replay reading those fields back. And three small engine promises: a paused run with the service
up says exit 4 in its state, a resume's plan shows the steps done earlier as not acting, and a
finished run is refused in the store's one wording. (On a real drill: tests/test_window.py's
test_headless_drill_end_to_end.)"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console import messages as m
from console.procedure import run_jobs
from console.procedure.engine import EXIT_PAUSED, Engine, ResumeRefused
from console.procedure.replay import read_recording
from console.procedure.store import for_replay_only, what_next
from console.ssh.jobs import JobHandle
from tests.engine_fakes import ScriptedDecider
from tests.engine_sweep import Crasher, Window
from tests.fake_hosts import FakeHosts


def _journal(window: Window) -> list[dict[str, Any]]:
    return window.store.open(window.run_id).read_journal()


async def test_the_journal_holds_what_a_replay_needs(window: Window) -> None:
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    state, journal = window.state(), _journal(window)
    steps = [e for e in journal if e.get("kind") == "step"]
    for name, rec in state.steps.items():  # every step: its start (with the attempt's start) and its end
        said = [(e["status"], e.get("started_at")) for e in steps if e["step"] == name]
        assert said[-1][0] == rec.status, (name, said)
        if rec.started_at is not None:  # it ran (a step skipped by its check never did)
            assert said[0] == ("running", rec.started_at), (name, said)
    questions = [e for e in journal if e.get("kind") == "question"]
    assert [q["step"] for q in questions] == ["stop", "free-vram", "restart"]
    for q in questions:  # the whole question: what, where, the command, its impact and estimate, when
        data = q["data"]
        assert q["host"] and q["argv"] and q["decision"].startswith("yes") and data["impact"], q
        assert isinstance(data["destructive"], bool) and data["estimate_basis"] and data["asked_at"] <= q["t"]
    assert next(q for q in questions if q["step"] == "stop")["data"]["estimate_s"] is not None
    jobs = {j.job_id: j for j in state.jobs.values()}
    started = [e for e in journal if e.get("kind") == "job-start"]
    assert started and all(e["job_id"] in jobs for e in started)
    extract = state.jobs["extract"]
    progress = [e["data"] for e in journal if e.get("kind") == "job-progress" and e["job_id"] == extract.job_id]
    bars = [(p["done"], p["total"]) for p in progress if "done" in p]
    assert bars and bars[-1] == (2, 2), progress  # the bar as far as it got (held back, then written at the milestone)
    assert "forward" in [p.get("phase") for p in progress if p.get("event") == "phase"]
    assert "gpu_released" in [p.get("event") for p in progress]
    exits = {e["job_id"]: e["exit"] for e in journal if e.get("kind") == "job-exit"}
    assert exits == {j.job_id: j.exit_code for j in jobs.values() if j.exit_code is not None and j.job_id in exits}
    assert exits[extract.job_id] == 0 and exits[state.jobs["evaluate"].job_id] == 0
    assert [e["data"]["state"] for e in journal if e.get("kind") == "service" and "ready" not in e["data"]] == \
        ["down", "up"]
    # The replay reads them: the bars, each question shown before its answer, no progress in the event log.
    recording = read_recording(window.store.root / window.run_id)
    assert recording.damage == []
    shown = [e.message for e in recording.events]
    assert any(isinstance(p, m.JobProgress) and p.job_id == extract.job_id and p.done == 2 and p.total == 2
               for p in shown)
    assert any(isinstance(x, m.JobExit) and x.job_id == extract.job_id and x.code == 0 for x in shown)
    for index, message in enumerate(shown):
        if isinstance(message, m.DecisionMade):
            assert message.run_id == window.run_id and message.confirmation.impact
            assert any(isinstance(q, m.Confirmation) and q == message.confirmation for q in shown[:index])
    assert not any(isinstance(x, m.JournalEntry) and for_replay_only({"kind": x.kind, "status": x.status,
                                                                       "message": x.message}) for x in shown)


async def test_the_pause_route_publishes_its_pause_and_journals_it(window: Window) -> None:
    window.route = "pause"
    hosts = FakeHosts(window.world)
    said: list[m.Downtime] = []
    hosts.bus.subscribe(lambda msg: said.append(msg) if isinstance(msg, m.Downtime) else None)
    engine = Engine(hosts, window.world.config, window.store.open(window.run_id), ScriptedDecider(window.world.clock),
                    window.store, route="pause")
    finished = await engine.execute()
    assert finished.exit_code == 0, finished.message
    service = window.state().service
    paused = [d for d in said if d.down_since is not None]
    assert paused and all(d.paused and d.down_since == service.paused_at for d in paused)  # from the pause
    assert said[-1] == m.Downtime(window.run_id, None, service.continued_at)  # to the continue
    journal = _journal(window)
    assert [e["data"]["state"] for e in journal if e.get("kind") == "service" and "ready" not in e["data"]] == \
        ["paused", "up"]


class _Recorder:
    """What `record_progress` needs of an engine: where it writes (the journal's own fields kept)."""

    def __init__(self) -> None:
        self.progress_said: dict[Any, Any] = {}
        self.written: list[dict[str, Any]] = []

    def record(self, step: str | None, message: str, **fields: Any) -> None:
        self.written.append(fields)


@settings(max_examples=40, deadline=None)
@given(gaps=st.lists(st.floats(min_value=0.0, max_value=1.5), min_size=1, max_size=60))
def test_progress_is_throttled_and_never_left_short(gaps: list[float]) -> None:
    """At most one entry per PROGRESS_EVERY_S per counter (plus the one the exit writes), and the
    last value always reaches the journal."""
    clock = [0.0]

    class Time:
        @staticmethod
        def monotonic() -> float:
            return clock[0]

    engine = _Recorder()
    handle = JobHandle(host="ct129", job_id="r-extract", worker="extract", run_dir="/w/j", pid=1, start_ticks=None,
                       started_at=0.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(run_jobs, "time", Time)
        for done, gap in enumerate(gaps, 1):
            clock[0] += gap
            run_jobs.record_progress(engine, handle, "progress", m.JobProgress(
                "r-extract", "extract", "ct129", done, len(gaps), "prompts", key="prompts"))
        run_jobs.record_progress(engine, handle, "exit", m.JobExit("r-extract", "extract", "ct129", 0))
    bars = [w["data"]["done"] for w in engine.written if w["kind"] == "job-progress"]
    assert bars[-1] == len(gaps) and bars == sorted(set(bars))
    assert len(bars) <= math.floor(clock[0] / run_jobs.PROGRESS_EVERY_S) + 2
    assert engine.written[-1]["kind"] == "job-exit" and engine.written[-1]["exit"] == 0


# --- the engine's small promises ---------------------------------------------------------------


async def test_a_run_paused_with_the_service_up_records_exit_4(window: Window) -> None:
    finished = await window.console(one_step=True)
    assert finished.status == "paused" and finished.service_up, finished.message
    assert finished.exit_code == EXIT_PAUSED and window.state().exit_code == EXIT_PAUSED  # as the CLI exits


async def test_a_resumes_plan_shows_the_steps_done_earlier_as_not_acting(window: Window) -> None:
    assert await window.console(Crasher("stop-asked")) is None  # stage and cache recorded done
    hosts = FakeHosts(window.world)
    plans: list[m.PlanReady] = []
    hosts.bus.subscribe(lambda msg: plans.append(msg) if isinstance(msg, m.PlanReady) else None)
    engine = Engine(hosts, window.world.config, window.store.open(window.run_id), ScriptedDecider(window.world.clock),
                    window.store)
    finished = await engine.execute()
    assert finished.exit_code == 0, finished.message
    acts = {s.name: (s.acts, s.why, s.argv) for s in plans[-1].steps}
    for name in ("stage", "cache"):
        assert acts[name] == (False, "done earlier in this run: not done again", ()), acts[name]
    assert acts["stop"][0] and acts["stop"][2]  # what the resume does still acts, its command shown
    assert engine.plan is not None and next(s for s in engine.plan.steps if s.name == "stage").acts  # still staged


async def test_a_finished_run_is_refused_in_the_stores_words(window: Window) -> None:
    assert (await window.console()).exit_code == 0
    with pytest.raises(ResumeRefused) as refused:
        await window.console()
    assert str(refused.value) == what_next(window.store.open(window.run_id))


async def test_each_question_is_in_question_json_while_it_waits_whoever_asks(window: Window) -> None:
    """question.json (what a read-only console, the browser view and `status` show as the driving
    console's open question) is the engine's: written for a headless decider too (`run --step`), for
    as long as the question waits, and gone once it is answered."""
    seen: list[dict[str, Any]] = []
    path = window.store.root / window.run_id / "question.json"

    class Looking(ScriptedDecider):
        async def decide(self, confirmation: m.Confirmation) -> bool:
            import json

            seen.append(json.loads(path.read_text()))
            return await super().decide(confirmation)

    finished = await window.console(decider=Looking(window.world.clock))
    assert finished.exit_code == 0, finished.message
    assert [q["step"] for q in seen] == ["stop", "free-vram", "restart"]
    restart = seen[-1]
    assert restart["host"] and restart["command"] and restart["action"] == "start the service"
    assert not path.exists()


async def test_a_refused_restart_is_asked_once(window: Window) -> None:
    """The walk's refused restart was asked three times: at gpu_released, again by the restart step,
    again by the compensation. The operator's no stands for the run: asked once, the service left
    down and said so; `r` (or `run --resume`) asks again, as a decision of its own."""
    refuse = ScriptedDecider(window.world.clock, refuse={"restart"})
    finished = await window.console(decider=refuse)
    assert not finished.service_up and finished.exit_code == 3  # the service left down, and said so
    assert [c.step for c in refuse.asked].count("restart") == 1, [c.step for c in refuse.asked]
    assert window.world.service.start_commands == 0
    said = [e["message"] for e in _journal(window) if e.get("step") == "restart"]
    assert any("the restart was refused: the service stays down" in line for line in said), said
    again = await window.console()  # the resume asks, once, and restarts it
    assert again.service_up and window.world.service.start_commands == 1
