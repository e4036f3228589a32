"""A release or resume whose answer was lost, settled from evidence and never resent on a guess
(issue 40, item 2), and a release that answers before its memory left (section 1), over the
engine's fakes: at most one resume per release, no continue over released memory, the server
serving in the end or named as left paused."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from console.messages import RunFinished
from console.procedure.engine import EXIT_DOWN
from console.procedure.steps import pause_settle
from console.procedure.steps.pause_settle import MEASURED_H200, SETTLE_MARGIN
from tests.engine_fakes import INFERENCE, FakeWorld, Fault, ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Window,
)
from tests.pause_fixtures import assert_pause_promises, journal_text


@dataclasses.dataclass
class Operator(ScriptedDecider):
    """Approves every step's question; asked to settle a lost release or resume (the evidence did not),
    answers from the server's truth (an operator who looked at nvidia-smi), or refuses both questions
    (`refuse_settle`: the server left paused). The agent's telemetry comes back as it answers."""

    world: FakeWorld | None = None
    refuse_settle: bool = False
    settled: list[Any] = dataclasses.field(default_factory=list)  # the settle questions asked

    async def decide(self, confirmation: Any) -> bool:
        if not confirmation.action.startswith("settle the lost"):
            return await super().decide(confirmation)
        self.asked.append(confirmation)
        self.settled.append(confirmation)
        if self.refuse_settle:
            return False
        stream = self.world.streams[INFERENCE]
        stream.frozen = stream.no_readings = False
        out = bool(self.world.server.released)
        return {"WERE released": out, "were NOT released": not out, "ARE back": not out,
                "are NOT back": out}[next(k for k in ("WERE released", "were NOT released", "ARE back",
                                                      "are NOT back") if k in confirmation.action)]


def lose_answer(w: Window, route: str, how: str, telemetry: str, info: str | None,
                crasher: Crasher | None = None) -> None:
    """The first `route` request's answer is lost: its link drops or the console dies ("link-…",
    "crash-…") before the server ran it or after ("…-before", "…-after"). From that moment the
    telemetry is "fresh" (the agent samples on), "stale" (it sends nothing more) or "absent" (no GPU
    readings), and /server_info's memory_usage is "start-up" (agrees), "other" (disagrees) or None."""
    from tests.engine_fakes import raise_fault

    server = w.world.server
    method = {"release_memory_occupation": "release", "resume_memory_occupation": "resume"}[route]
    real = getattr(server, method)
    lost: list[str] = []

    def lossy(tags: list[str]) -> None:
        if lost:
            return real(tags)
        lost.append(how)
        if how.endswith("after"):
            real(tags)
        stream = w.world.streams[INFERENCE]
        stream.frozen, stream.no_readings = telemetry == "stale", telemetry == "absent"
        server.memory_usage = info
        if how.startswith("crash"):
            crasher(crasher.point)
        raise_fault(Fault(route, "link"), f"POST /{route}", w.world.service_host)

    setattr(server, method, lossy)


def assert_settled(w: Window, finished: RunFinished, route: str) -> None:
    assert_pause_promises(w, finished)
    server = w.world.server
    releases = server.count("release_memory_occupation")
    assert server.count("resume_memory_occupation") <= releases, server.calls
    assert not any("continue over released" in v for v in server.violations)


# Every loss crossed with every telemetry, and /server_info's answer so that every pair of the three
# is met (a Latin square: 12 cases a route, not 36; the full product passes too, at 3x the CI time).
SETTLE_INFO: tuple[str | None, ...] = ("start-up", "other", None)
SETTLE_CASES = [(route, how, telemetry, SETTLE_INFO[(i + j) % 3])
                for route in ("release_memory_occupation", "resume_memory_occupation")
                for i, how in enumerate(("link-before", "link-after", "crash-before", "crash-after"))
                for j, telemetry in enumerate(("fresh", "stale", "absent"))]


@pytest.mark.parametrize(("route", "how", "telemetry", "info"), SETTLE_CASES,
                         ids=["-".join([r.split("_")[0], h, t, str(i)]) for r, h, t, i in SETTLE_CASES])
