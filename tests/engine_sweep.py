"""What the engine's crash-point sweeps share (`tests/test_engine_sweep.py`, the window route;
`tests/test_pause_sweep.py`, the pause route): a world of fakes and the consoles that drive it one
after the other (`Window`), the crash hook (`Crasher`), the fixtures, and the promises every case
ends with, checked against the world itself."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from console.messages import RunFinished
from console.procedure.engine import EXIT_DOWN, Engine, SimulatedCrash
from console.procedure.store import RunStore
from tests.engine_fakes import (
    INFERENCE,
    FakeWorld,
    Fault,
    Producers,
    ScriptedDecider,
    build_producers,
    install_clock,
    write_config,
)
from tests.fake_hosts import FakeHosts


@pytest.fixture(scope="session")
def producers(tmp_path_factory: pytest.TempPathFactory) -> Producers:
    return build_producers(tmp_path_factory.mktemp("producers"))


@pytest.fixture
def window(tmp_path: Path, producers: Producers, monkeypatch: pytest.MonkeyPatch) -> Window:
    return make_window(tmp_path, producers, monkeypatch)


class Crasher:
    """The `crash_at` hook: the console dies at the `nth` time it reaches `point` (its hosts view
    and its run store go dead with it: nothing after the point reaches the world)."""

    def __init__(self, point: str | None, nth: int = 1):
        self.point, self.nth, self.seen = point, nth, 0
        self.fired = False
        self.hosts: FakeHosts | None = None
        self.run: Any = None

    def __call__(self, point: str) -> None:
        if point != self.point or self.fired:
            return
        self.seen += 1
        if self.seen < self.nth:
            return
        self.fired = True
        self.hosts.kill()

        def dead(*args: Any, **kwargs: Any) -> Any:
            raise SimulatedCrash(f"the console died at {point}")
        self.run.save = self.run.journal = self.run.record_telemetry = dead
        raise SimulatedCrash(point)


@dataclass
class Window:
    """One fake world, its run store, and the consoles that drove it one after the other."""

    root: Path
    world: FakeWorld
    store: RunStore
    run_id: str
    finished: list[RunFinished] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    deciders: list[ScriptedDecider] = field(default_factory=list)
    route: str | None = None  # the route the run is made for (the first console's)
    # The config each console runs under, made from the run's state and the console's hosts (a
    # fleet's: narrowed to its window's replica, as `run` does); None: the world's config.
    config_of: Any = None

    def state(self) -> Any:
        return self.store.open(self.run_id).state

    async def console(self, crash: Crasher | None = None, decider: ScriptedDecider | None = None,
                      seen: list[Any] | None = None, **engine_kwargs: Any) -> RunFinished | None:
        """One console: a new engine over a new view of the same world; None when it died. `seen`
        gets every message it publishes."""
        self.world.clock.advance(1.0)  # a console starts a moment after the last one died
        hosts = FakeHosts(self.world)
        if seen is not None:
            hosts.bus.subscribe(seen.append)
        run = self.store.open(self.run_id)
        decider = decider or ScriptedDecider(self.world.clock)
        self.deciders.append(decider)
        crash = crash or Crasher(None)
        crash.hosts, crash.run = hosts, run
        engine_kwargs.setdefault("route", self.route)
        config = await self.config_of(run.state, hosts) if self.config_of is not None else self.world.config
        engine = Engine(hosts, config, run, decider, self.store, crash_at=crash, **engine_kwargs)
        before = asyncio.all_tasks()
        try:
            finished = await engine.execute()
        except SimulatedCrash:
            await self._bury(before)
            self.crashes.append(crash.point)
            return None
        finally:
            if crash.fired:
                await self._bury(before)
        self.finished.append(finished)
        return finished

    async def _bury(self, before: set[asyncio.Task]) -> None:
        """What the dead console left running in this process is ended (a killed process's tasks
        die with it); the world's own tasks, its jobs and the unit, go on."""
        leftovers = [t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()
                     and t not in self.world.tasks]
        for task in leftovers:
            task.cancel()
        await asyncio.gather(*leftovers, return_exceptions=True)

    async def until_finished(self, crashes: list[Crasher], limit: int = 8) -> RunFinished:
        """Consoles one after the other, each dying at its crash (if it reaches it), until one ends."""
        for crash in [*crashes, *[None] * limit]:
            finished = await self.console(crash)
            if finished is not None:
                return finished
        raise AssertionError("no console finished the run")


