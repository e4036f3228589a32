"""The downtime window end to end on the drill: real SSH hosts in their own process, the rehearsal
server as the service, simulated GPUs with a stuck-VRAM episode, the real workers.

Interlocks and refusals run the engine in-process (its messages are observed on the bus); crashes
kill the real console process with SIGKILL and resume it with `run --resume`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from console import messages as m
from console.messages import Confirmation
from console.operator import Operator
from console.procedure import forecast as fc
from console.procedure.engine import EXIT_DONE, EXIT_DOWN, EXIT_FAILED, EXIT_PAUSED
from console.procedure.replay import read_recording
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env, kill, read_json

pytestmark = pytest.mark.timeout(600)


class Scripted:
    """A decider that approves everything except the steps named in `refuse`, recording each question."""

    name = "test"

    def __init__(self, refuse: tuple[str, ...] = ()):
        self.refuse = refuse
        self.asked: list[Confirmation] = []

    async def decide(self, confirmation: Confirmation) -> bool:
        self.asked.append(confirmation)
        return confirmation.step not in self.refuse


async def run_in_process(drill: Drill, decider: Scripted, **kwargs) -> tuple[m.RunFinished, list[object]]:
    operator = Operator(drill.config, runs_dir=drill.runs)
    seen: list[object] = []
    operator.bus.subscribe(seen.append)
    operator.start()
    try:
        finished = await operator.run(decider, **kwargs)
    finally:
        await asyncio.wait_for(operator.stop(), 30)  # a stop that hangs is a failure, not a stuck suite
    return finished, seen


def steps_seen(seen: list[object]) -> dict[str, str]:
    """Each step's last status, from the StepUpdate messages published."""
    return {u.step: u.status for u in seen if isinstance(u, m.StepUpdate)}


