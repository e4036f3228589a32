"""The pause route after a weights release (issue 40, items 4 and 5), over the engine's fakes: the
served drafter checked before and after the window (a drafter lost to the release ends the run
degraded, its restart offered), and the target's weights checked by /weights_checker's checksum,
else by the greedy probe asked once more alone before it fails anything."""

from __future__ import annotations

import pytest

import console.procedure.engine as engine_module
from console.procedure.engine import DRAFTER_CRASH_POINTS, PAUSE_CRASH_POINTS
from console.procedure.steps.pause_weights import WEIGHTS_CRASH_POINTS
from tests.engine_fakes import ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Window,
)
from tests.pause_fixtures import RefusesRemedies, assert_pause_promises, journal_text


async def test_a_drafter_lost_to_the_weights_release_ends_the_run_degraded(weights_released: Window) -> None:
    """SGLang 0.5.23 (PR #31674): the target comes back from the weights release, the drafter does not.
    The outputs are the same, so only the acceptance length tells: measured before the window and after
    the continue, its fall ends the run degraded with both figures; the release's question warned of
    it; the restart that reloads the drafter is offered (refused here: the server serves on)."""
    w = weights_released
    decider = ScriptedDecider(w.world.clock, refuse={"drafter"})
    finished = await w.console(decider=decider)
    assert finished.status == "degraded" and finished.exit_code == engine_module.EXIT_DEGRADED, finished
    assert "acceptance length 4.00 before the window, 1.00 after" in finished.message, finished.message
    assert "restart" in finished.message  # the remedy named, its refusal said
    asked = {c.step: c for c in decider.asked}
    assert "DRAFTER MAY COME BACK WRONG" in asked["release"].impact and "4.00" in asked["release"].impact
    assert "from 4.00 to 1.00" in asked["drafter"].impact
    state = w.state()
    assert state.status == "degraded" and state.steps["drafter"].status == "done"
    assert [state.steps[s].status for s in ("evaluate", "report")] == ["done", "done"]  # the work is kept
    assert "1.00 after" in (w.store.root / w.run_id / "report.md").read_text()
    (summary,) = w.store.summaries()
    assert summary.status == "degraded" and summary.drafter_fell == (4.0, 1.0)
    assert_pause_promises(w, finished)  # the server never stopped: the remedy was refused


async def test_a_yes_to_the_remedy_restarts_the_server_and_its_drafter_comes_back(weights_released: Window) -> None:
    w = weights_released
    finished = await w.console()
    assert finished.exit_code == engine_module.EXIT_DEGRADED, finished
    assert "restarted: acceptance length 4.00 now" in finished.message, finished.message
    service = w.world.service
    assert service.stop_commands == 1 and service.start_commands == 1 and w.world.server.serving()
    state = w.state()
    svc, (restart,) = state.service, [w["service"] for w in state.windows if w.get("drafter_restart")]
    assert svc.paused_at < svc.continued_at < restart["stopped_at"] < restart["ready_at"]  # the window's own record kept
    (summary,) = w.store.summaries()  # the pause, then the restart: both down periods counted
    assert summary.downtime_s == (svc.continued_at - svc.paused_at) + (restart["ready_at"] - restart["stopped_at"])
    assert summary.windows == 2 and not summary.service_down


async def test_a_drafter_that_survives_the_weights_release_ends_done(weights_released: Window) -> None:
    w = weights_released
    w.world.server.drafter_survives = True  # a fixed SGLang
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    state = w.state()
    assert state.service.released_tags == ["kv_cache", "cuda_graph", "weights"]
    assert "intact: acceptance length 4.00 before the window, 4.00 after" in state.steps["drafter"].detail
    assert_pause_promises(w, finished)


async def test_the_stop_route_checks_the_drafter_too(window: Window) -> None:
    """A restarted server loads its drafter again: the stop route's check finds it intact."""
    window.world.server.acceptance = 4.0
    finished = await window.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    detail = window.state().steps["drafter"].detail
    assert "intact: acceptance length 4.00 before the window, 4.00 after" in detail, detail