def make_window(root: Path, producers: Producers, monkeypatch: Any, stuck_holder: bool = True,
                **service: Any) -> Window:
    # fsync is what a power cut needs; a console's death is simulated in this process, where every
    # write is visible at once. Without it the sweep's thousands of state writes take seconds, not minutes.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    config = write_config(root, producers, **service)
    world = FakeWorld(root, config, producers, stuck_holder=stuck_holder)
    install_clock(monkeypatch, world.clock)
    store = RunStore(root / "runs")
    run = store.create(str(config.source), None)
    return Window(root, world, store, run.run_id)


# --- the promises, checked against the world ---------------------------------------------------


def assert_promises(w: Window, finished: RunFinished) -> None:
    world, state, service = w.world, w.state(), w.world.service
    run_dir = w.store.root / w.run_id
    # The service ends ready, or the run says exit 3 and the store names it as the one left down.
    if service.state == "active" and service.ready:
        assert not state.service.down, "the service is up but the run says it is down"
    else:
        assert finished.exit_code == EXIT_DOWN, (finished, service.state)
        left = w.store.left_down()
        assert left is not None and left.run_id == w.run_id
    # The stop ran at most once; one start per down period (exactly one when it came back).
    assert service.stop_commands <= 1, service.commands
    for stopped, ready, starts in service.down_periods():
        assert starts <= 1, f"{starts} starts for the down period from {stopped}: {service.commands}"
        if ready is not None:
            assert starts == 1
    # The extraction: at most one worker got the GPU; none started once one was complete.
    extractions = world.extraction_jobs()
    assert sum("holds-gpu" in j.reached for j in extractions) <= 1, [j.reached for j in extractions]
    complete_at = next((i for i, j in enumerate(extractions) if j.seen("artifact")), None)
    if complete_at is not None:
        assert complete_at == len(extractions) - 1, "an extraction was started after one completed"
    # No step recorded done whose work is not on the host.
    steps = {name: rec.status for name, rec in state.steps.items()}
    inference = world.workdir(INFERENCE) / "windows" / w.run_id
    if steps.get("cache") == "done":
        assert (inference / "completions.json").is_file()
    if steps.get("stage") == "done":
        assert any(j.seen("staged") for j in extractions)
    if steps.get("stop") == "done":
        assert service.stop_commands == 1
    if steps.get("free-vram") == "done" and state.route == "window":
        assert world.vram_free_seen, "free-vram done but the service's GPUs were never seen free"
    if steps.get("extract") == "done":
        assert (inference / "states" / "manifest.json").is_file()
    if steps.get("restart") == "done":
        assert service.state == "active"
    if steps.get("evaluate") == "done":
        assert (inference / "eval" / "manifest.json").is_file()
    if steps.get("report") == "done":
        assert (run_dir / "report.md").is_file() and (run_dir / "results" / "results.json").is_file()
    if steps.get("crosscheck") == "done":
        assert (run_dir / "crosscheck.json").is_file()
    # The downtime recorded is the world's: exact unless the console was away at the ready moment.
    periods = service.down_periods()
    if periods and periods[0][1] is not None and state.service.ready_at is not None:
        stopped, ready, _ = periods[0]
        assert state.service.stopped_at == stopped
        if state.service.ready_seen_late:
            assert state.service.ready_at >= ready
        else:
            assert state.service.ready_at == ready, (state.service.ready_at - ready)


def fired(w: Window, point: str) -> bool:
    return point in w.crashes


@dataclass(frozen=True)
class Failure:
    name: str
    faults: tuple[Fault, ...] = ()
    refuse: frozenset[str] = frozenset()
    holders_survive: bool = False
    status: str = "done"  # how the first console's run ends
    failed_step: str | None = None


async def cancel_at(window: Window, point: str) -> RunFinished:
    """One console whose run is cancelled (Engine.cancel, as Ctrl-C is) when it reaches `point`,
    with the first host call the cancel lands in losing it."""
    window.world.swallow_cancels = 1
    box: list[Engine] = []
    engine = Engine(FakeHosts(window.world), window.world.config, window.store.open(window.run_id),
                    ScriptedDecider(window.world.clock), window.store, route=window.route,
                    crash_at=lambda reached: box[0].cancel() if reached == point else None)
    box.append(engine)
    return await engine.execute()