def test_headless_drill_end_to_end(drill: Drill) -> None:
    before = drill.service_pid()
    # README line 1's command, headless: the drill (already up: `drill` finds it) runs to its tables.
    # --simulated: the shared drill's kind, also on a machine with a GPU (`drill` never replaces it silently)
    done = subprocess.run([ENTRY_POINT, "drill", "--headless", "--yes", "--simulated", "--dir", str(drill.dir),
                           "--runs", str(drill.runs)], capture_output=True, text=True, timeout=300, env=cli_env())
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    run_id, state = drill.only_run()
    assert state["status"] == "done" and state["exit_code"] == 0
    # Then where a new operator goes next: the run's report, and the hosts still up (issue 43 item 15).
    told = done.stderr.strip().splitlines()[-2:]
    assert told[0].startswith(f"run {run_id} done: its report is {drill.runs / run_id / 'report.md'}"), told
    assert f"`dflash-ops report {run_id} --runs {drill.runs}`" in told[0], told
    assert told[1].startswith("the drill's hosts are still up") and f"`dflash-ops drill down --dir {drill.dir}`" \
        in told[1], told
    assert [state["steps"][s]["status"] for s in ("preflight", "stage", "cache", "stop", "free-vram", "extract",
                                                  "restart", "evaluate", "report")] == ["done"] * 9
    # The engine's own state.json is read as an earlier window (schema drift between the engine and the
    # forecast's reader fails here): its phases tile the downtime, and a next run's forecast takes
    # every phase from it.
    measured = fc.measured_phases(state)
    assert all(measured[p] is not None and measured[p] >= 0 for p in fc.PHASES), measured
    assert fc.ended_holders(state)  # the drill's first stop leaves VRAM held: read from the engine's own state
    # They tile the downtime but for the operator's answers (--yes: the restart's question and its
    # status check before it, between the GPUs' release and the start; the holders' question).
    answers = (state["service"]["start_issued_at"] - state["extraction"]["gpu_released_at"]
               + state["steps"]["free-vram"].get("decision_s", 0.0))
    assert 0 <= answers < 5
    assert sum(measured.values()) + answers == pytest.approx(state["service"]["ready_at"] - state["service"]["stopped_at"])
    config, window = drill.config, state["extraction"]["window"]
    made = fc.forecast(fc.ForecastInputs(
        run_id="next", service_host=config.service.host, extract_host=config.target.host,
        staged=bool(window.get("staged")), prompt_tokens=(window["tokens"],), model_bytes=window.get("bytes"),
        stop_grace_s=config.service.stop_grace_s, earlier=[state]))
    for p in made.phases:
        if p.name == "free-vram":  # the first stop's episode (holders ended) is not the usual release
            assert p.estimated and p.seconds == config.service.stop_grace_s and "ended VRAM holders" in p.basis, p
            continue
        assert p.basis.startswith(f"the earlier run on {config.service.host}") and not p.estimated, p
        assert p.seconds == pytest.approx(measured[p.name], abs=1e-5)
    # The first stop of a drill leaves VRAM held: the holder was shown and ended (approved by --yes).
    journal = drill.journal()
    assert any("approved: end 1 process holding VRAM" in e["message"] for e in journal)
    assert any(e.get("argv", [None])[0:1] and "remote.endpids" in " ".join(e.get("argv", [])) for e in journal)
    # Each host's probe said where its environment facts came from: probed and kept by the first window
    # on these (shared) drill hosts, taken from that probe by any later one.
    probed = [e["message"] for e in journal if e["message"].startswith("probe on ") and "environment" in e["message"]]
    assert len(probed) == len(drill.config.hosts) and all(
        ("environment probed now" in line and "kept for the next window" in line)
        or ("environment unchanged since" in line and "kernel binding from that probe" in line) for line in probed), probed
    # The restart began at gpu_released, before the extraction's files were flushed and verified.
    service = state["service"]
    assert state["extraction"]["gpu_released_at"] <= service["restart_begun_at"] < state["steps"]["extract"]["ended_at"]
    assert service["start_issued_at"] - state["extraction"]["gpu_released_at"] < 1.0
    assert drill.service_pid() not in (None, before)  # up again: a new server process
    results = read_json(drill.runs / run_id / "results" / "results.json")
    taus = {name: d["tau"]["vanilla"]["macro"] for name, d in results["drafters"].items()}
    assert taus["reference"] > taus["candidate"] + 2  # the story's off-by-one candidate is visibly worse
    assert (drill.runs / run_id / "report.md").read_text().count("reference") >= 1
    # The restarted server drafts with the reference: the cross-check measured it, and it agrees.
    assert state["steps"]["crosscheck"]["status"] == "done", state["steps"]["crosscheck"]
    report = read_json(drill.runs / run_id / "report.json")
    # The window as it was forecast before the stop, beside what it measured, per phase.
    assert [row[0] for row in report["window"]["rows"]] == ["stop", "free-vram", "extract", "start", "downtime"]
    assert all(row[2] != "-" for row in report["window"]["rows"])  # every phase measured
    assert "## Window: forecast against measured" in (drill.runs / run_id / "report.md").read_text()
    online = report["online"]
    assert online["drafter"] == "reference" and online["agrees"] is True
    assert state["facts"]["headline_online"]["reference"] == online["tau"]
    assert "Drafter evaluation" in done.stdout  # the tables end the headless output
    telemetry = (drill.runs / run_id / "telemetry.jsonl").read_text().splitlines()
    assert any('"service_down": true' in line for line in telemetry)  # the window's chart has the downtime
    # The replay reads what this engine wrote (tests/data/replay is a recording of such a store): whole,
    # every step begun, the three questions with their answers, down then back, the run's end last.
    recording = read_recording(drill.runs / run_id)
    assert recording.damage == [] and sorted(name for name, _ in recording.step_starts()) == \
        sorted(name for name, step in state["steps"].items() if step["started_at"])  # (a skipped step never began)
    asked = [e.message for e in recording.events if isinstance(e.message, m.DecisionMade)]
    assert [(d.confirmation.step, d.approved) for d in asked] == [("stop", True), ("free-vram", True), ("restart", True)]
    assert [e.message.down_since is None for e in recording.events if isinstance(e.message, m.Downtime)] == [False, True]
    assert isinstance(recording.events[-1].message, m.RunFinished) and recording.events[-1].message.status == "done"
    # Each question shown as it was asked (its impact and estimate), before its answer; the jobs' bars
    # as they moved (the extraction's to its end), and their exits.
    for answered in (e for e in recording.events if isinstance(e.message, m.DecisionMade)):
        question = answered.message.confirmation
        asked_at = [e.t for e in recording.events if e.message == question]
        assert asked_at and asked_at[0] <= answered.t and question.impact, question
    assert next(d for d in asked if d.confirmation.step == "stop").confirmation.estimate_s is not None
    bars = [e.message for e in recording.events if isinstance(e.message, m.JobProgress)]
    for key in ("cache", "extract", "evaluate"):
        job_id = state["jobs"][key]["job_id"]
        assert any(b.job_id == job_id for b in bars), key
        assert any(isinstance(e.message, m.JobExit) and e.message.job_id == job_id and e.message.code == 0
                   for e in recording.events), key
    prompts = [b for b in bars if b.job_id == state["jobs"]["extract"]["job_id"] and b.key == "prompts"]
    assert prompts and prompts[-1].done == prompts[-1].total, prompts[-1:]
    listed = subprocess.run([ENTRY_POINT, "runs", "--runs", str(drill.runs)], capture_output=True, text=True,
                            env=cli_env(), timeout=60)
    assert run_id in listed.stdout and "done" in listed.stdout and "reference" in listed.stdout
    assert "online tau" in listed.stdout and f"reference {online['tau']:.2f}" in listed.stdout
    assert f"({state['forecast']['downtime_s']:.1f} s)" in listed.stdout  # the forecast beside the downtime


