"""The run store: atomic state, an fsynced append-only journal, summaries; and the terminal decider."""

from __future__ import annotations

import asyncio
import io
import json

import pytest

from console.messages import Confirmation
from console.procedure.decider import TerminalDecider
from console.procedure.steps import Preflight, estimates, stage_decision
from console.procedure.store import RunStore, RunStoreError


def test_state_journal_and_summary(tmp_path) -> None:
    store = RunStore(tmp_path)
    run = store.create("/etc/dflash-ops.toml", "abc")
    run.step("stop")["status"] = "done"
    run.state["service"].update(stopped_at=100.0, ready_at=130.5)
    run.state["headline"] = {"reference": 3.2}
    run.save()
    run.journal("stop", "approved: stop the service", host="ct129", argv=["systemctl", "stop", "sglang"])
    again = store.open(run.run_id)
    assert again.state["steps"]["stop"]["status"] == "done"
    entry = again.read_journal()[0]
    assert entry["argv"] == ["systemctl", "stop", "sglang"] and entry["host"] == "ct129" and entry["user"]
    (summary,) = store.summaries()
    assert summary.downtime_s == pytest.approx(30.5) and summary.headline == {"reference": 3.2}
    assert store.latest_unfinished().run_id == run.run_id  # status "running"


def test_a_torn_journal_line_is_left_out_and_a_foreign_state_refused(tmp_path) -> None:
    store = RunStore(tmp_path)
    run = store.create(None, None)
    run.journal(None, "first")
    with open(run.dir / "journal.jsonl", "a") as f:
        f.write('{"t": 1, "message": "tor')  # a crash mid-write
    assert [e["message"] for e in run.read_journal()] == ["first"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "state.json").write_text(json.dumps({"format": "something/else"}))
    with pytest.raises(RunStoreError, match="not a dflash-ops run state"):
        store.open("other")
    with pytest.raises(RunStoreError, match="no run 'missing'"):
        store.open("missing")


def test_terminal_decider_y_n_c() -> None:
    answers = iter(["maybe\n", "n\n", "y\n", "c\n", ""])
    out = io.StringIO()
    decider = TerminalDecider(read_line=lambda: next(answers), out=out)
    question = Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang"),
                            "SGLang on ct129 goes down", True, 94.0)

    async def ask() -> list[bool]:
        return [await decider.decide(question) for _ in range(4)]

    assert asyncio.run(ask()) == [False, True, True, True]  # "maybe" re-asked, then n; y; c; then no question
    text = out.getvalue()
    assert "systemctl stop sglang" in text and "[DESTRUCTIVE]" in text and "estimate: 94 s" in text
    assert text.count("Proceed?") == 4  # after `c` nothing more is asked


def test_end_of_input_refuses() -> None:
    decider = TerminalDecider(read_line=lambda: "", out=io.StringIO())
    c = Confirmation("stop", "stop the service", "h", ("true",), "x", True)
    assert asyncio.run(decider.decide(c)) is False


def test_stage_left_out_without_ram_and_estimates_from_earlier_runs() -> None:
    gib = 1 << 30
    stage, why = stage_decision(Preflight(model_bytes=54 * gib, ram_available=40 * gib))
    assert not stage and "40.0 GiB RAM available" in why and "56.0 GiB" in why
    stage, _ = stage_decision(Preflight(model_bytes=3 * gib, ram_available=100 * gib))
    assert stage
    earlier = [{"steps": {"stop": {"status": "done", "started_at": 0, "ended_at": d}},
                "service": {"stopped_at": 0, "ready_at": 10 * d}} for d in (1.0, 2.0, 9.0)]
    assert estimates(earlier) == {"stop": 2.0, "downtime": 20.0}
