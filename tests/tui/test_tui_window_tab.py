"""The results' Window tab on the pause route (issue 43.7): the time the server was paused is said
(the route never stops it, so no stop and no ready to show), and a phase forecast at nothing has
no error figure (it read "forecast 0.0 s ... -85%")."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from console.procedure import forecast as fc
from console.procedure.state import RunState, StepState
from console.procedure.store import Run
from console.views.report import window_rows
from screens.results import PAUSE_TIMELINE_TITLE, ServiceStrip
from tests.tui.standin import T0

PAUSED, CONTINUED = T0 + 60, T0 + 122  # paused 1 min 02 s


@pytest.fixture
def pause_run(tmp_path: Path) -> Path:
    """A finished pause-route run: its forecast (the pause and the continue at 0.04 s, shown as 0.0 s)
    and what each phase took."""
    state = RunState(run_id="20251201-093500-pa05", created_at=T0, status="done", route="pause", started=True)
    took = {"pause": 0.27, "release": 3.0, "free-vram": 1.0, "extract": 50.0, "resume": 7.0, "continue": 0.3}
    forecast = {"pause": 0.04, "release": 2.5, "free-vram": 1.0, "extract": 55.0, "resume": 6.0, "continue": 0.04}
    phases = tuple(fc.ForecastPhase(name, seconds, "estimate") for name, seconds in forecast.items())
    state.facts["pause_forecast"] = fc.to_state(fc.Forecast(state.run_id, sum(forecast.values()), phases, None, False))
    t = PAUSED
    for name, seconds in took.items():
        state.steps[name] = StepState("done", t, t + seconds, work_s=seconds)
        t += seconds
    state.service.paused_at, state.service.continued_at, state.service.pauses, state.service.continues = \
        PAUSED, CONTINUED, 1, 1
    run = Run(tmp_path / state.run_id, state)
    run.dir.mkdir(parents=True)
    run.save()
    run.close()
    return run.dir


def drawn(renderable: object, width: int = 120) -> str:
    out = Console(width=width, file=io.StringIO(), record=True, color_system=None)
    out.print(renderable)
    return out.export_text()


def test_the_pause_routes_strip_says_how_long_the_server_was_paused(pause_run: Path) -> None:
    state = json.loads((pause_run / "state.json").read_text())  # as the results screen reads it
    strip = drawn(ServiceStrip(state, T0, T0 + 200))
    assert "paused 1 min 02 s (09:36:00 to 09:37:02)" in strip, strip
    assert "NOT RESTARTED" not in strip
    assert len(PAUSE_TIMELINE_TITLE) < 70  # plotext leaves out a title wider than the plot (80 columns)


def test_a_phase_forecast_at_nothing_has_no_error_figure(pause_run: Path) -> None:
    rows = {row[0]: row for row in window_rows(pause_run)}
    assert rows["pause"][1:4] == ["0.0 s", "0.3 s", "-"]  # was "-85%": a percentage of a forecast of nothing
    assert rows["continue"][3] == "-"
    assert rows["release"][3] == "-17%"  # (2.5 - 3.0) / 3.0: a forecast of something keeps its error
