"""The run store: atomic state, an fsynced append-only journal, summaries; and the terminal decider."""

from __future__ import annotations

import asyncio
import io
import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.messages import Confirmation
from console.procedure.decider import TerminalDecider
from console.procedure.state import JobRecord
from console.procedure.steps import Preflight, estimates, stage_decision
from console.procedure.store import RunStore, RunStoreError, RunSummary, StoreWriteError, UnreadableRun
from tests.small_fs import fill, small_filesystem


def test_state_journal_and_summary(tmp_path) -> None:
    store = RunStore(tmp_path)
    run = store.create("/etc/dflash-ops.toml", "abc")
    run.state.step("stop").status = "done"
    run.state.service.stopped_at, run.state.service.ready_at = 100.0, 130.5
    run.state.headline = {"reference": 3.2}
    run.save()
    run.journal("stop", "approved: stop the service", host="ct129", argv=["systemctl", "stop", "sglang"])
    again = store.open(run.run_id)
    assert again.state == run.state  # typed state round-trips through state.json
    entry = again.read_journal()[0]
    assert entry["argv"] == ["systemctl", "stop", "sglang"] and entry["host"] == "ct129" and entry["user"]
    (summary,) = store.summaries()
    assert summary.downtime_s == pytest.approx(30.5) and summary.headline == {"reference": 3.2}
    assert store.latest_unfinished().run_id == run.run_id  # status "running"


