"""The window engine over small fakes of the hosts (`tests/engine_fakes.py`): unit tests of its
decisions, then the crash-point sweep of issue 22: for every point where the engine writes state in
a window, and for every step's failure, the console dies (or the step fails) there and a new engine
resumes over the same world and the same run store. Every case ends with the same promises checked
against the world itself: the service is ready (or the run says exit 3 and the store names it), the
stop ran at most once, one start per down period, the extraction ran at most once and never again
once complete, no step is recorded done whose work is not on the host, and the downtime recorded is
the world's own."""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import console.procedure.engine as engine_module
from console import messages as m
from console.operator import Operator
from console.procedure.engine import CRASH_POINTS, EXIT_DOWN, Engine, ResumeRefused
from tests.engine_fakes import SCHEDULER_PID, TRAINING, Fault, Producers, ScriptedDecider, write_config
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Failure,
    Window,
    assert_promises,
    cancel_at,
    make_window,
)
from tests.fake_hosts import FakeHosts

# --- the happy path -------------------------------------------------------------------------------


async def test_the_window_runs_to_the_end_over_the_fakes(window: Window) -> None:
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    state = window.state()
    assert [state.steps[s].status for s in ("preflight", "stage", "cache", "stop", "free-vram", "extract",
                                             "restart", "evaluate", "report")] == ["done"] * 9
    assert window.world.ended == [4243], "the story's leftover scheduler was ended"
    assert state.headline and all(v is not None for v in state.headline.values())
    assert_promises(window, finished)


# --- the crash-point sweep ---------------------------------------------------------------------------


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_a_console_killed_at_each_crash_point_resumes_to_the_end(window: Window, point: str) -> None:
    assert await window.console(Crasher(point)) is None, f"the run never reached {point}"
    finished = await window.console()
    assert finished is not None and finished.exit_code == 0, finished
    assert_promises(window, finished)
    state = window.state()
    assert all(state.steps[s].status == "done" for s in ("stop", "extract", "restart", "evaluate", "report"))
    assert len([j for j in window.world.extraction_jobs() if "holds-gpu" in j.reached]) == 1
    assert window.world.ended == [SCHEDULER_PID], "the leftover holder is ended once"
    assert len([j for j in window.world.job_order if j.kind == "completions"]) == 1, "generated once"


SECOND = [(a, b) for i, a in enumerate(CRASH_POINTS) for b in CRASH_POINTS[i:]]


@pytest.mark.parametrize(("first", "second"), SECOND, ids=[f"{a}+{b}" for a, b in SECOND])
async def test_a_second_crash_during_the_resume(window: Window, first: str, second: str) -> None:
    """Killed at `first`, then the resuming console killed at `second` (when it gets there: a
    point already passed is not reached again), then a third console finishes."""
    assert await window.console(Crasher(first)) is None
    finished = await window.until_finished([Crasher(second)])
    assert finished.exit_code == 0, finished
    assert_promises(window, finished)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(crashes=st.lists(st.tuples(st.sampled_from(CRASH_POINTS), st.integers(1, 2)), min_size=1, max_size=4))
def test_any_sequence_of_crashes_keeps_the_promises(producers: Producers, tmp_path_factory: pytest.TempPathFactory,
                                                    crashes: list[tuple[str, int]]) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        w = make_window(tmp_path_factory.mktemp("seq"), producers, monkeypatch)
        finished = asyncio.run(w.until_finished([Crasher(p, nth) for p, nth in crashes]))
    assert finished.exit_code == 0, finished
    assert_promises(w, finished)


# --- every step's failure --------------------------------------------------------------------------


