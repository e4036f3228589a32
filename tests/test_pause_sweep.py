"""The pause route (issue 26) over the engine's fakes: the server of the fake world answers SGLang's
memory-saver routes as its source does (`tests/fake_sglang.py`). For every new crash point (paused,
released, the extraction, resumed, continued), every pair of them, random sequences, every step's
failure, refusal and lost answer, and a cancel after the pause, the console dies (or the step
fails) and a new engine resumes; every case ends with the window's promises and the pause route's
own: the server is never stopped; it ends serving, or the run exits 3 and the store names it as the
one that left it paused; each pause has exactly one continue and each release exactly one resume of
the same tags; the held requests run again; nothing is extracted twice. A server restarted outside
the run at each point, crossed with a crash at each (issue 40), gets nothing meant for the process
paused; an SGLang whose pause aborts has no pause route."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import console.procedure.engine as engine_module
from console.messages import RunFinished
from console.procedure import forecast as fc
from console.procedure.engine import DRAFTER_CRASH_POINTS, EXIT_DOWN, PAUSE_CRASH_POINTS, ResumeRefused
from console.views.units import duration
from tests.engine_fakes import INFERENCE, TRAINING, FakeWorld, Fault, Producers, ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Failure,
    Window,
    assert_promises,
    cancel_at,
    make_window,
)
from tests.fake_hosts import FakeHosts


@pytest.fixture
def paused(window: Window) -> Window:
    window.route = "pause"
    return window


def assert_pause_promises(w: Window, finished: RunFinished) -> None:
    """The promises, and the pause route's own: the server is never stopped; it ends serving, or the
    run exits 3 and the store names it as the one that left it paused; each pause has exactly one
    continue, each release exactly one resume of the same tags; no request held is lost; SGLang's
    scheduler never met a call that kills it."""
    assert_promises(w, finished)
    server, state = w.world.server, w.state()
    assert w.world.service.stop_commands == 0 and w.world.service.start_commands == 0, w.world.service.commands
    assert not server.violations, server.violations
    releases = [sorted(b["tags"]) for _, r, b in server.calls if r == "release_memory_occupation"]
    resumes = [sorted(b["tags"]) for _, r, b in server.calls if r == "resume_memory_occupation"]
    if server.serving():
        assert not state.service.held, "the server serves but the run says it holds it"
        assert server.count("continue_generation") == server.count("pause_generation")
        assert resumes == releases, (releases, resumes)
        assert server.held == 0, "requests held by the pause were not let through"
    else:
        assert finished.exit_code == EXIT_DOWN, finished
        left = w.store.left_down()
        assert left is not None and left.run_id == w.run_id and left.state.service.left_as() == "paused"
        assert "THE SERVER IS STILL PAUSED" in finished.message
    assert server.count("pause_generation") <= 1 and len(releases) <= 1
    steps = {name: rec.status for name, rec in state.steps.items()}
    if steps.get("release") == "done":
        assert releases
    if steps.get("continue") == "done":
        assert server.serving() and state.service.continued_at is not None


async def test_the_pause_route_runs_to_the_end_over_the_fakes(paused: Window) -> None:
    world, server = paused.world, paused.world.server
    server.running = 3  # requests in flight when the pause comes: held, then answered
    used_before = world.streams[INFERENCE].sample().gpus[0].mem_used_mib
    finished = await paused.console()
    assert finished.exit_code == 0, finished.message
    state = paused.state()
    assert [state.steps[s].status for s in ("pause", "release", "free-vram", "extract", "resume", "continue",
                                             "evaluate", "report")] == ["done"] * 8
    assert "stop" not in state.steps and "restart" not in state.steps
    # Only the KV cache and the CUDA graphs: the extraction fits beside the resident weights.
    assert state.service.released_tags == ["kv_cache", "cuda_graph"]
    assert state.service.used_before_release_mib["0"] == used_before
    assert state.service.used_after_release_mib["0"] == used_before - 14000
    assert world.streams[INFERENCE].sample().gpus[0].mem_used_mib == used_before, "the memory came back"
    assert world.ended == [], "the server's own processes are never ended"
    asked = {c.step: " ".join(c.argv) for d in paused.deciders for c in d.asked}
    assert asked["release"] == ('POST http://127.0.0.1:30000/release_memory_occupation '
                                '{"tags": ["kv_cache", "cuda_graph"]}')
    assert asked["pause"].endswith('/pause_generation {"mode": "retract"}') and "continue" in asked
    assert server.held == 0 and server.running == 3, "the held requests run again"
    assert state.service.paused_at < state.service.released_at < state.service.resumed_at < state.service.continued_at
    # The report's window section: the forecast against the measured, and pause -> continue as the downtime.
    report = (paused.store.root / paused.run_id / "report.md").read_text()
    held = state.service.continued_at - state.service.paused_at
    assert "| downtime (pause -> continue) |" in report and "| release |" in report, report
    (downtime,) = [r for r in fc.against(state) if r.phase.startswith("downtime")]
    assert downtime.measured_s == held and downtime.forecast_s is not None
    assert_pause_promises(paused, finished)


@pytest.mark.parametrize("point", PAUSE_CRASH_POINTS)
async def test_a_console_killed_at_each_pause_point_resumes_to_the_end(paused: Window, point: str) -> None:
    assert await paused.console(Crasher(point)) is None, f"the run never reached {point}"
    finished = await paused.console()
    assert finished is not None and finished.exit_code == 0, finished
    assert_pause_promises(paused, finished)
    assert len([j for j in paused.world.extraction_jobs() if "holds-gpu" in j.reached]) == 1


PAUSE_SECOND = [(a, b) for i, a in enumerate(PAUSE_CRASH_POINTS[2:8]) for b in PAUSE_CRASH_POINTS[2 + i:8]]


@pytest.mark.parametrize(("first", "second"), PAUSE_SECOND, ids=[f"{a}+{b}" for a, b in PAUSE_SECOND])
async def test_a_second_crash_during_the_pause_routes_resume(paused: Window, first: str, second: str) -> None:
    assert await paused.console(Crasher(first)) is None
    finished = await paused.until_finished([Crasher(second)])
    assert finished.exit_code == 0, finished
    assert_pause_promises(paused, finished)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(crashes=st.lists(st.tuples(st.sampled_from(PAUSE_CRASH_POINTS), st.integers(1, 2)), min_size=1, max_size=4))
def test_any_sequence_of_crashes_keeps_the_pause_routes_promises(
        producers: Producers, tmp_path_factory: pytest.TempPathFactory, crashes: list[tuple[str, int]]) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        w = make_window(tmp_path_factory.mktemp("seq"), producers, monkeypatch)
        w.route = "pause"
        finished = asyncio.run(w.until_finished([Crasher(p, nth) for p, nth in crashes]))
    assert finished.exit_code == 0, finished
    assert_pause_promises(w, finished)


PAUSE_FAILURES = [
    Failure("pause-refused", refuse=frozenset({"pause"}), status="refused", failed_step="pause"),
    Failure("pause-link-before", (Fault("pause_generation", "link"),)),
    Failure("pause-link-after", (Fault("pause_generation", "link", after=True),)),
    Failure("pause-error-before", (Fault("pause_generation", "error"),), status="failed", failed_step="pause"),
    Failure("pause-error-after", (Fault("pause_generation", "error", after=True),), status="failed",
            failed_step="pause"),
    Failure("release-refused", refuse=frozenset({"release"}), status="refused", failed_step="release"),
    Failure("release-link-before", (Fault("release_memory_occupation", "link"),)),
    Failure("release-link-after", (Fault("release_memory_occupation", "link", after=True),)),
    Failure("extract-dead", (Fault("extract:forward", "dead"),), status="failed", failed_step="extract"),
    Failure("extract-exit", (Fault("extract:forward", "exit"),), status="failed", failed_step="extract"),
    Failure("resume-refused", refuse=frozenset({"resume"}), status="refused", failed_step="resume"),
    Failure("resume-link-after", (Fault("resume_memory_occupation", "link", after=True),)),
    Failure("resume-timeout", (Fault("resume_memory_occupation", "timeout", times=9),), status="failed",
            failed_step="resume"),
    Failure("continue-refused", refuse=frozenset({"continue"}), status="refused", failed_step="continue"),
    Failure("continue-link-after", (Fault("continue_generation", "link", after=True),)),
]


@pytest.mark.parametrize("failure", PAUSE_FAILURES, ids=[f.name for f in PAUSE_FAILURES])
async def test_every_pause_steps_failure_then_a_new_console(paused: Window, failure: Failure) -> None:
    """Every failure, refusal and lost answer after the pause ends in resume + continue (the same
    compensation as the stop route's restart); a refused give-back leaves the run named by the
    store, and the next console (`run --resume`) only gives the server back."""
    paused.world.faults.extend(dataclasses.replace(f, match=dict(f.match)) for f in failure.faults)
    first = await paused.console(decider=ScriptedDecider(paused.world.clock, refuse=set(failure.refuse)))
    assert first is not None and first.status == failure.status, first.message
    if failure.failed_step is not None:
        assert paused.state().steps[failure.failed_step].status in ("failed", "refused")
    assert not any(j.state == "running" for j in paused.world.job_order), "a job of the run was left running"
    assert_pause_promises(paused, first)
    assert all(f.hit for f in paused.world.faults), "an injected fault never fired"
    paused.world.faults.clear()
    if paused.store.left_down() is not None:
        again = await paused.console()
        assert again is not None and again.service_up, again
        assert_pause_promises(paused, again)
        assert paused.store.left_down() is None
    else:
        with pytest.raises(ResumeRefused, match="a finished run is never resumed"):
            await paused.console()
    assert paused.world.server.serving()


@pytest.mark.parametrize("point", ["paused", "released", "go", "gpu-released", "resumed"])
async def test_a_cancel_after_the_pause_resumes_and_continues(paused: Window, point: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C, SIGTERM, SIGHUP or the console's quit (all `Engine.cancel`) after the pause, the
    host call it lands in losing it: cancelled all the same, and the server given back. At
    `gpu-released` the extractor writing its files is left to finish: the run ends paused, for its
    resume to evaluate (issue 27, item 6)."""
    monkeypatch.setattr(engine_module, "CANCEL_AGAIN_S", 0.01)
    finished = await cancel_at(paused, point)
    expected = "paused" if point == "gpu-released" else "cancelled"
    assert finished.status == expected and finished.service_up, finished
    assert_pause_promises(paused, finished)
    if expected == "paused":
        assert "left to finish" in finished.message
        resumed = await paused.console()
        assert resumed is not None and resumed.exit_code == 0, resumed
        assert_pause_promises(paused, resumed)


async def test_a_server_without_the_memory_saver_is_told_the_one_line(paused: Window) -> None:
    """No memory saver: the pause route is refused at preflight, before anything changes, with the
    one change that makes later windows need no restart."""
    paused.world.server.memory_saver = False
    finished = await paused.console()
    assert finished.status == "failed" and "--enable-memory-saver" in finished.message, finished.message
    assert paused.world.server.calls == [], "nothing was sent to the server"
    assert paused.world.server.serving() and paused.world.service.stop_commands == 0


@pytest.mark.parametrize(("free", "backup", "tags"), [
    (40000, True, ["kv_cache", "cuda_graph"]),  # fits beside the resident weights
    (1000, True, ["kv_cache", "cuda_graph", "weights"]),  # must: and the weights have a CPU backup
    (1000, False, None),  # must, but no backup: not proposed, the plan says why
])
def test_only_what_the_extraction_needs_is_released(free: int, backup: bool, tags: list[str] | None) -> None:
    from console.procedure.steps.pause import release_plan
    from console.service.memory_saver import MemorySaver

    saver = MemorySaver(True, backup, {"kv_cache": 12.0, "cuda_graph": 2.0, "weights": 24.0}, "0.5.23")
    chosen, why = release_plan(saver, free, 1, 30000)
    assert chosen == tags, why
    if tags is None:
        assert "--enable-weights-cpu-backup" in why


@pytest.mark.parametrize(("room", "saver", "route"), [(True, True, "zero-downtime"), (False, True, "pause"),
                                                      (False, False, "window")])
async def test_route_auto_takes_the_least_harm(window: Window, room: bool, saver: bool, route: str) -> None:
    """`--route auto`: zero-downtime where another host has room, else pause where the server runs
    with the memory saver, else the stop route; fixed for the run, and a resume keeps it."""
    if not room:
        window.world.gpus[9999] = (TRAINING, {0: 81000, 1: 81000}, "python train.py")
    window.world.server.memory_saver = saver
    window.route = "auto"
    assert await window.console(Crasher("cached")) is None
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    state = window.state()
    assert state.route == route and state.facts["route_chosen"]["route"] == route, state.facts["route_chosen"]
    if route == "zero-downtime":  # the states are on the other host; the server never touched
        assert window.world.service.commands == [] and window.world.server.calls == []
    else:
        (assert_pause_promises if route == "pause" else assert_promises)(window, finished)


async def test_the_pause_is_forecast_by_phase_and_refused_over_its_budget(paused: Window) -> None:
    """The pause's forecast (pause -> continue) names its basis per phase: issue 26's measurements
    on an H200 until this host has its own; `[window] max_downtime_s` refuses the pause before it."""
    config = paused.world.config
    paused.world.config = dataclasses.replace(config, window=dataclasses.replace(config.window, max_downtime_s=0.01))
    refused = await paused.console()
    assert refused.status == "failed" and "exceeds the budget" in refused.message, refused.message
    assert paused.world.server.calls == [] and paused.world.server.serving()
    phases = paused.state().facts["pause_forecast"]["phases"]
    assert set(phases) == {"pause", "release", "free-vram", "extract", "resume", "continue"}
    assert "issue 26" in phases["release"]["basis"] and phases["release"]["seconds"] == pytest.approx(0.12)


async def test_the_configs_window_route_chooses_when_run_is_not_told(window: Window) -> None:
    """`[window] route = "pause"` makes the run a pause-route run (`run --route` still wins); a
    route the engine does not know is refused where it is written."""
    from console.config import ConfigError, load_config

    path = Path(window.world.config.source)
    path.write_text(path.read_text() + '\n[window]\nroute = "pause"\n')
    window.world.config = load_config(path)
    finished = await window.console()
    assert finished.exit_code == 0 and window.state().route == "pause", finished.message
    assert_pause_promises(window, finished)
    path.write_text(path.read_text().replace('route = "pause"', 'route = "sideways"'))
    with pytest.raises(ConfigError, match="window.route"):
        load_config(path)


async def test_a_run_that_left_the_server_paused_is_named_by_every_view(paused: Window) -> None:
    """The store's one question (`left_down()`) names a run that left the server paused as it
    names one that left it down: `status`'s line, `runs`' row, and a new run is refused until
    `run --resume` gives the server back."""
    from console.cli.run import runs_rows
    from console.cli.status import downtime_line
    from console.operator import Operator

    refused = await paused.console(decider=ScriptedDecider(paused.world.clock, refuse={"resume"}))
    assert refused.exit_code == EXIT_DOWN and not refused.service_up
    line = downtime_line(paused.store).plain
    assert f"PAUSED: memory released by run {paused.run_id} (kv_cache, cuda_graph)" in line, line
    assert f"run --resume {paused.run_id}" in line
    _, rows, _ = runs_rows(paused.store.summaries())
    assert "SERVER PAUSED" in rows[0][2]
    with pytest.raises(ResumeRefused, match="PAUSED: memory released"):
        Operator(paused.world.config, runs_dir=paused.store.root).refuse_new_run()
    again = await paused.console()
    assert again.service_up and paused.store.left_down() is None and downtime_line(paused.store) is None
    assert_pause_promises(paused, again)
    # `runs` shows the pause window's forecast beside its downtime, as a stop window's (issue 43 item 14)
    summary = paused.store.summaries()[0]
    assert summary.forecast_s == paused.state().facts["pause_forecast"]["downtime_s"] is not None
    _, rows, _ = runs_rows([summary])
    assert f"({duration(summary.forecast_s, tenths=True)})" in rows[0][4], rows[0][4]


# --- a prompt set over one window's budget, on the pause route -----------------------------------


async def test_a_pause_window_cut_at_its_budget_gives_the_server_back_and_the_next_extracts_the_rest(
        paused: Window) -> None:
    """The operator's stop at the budget on the pause route (`FakeWorld.budget_prompts`: the stop file
    once 5 of the 10 prompts are done): the five are kept, the server resumed and continued (never
    stopped), the run paused, exit 4; its resume pauses again for the missing five only, then
    evaluates the whole set once. One continue per pause, one resume per release, in each window."""
    import json

    from console.procedure.engine import EXIT_DONE, EXIT_PAUSED
    from tests.engine_fakes import PARTIAL_MANIFEST

    world, server = paused.world, paused.world.server
    world.budget_prompts = 5
    first = await paused.console()
    assert first is not None and first.exit_code == EXIT_PAUSED and "cut short at its budget" in first.message, first
    assert server.serving() and server.count("pause_generation") == server.count("continue_generation") == 1
    assert len(world.extracted) == 5 and paused.store.left_down() is None and server.held == 0
    second = await paused.console()
    assert second is not None and second.exit_code == EXIT_DONE, second
    window = world.workdir(INFERENCE) / "windows" / paused.run_id
    ids = [str(r["id"]) for r in json.loads((window / "completions.json").read_text())["prompts"]]
    assert world.extracted == ids and len(ids) == 10  # every prompt once: the first five, then the rest
    assert (window / "states" / "manifest.json").is_file() and not (window / "states" / PARTIAL_MANIFEST).exists()
    state = paused.state()
    assert state.extraction.complete and state.extraction.partial is None and len(state.windows) == 1
    assert server.count("pause_generation") == server.count("continue_generation") == 2
    releases = [sorted(b["tags"]) for _, r, b in server.calls if r == "release_memory_occupation"]
    resumes = [sorted(b["tags"]) for _, r, b in server.calls if r == "resume_memory_occupation"]
    assert len(releases) == 2 and resumes == releases and not server.violations
    assert world.service.stop_commands == 0 and world.service.start_commands == 0  # never stopped
    assert sum(j.kind == "evaluate" for j in world.job_order) == 1  # the whole set, evaluated once
    assert server.serving() and server.held == 0 and paused.store.left_down() is None


# --- a server restarted outside the run (issue 40) ------------------------------------------------


RESTART_POINTS = ("paused", "released", "go", "gpu-released", "resumed", "continued")
CONTROL = ("release_memory_occupation", "resume_memory_occupation")


def restart_at(world: FakeWorld, moment: str) -> None:
    """The server's unit restarted outside the run (its own stop and start, by hand), once, the moment
    the world gets there: just after the server answered the pause (the release, the resume, the
    continue), or once the extractor computes on the GPU (go) or has let it go (gpu-released);
    whichever console is alive then, or none."""
    server = world.server

    def once() -> None:
        if len(server.lives) == 1:
            world.service.restart_outside()

    route = {"paused": "pause", "released": "release", "resumed": "resume", "continued": "continue_"}.get(moment)
    if route is not None:
        answer = getattr(server, route)

        def answered_then_restarted(*args: Any) -> Any:
            result = answer(*args)
            once()
            return result
        setattr(server, route, answered_then_restarted)
        return
    extractor_point, point = {"go": "forward", "gpu-released": "gpu_released"}[moment], world.point

    async def reached_then_restarted(job: Any, name: str) -> None:
        await point(job, name)
        if name == extractor_point:
            once()
    world.point = reached_then_restarted  # type: ignore[method-assign]


def assert_restart_promises(w: Window, finished: RunFinished, restarted_held: bool) -> None:
    """The window's promises, and over a restart: the server ends serving; SGLang's scheduler never
    met a resume of a tag it had not released, a second release or a continue over released memory
    (the fake's violations); each process got at most one pause and one release, and a continue and
    a resume of exactly what it released, unless the restart ended it first, which the run named
    with both processes."""
    assert_promises(w, finished)
    server, service = w.world.server, w.world.service
    assert server.serving() and not w.state().service.held and w.store.left_down() is None, finished
    assert not server.violations, server.violations
    assert service.stop_commands == 0 and service.start_commands == 0, service.commands
    assert len(server.lives) == 2, "the server was restarted once"
    for life, sent in enumerate(server.lives):
        routes = [route for route, _ in sent]
        tags = {route: [body["tags"] for r, body in sent if r == route] for route in CONTROL}
        assert routes.count("pause_generation") <= 1 and routes.count("release_memory_occupation") <= 1, sent
        whole = (routes.count("continue_generation") == routes.count("pause_generation")
                 and tags["resume_memory_occupation"] == tags["release_memory_occupation"])
        assert whole or life == 0, f"process {life} was left paused or released: {sent}"
    journal = " ".join(e["message"] for e in w.store.open(w.run_id).read_journal())
    if restarted_held:  # named with both processes (the fake unit's start times), and the memory's return
        assert "is not the process this run paused" in journal and "now, " in journal and "when paused" in journal
        assert "the window's memory came back by that restart" in finished.message, finished.message


# A restart after the continue meets a server serving again, which nothing of the run holds: once.
RESTARTS_AND_CRASHES = [(restart, crash) for restart in RESTART_POINTS for crash in (None, *RESTART_POINTS)
                        if restart != "continued" or crash is None]


@pytest.mark.parametrize(("restart", "crash"), RESTARTS_AND_CRASHES,
                         ids=[f"restart-{r}-crash-{c or 'none'}" for r, c in RESTARTS_AND_CRASHES])
async def test_a_server_restarted_at_each_point_crossed_with_a_crash_at_each(
        paused: Window, restart: str, crash: str | None) -> None:
    """The drill's case (issue 40): the server restarted by its own stop and start while this run
    held it, the console alive or killed at each point. Nothing is released, resumed or continued
    on the new process; a restart before the extraction began pauses the new one again (asked);
    after it, the window's memory came back by the restart and the run goes on."""
    world = paused.world
    restart_at(world, restart)
    finished = await paused.until_finished([Crasher(crash)])
    held = restart != "continued"  # continued: the server was serving again, nothing of the run held it
    if restart == "paused" and crash != "paused":  # the live console's release meets the new process
        assert finished.status == "failed" and "nothing was released" in finished.message, finished.message
    else:
        assert finished.exit_code == 0, finished.message
        assert paused.state().steps["evaluate"].status == "done"
    if restart in ("paused", "released") and crash == restart:  # found before the extraction: paused again
        assert [[r for r, _ in life].count("pause_generation") for life in world.server.lives] == [1, 1]
        assert paused.state().windows[0]["restarted_outside"], paused.state().windows
    assert_restart_promises(paused, finished, held)


async def test_a_run_that_left_the_server_paused_gives_back_nothing_to_a_restarted_one(paused: Window) -> None:
    """`run --resume` (or r) of a run that left the server paused, after the server was restarted by
    its own commands: the drill's case. Nothing is resumed or continued on the new process (SGLang's
    scheduler would die on the resume: `KeyError: 'kv_cache'`); the run says the memory came back
    by the restart, naming both processes, and it is no longer named as holding the server."""
    world = paused.world
    refused = await paused.console(decider=ScriptedDecider(world.clock, refuse={"resume"}))
    assert refused.exit_code == EXIT_DOWN and paused.store.left_down() is not None, refused.message
    world.service.restart_outside()
    again = await paused.console()
    assert again is not None and again.service_up and paused.store.left_down() is None, again
    assert "nothing was resumed or continued" in again.message and "came back by that restart" in again.message
    assert "now, " in again.message and "when paused" in again.message, again.message
    assert world.server.lives[1] == [] and not world.server.violations and world.server.serving()


async def test_an_sglang_whose_pause_aborts_has_no_pause_route(window: Window, tmp_path: Path) -> None:
    """The rehearsal server as SGLang 0.5.5 (`--sglang-version`; its model worker in this process, its
    front's answers as they are sent): its /pause_generation reads no mode and aborts the request in
    flight, as 0.5.5's does. The console reads the version from its /server_info: `--route pause`
    is refused before anything is sent, naming the version; `--route auto` says why and takes the
    stop route."""
    import json
    import threading

    from console.procedure.engine import Engine
    from console.service.sglang_api import memory_saver_of
    from remote.drill import memory_saver
    from remote.drill.standin.arguments import parse_args
    from remote.drill.standin.model import Request
    from remote.drill.standin.server import Server
    from tests.fake_hosts import FakeHosts

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    old = Server(parse_args(["--model", str(tmp_path), "--port", "0", "--sglang-version", "0.5.5",
                             "--enable-memory-saver", "--enable-weights-cpu-backup"]))
    request = Request("r1", [11, 22, 33], {})
    old.running[request.rid] = request

    def scheduler() -> None:  # the request ends once aborted, as the model worker's loop ends it
        request.aborted.wait(10)
        with old.counter_lock:
            old.running.pop(request.rid)
    threading.Thread(target=scheduler, daemon=True).start()
    assert memory_saver.answer(old.saver, "/pause_generation", {"mode": "retract"}) == (200, memory_saver.PAUSED)
    assert request.aborted.is_set() and old.saver.engine_paused is None, "0.5.5 aborts: no retract held it"
    memory_saver.answer(old.saver, "/continue_generation", {})
    assert old.server_info()["version"] == "0.5.5-standin"

    class OldServer:
        async def memory_saver(self) -> Any:
            return memory_saver_of(old.server_info())

    class OldServerHosts(FakeHosts):
        async def server(self) -> Any:
            return OldServer()

    async def run(route: str) -> RunFinished:
        run = window.store.open(window.run_id) if route == "pause" else window.store.create(
            str(window.world.config.source), None)
        return await Engine(OldServerHosts(window.world), window.world.config, run,
                            ScriptedDecider(window.world.clock), window.store, route=route).execute()

    window.world.gpus[9999] = (TRAINING, {0: 81000, 1: 81000}, "python train.py")  # no room elsewhere
    refused = await run("pause")
    assert refused.status == "failed" and "SGLang 0.5.5-standin" in refused.message, refused.message
    assert "aborts every request" in refused.message and "0.5.6" in refused.message
    auto = await run("auto")
    assert auto.exit_code == 0, auto.message
    state = window.store.open(auto.run_id).state
    assert state.route == "window" and "SGLang 0.5.5-standin" in state.facts["route_chosen"]["why"], state.facts
    assert window.world.service.stop_commands == 1 and window.world.server.calls == []  # the stop route, whole


@pytest.fixture
def weights_released(paused: Window, monkeypatch: pytest.MonkeyPatch) -> Window:
    """A speculating server whose extraction needs its weights released too (they have a CPU backup)."""
    from console.procedure.steps import pause as pause_steps

    paused.world.server.acceptance = 4.0
    monkeypatch.setattr(pause_steps, "release_plan", lambda saver, free, gpus, need: (
        ["kv_cache", "cuda_graph", "weights"], "the extraction does not fit beside the weights"))
    return paused


async def test_a_drafter_lost_to_the_weights_release_ends_the_run_degraded(weights_released: Window) -> None:
    """SGLang 0.5.23 (PR #31674): the target comes back from the weights release, the drafter does not.
    The outputs are the same, so only the acceptance length tells: measured before the window and after
    the continue, its fall ends the run degraded with both figures; the release's question warned of
    it; the restart that reloads the drafter is offered (refused here: the server serves on)."""
    w = weights_released
    decider = ScriptedDecider(w.world.clock, refuse={"drafter"})
    finished = await w.console(decider=decider)
    assert finished.status == "degraded" and finished.exit_code == engine_module.EXIT_DEGRADED, finished
    assert "acceptance length 4.00 before the window, 1.00 after" in finished.message, finished.message
    assert "restart" in finished.message  # the remedy named, its refusal said
    asked = {c.step: c for c in decider.asked}
    assert "DRAFTER MAY COME BACK WRONG" in asked["release"].impact and "4.00" in asked["release"].impact
    assert "from 4.00 to 1.00" in asked["drafter"].impact
    state = w.state()
    assert state.status == "degraded" and state.steps["drafter"].status == "done"
    assert [state.steps[s].status for s in ("evaluate", "report")] == ["done", "done"]  # the work is kept
    assert "1.00 after" in (w.store.root / w.run_id / "report.md").read_text()
    (summary,) = w.store.summaries()
    assert summary.status == "degraded" and summary.drafter_fell == (4.0, 1.0)
    assert_pause_promises(w, finished)  # the server never stopped: the remedy was refused


async def test_a_yes_to_the_remedy_restarts_the_server_and_its_drafter_comes_back(weights_released: Window) -> None:
    w = weights_released
    finished = await w.console()
    assert finished.exit_code == engine_module.EXIT_DEGRADED, finished
    assert "restarted: acceptance length 4.00 now" in finished.message, finished.message
    service = w.world.service
    assert service.stop_commands == 1 and service.start_commands == 1 and w.world.server.serving()
    state = w.state()
    svc, (restart,) = state.service, [w["service"] for w in state.windows if w.get("drafter_restart")]
    assert svc.paused_at < svc.continued_at < restart["stopped_at"] < restart["ready_at"]  # the window's own record kept
    (summary,) = w.store.summaries()  # the pause, then the restart: both down periods counted
    assert summary.downtime_s == (svc.continued_at - svc.paused_at) + (restart["ready_at"] - restart["stopped_at"])
    assert summary.windows == 2 and not summary.service_down


async def test_a_drafter_that_survives_the_weights_release_ends_done(weights_released: Window) -> None:
    w = weights_released
    w.world.server.drafter_survives = True  # a fixed SGLang
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    state = w.state()
    assert state.service.released_tags == ["kv_cache", "cuda_graph", "weights"]
    assert "intact: acceptance length 4.00 before the window, 4.00 after" in state.steps["drafter"].detail
    assert_pause_promises(w, finished)


async def test_the_stop_route_checks_the_drafter_too(window: Window) -> None:
    """A restarted server loads its drafter again: the stop route's check finds it intact."""
    window.world.server.acceptance = 4.0
    finished = await window.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    detail = window.state().steps["drafter"].detail
    assert "intact: acceptance length 4.00 before the window, 4.00 after" in detail, detail


@pytest.mark.parametrize("point", DRAFTER_CRASH_POINTS)
async def test_a_console_killed_in_the_drafters_restart_leaves_it_to_the_next(weights_released: Window,
                                                                              point: str) -> None:
    """The remedy's stop ran, then the console died: the next one starts the server (once), finds the
    drafter checked, and ends degraded with the window's record intact and the restart's kept apart."""
    w = weights_released
    assert await w.console(Crasher(point)) is None, f"the run never reached {point}"
    assert w.store.left_down() is not None  # the server down meanwhile: named
    finished = await w.console()
    assert finished.exit_code == engine_module.EXIT_DEGRADED and finished.service_up, finished
    assert "the next finished it" in finished.message, finished.message
    service = w.world.service
    assert service.stop_commands == 1 and service.start_commands == 1 and w.world.server.serving()
    state = w.state()
    assert state.service.continued_at is not None and state.windows[-1].get("drafter_restart")


async def test_a_weights_release_is_forecast_from_weights_releases_never_from_kv_only_ones(
        paused: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40, item 8: the release and the resume take their time from earlier windows that
    released the same tags. After a KV-only window, a window that must release the weights too is
    forecast from the H200's weights figures (20 s out, 7 s back for 48 GiB, scaled to this model's
    size), not from the KV-only window's 0 s; after one such window, from it."""
    from console.procedure.steps import pause as pause_steps

    async def next_window() -> dict[str, Any]:
        paused.run_id = paused.store.create(str(paused.world.config.source), None).run_id
        finished = await paused.console()
        assert finished.exit_code == 0, finished
        return paused.state().facts["pause_forecast"]["phases"]

    kv_only = await paused.console()
    assert kv_only.exit_code == 0 and paused.state().service.released_tags == ["kv_cache", "cuda_graph"]
    assert "median of 1 earlier pause runs that released kv_cache, cuda_graph" in (await next_window())["release"]["basis"]

    monkeypatch.setattr(pause_steps, "release_plan", lambda saver, free, gpus, need: (
        ["kv_cache", "cuda_graph", "weights"], "the extraction does not fit beside the weights"))
    first = await next_window()
    model_bytes = paused.state().facts["preflight"]["model_bytes"]
    assert model_bytes, "the fake's preflight measures the model"
    for step, kv_s, weights_s in (("release", 0.12, 20.0), ("resume", 0.34, 7.0)):
        basis, seconds = first[step]["basis"], first[step]["seconds"]
        assert "issue 26" in basis and "for 48.0 GiB" in basis and "this model's" in basis, basis
        assert "earlier" not in basis, basis  # never the KV-only window's time
        assert seconds == pytest.approx(kv_s + weights_s * model_bytes / 48 / 2**30, rel=1e-6), (step, seconds)
    again = await next_window()
    assert "median of 1 earlier pause runs that released kv_cache, cuda_graph, weights" in again["release"]["basis"]
    assert "median of 3 earlier pause runs" in again["pause"]["basis"]  # the pause itself: every earlier pause run


@pytest.mark.parametrize("point", ["paused", "released", "gpu-released"])
async def test_r_gives_a_paused_server_back_without_a_preflight_while_the_eval_host_is_down(
        paused: Window, point: str) -> None:
    """Issue 40, item 6: the console's `r` (`Operator.restart_service`) on a run that left the server
    paused gives its memory back, resume then continue, asking only the service's host: an eval host
    that cannot be reached (a full preflight would fail on it) never leaves production paused."""
    from console.operator import Operator

    assert await paused.console(Crasher(point)) is None  # the console dies with the server paused
    held = paused.state().service
    assert held.paused, held
    paused.world.faults.append(Fault("connect", "link", match={"host": TRAINING}, times=99))
    operator = Operator(paused.world.config, runs_dir=paused.store.root)
    assert operator.left_down() is not None and operator.left_down().run_id == paused.run_id
    hosts = FakeHosts(paused.world)
    run = paused.store.open(paused.run_id)
    engine = engine_module.Engine(hosts, paused.world.config, run, ScriptedDecider(paused.world.clock), paused.store)
    await engine.restart_service("the operator asked for it (r)")
    server = paused.world.server
    assert server.serving() and server.held == 0
    assert server.count("pause_generation") == server.count("continue_generation") == 1
    released = [sorted(b["tags"]) for _, r, b in server.calls if r == "release_memory_occupation"]
    assert [sorted(b["tags"]) for _, r, b in server.calls if r == "resume_memory_occupation"] == released
    assert hosts.calls and {host for _, host in hosts.calls} == {INFERENCE}, hosts.calls  # the eval host never asked
    assert paused.world.service.stop_commands == 0 and paused.world.service.start_commands == 0
    assert not paused.store.open(paused.run_id).state.service.held
    assert operator.left_down() is None  # no longer named as the run that left the server paused

# --- issue 40, item 5: the weights are checked, not guessed -----------------------------------------


def _journal(w: Window) -> str:
    return " ".join(e.get("message", "") for e in w.store.open(w.run_id).read_journal())


async def test_a_weights_release_is_verified_by_the_checksum_and_no_probe_is_sent(weights_released: Window) -> None:
    """SGLang 0.5.23's /weights_checker: the target's checksum before the release, the same after the
    resume: the window is verified by it, and the greedy probe, not batch-invariant under load, is
    never sent (a near-tie it would have met fails nothing)."""
    w = weights_released
    w.world.server.drafter_survives = True
    w.world.server.near_ties = 2
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    svc = w.state().service
    assert svc.weights_check == "checksum" and svc.weights_checksum_before == svc.weights_checksum_after == "sha-intact"
    assert svc.probe_tokens is None
    bodies = [b for _, r, b in w.world.server.calls if r == "weights_checker"]
    assert bodies == [{"action": "checksum", "selector": "target"}] * 2  # before the release, after the resume
    assert "checksum after the resume is the one before the release (sha-intact)" in _journal(w)
    assert_pause_promises(w, finished)


async def test_weights_that_come_back_wrong_fail_the_window_naming_both_checksums(weights_released: Window) -> None:
    """The greedy tokens are the same (every logit moved alike): only the checksum tells."""
    w = weights_released
    w.world.server.drafter_survives = True
    w.world.server.weights_come_back_wrong = True
    finished = await w.console()
    assert finished.status == "failed" and finished.exit_code != 0, finished
    assert "sha-changed after the resume, sha-intact before the release" in finished.message, finished.message
    state = w.state()
    assert state.steps["continue"].status == "failed" and state.status == "failed"
    assert state.service.weights_checksum_after == "sha-changed"
    assert w.world.server.serving()  # the server was given back all the same
    assert_pause_promises(w, finished)


@pytest.mark.parametrize("checker", [None, "0.5.6"])
async def test_a_server_without_the_checksum_falls_back_to_the_probe_asked_again_alone(
        weights_released: Window, checker: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No /weights_checker (404), or 0.5.6's without a checksum: the greedy probe, journalled as such; a
    near-tie after the continue is asked once more, alone, and passes."""
    from console.procedure.steps import pause_weights

    monkeypatch.setattr(pause_weights, "PROBE_SETTLE_S", 0.0)
    w = weights_released
    w.world.server.drafter_survives = True
    w.world.server.checker = checker
    w.world.server.near_ties = 1
    server, probes = w.world.server, []
    generate = server.generate

    def recorded(input_ids: list[int], max_new_tokens: int) -> dict:
        probes.append(len(server.calls))  # how many control requests were sent before it
        return generate(input_ids, max_new_tokens)
    server.generate = recorded  # type: ignore[method-assign]
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    svc = w.state().service
    assert svc.weights_check == "probe" and svc.probe_tokens is not None and svc.weights_checksum_before is None
    journal = _journal(w)
    assert "the weights are checked after the resume by the greedy probe instead" in journal
    assert ("HTTP 404" if checker is None else "Unsupported action='checksum'") in journal
    assert "asked once more, alone" in journal and "asked again alone, the same 8 tokens" in journal
    continued = [r for _, r, _ in server.calls].index("continue_generation")
    after = [p for p in probes if p > continued]
    assert len(after) >= 2 and after[0] == after[1], probes  # the probe, then again: nothing sent between them
    assert_pause_promises(w, finished)


async def test_a_probe_that_differs_twice_fails_the_window(paused: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KV-only release needs no weights check: the probe as before, asked once more; twice other
    tokens fail the window with both answers."""
    from console.procedure.steps import pause_weights

    monkeypatch.setattr(pause_weights, "PROBE_SETTLE_S", 0.0)
    paused.world.server.near_ties = 2
    finished = await paused.console()
    assert finished.status == "failed", finished
    assert "other greedy tokens than before the pause, twice" in finished.message, finished.message
    svc = paused.state().service
    assert svc.released_tags == ["kv_cache", "cuda_graph"] and svc.weights_check == "probe"
    assert paused.world.server.count("weights_checker") == 0
    assert_pause_promises(paused, finished)


@pytest.mark.parametrize("point", PAUSE_CRASH_POINTS[:PAUSE_CRASH_POINTS.index("continued") + 1])
async def test_the_checksum_taken_before_a_crash_is_the_one_checked_after(weights_released: Window, point: str) -> None:
    """The checksum before the release is kept in the run's state: a console killed at any point of the
    pause route, then resumed, compares the checksum after the resume with that one (never one taken
    again over the resumed weights), once the continue has landed, even where the first console died
    between the continue and its check."""
    w = weights_released
    w.world.server.drafter_survives = True
    w.world.server.weights_come_back_wrong = True
    assert await w.console(Crasher(point)) is None, f"the run never reached {point}"
    finished = await w.console()
    svc = w.state().service
    if finished.status == "paused":  # the extractor was still writing its files: a resume verifies them
        finished = await w.console()  # and meets the weights check again, never evaluating past it
    assert finished.status in ("failed", "paused"), finished.message
    assert "sha-changed after the resume, sha-intact before the release" in finished.message, finished.message
    assert svc.weights_check == "checksum" and not svc.weights_verified
    assert w.state().steps["continue"].status == "failed" and w.state().status_of("evaluate") != "done"
    routes = [r for _, r, _ in w.world.server.calls]
    released = routes.index("release_memory_occupation")
    assert routes[:released].count("weights_checker") == 1, routes  # taken once: never again after the crash
    assert routes[released:].count("weights_checker") >= 1
    assert_pause_promises(w, finished)


@pytest.mark.parametrize("journal", [True, False])
async def test_the_replay_shows_the_pause_as_paused_never_as_down_or_up(paused: Window, journal: bool) -> None:
    """Issue 42: `replay` of a pause-route run shows the server PAUSED from the pause to the continue
    (from the journal's service lines, or from state.json alone when the journal has none)."""
    from console.messages import Downtime
    from console.procedure.replay import read_recording
    from console.procedure.store import JOURNAL

    finished = await paused.console()
    assert finished.exit_code == 0, finished
    run_dir = paused.store.root / paused.run_id
    if not journal:  # an older run's journal: no service lines, the state's windows say it
        path = run_dir / JOURNAL
        lines = [line for line in path.read_text().splitlines() if '"kind": "service"' not in line
                 and '"kind":"service"' not in line]
        path.write_text("\n".join(lines) + "\n")
    svc = paused.state().service
    downtimes = [e.message for e in read_recording(run_dir).events if isinstance(e.message, Downtime)]
    held = [d for d in downtimes if d.down_since is not None]
    assert held and all(d.paused for d in held), downtimes  # never DOWN
    assert held[0].down_since == pytest.approx(svc.paused_at)
    assert downtimes[-1].down_since is None and downtimes[-1].restarted_at == pytest.approx(svc.continued_at)


# --- a lost release or resume answer, settled from evidence, never resent on a guess (issue 40 item 2) --


@dataclasses.dataclass
class Operator(ScriptedDecider):
    """Approves every step's question; asked to settle a lost release or resume (the evidence did not),
    answers from the server's truth (an operator who looked at nvidia-smi), or refuses both questions
    (`refuse_settle`: the server left paused). The agent's telemetry comes back as it answers."""

    world: FakeWorld | None = None
    refuse_settle: bool = False
    settled: list[Any] = dataclasses.field(default_factory=list)  # the settle questions asked

    async def decide(self, confirmation: Any) -> bool:
        if not confirmation.action.startswith("settle the lost"):
            return await super().decide(confirmation)
        self.asked.append(confirmation)
        self.settled.append(confirmation)
        if self.refuse_settle:
            return False
        stream = self.world.streams[INFERENCE]
        stream.frozen = stream.no_readings = False
        out = bool(self.world.server.released)
        return {"WERE released": out, "were NOT released": not out, "ARE back": not out,
                "are NOT back": out}[next(k for k in ("WERE released", "were NOT released", "ARE back",
                                                      "are NOT back") if k in confirmation.action)]


def lose_answer(w: Window, route: str, how: str, telemetry: str, info: str | None,
                crasher: Crasher | None = None) -> None:
    """The first `route` request's answer is lost: its link drops or the console dies ("link-…",
    "crash-…") before the server ran it or after ("…-before", "…-after"). From that moment the
    telemetry is "fresh" (the agent samples on), "stale" (it sends nothing more) or "absent" (no GPU
    readings), and /server_info's memory_usage is "start-up" (agrees), "other" (disagrees) or None."""
    from tests.engine_fakes import raise_fault

    server = w.world.server
    method = {"release_memory_occupation": "release", "resume_memory_occupation": "resume"}[route]
    real = getattr(server, method)
    lost: list[str] = []

    def lossy(tags: list[str]) -> None:
        if lost:
            return real(tags)
        lost.append(how)
        if how.endswith("after"):
            real(tags)
        stream = w.world.streams[INFERENCE]
        stream.frozen, stream.no_readings = telemetry == "stale", telemetry == "absent"
        server.memory_usage = info
        if how.startswith("crash"):
            crasher(crasher.point)
        raise_fault(Fault(route, "link"), f"POST /{route}", w.world.service_host)

    setattr(server, method, lossy)


def assert_settled(w: Window, finished: RunFinished, route: str) -> None:
    assert_pause_promises(w, finished)
    server = w.world.server
    releases = server.count("release_memory_occupation")
    assert server.count("resume_memory_occupation") <= releases, server.calls
    assert not any("continue over released" in v for v in server.violations)


# Every loss crossed with every telemetry, and /server_info's answer so that every pair of the three
# is met (a Latin square: 12 cases a route, not 36; the full product passes too, at 3x the CI time).
SETTLE_INFO: tuple[str | None, ...] = ("start-up", "other", None)
SETTLE_CASES = [(route, how, telemetry, SETTLE_INFO[(i + j) % 3])
                for route in ("release_memory_occupation", "resume_memory_occupation")
                for i, how in enumerate(("link-before", "link-after", "crash-before", "crash-after"))
                for j, telemetry in enumerate(("fresh", "stale", "absent"))]


@pytest.mark.parametrize(("route", "how", "telemetry", "info"), SETTLE_CASES,
                         ids=["-".join([r.split("_")[0], h, t, str(i)]) for r, h, t, i in SETTLE_CASES])
async def test_a_lost_release_or_resume_is_settled_from_fresh_evidence_or_asked(
        paused: Window, route: str, how: str, telemetry: str, info: str | None) -> None:
    """Lost before or after the server ran it, by a dropped link or a console killed in the request,
    with telemetry fresh, stale or absent and /server_info agreeing, disagreeing or silent: settled
    without a question only from a sample taken after the reconnect and the request's worst case
    that /server_info does not contradict; else the operator is asked, shown what is known. Never a
    second resume, never a continue over released memory; the server ends serving."""
    w = paused
    crasher = Crasher("lost") if how.startswith("crash") else None
    lose_answer(w, route, how, telemetry, info, crasher)
    operator = Operator(w.world.clock, world=w.world)
    if crasher is not None:
        assert await w.console(crasher) is None, "the console never reached the request"
    finished = await w.console(decider=operator)
    while finished is not None and finished.exit_code == EXIT_DOWN:  # a run --resume gives the server back
        finished = await w.console(decider=operator)
    assert finished is not None
    assert_settled(w, finished, route)
    assert w.world.server.serving(), finished.message
    decisive = telemetry == "fresh" and not (info == "other" and how.endswith("after"))
    assert bool(operator.settled) != decisive, ([c.action for c in operator.settled], _journal(w))
    if operator.settled:  # shown what is known: the GPUs before, now or why not, /server_info's figures
        impact = operator.settled[-1].impact
        assert "GPU memory used before the release GPU0" in impact, impact
        assert ("/server_info says" in impact) == (info is not None), impact
        assert ("no GPU sample taken" in impact) == (telemetry != "fresh"), impact
    landed = how.endswith("after")
    verb = "release" if route.startswith("release") else "resume"
    assert f"the {verb} of " in _journal(w) and ("had landed" if landed else "had not landed") in _journal(w)


@pytest.mark.parametrize("route", ["release_memory_occupation", "resume_memory_occupation"])
@pytest.mark.parametrize("point", ["settle-evidence", "settled"])
@pytest.mark.parametrize("telemetry", ["fresh", "stale"])
async def test_a_console_killed_while_it_settles_leaves_it_to_the_next(
        paused: Window, route: str, point: str, telemetry: str) -> None:
    """A console dies after it took the evidence, or after it settled: the next settles again (or
    finds it settled) from evidence of its own, and the promises hold."""
    w = paused
    lose_answer(w, route, "link-after", telemetry, "start-up")
    operator = Operator(w.world.clock, world=w.world)
    assert await w.console(Crasher(point), decider=operator) is None, f"never reached {point}"
    finished = await w.console(decider=operator)
    assert_settled(w, finished, route)
    assert finished.exit_code == 0 and w.world.server.serving(), finished.message


@pytest.mark.parametrize("route", ["release_memory_occupation", "resume_memory_occupation"])
async def test_an_unsettled_loss_refused_leaves_the_server_paused_and_named(paused: Window, route: str) -> None:
    """The operator refuses both answers: nothing is resumed or continued; the run exits 3 naming the
    server as still paused; `run --resume` asks again, and an answer gives the server back once."""
    w = paused
    lose_answer(w, route, "link-after", "stale", "start-up")
    refusing = Operator(w.world.clock, world=w.world, refuse_settle=True)
    first = await w.console(decider=refusing)
    assert first is not None and first.exit_code == EXIT_DOWN, first
    assert "THE SERVER IS STILL PAUSED" in first.message and len(refusing.settled) == 2, "never asked twice"
    assert_settled(w, first, route)
    server = w.world.server
    assert server.count("continue_generation") == 0 and server.paused
    assert server.count("resume_memory_occupation") == (1 if route.startswith("resume") else 0)
    w.world.streams[INFERENCE].frozen = True  # still no fresh evidence: asked again
    again = await w.console(decider=Operator(w.world.clock, world=w.world))
    assert again is not None and again.service_up, again
    assert_settled(w, again, route)
    assert server.count("resume_memory_occupation") == 1 and server.count("continue_generation") == 1


async def test_yes_never_settles_a_lost_answer_on_a_guess(paused: Window) -> None:
    """`--yes` answers every question yes: a settle question it would answer blindly is never put to it;
    the server stays paused for an operator, the run names it."""
    from console.procedure.decider import ApproveAll

    w = paused
    lose_answer(w, "release_memory_occupation", "link-after", "absent", "start-up")
    finished = await w.console(decider=ApproveAll())
    assert finished is not None and finished.exit_code == EXIT_DOWN, finished
    assert "THE SERVER IS STILL PAUSED" in finished.message and "--yes never settles" in finished.message, finished
    assert_settled(w, finished, "release_memory_occupation")
    assert w.world.server.count("resume_memory_occupation") == 0 == w.world.server.count("continue_generation")


async def test_a_sample_from_before_the_worst_case_is_never_the_evidence(
        weights_released: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights release whose answer was lost: the settle waits on the telemetry stream for a sample
    taken after the release's worst case (3 x issue 26's 20 s on an H200), never reads the one the
    release itself left (its memory half gone on a real H200 then)."""
    from console.procedure.steps import pause_settle

    w = weights_released
    taken: list[float] = []
    real = pause_settle.settle_evidence

    async def evidence(window: Any, kind: str, tags: list[str]) -> Any:
        started = w.world.clock.monotonic()
        got = await real(window, kind, tags)
        taken.append(w.world.clock.monotonic() - started)
        return got

    monkeypatch.setattr(pause_settle, "settle_evidence", evidence)
    lose_answer(w, "release_memory_occupation", "link-after", "fresh", "start-up")
    finished = await w.console(decider=Operator(w.world.clock, world=w.world, refuse={"drafter"}))
    assert finished is not None
    assert_settled(w, finished, "release_memory_occupation")
    assert taken and taken[0] >= pause_settle.SETTLE_MARGIN * pause_settle.MEASURED_H200["release"]["weights"], taken


@pytest.mark.parametrize("samples", [1, 3])
async def test_a_release_answered_before_its_memory_left_is_waited_for(paused: Window, samples: int) -> None:
    """Issue 40, section 1 (slime PR #579; the rehearsal server's `--release-frees-after`): the release
    answers while its memory is still on the GPUs. free-vram waits until it is seen gone, so what the
    release freed is measured (the resume is verified against it), and the window ends done."""
    world, server = paused.world, paused.world.server
    server.frees_after_samples = samples
    used_before = world.streams[INFERENCE].sample().gpus[0].mem_used_mib
    finished = await paused.console()
    assert finished.exit_code == 0, finished.message
    state = paused.state()
    assert not [s for s, rec in state.steps.items() if rec.status == "failed"]
    assert state.service.used_after_release_mib["0"] == used_before - 14000  # the release's, not the answer's
    assert world.streams[INFERENCE].sample().gpus[0].mem_used_mib == used_before, "the memory came back"
    assert_pause_promises(paused, finished)


async def test_a_console_back_after_the_worst_case_waits_no_more_for_its_evidence(
        weights_released: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst case of a lost release counts from when it was sent (recorded before the request),
    not from the console's return: a console killed in a weights release and started again two
    minutes later (past 3 x 20 s) takes the next sample; one back at once waits the worst case."""
    from console.procedure.steps import pause_settle

    w = weights_released
    waited: list[float] = []
    real = pause_settle.settle_evidence

    async def evidence(window: Any, kind: str, tags: list[str]) -> Any:
        started = w.world.clock.monotonic()
        got = await real(window, kind, tags)
        waited.append(w.world.clock.monotonic() - started)
        return got

    monkeypatch.setattr(pause_settle, "settle_evidence", evidence)
    crasher = Crasher("lost")
    lose_answer(w, "release_memory_occupation", "crash-after", "fresh", "start-up", crasher)
    assert await w.console(crasher) is None
    assert w.state().service.memory_request_sent_at is not None
    w.world.clock.advance(120.0)  # the operator starts a console two minutes later
    finished = await w.console(decider=Operator(w.world.clock, world=w.world, refuse={"drafter"}))
    assert finished is not None
    assert_settled(w, finished, "release_memory_occupation")
    worst = pause_settle.SETTLE_MARGIN * pause_settle.MEASURED_H200["release"]["weights"]
    assert waited and waited[0] < worst / 2, (waited, worst)  # the next sample, not another minute