JSON_LEAF = st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8) | st.floats()
JSON_VALUE = st.recursive(JSON_LEAF, lambda inner: st.lists(inner, max_size=3)
                          | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(facts=st.dictionaries(st.text(max_size=8), JSON_VALUE, max_size=4), result=JSON_VALUE,
       downtime=st.floats(allow_nan=False))
def test_state_json_reads_back_as_the_state_it_saved(tmp_path, facts, result, downtime) -> None:
    # state.json is written by pydantic-core (fast: it is saved at every event) and read by pydantic:
    # any JSON a worker's result or a fact holds, Infinity and NaN included, reads back as it was; a
    # tuple as a list and a value of no JSON type (a Path) as its str, as `json.dumps(default=str)` did.
    store = RunStore(tmp_path / uuid.uuid4().hex)
    run = store.create(None, None)
    run.state.facts = {**facts, "where": tmp_path, "pair": (1, "a")}
    run.state.step("stop").status = "done"
    run.state.jobs["extract"] = JobRecord(job_id="j1", host="ct129", worker="extract", result=result)
    run.state.service.stopped_at = downtime
    run.save()
    text = (run.dir / "state.json").read_text()
    assert text.startswith("{\n  ")  # indented: an operator reads it
    again = store.open(run.run_id).state
    written = json.loads(text)
    assert written["facts"]["where"] == str(tmp_path) and written["facts"]["pair"] == [1, "a"]
    same = json.dumps(again.to_json(), sort_keys=True) == json.dumps(
        {**run.state.to_json(), "facts": {**facts, "where": str(tmp_path), "pair": [1, "a"]}}, sort_keys=True)
    assert same, (again, run.state)


def test_a_torn_journal_line_is_left_out_and_the_next_entry_starts_a_line_of_its_own(tmp_path) -> None:
    store = RunStore(tmp_path)
    run = store.create(None, None)
    run.journal(None, "first")
    with open(run.dir / "journal.jsonl", "a") as f:
        f.write('{"t": 1, "message": "tor')  # a crash mid-write
    assert [e["message"] for e in run.read_journal()] == ["first"]
    again = store.open(run.run_id)  # a resumed console appends next
    again.journal(None, "second")
    messages = [e["message"] for e in again.read_journal()]
    assert messages[0] == "first" and messages[-1] == "second"
    assert "cut mid-write" in messages[1]  # said so in the journal
    assert (run.dir / "journal.jsonl").read_text().count('{"t": 1, "message": "tor\n') == 1


@pytest.mark.parametrize("content, why", [
    (b"[]", "not a run state (a JSON list"),
    (b"null", "not a run state (a JSON NoneType"),
    (bytes(range(256)), "not JSON"),
    (b'{"format": "something/else"}', "unknown run state version 'something/else'"),
    (b'{"format": "dflash-ops.run/9"}', "unknown run state version"),
    (b'{"format": "dflash-ops.run/2", "steps": []}', "damaged run state"),
])
def test_an_unreadable_state_names_its_path_and_never_hides_the_other_runs(tmp_path, content, why) -> None:
    store = RunStore(tmp_path)
    good = store.create(None, None)
    bad = tmp_path / "20260101-000000-dead"
    bad.mkdir()
    (bad / "state.json").write_bytes(content)
    with pytest.raises(RunStoreError) as caught:
        store.open(bad.name)
    assert why in str(caught.value) and str(bad / "state.json") in str(caught.value)
    listing = store.summaries()
    unreadable = [s for s in listing if isinstance(s, UnreadableRun)]
    assert [u.run_id for u in unreadable] == [bad.name] and why in unreadable[0].why
    assert [s.run_id for s in listing if isinstance(s, RunSummary)] == [good.run_id]
    assert store.latest_unfinished().run_id == good.run_id


def test_version_1_states_are_read(tmp_path) -> None:
    """A run written before the typed state (format 1) still opens, its milestones moved."""
    d = tmp_path / "20261130-120000-abcd"
    d.mkdir()
    (d / "state.json").write_text(json.dumps({
        "format": "dflash-ops.run/1", "run_id": d.name, "created_at": 1.0, "status": "done",
        "steps": {"stop": {"status": "done", "started_at": 1.0, "ended_at": 2.0}},
        "jobs": {"extract": {"job_id": f"{d.name}-extract", "host": "ct129", "worker": "extract", "args": []}},
        "facts": {"go_sent": 5.0, "gpu_released_at": 6.0, "extraction_complete": True, "layers": [1, 2]},
        "service": {"stopped_at": 3.0, "stop_returned_at": 4.0, "ready_at": 9.0, "down": False}}))
    state = RunStore(tmp_path).open(d.name).state
    assert state.extraction.go_sent_at == 5.0 and state.extraction.complete and state.facts == {"layers": [1, 2]}
    assert state.service.stops == 1 and state.jobs["extract"].host == "ct129"


def test_left_down_is_one_query_whatever_the_status(tmp_path) -> None:
    """A failed (or refused, cancelled) run that left the service down is the one the banner, `r`,
    status and resume name, before any newer paused run."""
    store = RunStore(tmp_path)
    failed = store.create(None, None)
    failed.state.status, failed.state.service.down, failed.state.service.stopped_at = "failed", True, 5.0
    failed.save()
    paused = store.create(None, None)
    paused.state.status = "paused"
    paused.save()
    assert store.left_down().run_id == failed.run_id
    assert store.to_resume().run_id == failed.run_id
    failed.state.service.down = False
    failed.save()
    assert store.left_down() is None and store.to_resume().run_id == paused.run_id


def test_a_full_disk_after_the_stop_is_said_and_kept_in_memory(tmp_path, capsys) -> None:
    with small_filesystem(tmp_path / "runs") as root:
        store = RunStore(root)
        run = store.create(None, None)
        fill(root)
        with pytest.raises(StoreWriteError, match=str(run.dir / "state.json")):
            run.save()  # before the stop: a failed write fails the run (nothing has changed yet)
        run.keep_going_on_write_errors = True  # once the service is down, the run must go on
        run.state.service.down = True
        run.save()
        run.journal("stop", "stop command ran")
        err = capsys.readouterr().err
        assert f"cannot write {run.dir / 'state.json'}" in err and "No space left on device" in err
        assert run.read_journal()[-1]["message"] == "stop command ran"  # kept in memory
        assert run.write_errors and run.state.service.down


def test_terminal_decider_y_n_c() -> None:
    from prompt_toolkit.input import create_pipe_input

    out = io.StringIO()
    question = Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang"),
                            "SGLang on ct129 goes down", True, 94.0)

    async def ask() -> list[bool]:
        with create_pipe_input() as keys:
            keys.send_text("maybe\rn\ry\rc\r")
            decider = TerminalDecider(input=keys, out=out)
            return [await decider.decide(question) for _ in range(4)]

    assert asyncio.run(ask()) == [False, True, True, True]  # "maybe" re-asked, then n; y; c; then no question
    text = out.getvalue()
    assert "systemctl stop sglang" in text and "[DESTRUCTIVE]" in text and "estimate: 1 min 34 s (earlier runs)" in text
    assert text.count("Proceed?") == 4  # after `c` nothing more is asked