async def test_a_drafter_that_accepts_about_one_already_is_said_to_tell_nothing(weights_released: Window) -> None:
    """A served drafter near 1 before the window (the GPU drill's random target, which no drafter
    predicts, measured 1.04) has nothing to fall: the lost one's 1.00 is within the margin. The check
    says it cannot tell, as a warning, rather than "intact", and the release's question said so before;
    nothing is known to be degraded."""
    w = weights_released
    w.world.server.acceptance = 1.05  # and the weights release loses it (PR #31674): 1.00 after
    decider = ScriptedDecider(w.world.clock)
    finished = await w.console(decider=decider)
    assert finished.status == "done" and finished.exit_code == 0, finished
    release = next(c for c in decider.asked if c.step == "release").impact
    assert "DRAFTER MAY COME BACK WRONG" in release and "CANNOT TELL: 1.05 now" in release, release
    detail = w.state().steps["drafter"].detail
    assert "cannot tell: acceptance length 1.05 before the window, 1.00 after" in detail, detail
    assert "a lost drafter accepts about 1, within 25% of 1.05" in detail and "intact" not in detail
    assert "cannot tell" in journal_text(w)


@pytest.mark.parametrize("point", DRAFTER_CRASH_POINTS)
async def test_a_console_killed_in_the_drafters_restart_leaves_it_to_the_next(weights_released: Window,
                                                                              point: str) -> None:
    """The remedy's stop ran, then the console died: the next one starts the server (once), finds the
    drafter checked, and ends degraded with the window's record intact and the restart's kept apart."""
    w = weights_released
    assert await w.console(Crasher(point)) is None, f"the run never reached {point}"
    assert w.store.left_down() is not None  # the server down meanwhile: named
    finished = await w.console()
    assert finished.exit_code == engine_module.EXIT_DEGRADED and finished.service_up, finished
    assert "the next finished it" in finished.message, finished.message
    service = w.world.service
    assert service.stop_commands == 1 and service.start_commands == 1 and w.world.server.serving()
    state = w.state()
    assert state.service.continued_at is not None and state.windows[-1].get("drafter_restart")


async def test_a_weights_release_is_verified_by_the_checksum_and_no_probe_is_sent(weights_released: Window) -> None:
    """SGLang 0.5.23's /weights_checker: the target's checksum before the release, the same after the
    resume: the window is verified by it, and the greedy probe, not batch-invariant under load, is
    never sent (a near-tie it would have met fails nothing)."""
    w = weights_released
    w.world.server.drafter_survives = True
    w.world.server.near_ties = 2
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    svc = w.state().service
    assert svc.weights_check == "checksum" and svc.weights_checksum_before == svc.weights_checksum_after == "sha-intact"
    assert svc.probe_tokens is None
    bodies = [b for _, r, b in w.world.server.calls if r == "weights_checker"]
    assert bodies == [{"action": "checksum", "selector": "target"}] * 2  # before the release, after the resume
    assert "checksum after the resume is the one before the release (sha-intact)" in journal_text(w)
    assert_pause_promises(w, finished)


def weights_wrong(w: Window) -> Window:
    w.world.server.drafter_survives = True
    w.world.server.weights_come_back_wrong = True
    return w


async def test_weights_that_come_back_wrong_offer_the_restart_and_a_no_fails_the_window_naming_both(
        weights_released: Window) -> None:
    """The greedy tokens are the same (every logit moved alike): only the checksum tells. The remedy, a
    restart of the server, is offered as a destructive (Cancel-focused) question; a no fails the window
    naming both checksums, the server left serving as it is and the remedy said."""
    w = weights_wrong(weights_released)
    decider = RefusesRemedies(w.world.clock)
    finished = await w.console(decider=decider)
    assert finished.status == "failed" and finished.exit_code != 0, finished
    assert "sha-changed after the resume, sha-intact before the release" in finished.message, finished.message
    assert "the restart was refused" in finished.message and "serves on as it is" in finished.message
    assert "a restart loads its weights again" in finished.message, finished.message
    (asked,) = [c for c in decider.asked if c.action == "restart the server to reload its weights"]
    assert asked.destructive and asked.step == "continue" and asked.argv == ("systemctl", "stop", "sglang.service")
    assert "sha-changed after the resume, sha-intact before the release" in asked.impact, asked.impact
    state = w.state()
    assert state.steps["continue"].status == "failed" and state.status == "failed"
    assert state.service.weights_checksum_after == "sha-changed" and state.facts["weights_restart"]["remedy"] == "refused"
    assert w.world.server.serving() and w.world.service.stop_commands == 0  # given back, never stopped
    assert_pause_promises(w, finished)


