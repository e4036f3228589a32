"""A restart offered as a remedy after the window: the drafter's (steps/drafter.py: it came back
degraded) and the weights' (steps/pause_weights.py: their checksum came back other). Each is a down
period of its own, apart from the window's: while it lasts, the service's record is the restart's (the
compensation, `left_down` and a resumed run read it) and the window's own is parked in the remedy's
facts; once the server is up, the window's is put back and the restart's kept in `windows`, so that
`runs` counts both and the next forecasts learn the window's phases."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from console.procedure.state import ServiceState

if TYPE_CHECKING:
    from console.procedure.window import Window

DRAFTER_RESTART, WEIGHTS_RESTART = "drafter_restart", "weights_restart"  # their marks in `windows`


def begin_down_period(window: Window, record: dict[str, Any]) -> None:
    """The remedy's stop begins: the service's record says the server is down because of this run
    (the compensation, `left_down` and a resumed run's checks read it: the stop route's restart step,
    or the remedy's own check, then starts it); the window's own record is kept in `record` (the
    remedy's facts) meanwhile and put back once the server is up (`end_down_period`)."""
    svc = window.state.service
    record["window_service"] = asdict(svc)
    svc.stopped_at, svc.ready_at, svc.down = time.time(), None, True
    svc.stops += 1
    window.run.keep_going_on_write_errors = True
    window.run.save()
    window.publish_downtime()


def end_down_period(window: Window, record: dict[str, Any], kind: str) -> None:
    """The server back: the window's record is the service's again (its phases are what the next
    runs' forecasts learn from), and the restart's down period is kept in `windows` (marked `kind`:
    "drafter_restart", "weights_restart"), as a window's, so that `runs` counts both."""
    state = window.state
    restart = state.service
    state.windows.append({"service": {"stopped_at": restart.stopped_at, "ready_at": restart.ready_at,
                                      "stops": 1, "starts": 1},
                          "extraction": {}, "steps": {}, "forecast": None, kind: True})
    state.service = ServiceState(**record.pop("window_service"))
    state.service.stops, state.service.starts = restart.stops, restart.starts
    window.run.save()


# The remedies whose restart parks the window's record meanwhile: their facts' key, their `windows` mark.
REMEDY_RECORDS = (("drafter", DRAFTER_RESTART), ("weights_restart", WEIGHTS_RESTART))


def end_parked_down_period(window: Window) -> None:
    """A remedy's restart whose start was refused, then done by a later `run --resume` (the stop
    route's restart alone, `ending.restart_only`): its down period ends there, the window's own record
    put back as `end_down_period` does, so that `runs` counts both and the next forecasts learn the
    window's phases, not the restart's."""
    for key, kind in REMEDY_RECORDS:
        record = window.state.facts.get(key) or {}
        if "window_service" in record:
            end_down_period(window, record, kind)
            record["remedy"] = f"{record.get('remedy') or 'restarted'}; started later by run --resume"
            window.run.save()