def test_the_stop_question_on_the_terminal_says_its_forecast_once() -> None:
    """Issue 28 item 3: the stop's forecast is in its impact with its basis by phase; `run --step` and
    the headless run (this decider) printed it again as "estimate: 3 min 14 s (forecast)". Another
    question's estimate (earlier runs) is still said beside its impact."""
    from prompt_toolkit.input import create_pipe_input

    from console.procedure.decider import confirmation_text

    out = io.StringIO()
    stop = Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang"),
                        "sglang on ct129 goes down; forecast downtime 3 min 14 s = stop 11 s + start 3 min 03 s; "
                        "stop, start: systemd's history of the unit", True, 194.0, "forecast")

    async def ask() -> bool:
        with create_pipe_input() as keys:
            keys.send_text("n\r")
            return await TerminalDecider(input=keys, out=out).decide(stop)

    assert asyncio.run(ask()) is False
    text = out.getvalue()
    assert text.count("3 min 14 s") == 1 and "estimate:" not in text and "forecast downtime 3 min 14 s" in text
    restart = Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang"), "back", False, 96.0)
    assert "  estimate: 1 min 36 s (earlier runs)" in confirmation_text(restart)


def test_end_of_input_refuses() -> None:
    from prompt_toolkit.input import create_pipe_input

    c = Confirmation("stop", "stop the service", "h", ("true",), "x", True)

    async def ask() -> bool:
        with create_pipe_input() as keys:
            keys.close()  # nobody is there to answer
            return await TerminalDecider(input=keys, out=io.StringIO()).decide(c)

    assert asyncio.run(ask()) is False


def test_one_question_at_a_time_each_answer_to_its_own_question() -> None:
    """Issue 27: the budget offer and the restart's question at once on the terminal. The second
    waits until the first is answered; the first answer typed goes to the first question only."""
    from prompt_toolkit.input import create_pipe_input

    out = io.StringIO()
    offer = Confirmation("extract", "stop the extraction now, keeping every prompt done", "ct129", (), "x", False)
    restart = Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang"), "back", False)

    async def both() -> tuple[bool, bool, str]:
        with create_pipe_input() as keys:
            decider = TerminalDecider(input=keys, out=out)
            first = asyncio.create_task(decider.decide(offer))
            await asyncio.sleep(0.2)
            second = asyncio.create_task(decider.decide(restart))
            await asyncio.sleep(0.2)
            shown_before = out.getvalue()
            keys.send_text("n\r")  # typed for the offer, the only question on the screen
            said_first = await first
            await asyncio.sleep(0.2)
            keys.send_text("y\r")
            return said_first, await second, shown_before

    first, second, shown_before = asyncio.run(both())
    assert (first, second) == (False, True)
    assert "extract: stop the extraction now" in shown_before and "restart:" not in shown_before
    assert out.getvalue().count("Proceed?") == 2


def test_stage_left_out_without_ram_and_estimates_from_earlier_runs() -> None:
    gib = 1 << 30
    stage, why = stage_decision(Preflight(model_bytes=54 * gib, ram_available=40 * gib))
    assert not stage and "40.0 GiB RAM available" in why and "56.0 GiB" in why
    stage, _ = stage_decision(Preflight(model_bytes=3 * gib, ram_available=100 * gib))
    assert stage
    from console.procedure.state import RunState

    def earlier_run(d: float) -> dict:
        """A window whose phases took d (stop), d (free-vram), d (extract) and 7 d (start)."""
        state = RunState(f"earlier-{d:g}", 0.0, status="done")
        stop = state.step("stop")
        stop.status, stop.started_at, stop.ended_at = "done", 0.0, d
        svc = state.service
        svc.stopped_at, svc.stop_returned_at, svc.vram_free_at, svc.ready_at = 0.0, d, 2 * d, 10 * d
        state.extraction.gpu_released_at = 3 * d
        return state.to_json()

    earlier = [earlier_run(d) for d in (1.0, 2.0, 9.0)]
    assert estimates(earlier) == {"stop": 2.0, "downtime": 20.0}
    # A run that did not measure every phase (its start seen late, the console away) is no basis.
    late = earlier_run(100.0)
    late["service"]["ready_seen_late"] = True
    assert estimates([late]) == {"stop": 100.0}


def a_full_state(store: RunStore):
    """A run as the engine leaves it mid-window: every table of the schema filled in."""
    from console.procedure.state import JobRecord, Owner

    run = store.create("/etc/dflash-ops.toml", "abc")
    s = run.state
    s.started, s.route, s.owner = True, "window", Owner.this_process()
    s.step("stop").status, s.step("stop").work_s, s.step("stop").detail = "done", 2.5, "stopped"
    s.jobs["extract"] = JobRecord("r-extract", "ct129", "extract", ["--model", "m"],
                                  handle={"pid": 7, "run_dir": "/w"}, offset=120, events_seen=["staged"])
    s.service.down, s.service.stopped_at, s.service.stops, s.service.pids_before_stop = True, 100.0, 1, [4242]
    s.extraction.staged_pid, s.extraction.gpu_released_at = 7, 130.0
    s.headline, s.exit_code = {"reference": 3.2, "candidate": None}, None
    run.save()
    return run