async def test_yes_never_restarts_the_server_for_its_weights(weights_released: Window) -> None:
    """`--yes` approves the window's questions, never a restart of production offered as a remedy: the
    window fails naming both checksums and the remedy, the server serving on as it is."""
    w = weights_wrong(weights_released)
    decider = ScriptedDecider(w.world.clock, name="--yes")
    finished = await w.console(decider=decider)
    assert finished.status == "failed", finished
    assert "sha-changed after the resume, sha-intact before the release" in finished.message, finished.message
    assert "--yes never restarts the server on its own" in finished.message, finished.message
    assert "a restart loads its weights again" in finished.message, finished.message
    assert not [c for c in decider.asked if "reload" in c.action]
    assert w.world.service.stop_commands == 0 and w.world.server.serving()
    assert_pause_promises(w, finished)


async def test_a_yes_to_the_weights_restart_reloads_them_and_checks_the_checksum_again(
        weights_released: Window) -> None:
    w = weights_wrong(weights_released)
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    service = w.world.service
    assert service.stop_commands == 1 and service.start_commands == 1 and w.world.server.serving()
    state = w.state()
    record = state.facts["weights_restart"]
    assert record["after"] == "sha-changed" and record["restarted"] == "sha-intact", record
    assert "checksum is sha-intact again" in record["remedy"] and state.service.weights_verified
    svc, (restart,) = state.service, [x["service"] for x in state.windows if x.get("weights_restart")]
    assert svc.paused_at < svc.continued_at < restart["stopped_at"] < restart["ready_at"]
    assert "restarted with the operator's yes to reload its weights" in journal_text(w)
    assert state.steps["evaluate"].status == "done"
    assert_pause_promises(w, finished)


@pytest.mark.parametrize("point", [*WEIGHTS_CRASH_POINTS, "start-issued"])
async def test_a_console_killed_in_the_weights_restart_leaves_it_to_the_next(weights_released: Window,
                                                                             point: str) -> None:
    """The remedy's stop ran (or its start was sent), then the console died: the server is named as
    down by the run, and the next console starts it once, checks the checksum again and goes on."""
    w = weights_wrong(weights_released)
    assert await w.console(Crasher(point)) is None, f"the run never reached {point}"
    finished = await w.console()
    assert finished.status == "done" and finished.service_up, finished
    service = w.world.service
    assert service.stop_commands == 1 and service.start_commands == 1 and w.world.server.serving()
    assert w.state().facts["weights_restart"]["restarted"] == "sha-intact"
    assert_pause_promises(w, finished)


