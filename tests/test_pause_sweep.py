"""The pause route (issue 26) over the engine's fakes: the server of the fake world answers SGLang's
memory-saver routes as its source does (`tests/fake_sglang.py`). For every new crash point (paused,
released, the extraction, resumed, continued), every pair of them, random sequences, every step's
failure, refusal and lost answer, and a cancel after the pause, the console dies (or the step
fails) and a new engine resumes; every case ends with the window's promises and the pause route's
own: the server is never stopped; it ends serving, or the run exits 3 and the store names it as the
one that left it paused; each pause has exactly one continue and each release exactly one resume of
the same tags; the held requests run again; nothing is extracted twice. A server restarted outside
the run at each point, crossed with a crash at each (issue 40), gets nothing meant for the process
paused; an SGLang whose pause aborts has no pause route. (After a weights release, the drafter and
the weights: tests/test_pause_weights.py; a lost answer settled: tests/test_pause_settle.py; the
fixtures and promises they share: tests/pause_fixtures.py.)"""

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
from console.procedure.engine import EXIT_DOWN, PAUSE_CRASH_POINTS, ResumeRefused
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
from tests.pause_fixtures import assert_pause_promises


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


async def test_a_weights_release_is_forecast_from_weights_releases_never_from_kv_only_ones(
        paused: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 40, item 8: the release and the resume take their time from earlier windows that
    released the same tags. After a KV-only window, a window that must release the weights too is
    forecast from the H200's weights figures (20 s out, 7 s back for 48 GiB, scaled to this model's
    size), not from the KV-only window's 0 s; after one such window, from it."""
    from console.procedure.steps import pause_plan

    async def next_window() -> dict[str, Any]:
        paused.run_id = paused.store.create(str(paused.world.config.source), None).run_id
        finished = await paused.console()
        assert finished.exit_code == 0, finished
        return paused.state().facts["pause_forecast"]["phases"]

    kv_only = await paused.console()
    assert kv_only.exit_code == 0 and paused.state().service.released_tags == ["kv_cache", "cuda_graph"]
    assert "median of 1 earlier pause runs that released kv_cache, cuda_graph" in (await next_window())["release"]["basis"]

    monkeypatch.setattr(pause_plan, "release_plan", lambda saver, free, gpus, need: (
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
