"""Issue 27, "numbers the operator decides on are right", over the engine fakes (tests/engine_fakes.py):
the real engine and store, a fake unit, fake jobs whose workers write real events, the world's clock.

- a stop that failed while the server stayed up records no downtime (item 16);
- the live re-projection runs on the worker's clock (item 14);
- after a budget cut, the next window's forecast counts only the missing prompts (item 13);
- `run --plan`'s plan carries the forecast by phase before any run begins."""

from __future__ import annotations

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