def test_plan_prints_every_step_and_changes_nothing(drill: Drill) -> None:
    pid = drill.service_pid()
    done = drill.run_cli("run", "--plan")
    assert done.returncode == 0, done.stdout + done.stderr
    for step in ("preflight", "stage", "cache", "stop", "free-vram", "extract", "restart", "evaluate", "report"):
        assert step in done.stdout
    assert "remote.drill.service stop" in done.stdout  # the literal stop command
    assert drill.service_pid() == pid  # the server's uptime continues
    assert not drill.job_dirs("ct129", "extract") and not drill.job_dirs("ct129", "cache")
    assert not drill.runs.exists() or not list(drill.runs.iterdir())  # no run kept


async def test_refusing_the_stop_changes_nothing(drill: Drill) -> None:
    pid = drill.service_pid()
    decider = Scripted(refuse=("stop",))
    finished, seen = await run_in_process(drill, decider)
    assert finished.status == "refused" and finished.exit_code == EXIT_FAILED and finished.service_up
    assert [c.step for c in decider.asked] == ["stop"]  # asked once, before anything changed a host
    stop = decider.asked[0]
    assert stop.destructive and "remote.drill.service" in " ".join(stop.argv) and stop.host == "ct129"
    assert drill.service_pid() == pid
    assert steps_seen(seen)["stop"] == "refused" and "extract" not in steps_seen(seen)
    assert not any(isinstance(x, m.Downtime) and x.down_since for x in seen)
    assert any(e.get("decision", "").startswith("no") for e in drill.journal())


async def test_extract_never_starts_while_vram_is_held(drill: Drill) -> None:
    # The drill's first stop leaves a holder; refusing to end it must not let the extraction start,
    # and the service is restarted (the compensation), so the run ends failed with the service up.
    decider = Scripted(refuse=("free-vram",))
    finished, seen = await run_in_process(drill, decider)
    assert finished.status == "refused" and finished.service_up and finished.exit_code == EXIT_FAILED
    holders = [x for x in seen if isinstance(x, m.HoldersFound)]
    assert holders and holders[0].holders[0].was_service and holders[0].holders[0].mib == 80000
    _, state = drill.only_run()
    assert state["extraction"]["go_sent_at"] is None and state["extraction"]["gpu_released_at"] is None
    assert [c.step for c in decider.asked] == ["stop", "free-vram", "restart"]
    assert drill.service_pid() is not None
    downtimes = [x for x in seen if isinstance(x, m.Downtime)]
    assert downtimes[0].down_since is not None and downtimes[-1].down_since is None


async def test_stop_refused_without_verified_completions(drill: Drill, tmp_path: Path) -> None:
    # A prompt set whose cache cannot be verified (the server answers, but the prompts file names a
    # prompt id twice) fails before the stop: the server is never touched.
    prompts = tmp_path / "prompts.jsonl"
    line = Path(drill.config.prompts.file).read_text().splitlines()[0]
    prompts.write_text(line + "\n" + line + "\n")
    text = drill.config_path.read_text().replace(f'file = "{drill.config.prompts.file}"', f'file = "{prompts}"')
    drill.config_path.write_text(text)
    pid = drill.service_pid()
    decider = Scripted()
    finished, seen = await run_in_process(drill, decider)
    assert finished.status == "failed" and finished.service_up
    assert decider.asked == [] and drill.service_pid() == pid
    assert "stop" not in steps_seen(seen) or steps_seen(seen)["stop"] != "done"


@pytest.mark.parametrize("moment", ["started extract", "stop: done", "go: the staged extractor"])
def test_console_killed_then_resumed_runs_each_job_once(drill: Drill, moment: str) -> None:
    console = drill.start_cli("run", "--headless", "--yes")
    drill.wait_journal(lambda e: e["message"].startswith(moment), proc=console)
    kill(console)
    if moment == "stop: done":  # the console is gone with the service down: every view still says so
        status = drill.run_cli("status")
        assert status.returncode == 1 and "SERVICE DOWN since" in status.stdout
        run_id, _ = drill.only_run()
        assert f"`dflash-ops run --resume {run_id}` continues it" in " ".join(status.stdout.split())
    done = drill.run_cli("run", "--headless", "--yes", "--resume")
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    _, state = drill.only_run()
    assert state["status"] == "done"
    assert len(drill.job_dirs("ct129", "extract")) == 1  # started once, found again after the crash
    assert len(drill.job_dirs("ct129", "cache")) == 1
    assert len(drill.job_dirs("ct129", "evaluate")) == 1
    assert drill.service_pid() is not None
    assert any(e["message"].startswith("resumed run") for e in drill.journal())