NOT_BOOL, NOT_NUMBER, NOT_TEXT, NOT_LIST = ["false", "true", 0, 1, [], {}], ["3", "1.5", True, [], {}], [3, True, [], {}], ["a", 3, {}]
WRONG = {("service", "down"): NOT_BOOL, ("service", "stops"): NOT_NUMBER + [1.5, None],
         ("service", "stopped_at"): NOT_NUMBER, ("service", "pids_before_stop"): NOT_LIST + [[1, "x"], None],
         ("steps", "stop", "status"): NOT_TEXT + [None], ("steps", "stop", "work_s"): NOT_NUMBER + [None],
         ("steps", "stop", "found_on_resume"): NOT_BOOL, ("jobs", "extract", "offset"): NOT_NUMBER + [2.5],
         ("jobs", "extract", "events_seen"): NOT_LIST + [[1]], ("jobs", "extract", "handle"): ["x", 3, []],
         ("owner", "pid"): NOT_NUMBER + [None], ("extraction", "staged_pid"): NOT_NUMBER + [7.5],
         ("extraction", "complete"): NOT_BOOL, ("started",): NOT_BOOL, ("created_at",): NOT_NUMBER + [None],
         ("headline", "reference"): NOT_NUMBER, ("run_id",): [3, None, [], ""], ("status",): NOT_TEXT + [None],
         ("owner",): ["me", 3, []], ("service",): ["down", 3, []]}
PATHS = sorted(WRONG)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(PATHS), pick=st.integers(0, 100))
def test_a_field_of_the_wrong_type_is_a_clean_error_naming_it(tmp_path, path, pick) -> None:
    """`"down": "false"` is truthy: read as it was, a resume would take a service for down. Every field
    is checked against its type (issue 27): a wrong one is a StateError naming the file and the field,
    never a run read with it; unknown extra fields (a newer dflash-ops) are ignored."""
    from console.procedure.state import RunState, StateError

    store = RunStore(tmp_path / uuid.uuid4().hex[:6])
    run = a_full_state(store)
    data = json.loads((run.dir / "state.json").read_text())
    data["added_by_a_newer_version"] = {"x": 1}
    data["service"]["paused_by_a_newer_route"] = True
    assert RunState.from_json(json.loads(json.dumps(data)), "here") == run.state  # extras ignored
    *parents, name = path
    table = data
    for part in parents:
        table = table[part]
    table[name] = WRONG[path][pick % len(WRONG[path])]
    (run.dir / "state.json").write_text(json.dumps(data))
    with pytest.raises(RunStoreError) as caught:
        store.open(run.run_id)
    said = str(caught.value)
    assert said.startswith(f"{run.dir / 'state.json'}: a damaged run state: `{'.'.join(path)}"), said
    assert "\n" not in said
    with pytest.raises(StateError):
        RunState.from_json(data, "here")


def test_a_question_on_a_terminal_wraps_between_words_under_its_labels() -> None:
    """The tmux walk at 80 columns: `run --step --headless` printed the stop question's command and
    impact cut at the edge ("/tm" then "p/walk", "t" then "he stop's"). On a terminal each part wraps
    between words, under its label; every word is kept whole and in order."""
    from console.messages import Confirmation
    from console.procedure.decider import confirmation_text

    asked = Confirmation("stop", "stop the service", "ct129", ("python3", "-m", "remote.drill.service", "stop",
                         "--state", "/tmp/walk/drill/ct129/home/standin"),
                         "server on ct129 goes down; forecast downtime 5 s = stop 2 s + free-vram 2 s + extract 0 s + "
                         "start 1 s; stop, free-vram: estimate: the stop's grace", True)
    text = confirmation_text(asked, 80)
    assert all(len(line) <= 80 for line in text.splitlines()), text
    assert text.split() == confirmation_text(asked).split()  # nothing cut, nothing lost
    command = text.splitlines()[1:3]
    assert command[0].startswith("  command: ") and command[1].startswith(" " * 11), text
    assert "/tmp/walk/drill/ct129/home/standin" in text  # a path kept whole