FAILURES = [
    Failure("preflight-link", (Fault("connect", "link"),)),
    Failure("preflight-timeout", (Fault("connect", "timeout", times=99),), status="failed", failed_step="preflight"),
    Failure("stage-dead", (Fault("extract:staged", "dead"),)),
    Failure("stage-exit", (Fault("extract:staged", "exit"),)),  # gone before the go: extracted from disk
    Failure("stage-follow-timeout", (Fault("follow", "timeout", {"kind": "extract-staged"}),), status="failed",
            failed_step="stage"),
    Failure("stage-link", (Fault("start_job", "link", {"worker": "extract"}),)),
    Failure("cache-dead", (Fault("completions:generate", "dead"),), status="failed", failed_step="cache"),
    Failure("cache-exit", (Fault("completions:generate", "exit"),), status="failed", failed_step="cache"),
    Failure("cache-stall", (Fault("completions:generate", "stall"),), status="failed", failed_step="cache"),
    Failure("cache-link", (Fault("write_text", "link", {"path": "prompts.jsonl"}),)),
    Failure("stop-refused", refuse=frozenset({"stop"}), status="refused", failed_step="stop"),
    Failure("stop-link-before", (Fault("stop", "link"),)),
    Failure("stop-link-after", (Fault("stop", "link", after=True),)),
    Failure("stop-status-timeout", (Fault("status", "timeout"),), status="failed"),
    Failure("free-vram-refused", refuse=frozenset({"free-vram"}), status="refused", failed_step="free-vram"),
    Failure("free-vram-stuck", holders_survive=True, status="failed", failed_step="free-vram"),
    Failure("free-vram-link", (Fault("end_holders", "link"),)),
    Failure("extract-dead", (Fault("extract:forward", "dead"),), status="failed", failed_step="extract"),
    Failure("extract-exit", (Fault("extract:forward", "exit"),), status="failed", failed_step="extract"),
    Failure("extract-dead-after-release", (Fault("extract:gpu_released", "dead"),), status="failed",
            failed_step="extract"),
    Failure("extract-link", (Fault("run", "link", {"argv0": "sh"}),)),
    Failure("extract-follow-timeout", (Fault("follow", "timeout", {"kind": "extract-staged"}, skip=1),), status="failed",
            failed_step="extract"),
    Failure("restart-refused", refuse=frozenset({"restart"}), status="refused", failed_step="restart"),
    Failure("restart-timeout", (Fault("ready", "timeout"),)),
    Failure("restart-link", (Fault("start", "link"),)),
    Failure("evaluate-dead", (Fault("evaluate:mid", "dead"),), status="failed", failed_step="evaluate"),
    Failure("evaluate-exit", (Fault("evaluate:start", "exit"),), status="failed", failed_step="evaluate"),
    Failure("evaluate-link", (Fault("relay_tree", "link"),)),
    Failure("report-link", (Fault("fetch_tree", "link"),)),
]


@pytest.mark.parametrize("failure", FAILURES, ids=[f.name for f in FAILURES])
async def test_every_steps_failure_then_a_new_console(window: Window, failure: Failure) -> None:
    window.world.faults.extend(dataclasses.replace(f, match=dict(f.match)) for f in failure.faults)
    window.world.holders_survive = failure.holders_survive
    first = await window.console(decider=ScriptedDecider(window.world.clock, refuse=set(failure.refuse)))
    assert first is not None
    assert first.status == failure.status, first.message
    state = window.state()
    if failure.failed_step is not None:
        assert state.steps[failure.failed_step].status in ("failed", "refused"), state.steps[failure.failed_step]
    assert not any(j.state == "running" for j in window.world.job_order), "a job of the run was left running"
    assert_promises(window, first)
    assert all(f.hit for f in window.world.faults), "an injected fault never fired"
    # A new console over the finished run: only a restart, when the run left the service down.
    window.world.faults.clear()
    if window.store.left_down() is not None:
        again = await window.console()
        assert again is not None and again.service_up, again
        assert_promises(window, again)
    else:
        with pytest.raises(ResumeRefused, match="a finished run is never resumed"):
            await window.console()
    assert window.world.service.state == "active"


# --- the old engine's defects (issue 22 items 1-10 and 13) -------------------------------------------


