"""The pause-route sweeps' fixtures and promises (tests/test_pause_sweep.py, test_pause_weights.py,
test_pause_settle.py): a window on the pause route, one whose extraction must release the weights
too, and what every pause-route run must keep."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from console.messages import Confirmation, RunFinished
from console.procedure.engine import EXIT_DOWN
from tests.engine_fakes import ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Window,
    assert_promises,
)

REMEDIES = ("restart the server to reload its drafter", "restart the server to reload its weights")


@dataclass
class RefusesRemedies(ScriptedDecider):
    """Approves everything but the steps in `refuse` and the restarts offered as remedies (their
    question is asked within a step whose other questions it approves: the weights' within continue)."""

    async def decide(self, confirmation: Confirmation) -> bool:
        approved = await super().decide(confirmation)
        return approved and confirmation.action not in REMEDIES


def operator_restarts(w: Window) -> list[dict]:
    """The journal's yes to a restart offered as a remedy, by an operator (never `--yes`)."""
    return [e for e in w.store.open(w.run_id).read_journal()
            if e.get("kind") == "question" and str(e.get("decision", "")).startswith("yes")
            and "(--yes)" not in str(e.get("decision")) and e.get("message", "").removeprefix("approved: ") in REMEDIES]


@pytest.fixture
def paused(window: Window) -> Window:
    window.route = "pause"
    return window


def assert_pause_promises(w: Window, finished: RunFinished) -> None:
    """The promises, and the pause route's own: the server is never stopped; it ends serving, or the
    run exits 3 and the store names it as the one that left it paused; each pause has exactly one
    continue, each release exactly one resume of the same tags; no request held is lost; SGLang's
    scheduler never met a call that kills it."""
    assert_promises(w, finished)
    server, state = w.world.server, w.state()
    # Never stopped, unless an operator said yes to a restart offered as a remedy (the drafter's, the
    # weights'), never `--yes` on its own; one stop per yes.
    restarts = operator_restarts(w)
    assert w.world.service.stop_commands <= len(restarts), (w.world.service.commands, restarts)
    if not restarts:
        assert w.world.service.start_commands == 0, w.world.service.commands
    assert not server.violations, server.violations
    releases = [sorted(b["tags"]) for _, r, b in server.calls if r == "release_memory_occupation"]
    resumes = [sorted(b["tags"]) for _, r, b in server.calls if r == "resume_memory_occupation"]
    if server.serving():
        assert not state.service.held, "the server serves but the run says it holds it"
        # A continue resent after its answer was lost, finding the server serving (a no-op on SGLang), is
        # said; every other continue lets the held requests of one pause run.
        assert server.count("continue_generation") - server.noop_continues == server.count("pause_generation")
        assert server.noop_continues == 0 or "got no answer and /ready does not say it landed" in journal_text(w)
        assert resumes == releases, (releases, resumes)
        assert server.held == 0, "requests held by the pause were not let through"
    else:
        assert finished.exit_code == EXIT_DOWN, finished
        left = w.store.left_down()
        assert left is not None and left.run_id == w.run_id and left.state.service.left_as() == "paused"
        assert "THE SERVER IS STILL PAUSED" in finished.message
    assert server.count("pause_generation") <= 1 and len(releases) <= 1
    steps = {name: rec.status for name, rec in state.steps.items()}
    if steps.get("release") == "done":
        assert releases
    if steps.get("continue") == "done":
        assert server.serving() and state.service.continued_at is not None


@pytest.fixture
def weights_released(paused: Window, monkeypatch: pytest.MonkeyPatch) -> Window:
    """A speculating server whose extraction needs its weights released too (they have a CPU backup)."""
    from console.procedure.steps import pause_plan

    paused.world.server.acceptance = 4.0
    monkeypatch.setattr(pause_plan, "release_plan", lambda saver, free, gpus, need: (
        ["kv_cache", "cuda_graph", "weights"], "the extraction does not fit beside the weights"))
    return paused


def journal_text(w: Window) -> str:
    return " ".join(e.get("message", "") for e in w.store.open(w.run_id).read_journal())