async def test_a_lost_release_or_resume_is_settled_from_fresh_evidence_or_asked(
        paused: Window, route: str, how: str, telemetry: str, info: str | None) -> None:
    """Lost before or after the server ran it, by a dropped link or a console killed in the request,
    with telemetry fresh, stale or absent and /server_info agreeing, disagreeing or silent: settled
    without a question only from a sample taken after the reconnect and the request's worst case
    that /server_info does not contradict; else the operator is asked, shown what is known. Never a
    second resume, never a continue over released memory; the server ends serving."""
    w = paused
    crasher = Crasher("lost") if how.startswith("crash") else None
    lose_answer(w, route, how, telemetry, info, crasher)
    operator = Operator(w.world.clock, world=w.world)
    if crasher is not None:
        assert await w.console(crasher) is None, "the console never reached the request"
    finished = await w.console(decider=operator)
    while finished is not None and finished.exit_code == EXIT_DOWN:  # a run --resume gives the server back
        finished = await w.console(decider=operator)
    assert finished is not None
    assert_settled(w, finished, route)
    assert w.world.server.serving(), finished.message
    decisive = telemetry == "fresh" and not (info == "other" and how.endswith("after"))
    assert bool(operator.settled) != decisive, ([c.action for c in operator.settled], journal_text(w))
    if operator.settled:  # shown what is known: the GPUs before, now or why not, /server_info's figures
        impact = operator.settled[-1].impact
        assert "GPU memory used before the release GPU0" in impact, impact
        assert ("/server_info says" in impact) == (info is not None), impact
        assert ("no GPU sample taken" in impact) == (telemetry != "fresh"), impact
    landed = how.endswith("after")
    verb = "release" if route.startswith("release") else "resume"
    assert f"the {verb} of " in journal_text(w) and ("had landed" if landed else "had not landed") in journal_text(w)


@pytest.mark.parametrize("route", ["release_memory_occupation", "resume_memory_occupation"])
@pytest.mark.parametrize("point", ["settle-evidence", "settled"])
@pytest.mark.parametrize("telemetry", ["fresh", "stale"])
async def test_a_console_killed_while_it_settles_leaves_it_to_the_next(
        paused: Window, route: str, point: str, telemetry: str) -> None:
    """A console dies after it took the evidence, or after it settled: the next settles again (or
    finds it settled) from evidence of its own, and the promises hold."""
    w = paused
    lose_answer(w, route, "link-after", telemetry, "start-up")
    operator = Operator(w.world.clock, world=w.world)
    assert await w.console(Crasher(point), decider=operator) is None, f"never reached {point}"
    finished = await w.console(decider=operator)
    assert_settled(w, finished, route)
    assert finished.exit_code == 0 and w.world.server.serving(), finished.message


@pytest.mark.parametrize("route", ["release_memory_occupation", "resume_memory_occupation"])
async def test_an_unsettled_loss_refused_leaves_the_server_paused_and_named(paused: Window, route: str) -> None:
    """The operator refuses both answers: nothing is resumed or continued; the run exits 3 naming the
    server as still paused; `run --resume` asks again, and an answer gives the server back once."""
    w = paused
    lose_answer(w, route, "link-after", "stale", "start-up")
    refusing = Operator(w.world.clock, world=w.world, refuse_settle=True)
    first = await w.console(decider=refusing)
    assert first is not None and first.exit_code == EXIT_DOWN, first
    assert "THE SERVER IS STILL PAUSED" in first.message and len(refusing.settled) == 2, "never asked twice"
    assert_settled(w, first, route)
    server = w.world.server
    assert server.count("continue_generation") == 0 and server.paused
    assert server.count("resume_memory_occupation") == (1 if route.startswith("resume") else 0)
    w.world.streams[INFERENCE].frozen = True  # still no fresh evidence: asked again
    again = await w.console(decider=Operator(w.world.clock, world=w.world))
    assert again is not None and again.service_up, again
    assert_settled(w, again, route)
    assert server.count("resume_memory_occupation") == 1 and server.count("continue_generation") == 1