async def test_a_dead_staged_worker_never_counts_as_staged_on_resume(window: Window) -> None:
    """Item 1: killed after `staged`, the staged worker dies too; the resume stages again (a new
    attempt, seen alive) before it stops the server, and the window extracts."""
    assert await window.console(Crasher("staged")) is None
    (staged,) = window.world.extraction_jobs()
    window.world.kill_job(staged)
    await asyncio.sleep(0)
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    first, second = window.world.extraction_jobs()
    assert first.state == "dead" and second.seen("staged") and second.seen("artifact")
    stop_at = window.world.service.commands[0][0]
    assert stop_at > staged.handle.started_at
    assert_promises(window, finished)


async def test_a_job_dead_after_the_go_is_never_replayed_as_live(window: Window) -> None:
    """Item 1, second half: the extractor dies after the go while the console is away; the resume
    follows it from its offset, finds it dead, and restarts the server without extracting twice."""
    assert await window.console(Crasher("go")) is None
    (job,) = window.world.extraction_jobs()
    await window.world.wait_file(Path(job.arg("--go-file")))
    window.world.kill_job(job)
    await asyncio.sleep(0)
    finished = await window.console()
    assert finished.status == "failed" and "dead" in finished.message, finished.message
    assert window.world.service.state == "active" and len(window.world.extraction_jobs()) == 1
    assert window.state().steps["extract"].status == "failed"
    assert_promises(window, finished)


async def test_a_finished_run_is_never_resumed(window: Window) -> None:
    """Item 2 (and 8's `p`): a run that ended is not run again; one that left the service down is
    only restarted, and the store names it until then."""
    assert (await window.console()).exit_code == 0
    with pytest.raises(ResumeRefused, match="never resumed"):
        await window.console()
    assert window.world.service.stop_commands == 1


async def test_a_run_refused_with_the_service_down_is_named_by_the_store(window: Window) -> None:
    """Item 2: failed, refused or cancelled, a run that left the service down is `left_down()`,
    whatever its status; the next console only restarts it."""
    refuse = ScriptedDecider(window.world.clock, refuse={"restart"})
    finished = await window.console(decider=refuse)
    assert finished.status == "refused" and finished.exit_code == EXIT_DOWN
    assert window.store.left_down().run_id == window.run_id
    assert window.store.to_resume().run_id == window.run_id
    again = await window.console()
    assert again.service_up and window.store.left_down() is None
    assert window.world.service.start_commands == 1
    assert_promises(window, again)


async def test_step_mode_runs_each_next_step_to_the_end(window: Window) -> None:
    """Issue 43.1: `--step` (the console's n), one console per step: each runs the first step the run's
    state has not settled, and pauses after it. free-vram, done before the extraction began, is asked
    of the hosts again on the way and is no step of its own (a resume paused after it again, forever,
    and never reached the extraction); the restart begun at gpu_released is joined before the pause."""
    ends: list[tuple[str, int, str]] = []
    for _ in range(10):
        seen: list = []
        finished = await window.console(seen=seen, one_step=True)
        ran = [u.step for u in seen if isinstance(u, m.StepUpdate) and u.status == "running" and u.step != "preflight"]
        ends.append((finished.status, finished.exit_code, ",".join(ran)))
        if finished.status != "paused":
            break
    assert ends == [("paused", 4, "stage,cache"), ("paused", 4, "acceptance"), ("paused", 3, "stop"),
                    ("paused", 3, "free-vram"), ("paused", 4, "free-vram,extract,restart"), ("paused", 4, "drafter"),
                    ("paused", 4, "evaluate"), ("paused", 4, "report"), ("done", 0, "report,crosscheck")], ends
    said = [f.message for f in window.finished]
    assert said[3].startswith(f"paused after free-vram (one step at a time): the next step, extract, runs on "
                              f"`dflash-ops run --resume {window.run_id}`"), said[3]
    assert "THE SERVICE IS STILL DOWN" in said[3]
    assert_promises(window, window.finished[-1])
    assert window.world.service.stop_commands == window.world.service.start_commands == 1


