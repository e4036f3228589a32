"""Issue 40, section 3: every edge of section 1 at every step of the pause route, crossed with a console
crash at each point, over the engine's fakes (`tests/fake_sglang.py` answers as SGLang 0.5.23 does).

The edges, as the fake server switches them on (docs/sglang.md, "The edges around a pause"):

- `busy`: requests run when the pause comes, so a release before the pause (or after an in_place
  one) would fail SGLang's idle assertion and kill the server;
- `late-free`: a release that answers before its memory has left the GPUs (slime PR #579,
  `--release-frees-after`);
- `health`: another client's `/health` meets the pause (a load balancer's): SGLang marks the server
  unhealthy, so `/ready` stays 503 after the continue until a `/health` passes, and a `/health` the
  console sent while paused would do the same (recorded as a violation);
- `drafter-lost`: a weights release on a speculating server brings the drafter back wrong (PR #31674);
- `old-sglang`: 0.5.5, whose pause aborts every request: `--route auto` takes the stop route.

A resume of a tag that is not released, and a continue over released memory, kill the fake's server
or are recorded in every case (its `violations`); a server restarted outside the run at each point,
crossed with a crash at each, is tests/test_pause_sweep.py's; the lost answers of the release and
the resume, tests/test_pause_settle.py's. `/flush_cache` while the KV cache is released: the console
has no such request at all (the drill's run asserts the server's log has none).

The crash points: every pause crash point of the engine, the console killed inside each control
request once the server ran it (its answer never seen: `<route>-landed`), and the remedy's own points
where the edge offers one. Every case ends with what must always hold: the server ends serving, the
same process, or restarted only with the operator's yes; no resume of a tag that is not released; no
continue over released memory; no degraded drafter left unreported; one pause and one continue per
window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from console.messages import RunFinished
from console.procedure.engine import (
    CRASH_POINTS,
    DRAFTER_CRASH_POINTS,
    EXIT_DEGRADED,
    PAUSE_CRASH_POINTS,
)
from console.procedure.steps.pause_weights import WEIGHTS_CRASH_POINTS
from tests.engine_fakes import TRAINING, ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Window,
    assert_promises,
)
from tests.pause_fixtures import assert_pause_promises, journal_text, operator_restarts

# The console killed inside a control request, after the server ran it: its answer is never seen.
LANDED = {"pause-landed": "pause", "release-landed": "release", "resume-landed": "resume",
          "continue-landed": "continue_"}
PAUSE_POINTS = (*PAUSE_CRASH_POINTS, *LANDED)
AFTER_RELEASE = ("released", "gpu-released", "resumed", "continued", "resume-landed", "continue-landed")


@dataclass(frozen=True)
class Edge:
    name: str
    setup: Callable[[Window], None]
    route: str = "pause"
    status: tuple[str, ...] = ("done",)  # how the run may end
    points: tuple[str, ...] = PAUSE_POINTS
    extra: tuple[str, ...] = field(default=())
    decider: str = "scripted"  # who answers: an operator ("scripted", yes to everything) or "--yes"


def busy(w: Window) -> None:
    w.world.server.running = 3


def late_free(w: Window) -> None:
    w.world.server.frees_after_samples = 2


def health(w: Window) -> None:
    w.world.server.health_prober = True


def drafter_lost(w: Window) -> None:
    from console.procedure.steps import pause_plan

    w.world.server.acceptance = 4.0
    w.world.server.running = 2
    w.monkeypatch.setattr(pause_plan, "release_plan", lambda saver, free, gpus, need: (
        ["kv_cache", "cuda_graph", "weights"], "the extraction does not fit beside the weights"))


def weights_wrong(w: Window) -> None:
    """Not an edge of section 1 but its remedy's: the target's weights come back other than they went,
    the restart that reloads them offered (an operator's yes; never `--yes`'s)."""
    drafter_lost(w)
    w.world.server.drafter_survives = True
    w.world.server.weights_come_back_wrong = True


def old_sglang(w: Window) -> None:
    w.world.server.version = "0.5.5"
    w.world.gpus[9999] = (TRAINING, {0: 81000, 1: 81000}, "python train.py")  # no room elsewhere


EDGES = (
    Edge("busy", busy),
    Edge("late-free", late_free),
    Edge("health", health),
    Edge("drafter-lost", drafter_lost, status=("degraded",), extra=DRAFTER_CRASH_POINTS),
    Edge("old-sglang", old_sglang, route="auto", points=CRASH_POINTS),
    # The weights' remedy at the points from the release on (the weights reference is taken before it).
    Edge("weights-wrong", weights_wrong, points=AFTER_RELEASE, extra=(*WEIGHTS_CRASH_POINTS, "start-issued")),
    # Failed; or, the console killed once the extractor let the GPUs go, paused (exit 4) for the extractor
    # left writing its files, each resume meeting the weights' failure again before its check of them.
    Edge("weights-wrong-yes", weights_wrong, status=("failed", "paused"), points=AFTER_RELEASE, decider="--yes"),
)
CASES = [(edge, point) for edge in EDGES for point in (None, *edge.points, *edge.extra)]


def crash_inside_requests(w: Window, crasher: Crasher) -> None:
    """`<route>-landed`: the server runs the request, then the console dies before its answer."""
    route = LANDED.get(crasher.point or "")
    if route is None:
        return
    server = w.world.server
    real = getattr(server, route)

    def landed_then_dead(*args: object) -> object:
        result = real(*args)
        setattr(server, route, real)  # once
        crasher(crasher.point)
        return result
    setattr(server, route, landed_then_dead)


def extraction_over_freed_memory(w: Window) -> None:
    """The extractor's weights land on the GPUs only once the released memory has left them: on a real
    GPU a release that answered before its memory was free (slime PR #579) makes that load run out of
    memory. Recorded among the server's violations."""
    world, server = w.world, w.world.server
    point = world.point

    async def checked(job: object, name: str) -> None:
        if name == "forward" and server.freeing:
            server.violations.append(f"the extraction loaded while {server.freeing} had not left the GPUs")
        await point(job, name)
    world.point = checked  # type: ignore[method-assign]


async def to_the_end(w: Window, crasher: Crasher, decider: str) -> RunFinished:
    """The first console (dying at its crash, if it gets there), then new ones (`run --resume`) until
    the run is finished: not paused to let the extractor's files finish, nor ended with the server held."""
    finished = await w.console(crasher, decider=ScriptedDecider(w.world.clock, name=decider))
    for _ in range(3):
        if finished is not None and finished.status != "paused" and not w.state().service.held:
            return finished
        finished = await w.console(decider=ScriptedDecider(w.world.clock, name=decider))
    assert finished is not None and not w.state().service.held, f"no console gave the server back: {finished}"
    return finished


def assert_always(w: Window, edge: Edge, point: str | None, finished: RunFinished) -> None:
    """Section 3's promises, over every edge and crash."""
    server, service, state = w.world.server, w.world.service, w.state()
    # The server ends serving, the same process (never restarted outside: one life), or restarted by
    # the run only with an operator's yes (`assert_pause_promises`: one stop per yes to a remedy).
    assert server.serving() and len(server.lives) == 1, (finished, server.lives)
    assert server.ready() == 200, "/ready is not 200: a router or a probe would not send it requests"
    # No resume of a tag not released, no continue over released memory, no /health while paused, no
    # release while requests run: each would have killed or marked the server (its violations).
    assert not server.violations, server.violations
    if edge.route == "pause":
        assert_pause_promises(w, finished)
        # One pause and one continue per window. The one exception, said in the journal: a continue whose
        # answer was lost while /ready cannot tell a paused server from one a /health marked unhealthy
        # during the pause (`health`) is sent again, finding the server serving (a no-op on SGLang).
        resent = point == "continue-landed" and edge.name == "health"
        assert server.count("pause_generation") == 1, server.calls
        assert server.count("continue_generation") - server.noop_continues == 1, server.calls
        assert server.noop_continues == int(resent), server.calls
        if resent:
            assert "got no answer and /ready does not say it landed" in journal_text(w)
        assert server.held == 0 and server.running == edge_running(edge), "the held requests run again"
    else:  # the old SGLang: the stop route, the server never paused
        assert_promises(w, finished)
        assert state.route == "window" and "0.5.5" in state.facts["route_chosen"]["why"], state.facts
        assert not any(r in ("pause_generation", "release_memory_occupation") for _, r, _ in server.calls)
        assert service.stop_commands == 1 and service.start_commands == 1
    # No degraded drafter left unreported: a drafter lost to the window ends the run degraded, both figures said.
    lost = server.acceptance is not None and not server.drafter_survives and any(
        r == "resume_memory_occupation" and "weights" in b["tags"] for _, r, b in server.calls)
    if lost:
        assert finished.status == "degraded" and finished.exit_code == EXIT_DEGRADED, finished
        assert "acceptance length 4.00 before the window, 1.00 after" in finished.message, finished.message
    assert finished.status in edge.status and finished.service_up, finished
    if edge.name.startswith("weights-wrong"):  # both checksums named; the remedy taken, or said under --yes
        record = state.facts["weights_restart"]
        assert record["after"] == "sha-changed", record
        if edge.decider == "--yes":
            assert "--yes never restarts the server on its own" in finished.message, finished.message
        else:
            assert record["restarted"] == "sha-intact" and state.service.weights_verified, record
    restarts = operator_restarts(w)
    assert len(restarts) == service.stop_commands - (edge.route != "pause"), (restarts, service.commands)


def edge_running(edge: Edge) -> int:
    return {"busy": 3, "drafter-lost": 2, "weights-wrong": 2, "weights-wrong-yes": 2}.get(edge.name, 0)


@pytest.mark.parametrize(("edge", "point"), CASES, ids=[f"{e.name}-{p or 'no-crash'}" for e, p in CASES])
async def test_every_edge_crossed_with_a_crash_at_each_point_keeps_the_promises(
        window: Window, monkeypatch: pytest.MonkeyPatch, edge: Edge, point: str | None) -> None:
    w = window
    w.monkeypatch = monkeypatch  # type: ignore[attr-defined]
    w.route = edge.route
    edge.setup(w)
    crasher = Crasher(point)
    crash_inside_requests(w, crasher)
    extraction_over_freed_memory(w)
    finished = await to_the_end(w, crasher, edge.decider)
    if point is not None:
        assert crasher.fired, f"the run never reached {point}"
    assert_always(w, edge, point, finished)


def test_every_edge_meets_every_point() -> None:
    """The sweep's own shape: each edge of section 1 on the pause route at every pause crash point and
    inside every control request."""
    for edge in EDGES:
        met = {p for e, p in CASES if e is edge}
        assert set(edge.points) <= met and None in met, edge.name
        if edge.route == "pause" and not edge.name.startswith("weights-wrong"):
            assert set(PAUSE_POINTS) <= met, edge.name