def test_a_staged_extractor_dead_before_its_go_is_replaced_by_an_extraction_from_disk(drill: Drill) -> None:
    """The staged worker dies after the stop, before its go: it never counts as staged; the window
    is not wasted: the extraction reads the weights from disk, and the service comes back once."""
    console = drill.start_cli("run", "--headless", "--yes")
    drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
    _, state = drill.only_run()
    pid = state["jobs"]["extract"]["handle"]["pid"]
    os.kill(pid, signal.SIGKILL)  # a real crash of the staged worker
    out, _ = console.communicate(timeout=240)
    assert console.returncode == EXIT_DONE, out
    _, state = drill.only_run()
    assert state["status"] == "done" and state["steps"]["extract"]["status"] == "done"
    assert state["extraction"]["go_sent_at"] is None and state["jobs"]["extract"]["attempt"] == 2
    assert state["service"]["stops"] == 1 and state["service"]["starts"] == 1 and not state["service"]["down"]
    assert any("is gone before the go: extracting from disk" in e["message"] for e in drill.journal())
    assert drill.service_pid() is not None


async def test_link_dropped_mid_extraction_is_followed_through(drill: Drill) -> None:
    operator = Operator(drill.config, runs_dir=drill.runs)
    dropped = asyncio.Event()

    def on_message(message: object) -> None:
        if isinstance(message, m.JournalEntry) and message.message.startswith("go:") and not dropped.is_set():
            dropped.set()
            os.kill(drill_hosts_pid(drill), signal.SIGUSR1)  # the hosts drop every SSH connection

    operator.bus.subscribe(on_message)
    operator.start()
    try:
        finished = await operator.run(Scripted())
    finally:
        await operator.stop()
    assert dropped.is_set()
    assert finished.status == "done", finished.message
    assert len(drill.job_dirs("ct129", "extract")) == 1


def drill_hosts_pid(drill: Drill) -> int:
    return int((drill.dir / "drill.pid").read_text().split()[0])


def test_a_drafter_without_target_layer_ids_is_refused_before_anything_changes(drill: Drill) -> None:
    candidate = next(d for d in drill.config.drafters if d.name == "candidate")
    config_json = Path(candidate.path) / "config.json"
    data = read_json(config_json)
    del data["dflash_config"]["target_layer_ids"]
    config_json.write_text(json.dumps(data))
    pid = drill.service_pid()
    done = drill.run_cli("run", "--headless", "--yes")
    assert done.returncode == EXIT_FAILED
    assert "target_layer_ids" in done.stderr and str(config_json.parent) in done.stderr
    assert drill.service_pid() == pid and not drill.job_dirs("ct129", "cache")
    # The config's explicit override is taken, and shown as one.
    text = drill.config_path.read_text().replace('name = "candidate"', 'name = "candidate"\nlayers = [1, 2, 3]')
    drill.config_path.write_text(text)
    planned = drill.run_cli("run", "--plan")
    assert planned.returncode == 0, planned.stdout + planned.stderr
    assert "drafter candidate on ct200: target layers [1, 2, 3] from the config's override" in planned.stderr


async def test_one_step_at_a_time_then_the_rest(drill: Drill) -> None:
    pid = drill.service_pid()
    first, _ = await run_in_process(drill, Scripted(), one_step=True)
    assert first.status == "paused" and first.exit_code == EXIT_PAUSED and first.service_up, first.message
    run_id, state = drill.only_run()
    assert state["steps"]["stage"]["status"] == "done" and state["steps"]["cache"]["status"] == "done"
    assert "stop" not in state["steps"] and drill.service_pid() == pid  # nothing past the unit asked for
    measured, _ = await run_in_process(drill, Scripted(), resume=run_id, one_step=True)
    assert measured.message.startswith("paused after acceptance") and measured.service_up, measured.message
    second, seen = await run_in_process(drill, Scripted(), resume=run_id, one_step=True)
    assert second.status == "paused" and not second.service_up, second.message  # paused after the stop: said so
    assert second.exit_code == EXIT_DOWN  # exit 3 whenever the service is down at the end, paused included
    assert "THE SERVICE IS STILL DOWN" in second.message
    assert steps_seen(seen)["stop"] == "done" and "free-vram" not in steps_seen(seen)
    last, _ = await run_in_process(drill, Scripted(), resume=run_id)
    assert last.status == "done" and last.service_up
    assert len(drill.job_dirs("ct129", "extract")) == 1