async def test_a_no_to_a_step_that_runs_while_down_says_what_it_leaves(window: Window) -> None:
    """Issue 43.1: a no to a step that must run while the service is down (the holders left running):
    the restart then offered says what the no left (the service down, which run) and what a no to it
    leaves: the service down for later, `run --resume` naming the run, exit 3."""
    decider = ScriptedDecider(window.world.clock, refuse={"free-vram", "restart"})
    finished = await window.console(decider=decider)
    restart = decider.asked[-1]
    assert [c.step for c in decider.asked] == ["stop", "free-vram", "restart"]
    assert restart.impact.startswith("free-vram: the operator refused to end 1 process holding VRAM; free-vram "
                                     "must run while the service is down, so this window cannot go on"), restart.impact
    assert restart.leaves.startswith(f"the service stays DOWN, stopped by run {window.run_id} at ")
    assert restart.leaves.endswith(f"`dflash-ops run --resume {window.run_id}` restarts it later (exit 3)")
    assert finished.status == "refused" and finished.exit_code == EXIT_DOWN
    assert finished.message.endswith(f"`dflash-ops run --resume {window.run_id}` restarts it"), finished.message
    assert window.store.left_down().run_id == window.run_id
    assert_promises(window, finished)


async def test_a_resume_cannot_switch_route(window: Window) -> None:
    """Item 4: the route is fixed when the run is made."""
    assert await window.console(Crasher("stop-ran")) is None
    with pytest.raises(ResumeRefused, match="keeps its route"):
        Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
               ScriptedDecider(), window.store, route="zero-downtime")
    finished = await window.console()
    assert finished.exit_code == 0
    assert_promises(window, finished)


async def test_two_restarts_at_once_start_the_service_once(window: Window) -> None:
    """Item 5: the quit modal's "restart, then quit" beside the engine's own restart."""
    assert await window.console(Crasher("stop-ran")) is None
    engine = Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                    ScriptedDecider(window.world.clock), window.store)
    await asyncio.gather(engine.restart_service("the quit modal"), engine.restart_service("the engine"))
    assert window.world.service.start_commands == 1 and window.world.service.state == "active"
    assert not window.store.open(window.run_id).state.service.down


async def test_a_start_cut_off_is_waited_for_never_started_again(window: Window) -> None:
    """Item 5: the console dies while the unit loads; the resume finds it activating (or active)
    and waits; the ready moment it did not see is said so."""
    window.world.faults.append(Fault("ready", "crash"))
    assert await window.console() is None
    assert window.world.service.state == "activating"
    assert window.world.service.start_commands == 1
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    assert window.world.service.start_commands == 1
    assert window.state().service.ready_seen_late
    assert_promises(window, finished)


async def test_the_stops_check_asks_the_host(window: Window) -> None:
    """Item 6: the saved `down` flag is not trusted: a server started outside the run meanwhile
    is found running, and it is never stopped a second time without asking (refused here: nothing
    more is done to it). Issue 27's item 4 (tests/test_resume_rules.py) asks and stops it again."""
    assert await window.console(Crasher("stop-ran")) is None
    window.world.service.start()
    while window.world.service.state != "active":
        await window.world.wait_changed()
    finished = await window.console(decider=ScriptedDecider(window.world.clock, refuse={"stop"}))
    assert finished.status == "refused", finished.message
    assert "started outside this run" in window.deciders[-1].asked[-1].impact
    assert window.world.service.stop_commands == 1 and window.world.service.start_commands == 1
    assert not window.state().service.down


async def test_work_time_excludes_decision_time(window: Window) -> None:
    """Item 7: the operator's think time is decision time; a step done while the console was away
    is `done`, found on resume, its first start kept."""
    thinking = ScriptedDecider(window.world.clock, think_s=100.0)
    assert await window.console(Crasher("reported"), decider=thinking) is None
    stop = window.state().steps["stop"]
    assert stop.decision_s == 100.0
    assert stop.work_s == pytest.approx(4.0)  # STOP_S: the stop's own time
    finished = await window.console()
    assert finished.exit_code == 0
    report = window.state().steps["report"]
    assert report.status == "done"