@pytest.mark.parametrize("checker", [None, "0.5.6"])
async def test_a_server_without_the_checksum_falls_back_to_the_probe_asked_again_alone(
        weights_released: Window, checker: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No /weights_checker (404), or 0.5.6's without a checksum: the greedy probe, journalled as such; a
    near-tie after the continue is asked once more, alone, and passes."""
    from console.procedure.steps import pause_weights

    monkeypatch.setattr(pause_weights, "PROBE_SETTLE_S", 0.0)
    w = weights_released
    w.world.server.drafter_survives = True
    w.world.server.checker = checker
    w.world.server.near_ties = 1
    server, probes = w.world.server, []
    generate = server.generate

    def recorded(input_ids: list[int], max_new_tokens: int) -> dict:
        probes.append(len(server.calls))  # how many control requests were sent before it
        return generate(input_ids, max_new_tokens)
    server.generate = recorded  # type: ignore[method-assign]
    finished = await w.console()
    assert finished.status == "done" and finished.exit_code == 0, finished
    svc = w.state().service
    assert svc.weights_check == "probe" and svc.probe_tokens is not None and svc.weights_checksum_before is None
    journal = journal_text(w)
    assert "the weights are checked after the resume by the greedy probe instead" in journal
    assert ("HTTP 404" if checker is None else "Unsupported action='checksum'") in journal
    assert "asked once more, alone" in journal and "asked again alone, the same 8 tokens" in journal
    continued = [r for _, r, _ in server.calls].index("continue_generation")
    after = [p for p in probes if p > continued]
    assert len(after) >= 2 and after[0] == after[1], probes  # the probe, then again: nothing sent between them
    assert_pause_promises(w, finished)


async def test_a_probe_that_differs_twice_fails_the_window(paused: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """A KV-only release needs no weights check: the probe as before, asked once more; twice other
    tokens fail the window with both answers."""
    from console.procedure.steps import pause_weights

    monkeypatch.setattr(pause_weights, "PROBE_SETTLE_S", 0.0)
    paused.world.server.near_ties = 2
    finished = await paused.console()
    assert finished.status == "failed", finished
    assert "other greedy tokens than before the pause, twice" in finished.message, finished.message
    svc = paused.state().service
    assert svc.released_tags == ["kv_cache", "cuda_graph"] and svc.weights_check == "probe"
    assert paused.world.server.count("weights_checker") == 0
    assert_pause_promises(paused, finished)


@pytest.mark.parametrize("point", PAUSE_CRASH_POINTS[:PAUSE_CRASH_POINTS.index("continued") + 1])
async def test_the_checksum_taken_before_a_crash_is_the_one_checked_after(weights_released: Window, point: str) -> None:
    """The checksum before the release is kept in the run's state: a console killed at any point of the
    pause route, then resumed, compares the checksum after the resume with that one (never one taken
    again over the resumed weights), once the continue has landed, even where the first console died
    between the continue and its check."""
    w = weights_wrong(weights_released)
    assert await w.console(Crasher(point), decider=RefusesRemedies(w.world.clock)) is None, \
        f"the run never reached {point}"
    finished = await w.console(decider=RefusesRemedies(w.world.clock))
    svc = w.state().service
    # The run ends here, failed, at every point: a resume that found the extraction's files complete
    # never ends paused "for the extractor writing its files" (it did, at gpu-released, and every later
    # resume ended paused again, exit 4: a run that never finished).
    assert finished.status == "failed" and finished.exit_code == engine_module.EXIT_FAILED, finished.message
    assert "sha-changed after the resume, sha-intact before the release" in finished.message, finished.message
    assert svc.weights_check == "checksum" and not svc.weights_verified
    assert w.state().steps["continue"].status == "failed" and w.state().status_of("evaluate") != "done"
    routes = [r for _, r, _ in w.world.server.calls]
    released = routes.index("release_memory_occupation")
    assert routes[:released].count("weights_checker") == 1, routes  # taken once: never again after the crash
    assert routes[released:].count("weights_checker") >= 1
    assert_pause_promises(w, finished)


async def test_a_yes_to_the_weights_restart_then_a_no_to_its_start_leaves_the_server_named_down(
        weights_released: Window) -> None:
    """Stopped with the operator's yes, then the start refused: the run exits 3 and the store names it
    as the one that left the server down, the remedy's record saying so; the next console (`run
    --resume` of a run that finished with the server down) only starts it, once."""
    w = weights_wrong(weights_released)
    refused = await w.console(decider=ScriptedDecider(w.world.clock, refuse={"restart"}))
    assert refused.exit_code == engine_module.EXIT_DOWN and not refused.service_up, refused
    left = w.store.left_down()
    assert left is not None and left.run_id == w.run_id and left.state.service.left_as() == "down"
    assert w.world.service.stop_commands == 1 and w.world.service.start_commands == 0
    finished = await w.console()
    assert finished.service_up and w.store.left_down() is None, finished
    assert w.world.service.start_commands == 1 and w.world.server.serving()
    state = w.state()
    remedy = state.facts["weights_restart"]
    assert "the start was refused" in remedy["remedy"] and "started later by run --resume" in remedy["remedy"]
    # The restart's down period ended there, as a yes-then-start's does: the window's own record is the
    # service's again (never left parked in the remedy's facts) and `runs` counts both periods.
    assert "window_service" not in remedy
    svc, (restart,) = state.service, [x["service"] for x in state.windows if x.get("weights_restart")]
    assert svc.paused_at < svc.continued_at < restart["stopped_at"] < restart["ready_at"]
    (summary,) = w.store.summaries()
    assert summary.windows == 2 and not summary.service_down
    assert summary.downtime_s == pytest.approx((svc.continued_at - svc.paused_at)
                                               + (restart["ready_at"] - restart["stopped_at"]))
    assert_pause_promises(w, finished)
