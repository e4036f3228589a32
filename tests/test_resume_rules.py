"""Issue 27: a resume never makes things worse (items 4 to 7), and the record says what happened (a
signal in the moment the stop's work is done).

The real engine over the engine fakes (`tests/engine_fakes.py`), where the timing must be exact: the
world's own clock, a unit whose start time systemd would report, workers that flush after
`gpu_released`, and a cancel delivered the way `Engine.cancel` delivers SIGINT."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from console.messages import Confirmation, ServiceStatus
from console.procedure.engine import EXIT_DOWN, Engine
from console.procedure.state import ServiceState
from console.procedure.steps.stop import restarted_outside
from console.procedure.store import summary_of
from tests.engine_fakes import TRAINING, Fault, ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Window,
    assert_promises,
)
from tests.fake_hosts import FakeHosts


def engine_for(window: Window, decider: ScriptedDecider | None = None, **kwargs: object) -> Engine:
    return Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                  decider or ScriptedDecider(window.world.clock), window.store, **kwargs)


async def test_a_signal_as_the_stop_finishes_records_the_service_stopped(window: Window) -> None:
    """SIGINT lands after the unit went down, before `systemctl stop` returned: the stop, which ran,
    is recorded done (not cancelled) and the service stopped, so the compensation restarts it and
    the downtime runs from the stop."""
    engine = engine_for(window)
    window.world.after_stop = engine.cancel  # what SignalGuard does on SIGINT
    finished = await engine.execute()
    state = window.state()
    assert finished.status == "cancelled", finished.message
    assert state.steps["stop"].status == "done", state.steps["stop"]
    assert state.service.stop_confirmed and state.service.stops == 1
    assert window.world.service.state == "active" and window.world.service.start_commands == 1
    assert_promises(window, finished)


async def started_outside(window: Window) -> float:
    """The console dies right after its stop; someone starts the unit by hand meanwhile. Returns
    when the unit became active again (systemd's ActiveEnterTimestamp)."""
    assert await window.console(Crasher("stop-ran")) is None
    window.world.service.start()
    while window.world.service.state != "active":
        await window.world.wait_changed()
    return window.world.service.active_since


async def test_a_service_started_outside_the_run_is_asked_about_before_a_second_stop(window: Window) -> None:
    """Item 4: the resume finds the unit active again, started after the run's stop (its
    ActiveEnterTimestamp): the stop's question says so before any second stop, and the time it
    was up is not downtime: the run's downtime is exactly the world's two down periods."""
    up_at = await started_outside(window)
    decider = ScriptedDecider(window.world.clock)
    finished = await window.console(decider=decider)
    assert finished is not None and finished.exit_code == 0, finished
    (stop_question,) = [c for c in decider.asked if c.step == "stop"]
    assert "started outside this run" in stop_question.impact and "second stop" in stop_question.impact
    service = window.world.service
    assert service.stop_commands == 2 and service.start_commands == 2
    (first_stop, first_ready, _), (second_stop, second_ready, _) = service.down_periods()
    assert first_ready == up_at
    state = window.state()
    assert state.windows[-1]["service"]["ready_at"] == up_at  # the first down period ends at the outside start
    assert summary_of(window.store.open(window.run_id)).downtime_s == (up_at - first_stop) + (second_ready - second_stop)


async def test_a_second_stop_refused_leaves_the_service_serving(window: Window) -> None:
    """Item 4: no to the second stop: nothing more is done, the service serves, no run is named as
    having left it down, and the up time is no downtime."""
    up_at = await started_outside(window)
    finished = await window.console(decider=ScriptedDecider(window.world.clock, refuse={"stop"}))
    assert finished.status == "refused" and finished.service_up, finished
    assert window.world.service.stop_commands == 1 and window.world.service.state == "active"
    assert window.store.left_down() is None
    first_stop = window.world.service.down_periods()[0][0]
    assert summary_of(window.store.open(window.run_id)).downtime_s == up_at - first_stop


async def test_a_cancel_while_the_extractor_flushes_leaves_it_to_finish(window: Window) -> None:
    """Item 6: Ctrl-C after `gpu_released`, the extractor still writing its files: it is not killed,
    the service is restarted, and the run ends paused (resumable), not cancelled; once the files are
    written the resume verifies them and evaluates, with one extraction in all."""
    window.world.flush_gate = gate = asyncio.Event()
    box: list[Engine] = []
    engine = engine_for(window, crash_at=lambda point: box[0].cancel() if point == "gpu-released" else None)
    box.append(engine)
    finished = await engine.execute()
    (job,) = window.world.extraction_jobs()
    assert job.state == "running" and "killed" not in job.reached, "the flushing extractor was ended"
    assert finished.status == "paused" and finished.service_up, finished
    assert "left to finish" in finished.message and window.world.service.state == "active"
    gate.set()
    again = await window.console()
    assert again is not None and again.exit_code == 0, again
    assert job.seen("artifact") and len(window.world.extraction_jobs()) == 1
    assert window.state().steps["evaluate"].status == "done"
    assert_promises(window, again)


async def test_a_resume_after_gpu_released_starts_the_server_before_verifying_the_states(
        window: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 6: the console dies at `gpu_released`; the resume sends the start before it reads the
    sha256 of any state file (today every file was hashed while the server was down)."""
    assert await window.console(Crasher("gpu-released")) is None
    hashed_with: list[int] = []  # start commands sent when each verification began
    verify = FakeHosts.manifest_complete

    async def counted(self: FakeHosts, host: str, path: str) -> bool:
        hashed_with.append(window.world.service.start_commands)
        return await verify(self, host, path)
    monkeypatch.setattr(FakeHosts, "manifest_complete", counted)
    finished = await window.console()
    assert finished is not None and finished.exit_code == 0, finished
    assert hashed_with and min(hashed_with) == 1, hashed_with
    assert_promises(window, finished)


async def test_a_staged_worker_dead_before_the_stop_is_found_before_its_question(window: Window) -> None:
    """Item 7: the staged extractor says `staged` and dies before the stop. The host is asked
    before the stop's question: it is staged again while the server serves, so the stop is approved
    on a live staged worker (not found dead only after the stop, with the disk read in the window)."""
    window.world.faults.append(Fault("extract:staged", "dead"))
    seen_at_stop: list[list[str]] = []

    class Watching(ScriptedDecider):
        async def decide(self, confirmation: Confirmation) -> bool:
            if confirmation.step == "stop":
                seen_at_stop.append([j.state for j in window.world.extraction_jobs()])
            return await super().decide(confirmation)

    finished = await window.console(decider=Watching(window.world.clock))
    assert finished is not None and finished.exit_code == 0, finished
    assert seen_at_stop == [["dead", "running"]], seen_at_stop
    dead, staged = window.world.extraction_jobs()
    assert staged.seen("staged") and staged.seen("artifact") and window.world.service.stop_commands == 1
    assert_promises(window, finished)


async def test_a_staged_worker_dead_that_cannot_be_staged_again_leaves_the_cold_path_asked(window: Window) -> None:
    """Item 7, its fallback: the staged extractor dies after `staged`, and staging again fails too
    (the weights cannot be loaded). The stage is left out of the plan, saying why, and the stop is
    asked for the cold path: the extraction reads the weights from disk inside the window, and the
    run still ends done with every promise."""
    window.world.faults += [Fault("extract:staged", "dead"), Fault("extract:load", "exit", skip=1)]
    at_stop: list[tuple[list[str], bool]] = []

    class Watching(ScriptedDecider):
        async def decide(self, confirmation: Confirmation) -> bool:
            if confirmation.step == "stop":
                plan = window.state().plan
                at_stop.append(([j.state for j in window.world.extraction_jobs()],
                                next(s for s in plan if s["name"] == "stage")["acts"]))
            return await super().decide(confirmation)

    finished = await window.console(decider=Watching(window.world.clock))
    assert finished is not None and finished.exit_code == 0, finished
    assert at_stop == [(["dead", "exited"], False)], at_stop  # asked knowing the stage is gone
    state = window.state()
    assert "staging again failed" in state.facts["plan_stage"]["why"]
    cold = window.world.extraction_jobs()[-1]
    assert cold.kind == "extract" and "holds-gpu" in cold.reached  # the cold extraction did the work
    assert window.world.service.stop_commands == 1
    assert_promises(window, finished)


async def test_a_failed_preflight_on_resume_leaves_the_run_as_it_was(window: Window) -> None:
    """Item 5: the console dies with the extraction running on the GPUs (the service down); the
    next console's preflight cannot reach a host. Nothing is undone: the extractor goes on, the
    service is not started, the state is as it was (running, the window's record untouched), exit 3
    while it is down; once the host answers, the resume finishes with one extraction."""
    window.world.flush_gate = gate = asyncio.Event()  # the extraction is still running when the resume fails
    assert await window.console(Crasher("go")) is None
    before = window.state()
    window.world.faults.append(Fault("connect", "timeout", times=99))
    failed = await window.console()
    assert failed is not None and failed.exit_code == EXIT_DOWN, failed
    assert "left as it was (running, the service down by it)" in failed.message
    after = window.state()
    assert (after.status, after.service, after.extraction, after.steps, after.jobs, after.windows) == \
        (before.status, before.service, before.extraction, before.steps, before.jobs, before.windows)
    (job,) = window.world.extraction_jobs()
    assert job.state == "running" and window.world.service.start_commands == 0
    window.world.faults.clear()
    gate.set()
    finished = await window.console()
    assert finished is not None and finished.exit_code == 0, finished
    assert len(window.world.extraction_jobs()) == 1
    assert_promises(window, finished)


async def test_a_resume_requires_only_the_hosts_its_remaining_steps_need(window: Window) -> None:
    """Item 5: the console dies as the report is written (the evaluation done); the drafters' host
    (ct200) is then unreachable. The resume needs only the inference host (the report, the
    cross-check): it finishes instead of failing at preflight on a host it no longer needs."""
    assert await window.console(Crasher("reported")) is None
    window.world.faults.append(Fault("connect", "timeout", {"host": TRAINING}, times=99))
    finished = await window.console()
    assert finished is not None and finished.exit_code == 0, finished.message
    assert window.state().steps["report"].status == "done"
    assert not any(f.hit for f in window.world.faults), "the resume asked for a host it does not need"
    assert_promises(window, finished)


def test_a_restart_outside_the_run_is_told_by_the_managers_start_time_or_its_pid() -> None:
    """Item 4, the rule itself: systemd's ActiveEnterTimestamp after the stop, or (a command-managed
    server such as the drill's, whose status prints its pid) another main pid than before the stop,
    is a restart outside the run; the same process is a stop that never took effect; when nothing
    tells, it is never taken for the same process (the second stop is asked)."""
    stopped = ServiceState(stopped_at=1000.0, main_pid_before_stop=42, active_since_before_stop=500.0)
    systemd = ServiceStatus("systemd", "sglang.service", True, "active", main_pid=42, since=1030.0)
    assert "active since" in restarted_outside(stopped, systemd)
    assert restarted_outside(stopped, dataclasses.replace(systemd, since=500.0)) is None
    command = ServiceStatus("command", "ct129 server", True, "running", main_pid=77)
    assert "main pid 77, 42 before the stop" in restarted_outside(stopped, command)
    assert restarted_outside(stopped, dataclasses.replace(command, main_pid=42)) is None
    returned = dataclasses.replace(stopped, stop_returned_at=1004.0)
    assert restarted_outside(returned, dataclasses.replace(command, main_pid=42)) == "its stop had returned"
    unknown = ServiceState(stopped_at=1000.0)
    assert "cannot tell" in restarted_outside(unknown, dataclasses.replace(command, main_pid=None))


async def test_ctrl_c_while_a_finished_run_only_restarts_the_service_is_taken(window: Window) -> None:
    """Issue 27: Ctrl-C during `run --resume` of a finished run that only restarts its service
    (here, while the restart's question waits) ends the resume at once, saying the service is still
    down, never ignored; the next resume restarts it."""
    refuse = ScriptedDecider(window.world.clock, refuse={"restart"})
    finished = await window.console(decider=refuse)
    assert finished.exit_code == EXIT_DOWN and window.store.left_down() is not None
    engine: list[Engine] = []

    class CtrlC(ScriptedDecider):
        async def decide(self, confirmation):  # the operator presses Ctrl-C instead of answering
            engine[0].cancel()
            await asyncio.sleep(3600)

    engine.append(Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                         CtrlC(window.world.clock), window.store))
    cancelled = await asyncio.wait_for(engine[0].execute(), 30)
    assert cancelled.exit_code == EXIT_DOWN and not cancelled.service_up, cancelled
    assert window.world.service.start_commands == 0 and window.store.left_down() is not None
    again = await window.console()
    assert again.service_up and window.world.service.start_commands == 1