async def test_a_step_done_while_the_console_was_away_is_found_done(window: Window) -> None:
    assert await window.console(Crasher("cached")) is None
    before = window.state().steps["cache"]
    finished = await window.console()
    after = window.state().steps["cache"]
    assert finished.exit_code == 0
    assert after.status == "done" and after.found_on_resume and after.started_at == before.started_at


async def test_a_cancel_right_after_the_stop_marks_the_stop_done(window: Window) -> None:
    """Item 8: Ctrl-C the moment the stop returned: the stop happened, it is `done`, and the
    compensation restarts the service."""

    def cancel_at(point: str) -> None:
        if point == "stop-ran":
            asyncio.current_task().cancel()

    hosts = FakeHosts(window.world)
    engine = Engine(hosts, window.world.config, window.store.open(window.run_id), ScriptedDecider(window.world.clock),
                    window.store, crash_at=cancel_at)
    finished = await engine.execute()
    state = window.state()
    assert finished.status == "cancelled" and state.steps["stop"].status == "done"
    assert window.world.service.state == "active"
    assert_promises(window, finished)


@pytest.mark.parametrize("point", CRASH_POINTS)
async def test_a_cancel_lost_on_its_way_is_asked_again(window: Window, point: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (or SIGTERM) at each crash point, and the host call it lands in loses it (Python
    3.11's wait_for, under asyncssh): the run is cancelled all the same, and compensates; it
    never goes on to the end as if nobody had asked (a CI run saw exactly that, exit 0). At
    `gpu-released` the extractor is writing its files: it is left to finish and the run ends paused
    for its resume, which evaluates (issue 27, item 6: a finished extraction is never thrown away)."""
    monkeypatch.setattr(engine_module, "CANCEL_AGAIN_S", 0.01)
    finished = await cancel_at(window, point)
    expected = "paused" if point == "gpu-released" else "cancelled"
    assert finished.status == expected, (finished, window.world.swallowed)
    assert_promises(window, finished)
    if expected == "paused":
        assert "left to finish" in finished.message and finished.service_up, finished
        resumed = await window.console()
        assert resumed is not None and resumed.exit_code == 0, resumed
        assert len(window.world.extraction_jobs()) == 1 and window.state().steps["evaluate"].status == "done"
    if window.world.swallowed:  # where the next call lost it, it was asked again, and taken
        assert window.world.swallow_cancels == 0


def test_the_lost_cancel_sweep_meets_lost_cancels(producers: Producers, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The sweep above is not vacuous: at most crash points the cancel does land in a host call
    that loses it."""
    lost = []
    for point in CRASH_POINTS:
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(engine_module, "CANCEL_AGAIN_S", 0.01)
            window = make_window(tmp_path_factory.mktemp(point), producers, monkeypatch)
            asyncio.run(cancel_at(window, point))
            lost += [point] if window.world.swallowed else []
    assert len(lost) >= len(CRASH_POINTS) // 2, lost


async def test_one_of_stage_and_cache_failing_cancels_the_other_and_ends_its_job(window: Window) -> None:
    """Item 9: the cache fails; the staged extractor is not left waiting for a go."""
    window.world.faults.append(Fault("completions:generate", "exit"))
    finished = await window.console()
    state = window.state()
    assert finished.status == "failed" and state.steps["cache"].status == "failed"
    assert state.steps["stage"].status == "cancelled"
    (staged,) = window.world.extraction_jobs()
    assert staged.state == "exited" and staged.exit_code == 143  # SIGTERM, written as its exit
    assert window.world.service.stop_commands == 0


async def test_an_exception_inside_the_compensation_still_finishes_the_run(window: Window) -> None:
    """Item 10: the compensation's restart meets an unexpected error: it is journalled, the run
    still finishes (not `running`), exit 3, and the store names it as left down."""
    window.world.faults.append(Fault("service_manager", "error", skip=3))
    finished = await window.console(decider=ScriptedDecider(window.world.clock, refuse={"free-vram"}))
    state = window.state()
    assert state.status == "refused" and state.exit_code == EXIT_DOWN == finished.exit_code
    journal = window.store.open(window.run_id).read_journal()
    assert any("compensation failed" in e["message"] or "restart failed" in e["message"] for e in journal)
    assert window.store.left_down().run_id == window.run_id


async def test_the_zero_downtime_watcher_never_counts_our_extractor(tmp_path: Path, producers: Producers,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 13: the extractor fills the chosen GPU itself; the route must not cancel itself."""
    w = make_window(tmp_path, producers, monkeypatch)
    w.world.extract_mib = 81559 - 400  # all of the GPU but what the driver keeps
    finished = await w.console(route="zero-downtime")
    assert finished.exit_code == 0, finished.message
    (job,) = w.world.extraction_jobs()
    assert job.handle.host == TRAINING and "holds-gpu" in job.reached
    need = w.state().facts["extract_on"]["need_mib"]
    assert 81559 - 300 - w.world.extract_mib < need, "our own memory, counted, would leave too little room"
    assert w.world.service.stop_commands == 0 and w.world.service.start_commands == 0
    assert w.state().steps["extract"].status == "done"


AFTER_THE_STOP = [f for f in FAILURES if f.name in ("free-vram-refused", "free-vram-stuck", "extract-dead",
                                                    "extract-exit", "stop-status-timeout")]


@pytest.mark.parametrize("failure", AFTER_THE_STOP, ids=[f.name for f in AFTER_THE_STOP])
@pytest.mark.parametrize("point", ["start-issued", "ready"])
async def test_a_crash_inside_the_compensation_then_a_resume(window: Window, failure: Failure, point: str) -> None:
    """A step fails after the stop, and the console dies while its compensation restarts the
    service: the resume still brings the service back, with one start for the down period."""
    window.world.faults.extend(dataclasses.replace(f, match=dict(f.match)) for f in failure.faults)
    window.world.holders_survive = failure.holders_survive
    refusing = ScriptedDecider(window.world.clock, refuse=set(failure.refuse))
    assert await window.console(Crasher(point), decider=refusing) is None
    window.world.holders_survive = False
    finished = await window.until_finished([])
    assert window.world.service.state == "active", finished
    assert_promises(window, finished)


async def test_a_job_that_failed_before_the_crash_is_reported_as_it_failed(window: Window) -> None:
    """The extractor exits 2 with its error; the console dies in the compensation. The resume says
    the worker's own error, not that the job is dead (its `exit` was handled: nothing follows it)."""
    window.world.faults.append(Fault("extract:forward", "exit"))
    assert await window.console(Crasher("start-issued")) is None
    finished = await window.console()
    assert finished.status == "failed"
    assert "injected failure after forward" in finished.message and "exit 2" in finished.message, finished.message
    assert_promises(window, finished)


async def test_a_resume_keeps_the_original_times_and_journals_no_replayed_event(window: Window) -> None:
    """Item 7: `gpu_released_at` is not overwritten by a resume, and a log event handled before the
    crash is not journalled again with a new time."""
    assert await window.console(Crasher("gpu-released")) is None
    released = window.state().extraction.gpu_released_at
    assert released is not None
    finished = await window.console()
    assert finished.exit_code == 0
    assert window.state().extraction.gpu_released_at == released
    waits = [e for e in window.store.open(window.run_id).read_journal() if "waiting for the go signal" in e["message"]]
    assert len(waits) == 1, waits


async def test_the_early_restarts_failure_is_said_before_the_restart_is_asked_again(window: Window) -> None:
    """Item 10: the restart begun at gpu_released fails (the link drops); its reason is journalled
    and the next confirmation says it."""
    window.world.faults.append(Fault("start", "link"))
    decider = ScriptedDecider(window.world.clock)
    finished = await window.console(decider=decider)
    assert finished.exit_code == 0
    starts = [c for c in decider.asked if c.step == "restart"]
    assert len(starts) == 2 and "the last start failed" in starts[1].impact and "link dropped" in starts[1].impact
    journal = window.store.open(window.run_id).read_journal()
    assert any("the restart begun at gpu_released failed" in e["message"] for e in journal)
    assert window.world.service.start_commands == 1


# --- a resume under another config (issue 27, item 3) ----------------------------------------------

OTHER_CONFIGS = {  # what another config changes, each written to a file of its own
    "another host": {"host": TRAINING},
    "another unit": {"unit": "sglang-b.service"},
    "another URL": {"url": "http://127.0.0.1:30001"},
    "another config file": {"ready_timeout_s": 901},  # the same service, another file with other bytes
}
UNDER_ANOTHER_CONFIG = ("stop-ran", "holders", "gpu-released", "start-issued", "refused-restart")


@pytest.mark.parametrize("point", UNDER_ANOTHER_CONFIG)
async def test_a_resume_under_another_config_is_refused_before_anything(window: Window, point: str,
                                                                        producers: Producers) -> None:
    """The class: wherever the run stands (down, releasing the GPUs, starting, ended with the service
    down), a resume (`run --resume`, the console's offer) and `r` under a config that addresses
    another service, or under another config file, are refused naming both, before anything is
    written or sent: the state file is byte for byte the same and no host was asked anything. Then
    the run's own config, edited in place since (the same service), resumes it to the end."""
    if point == "refused-restart":
        first = await window.console(decider=ScriptedDecider(window.world.clock, refuse={"restart"}))
        assert first is not None and first.exit_code == EXIT_DOWN
    else:
        assert await window.console(Crasher(point)) is None
    state_file = window.store.root / window.run_id / "state.json"
    before = state_file.read_bytes()
    own = window.world.config
    for name, change in OTHER_CONFIGS.items():
        (window.root / name.replace(" ", "-")).mkdir()
        other = write_config(window.root / name.replace(" ", "-"), producers, **change)
        hosts = FakeHosts(window.world)
        with pytest.raises(ResumeRefused) as refused:
            Engine(hosts, other, window.store.open(window.run_id), ScriptedDecider(window.world.clock), window.store)
        said = str(refused.value)
        assert str(own.source) in said and str(other.source) in said, said
        assert hosts.calls == [] and state_file.read_bytes() == before, name
        operator = Operator(other, runs_dir=window.store.root)
        with pytest.raises(ResumeRefused, match=re.escape(str(other.source))):  # `run --resume`: said before connecting
            operator.open_run(window.run_id)
        if point == "refused-restart" and name != "another config file":  # `r`: this service's run only
            with pytest.raises(LookupError, match=f"run {window.run_id} left .* down"):
                await operator.restart_service(ScriptedDecider(window.world.clock))
            assert operator.left_down() is None
    assert window.world.service.stop_commands == 1 and state_file.read_bytes() == before
    edited = write_config(window.root, producers, ready_timeout_s=902)  # the run's own file, edited in place
    assert edited.source == own.source
    window.world.config = edited
    finished = await window.console()
    assert finished is not None and finished.service_up, finished
    assert_promises(window, finished)
    journal = window.store.open(window.run_id).read_journal()
    assert any("changed since the run was made" in e["message"] for e in journal)


async def test_a_fresh_run_never_says_it_found_its_own_job_again_a_resumed_one_does(window: Window) -> None:
    """Issue 43 (low): the staged extractor started before the stop goes on at the extraction; the
    journal says so, not "found extract job ... again; following it from byte 1927", which is what a
    resumed run (another console) says of a job it finds by its id."""
    assert await window.console(Crasher("staged")) is None  # the first console dies once staged
    finished = await window.console()
    assert finished is not None and finished.exit_code == 0, finished
    starts = [e["message"] for e in window.store.open(window.run_id).read_journal() if e.get("kind") == "job-start"]
    assert any("again (pid" in line for line in starts), starts  # the second console found the first's job
    window.run_id = window.store.create(str(window.world.config.source), None).run_id
    fresh = await window.console()
    assert fresh is not None and fresh.exit_code == 0, fresh
    starts = [e["message"] for e in window.store.open(window.run_id).read_journal() if e.get("kind") == "job-start"]
    assert not any("again" in line for line in starts), starts
    assert any("started by this console) goes on" in line for line in starts), starts