async def test_yes_never_settles_a_lost_answer_on_a_guess(paused: Window) -> None:
    """`--yes` answers every question yes: a settle question it would answer blindly is never put to it;
    the server stays paused for an operator, the run names it."""
    from console.procedure.decider import ApproveAll

    w = paused
    lose_answer(w, "release_memory_occupation", "link-after", "absent", "start-up")
    finished = await w.console(decider=ApproveAll())
    assert finished is not None and finished.exit_code == EXIT_DOWN, finished
    assert "THE SERVER IS STILL PAUSED" in finished.message and "--yes never settles" in finished.message, finished
    assert_settled(w, finished, "release_memory_occupation")
    assert w.world.server.count("resume_memory_occupation") == 0 == w.world.server.count("continue_generation")



def evidence_waits(w: Window, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """How long each gathering of the settle's evidence waited, on the world's clock (filled as the
    run goes)."""
    waits: list[float] = []
    real = pause_settle.settle_evidence

    async def timed(window: Any, kind: str, tags: list[str]) -> Any:
        started = w.world.clock.monotonic()
        got = await real(window, kind, tags)
        waits.append(w.world.clock.monotonic() - started)
        return got

    monkeypatch.setattr(pause_settle, "settle_evidence", timed)
    return waits


async def test_a_sample_from_before_the_worst_case_is_never_the_evidence(
        weights_released: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """A weights release whose answer was lost: the settle waits on the telemetry stream for a sample
    taken after the release's worst case (3 x issue 26's 20 s on an H200), never reads the one the
    release itself left (its memory half gone on a real H200 then)."""
    w = weights_released
    taken = evidence_waits(w, monkeypatch)
    lose_answer(w, "release_memory_occupation", "link-after", "fresh", "start-up")
    finished = await w.console(decider=Operator(w.world.clock, world=w.world, refuse={"drafter"}))
    assert finished is not None
    assert_settled(w, finished, "release_memory_occupation")
    assert taken and taken[0] >= SETTLE_MARGIN * MEASURED_H200["release"]["weights"], taken


@pytest.mark.parametrize("samples", [1, 3])
async def test_a_release_answered_before_its_memory_left_is_waited_for(paused: Window, samples: int) -> None:
    """Issue 40, section 1 (slime PR #579; the rehearsal server's `--release-frees-after`): the release
    answers while its memory is still on the GPUs. free-vram waits until it is seen gone, so what the
    release freed is measured (the resume is verified against it), and the window ends done."""
    world, server = paused.world, paused.world.server
    server.frees_after_samples = samples
    used_before = world.streams[INFERENCE].sample().gpus[0].mem_used_mib
    finished = await paused.console()
    assert finished.exit_code == 0, finished.message
    state = paused.state()
    assert not [s for s, rec in state.steps.items() if rec.status == "failed"]
    assert state.service.used_after_release_mib["0"] == used_before - 14000  # the release's, not the answer's
    assert world.streams[INFERENCE].sample().gpus[0].mem_used_mib == used_before, "the memory came back"
    assert_pause_promises(paused, finished)


async def test_a_console_back_after_the_worst_case_waits_no_more_for_its_evidence(
        weights_released: Window, monkeypatch: pytest.MonkeyPatch) -> None:
    """The worst case of a lost release counts from when it was sent (recorded before the request),
    not from the console's return: a console killed in a weights release and started again two
    minutes later (past 3 x 20 s) takes the next sample; one back at once waits the worst case."""
    w = weights_released
    waited = evidence_waits(w, monkeypatch)
    crasher = Crasher("lost")
    lose_answer(w, "release_memory_occupation", "crash-after", "fresh", "start-up", crasher)
    assert await w.console(crasher) is None
    assert w.state().service.memory_request_sent_at is not None
    w.world.clock.advance(120.0)  # the operator starts a console two minutes later
    finished = await w.console(decider=Operator(w.world.clock, world=w.world, refuse={"drafter"}))
    assert finished is not None
    assert_settled(w, finished, "release_memory_occupation")
    worst = SETTLE_MARGIN * MEASURED_H200["release"]["weights"]
    assert waited and waited[0] < worst / 2, (waited, worst)  # the next sample, not another minute
