"""The downtime forecast and its budget on the drill, with real consoles and workers: the plan and the
stop's question carry the forecast by phase; a forecast over `[window] max_downtime_s` refuses
before the stop (the service untouched); a window cut short keeps every prompt extracted, and
`run --resume` extracts only the missing ones in the next window."""

from __future__ import annotations

from pathlib import Path

from console.procedure.engine import EXIT_DONE, EXIT_FAILED
from console.procedure.store import RunStore
from console.runner import EXIT_PAUSED
from tests.window_fixtures import Drill, drill, read_json  # noqa: F401 - the fixture


def set_budget(d: Drill, seconds: float) -> None:
    text = d.config_path.read_text()
    d.config_path.write_text(text + f"\n[window]\nmax_downtime_s = {seconds}\n")


def test_a_forecast_over_the_budget_refuses_before_the_stop(drill: Drill) -> None:  # noqa: F811
    set_budget(drill, 0.5)
    pid = drill.service_pid()
    done = drill.run_cli("run", "--headless", "--yes")
    assert done.returncode == EXIT_FAILED, done.stdout + done.stderr
    assert "refused before the stop, the service untouched" in done.stderr
    assert "max_downtime_s = 0.5 s" in done.stderr and "What would fit" in done.stderr
    assert "zero-downtime route" in done.stderr and "fewer prompts" in done.stderr
    assert drill.service_pid() == pid  # never stopped
    _, state = drill.only_run()
    assert state["service"]["stops"] == 0 and state["forecast"]["downtime_s"] > 0.5
    assert set(state["forecast"]["phases"]) == {"stop", "free-vram", "extract", "start"}
    assert all(p["basis"] for p in state["forecast"]["phases"].values())  # each phase says what it is based on
    plan = [e["message"] for e in drill.journal() if e["message"].startswith("forecast downtime:")]
    assert plan  # the plan carried it too


def test_a_window_cut_short_keeps_its_prompts_and_the_next_window_extracts_the_rest(drill: Drill) -> None:  # noqa: F811
    console = drill.start_cli("run", "--headless", "--yes")
    drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
    run_id, _ = drill.only_run()
    window = Path(drill.config.hosts["ct129"].workdir) / "windows" / run_id
    (window / "stop").touch()  # the operator's stop at the budget, before the staged worker's first prompt
    out, _ = console.communicate(timeout=300)
    assert console.returncode == EXIT_PAUSED, out  # not done: a script must tell it from a finished run
    _, state = drill.only_run()
    assert state["status"] == "paused" and not state["service"]["down"]  # the service came back
    assert state["extraction"]["partial"]["missing"] and "cut short at its budget" in state["message"]
    assert (window / "states" / "manifest.partial.json").is_file()
    assert not (window / "states" / "manifest.json").exists()  # never taken as complete
    assert "evaluate" not in state["steps"]  # the evaluation waits for the whole set
    resumed = drill.run_cli("run", "--headless", "--yes", "--resume", run_id, timeout=300)
    assert resumed.returncode == EXIT_DONE, resumed.stdout + resumed.stderr
    state = RunStore(drill.runs).open(run_id).state
    assert state.status == "done" and len(state.windows) == 1
    assert state.windows[0]["service"]["stops"] == 1 and state.windows[0]["service"]["starts"] == 1
    assert state.service.stops == 1 and state.service.starts == 1 and not state.service.down
    manifest = read_json(window / "states" / "manifest.json")
    assert manifest["complete"] is True and manifest["prompts_missing"] == []
    assert state.steps["evaluate"].status == "done"
