"""The replay's core over a store the real engine wrote (tests/data/replay: a headless drill, the
first stop leaving VRAM held), and over damaged copies of it: the messages in time order, the
playback's time scaled by its speed on an injected clock (no sleeps), pause, step, seek, and damage
named by file and line. `dflash-ops replay --print` too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console import messages as m
from console.cli.main import main
from console.procedure.replay import Player, ReplayError, read_recording
from console.procedure.store import JOURNAL, STATE, TELEMETRY, Run, RunStore

RECORDED = Path(__file__).parent / "data" / "replay" / "20261202-041120-520a"
ROUTE = ["preflight", "stage", "cache", "stop", "free-vram", "extract", "restart", "evaluate", "report", "crosscheck"]
INTERRUPTED = RECORDED.parent / "20261202-042648-ad7a"  # the same drill killed (SIGKILL) after the stop ran
RECORDING = read_recording(RECORDED)  # read once: the tests that only read it share it


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def of(kind: type, events) -> list:
    return [e.message for e in events if isinstance(e.message, kind)]


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines(keepends=True)


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """A copy of the recorded run to damage."""
    return Path(shutil.copytree(RECORDED, tmp_path / RECORDED.name))


def test_the_recorded_run_replays_in_time_order_whole() -> None:
    rec, state = RECORDING, json.loads((RECORDED / STATE).read_text())
    assert rec.damage == [] and rec.cut_at is None and rec.run_id == state["run_id"]
    assert [e.t for e in rec.events] == sorted(e.t for e in rec.events)
    # every journal line is in the event log, and every telemetry sample in the GPU panels
    assert len(of(m.JournalEntry, rec.events)) == len(lines(RECORDED / JOURNAL))
    assert len(of(m.TelemetryUpdate, rec.events)) == len(lines(RECORDED / TELEMETRY))
    assert [name for name, _ in rec.step_starts()] == ROUTE
    # each step begins (running) before it ends, with the state's times and the journal's detail
    for name in ROUTE:
        updates = [u for u in of(m.StepUpdate, rec.events) if u.step == name]
        assert [u.status for u in updates] == ["running", "done"], name
        assert updates[1].started_at == state["steps"][name]["started_at"]
        assert updates[1].detail == state["steps"][name]["detail"] and updates[1].work_s == state["steps"][name]["work_s"]
    # the questions as they were answered: what, where, the literal command, the answer
    asked = of(m.DecisionMade, rec.events)
    assert [(d.confirmation.step, d.confirmation.action, d.approved, d.by) for d in asked] == [
        ("stop", "stop the service", True, "--yes"), ("free-vram", "end 1 process holding VRAM", True, "--yes"),
        ("restart", "start the service", True, "--yes")]
    stop_plan = next(p for p in state["plan"] if p["name"] == "stop")
    assert asked[0].confirmation.host == stop_plan["host"] == "ct129"
    assert "remote.endpids" in asked[1].confirmation.argv
    # the DOWN banner: from the stop to the ready, and the service's downtime is the state's
    down = of(m.Downtime, rec.events)
    assert [(d.down_since, d.restarted_at) for d in down] == [
        (state["service"]["stopped_at"], None), (None, state["service"]["ready_at"])]
    # the staged extractor's log lines are its own (the check job of the same worker had ended)
    extract = state["jobs"]["extract"]["job_id"]
    assert {j.job_id for j in of(m.JobLog, rec.events) if "staged:" in j.message} == {extract}
    assert {x.job_id: x.code for x in of(m.JobExit, rec.events)}[extract] == 0
    # its counters as it reported them on releasing the GPUs (state.json keeps those, not the events before)
    window = state["extraction"]["window"]
    assert {(p.key, p.done, p.total) for p in of(m.JobProgress, rec.events)} == {
        ("prompts", window["prompts_done"], window["prompts_done"] + window["prompts_missing"]),
        ("tokens", window["tokens"], window["tokens"])}
    assert [j.kind for j in of(m.JobLog, rec.events) if j.kind != "log"] == ["staged", "gpu_released"]
    # the end: results, then the run's own end
    assert isinstance(rec.events[-1].message, m.RunFinished)
    assert rec.events[-1].message.status == "done" and rec.events[-1].message.exit_code == 0
    assert rec.results_dir == RECORDED / "results"
    assert rec.hosts() == ["ct200", "ct129"]
    # the sparklines: ct129's GPU0 held 40000 MiB (simulated) until the leftover holder was ended
    stop, extract = dict(rec.step_starts())["stop"], dict(rec.step_starts())["extract"]
    assert set(rec.history("ct129", 0, stop)) == {40000} and rec.history("ct129", 0, extract)[-1] == 0
    assert len(rec.history("ct129", 0, stop, seconds=3)) < len(rec.history("ct129", 0, stop))


def test_an_interrupted_run_replays_to_where_it_was_killed_with_the_service_down() -> None:
    rec, state = read_recording(INTERRUPTED), json.loads((INTERRUPTED / STATE).read_text())
    assert state["status"] == "running" and rec.damage == []  # killed, not damaged: every line whole
    assert [name for name, _ in rec.step_starts()] == ROUTE[:4]
    last = {u.step: u for u in of(m.StepUpdate, rec.events)}
    assert {n: u.status for n, u in last.items()} == {"preflight": "done", "stage": "done", "cache": "done",
                                                      "stop": "running"}
    assert [d.down_since for d in of(m.Downtime, rec.events)] == [state["service"]["stopped_at"]]  # never back
    assert of(m.RunFinished, rec.events) == [] and of(m.ResultsReady, rec.events) == []
    assert rec.events[-1].source == f"{TELEMETRY}:{len(lines(INTERRUPTED / TELEMETRY))}"


def test_the_playback_moves_at_its_speed_on_the_clock_it_is_given() -> None:
    clock = Clock()
    player = Player(RECORDING, speed=4.0, clock=clock)
    shown = player.tick()  # no time has passed: what happened at the run's first instant
    assert shown and {e.t for e in shown} == {RECORDING.start}
    clock.t += 2.5
    shown += player.tick()
    assert player.now == pytest.approx(RECORDING.start + 10.0)
    assert shown == [e for e in RECORDING.events if e.t <= RECORDING.start + 10.0]
    player.pause()
    clock.t += 100  # paused: the run's time stands still, and the pause is not caught up afterwards
    assert player.tick() == [] and player.now == pytest.approx(RECORDING.start + 10.0)
    player.play()
    player.faster()  # 4 -> 8
    clock.t += 1.0
    more = player.tick()
    assert player.now == pytest.approx(RECORDING.start + 18.0) and player.speed == 8.0
    assert shown + more == [e for e in RECORDING.events if e.t <= RECORDING.start + 18.0]
    clock.t += 3600
    rest = player.tick()
    assert player.at_end and not player.playing and shown + more + rest == RECORDING.events


@settings(max_examples=40, deadline=None)
@given(moves=st.lists(st.tuples(st.floats(0, 5), st.sampled_from(["tick", "faster", "slower", "pause", "play"])),
                      max_size=30))
def test_whatever_the_keys_the_events_come_once_each_in_order(moves) -> None:
    clock = Clock()
    player = Player(RECORDING, speed=1.0, clock=clock)
    shown, expected_now = [], RECORDING.start
    for seconds, key in moves:
        clock.t += seconds
        if key == "tick":
            if player.playing:
                expected_now = min(RECORDING.end, expected_now + seconds * player.speed)
            shown += player.tick()
        else:
            if key in ("pause", "play", "faster", "slower") and player.playing:
                expected_now = min(RECORDING.end, expected_now + seconds * player.speed)
                shown += player.tick()  # a key moves the time shown up to the moment it is pressed
            getattr(player, key)()
    assert shown == RECORDING.events[:len(shown)]
    assert player.now == pytest.approx(expected_now)
    assert all(e.t <= player.now for e in shown) and len(shown) == player.position


def test_step_shows_the_next_instant_and_pauses() -> None:
    player = Player(RECORDING, clock=Clock())
    first = player.step()
    assert not player.playing and first and {e.t for e in first} == {RECORDING.start}
    second = player.step()
    assert second and all(e.t == second[0].t > RECORDING.start for e in second)
    assert first + second == RECORDING.events[:len(first) + len(second)]


def test_seek_to_a_step_forward_and_back() -> None:
    player = Player(RECORDING, clock=Clock(), playing=False)
    starts = dict(RECORDING.step_starts())
    to_stop = player.seek_step("stop")
    assert not player.reset and player.now == starts["stop"] and player.current_step() == "stop"
    assert to_stop == [e for e in RECORDING.events if e.t <= starts["stop"]]
    assert of(m.Downtime, to_stop) == []  # the stop was about to run: the service not down yet
    after = player.next_step()
    assert player.current_step() == "free-vram" and of(m.Downtime, after)[0].down_since is not None
    back = player.previous_step()  # a seek back: the views start again from a fresh state
    assert player.reset and player.current_step() == "stop"
    assert back == [e for e in RECORDING.events if e.t <= starts["stop"]]
    player.seek(RECORDING.end)
    assert player.at_end
    with pytest.raises(ValueError, match="never began in this run .*preflight, stage"):
        player.seek_step("parity")


def test_a_journal_cut_mid_line_replays_up_to_it_and_says_where(copy: Path) -> None:
    journal = lines(copy / JOURNAL)
    cut = 40  # 1-based: the line a crash cut (the free-vram step had begun)
    (copy / JOURNAL).write_text("".join(journal[:cut - 1]) + journal[cut - 1][:25])
    rec = read_recording(copy)
    assert [(d.file, d.line) for d in rec.damage] == [(JOURNAL, cut)] and "cut mid-write" in rec.damage[0].why
    last_good = json.loads(journal[cut - 2])["t"]
    assert rec.cut_at == last_good and rec.end <= last_good
    assert len(of(m.JournalEntry, rec.events)) == cut - 1
    assert not of(m.RunFinished, rec.events) and rec.events  # nothing from after the damage
    assert [name for name, _ in rec.step_starts()] == ROUTE[:5]


def test_a_journal_line_that_is_json_but_no_entry_is_damage_too(copy: Path) -> None:
    journal = lines(copy / JOURNAL)
    journal[20] = json.dumps({"t": "yesterday", "message": "preflight: done"}) + "\n"  # line 21
    (copy / JOURNAL).write_text("".join(journal))
    rec = read_recording(copy)
    assert [(d.file, d.line) for d in rec.damage] == [(JOURNAL, 21)] and "needs a message and a time" in rec.damage[0].why
    assert [name for name, _ in rec.step_starts()] == ["preflight"] and rec.cut_at == json.loads(journal[19])["t"]


def test_a_line_the_store_marked_as_cut_by_a_crash_is_not_damage(copy: Path) -> None:
    with open(copy / JOURNAL, "a") as f:
        f.write('{"t": 1, "message": "a line a crash cu')
    run = Run(copy, RunStore(copy.parent).open(copy.name).state)
    run.journal(None, "resumed after the crash")  # the store's writer: it ends the cut line and says so
    rec = read_recording(copy)
    assert rec.damage == [] and rec.cut_at is None
    assert "resumed after the crash" in [e.message for e in of(m.JournalEntry, rec.events)[-2:]]


def test_a_bad_telemetry_line_ends_the_replay_there(copy: Path) -> None:
    samples = lines(copy / TELEMETRY)
    samples[29] = '{"host": "ct129", "t": 1, "sample": {"seq": 1}}\n'  # line 30: no GPUs
    (copy / TELEMETRY).write_text("".join(samples))
    rec = read_recording(copy)
    assert [(d.file, d.line) for d in rec.damage] == [(TELEMETRY, 30)] and "not a telemetry sample (missing" in rec.damage[0].why
    assert rec.cut_at == json.loads(samples[28])["t"] and rec.end <= rec.cut_at
    assert len(of(m.TelemetryUpdate, rec.events)) == 29


def test_without_state_json_the_journal_and_telemetry_still_replay(copy: Path) -> None:
    (copy / STATE).unlink()
    rec = read_recording(copy)
    assert [(d.file, d.line) for d in rec.damage] == [(STATE, None)] and "missing" in rec.damage[0].why
    assert rec.cut_at is None and rec.run_id == copy.name
    ended = {u.step: u.status for u in of(m.StepUpdate, rec.events)}
    assert ended == dict.fromkeys(ROUTE, "done")  # the steps' ends, from the journal
    assert len(of(m.DecisionMade, rec.events)) == 3
    down = of(m.Downtime, rec.events)  # from the telemetry's service_down marks
    assert [d.down_since is not None for d in down] == [True, False]
    assert of(m.PlanReady, rec.events) == [] and of(m.RunFinished, rec.events) == []


def test_without_state_json_nothing_after_a_damaged_telemetry_line_is_read(copy: Path) -> None:
    (copy / STATE).unlink()
    samples = lines(copy / TELEMETRY)
    first_down = next(i for i, line in enumerate(samples) if json.loads(line)["service_down"])
    samples[first_down - 1] = "{}\n"  # the line before the first sample taken with the service down
    (copy / TELEMETRY).write_text("".join(samples))
    rec = read_recording(copy)
    assert [(d.file, d.line) for d in rec.damage] == [(STATE, None), (TELEMETRY, first_down)]
    assert of(m.Downtime, rec.events) == []  # the later samples' service_down marks are not read
    assert rec.cut_at == json.loads(samples[first_down - 2])["t"]


def test_a_state_json_whose_plan_is_damaged_is_named_and_the_journal_still_replays(copy: Path) -> None:
    state = json.loads((copy / STATE).read_text())
    state["plan"][0].pop("name")
    (copy / STATE).write_text(json.dumps(state))
    rec = read_recording(copy)
    assert [(d.file, d.line) for d in rec.damage] == [(STATE, None)] and "KeyError: 'name'" in rec.damage[0].why
    assert len(of(m.JournalEntry, rec.events)) == len(lines(copy / JOURNAL)) and len(of(m.DecisionMade, rec.events)) == 3


def test_nothing_to_replay_is_an_error_saying_why(tmp_path: Path) -> None:
    with pytest.raises(ReplayError, match="nothing to replay"):
        read_recording(tmp_path)
    (tmp_path / JOURNAL).write_text("garbage\n")
    with pytest.raises(ReplayError, match="nothing to replay: state.json: missing.*; journal.jsonl line 1: not complete"):
        read_recording(tmp_path)
    shutil.copy(INTERRUPTED / STATE, tmp_path / STATE)  # a state, but a journal damaged from its first line
    with pytest.raises(ReplayError, match="nothing to replay before the damage: journal.jsonl line 1"):
        read_recording(tmp_path)
    with pytest.raises(ReplayError, match="no such run directory"):
        read_recording(tmp_path / "nope")


def test_the_cli_prints_a_run_by_id_and_names_damage(copy: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["replay", copy.name, "--runs", str(copy.parent), "--print"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(RECORDING.events)
    assert any("asked: stop the service on ct129" in line and "approved (--yes)" in line for line in out)
    assert "run done (exit 0)" in out[-1]
    samples = lines(copy / TELEMETRY)
    (copy / TELEMETRY).write_text("".join(samples[:10]) + "{not json\n" + "".join(samples[11:]))
    assert main(["replay", str(copy), "--print"]) == 1
    err = capsys.readouterr().err
    assert "damaged: telemetry.jsonl line 11: not complete JSON" in err and "replayed up to the damage" in err
    assert main(["replay", "20990101-000000-zzzz", "--runs", str(copy.parent)]) == 2
    assert "no run '20990101-000000-zzzz'" in capsys.readouterr().err
    assert main(["replay", str(copy), "--speed", "0"]) == 2


def test_print_says_the_stop_questions_forecast_once() -> None:
    """`replay --print` of a stop asked: its forecast is in its impact (with its basis); it is not said
    again as "(estimate 3 min 14 s, forecast)". Another question's estimate still is."""
    from console.cli.replay import describe
    from console.procedure.replay import Event

    stop = m.Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang"),
                          "sglang on ct129 goes down; forecast downtime 3 min 14 s = stop 11 s + start 3 min 03 s",
                          True, 194.0, "forecast")
    said = describe(Event(0.0, stop, "journal.jsonl:1"))
    assert said.count("3 min 14 s") == 1 and "estimate" not in said
    restart = m.Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang"), "back", False, 96.0)
    assert "(estimate 1 min 36 s, earlier runs)" in describe(Event(0.0, restart, "journal.jsonl:2"))
