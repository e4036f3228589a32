"""Issue 27: a resume never makes things worse (items 4 to 7), and the record says what happened (a
signal in the moment the stop's work is done).

The real engine over the engine fakes (`tests/engine_fakes.py`), where the timing must be exact: the
world's own clock, a unit whose start time systemd would report, workers that flush after
`gpu_released`, and a cancel delivered the way `Engine.cancel` delivers SIGINT."""

from __future__ import annotations

from console.procedure.engine import Engine
from console.procedure.store import summary_of
from tests.engine_fakes import ScriptedDecider
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
