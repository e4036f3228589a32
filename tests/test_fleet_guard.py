"""The fleet checked again at the moment it matters (issue 41 section 2; console/procedure/steps/
fleet_guard.py), against SGLang's real routers (smg 1.13.0 and sglang-router 0.3.2, each test on both) in
front of two real rehearsal servers:

- the drain runs the preflight's rules again right before the removal: another replica gone from the
  router since the choice refuses it, nothing changed;
- while r1 is out, r2 turning unhealthy (its process stopped: SIGSTOP, the router's own health check
  sees it) is said at once and the window is offered to end early; a yes records why, ends the
  window before its next step and rejoins r1;
- r2 flapping (healthy, unhealthy, healthy) with a no, and the router restarted mid-window (from a
  configuration with r2 only, or with both replicas), each end with every replica in the router and
  one removal and at most one add by the run.

The steps run on a real run directory; the engine around them is the small `GuardSteps` below (the
whole engine over these faults: tests/test_fleet_guard_sweep.py). Every wait has a deadline."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from console.drill.fleet import GATEWAYS, SMG, FleetError, launch_router
from console.procedure.decider import confirmation_text
from console.procedure.outcomes import SimulatedCrash, StepFailed
from console.procedure.steps import fleet, fleet_guard
from console.procedure.store import RunStore
from console.service.router import RouterClient
from tests.router_helpers import QUICK_HEALTH, ROUTER_START_S, need_router
from tests.standin_helpers import ROOT, free_port, start_standin, stop, wait_status
from tests.test_fleet_steps import fleet_config

need_router()

DEADLINE_S = 60.0


class Fleet:
    """Two rehearsal servers (their processes, to stop and continue them) behind a real smg that a
    test may restart on the same port."""

    def __init__(self, tmp: Path, procs: list[subprocess.Popen], urls: list[str], gateway: str):
        self.tmp, self.procs, self.urls, self.gateway = tmp, procs, urls, gateway
        self.port = free_port()
        self.router = f"http://127.0.0.1:{self.port}"
        self.router_proc: subprocess.Popen | None = None
        self.starts = 0

    def start_router(self, workers: list[str]) -> None:
        self.starts += 1
        try:
            self.router_proc, _ = launch_router(self.gateway, sys.executable, self.port, workers,
                                                self.tmp / f"{self.gateway}{self.starts}.log", ROUTER_START_S,
                                                *QUICK_HEALTH, cwd=ROOT)
        except FleetError as exc:
            raise AssertionError(str(exc)) from None

    def stop_router(self) -> None:
        if self.router_proc is not None:
            stop(self.router_proc)
            self.router_proc = None

    def pause(self, index: int) -> None:
        os.kill(self.procs[index].pid, signal.SIGSTOP)

    def resume(self, index: int) -> None:
        os.kill(self.procs[index].pid, signal.SIGCONT)


@pytest.fixture(scope="module", params=GATEWAYS)
def guard_fleet(request: pytest.FixtureRequest, tiny_target: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Each test once behind smg, once behind sglang-router (each with its own two replicas)."""
    tmp = tmp_path_factory.mktemp(f"guard-{request.param}")
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            procs.append(start_standin(tiny_target, port, tmp / f"standin{i}.log", "--metrics", "--warmup-delay",
                                       "0.1"))
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            wait_status(url + "/health", 200, timeout=120, proc=proc)
        made = Fleet(tmp, procs, urls, request.param)
        made.start_router(urls)
        yield made
        made.stop_router()
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
            stop(proc)


@pytest.fixture
def fresh(guard_fleet: Fleet) -> Iterator[Fleet]:
    """The fleet as every test finds it: both replicas running, the router up and listing both healthy;
    put back so after the test, whatever it did."""
    yield guard_fleet
    for i in range(2):
        with contextlib.suppress(ProcessLookupError):
            guard_fleet.resume(i)
    if guard_fleet.router_proc is None or guard_fleet.router_proc.poll() is not None:
        guard_fleet.start_router(guard_fleet.urls)
    asyncio.run(_all_listed(guard_fleet))


async def _all_listed(f: Fleet) -> None:
    client = RouterClient(f.router)
    listed = {w.url for w in await client.workers()}
    for url in f.urls:
        if url not in listed:
            await client.add_worker(url, {"health": {"drain_settle_secs": 1}} if f.gateway == SMG else None)
    await until(lambda: _healthy(f.router, f.urls), "every replica listed healthy")


async def _healthy(router: str, urls: list[str]) -> bool:
    try:
        workers = await RouterClient(router, timeout=2).workers()
    except Exception:  # the router restarting: not yet
        return False
    return {w.url for w in workers if w.healthy} >= set(urls)


async def until(check: Callable[[], Awaitable[bool]], what: str, deadline_s: float = DEADLINE_S) -> None:
    ends = time.monotonic() + deadline_s
    while not await check():
        if time.monotonic() > ends:
            raise AssertionError(f"not within {deadline_s:g} s: {what}")
        await asyncio.sleep(0.1)


class GuardSteps:
    """What the fleet steps and the guard read of the window (console/procedure/window.py): the
    config, the run (its state.json on disk), the journal, the operator's answers (`answer`, called
    with each question; the offer to end early is asked without holding the window, `holds=False`)."""

    def __init__(self, config: Any, run: Any, answer: Callable[[Any], Awaitable[bool]] | None = None,
                 crash_at: str | None = None):
        self.config, self.run, self.crash_at = config, run, crash_at
        self.route = "window"
        self.fleet_watch: asyncio.Task | None = None
        self.asked: list[Any] = []
        self.lines: list[tuple[str, str]] = []
        self._answer = answer

    @property
    def state(self) -> Any:
        return self.run.state

    def journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.lines.append((fields.get("level", "info"), message))
        self.run.journal(step, message, **fields)

    async def ask(self, confirmation: Any, holds: bool = True) -> bool:
        self.asked.append(confirmation)
        return True if self._answer is None else await self._answer(confirmation)

    def crash_point(self, point: str) -> None:
        if point == self.crash_at:
            raise SimulatedCrash(point)

    def said(self, words: str) -> bool:
        return any(words in line for _, line in self.lines)


def ends_early(engine: GuardSteps) -> None:
    """What the engine does before its next step once the window was ended early: that step is never
    begun (EndedEarly), and the compensation rejoins."""
    with pytest.raises(fleet_guard.EndedEarly) as caught:
        fleet_guard.cut(engine, "stop")
    assert "the window ended early: " in caught.value.msg
    asyncio.run(fleet.rejoin_after(engine, "the window ended early"))


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "runs")


def test_the_drain_checks_the_fleet_again_right_before_the_removal(fresh, store):
    config, why = asyncio.run(fleet.fleet_config(fleet_config(fresh.router, fresh.urls), None, "r1"))
    assert why is not None  # preflight's choice: r1, both listed healthy
    client = RouterClient(fresh.router)
    asyncio.run(client.remove_worker(fresh.urls[1]))  # r2 leaves the router between preflight and the drain
    asyncio.run(client.wait_gone(fresh.urls[1], 30))
    engine = GuardSteps(config, store.create(None, None))
    with pytest.raises(StepFailed) as caught:
        asyncio.run(fleet.run_drain(engine))
    assert caught.value.msg == ("the fleet changed since preflight: the router does not list every replica healthy: "
                                "r2 (not listed); the fleet window runs only while all are; r1 stays in the router; "
                                "nothing was changed")
    assert asyncio.run(client.worker(fresh.urls[0])) is not None  # never removed
    svc = store.open(engine.run.run_id).state.service
    assert (svc.drains, svc.drained) == (0, None)


def test_another_replica_unhealthy_mid_window_is_said_at_once_and_a_yes_ends_it_early(fresh, store, monkeypatch):
    monkeypatch.setattr(fleet_guard, "WATCH_S", 0.2)
    config, _ = asyncio.run(fleet.fleet_config(fleet_config(fresh.router, fresh.urls), None, "r1"))
    asked = asyncio.Event()

    async def yes(confirmation: Any) -> bool:
        asked.set()
        return True

    engine = GuardSteps(config, store.create(None, None), yes)

    async def window() -> None:
        await fleet.run_drain(engine)
        assert engine.fleet_watch is not None  # r1 out: r2 carries everything, watched
        fresh.pause(1)  # r2's process stops answering: the router's health check marks it unhealthy
        await until(lambda: _said(engine, "THE FLEET IS AT RISK while r1 is out: "), "the risk said")
        await asyncio.wait_for(asked.wait(), DEADLINE_S)
        await until(lambda: _ended(engine), "the window ended early")

    asyncio.run(window())
    offer = engine.asked[-1]
    assert offer.action == "end the window on r1 early and rejoin it" and not offer.destructive
    assert "command: (none: the console acts itself)" in confirmation_text(offer)  # nothing sent by the yes itself
    early = store.open(engine.run.run_id).state.service.ended_early  # on disk before anything else
    assert early is not None and early["why"] in (
        f"another replica is unhealthy in the router {fresh.router}: r2 (unhealthy)",
        f"the router {fresh.router} lists no healthy worker: the requests through it fail")
    fresh.resume(1)
    ends_early(engine)
    asyncio.run(until(lambda: _healthy(fresh.router, fresh.urls), "r1 back and r2 healthy again"))
    svc = store.open(engine.run.run_id).state.service
    assert (svc.drains, svc.rejoins, svc.drained) == (1, 1, None)


async def _said(engine: GuardSteps, words: str) -> bool:
    return engine.said(words)


async def _ended(engine: GuardSteps) -> bool:
    return engine.state.service.ended_early is not None


def refusing_to_end_early(fresh, store, monkeypatch) -> GuardSteps:
    """The window's steps over the real gateway, watched every 0.2 s, by an operator who says yes to the
    drain and the rejoin and no to ending the window early."""
    monkeypatch.setattr(fleet_guard, "WATCH_S", 0.2)
    config, _ = asyncio.run(fleet.fleet_config(fleet_config(fresh.router, fresh.urls), None, "r1"))

    async def no(confirmation: Any) -> bool:
        return confirmation.step != "fleet"

    return GuardSteps(config, store.create(None, None), no)


def test_a_flapping_replica_with_a_no_is_said_both_ways_and_the_window_goes_on(fresh, store, monkeypatch):
    engine = refusing_to_end_early(fresh, store, monkeypatch)

    async def window() -> None:
        await fleet.run_drain(engine)
        fresh.pause(1)
        await until(lambda: _said(engine, "THE FLEET IS AT RISK while r1 is out: "), "the risk said")
        fresh.resume(1)
        await until(lambda: _said(engine, "the fleet is healthy again (r1 still out for its window)"), "healthy again")
        fresh.pause(1)  # a second fall after the no: offered again
        await until(lambda: _asked_twice(engine), "offered again")
        fresh.resume(1)
        await until(lambda: _healthy(fresh.router, fresh.urls[1:]), "r2 healthy again")
        assert engine.state.service.ended_early is None  # every offer refused: the window went on
        if await fleet.check_rejoin(engine) is None:
            await fleet.run_rejoin(engine)
        assert engine.fleet_watch is None

    asyncio.run(window())
    asyncio.run(until(lambda: _healthy(fresh.router, fresh.urls), "every replica in the router"))
    svc = store.open(engine.run.run_id).state.service
    assert (svc.drains, svc.rejoins, svc.drained, svc.ended_early) == (1, 1, None, None)


async def _asked_twice(engine: GuardSteps) -> bool:
    return len([c for c in engine.asked if c.step == "fleet"]) >= 2


@pytest.mark.parametrize("restarted_with", ["r2 only", "both replicas"])
def test_a_router_restarted_mid_window_is_said_and_ends_with_every_replica_back_once(fresh, store, monkeypatch,
                                                                                    restarted_with):
    engine = refusing_to_end_early(fresh, store, monkeypatch)

    async def window() -> None:
        await fleet.run_drain(engine)
        fresh.stop_router()
        await until(lambda: _said(engine, f"the router {fresh.router} cannot be read"), "the router's loss said")
        await asyncio.to_thread(fresh.start_router, fresh.urls[1:] if restarted_with == "r2 only" else fresh.urls)
        if restarted_with == "both replicas":  # its configuration lists r1: back in the rotation mid-window
            await until(lambda: _said(engine, "lists r1 again while its window lasts"), "r1 listed said")
        else:
            await until(lambda: _said(engine, "the fleet is healthy again"), "healthy again")
        if await fleet.check_rejoin(engine) is None:
            await fleet.run_rejoin(engine)

    asyncio.run(window())
    asyncio.run(until(lambda: _healthy(fresh.router, fresh.urls), "every replica in the new router"))
    svc = store.open(engine.run.run_id).state.service
    assert (svc.drains, svc.drained) == (1, None) and svc.rejoins == (1 if restarted_with == "r2 only" else 0)


def test_a_console_that_resumes_a_drained_window_watches_the_fleet_again(fresh, store, monkeypatch):
    """The console dies with r1 out; r2 falls while no console runs; the next console, finding r1 out
    (the drain's check), watches again: the risk said at once, the offer made, r1 back on the yes."""
    monkeypatch.setattr(fleet_guard, "WATCH_S", 0.2)
    config, _ = asyncio.run(fleet.fleet_config(fleet_config(fresh.router, fresh.urls), None, "r1"))
    run = store.create(None, None)
    with pytest.raises(SimulatedCrash):
        asyncio.run(fleet.run_drain(GuardSteps(config, run, crash_at="draining")))
    run.close()
    fresh.pause(1)
    again = store.open(run.run_id)  # a new console: only what state.json says
    resumed, _ = asyncio.run(fleet.fleet_config(fleet_config(fresh.router, fresh.urls), again.state))

    async def yes(confirmation: Any) -> bool:
        return True

    engine = GuardSteps(resumed, again, yes)

    async def window() -> None:
        assert await fleet.check_drain(engine) is not None  # r1 found out of the router: the drain is done
        await until(lambda: _said(engine, "THE FLEET IS AT RISK while r1 is out: "), "the risk said")
        await until(lambda: _ended(engine), "the window ended early")

    asyncio.run(window())
    fresh.resume(1)
    ends_early(engine)
    asyncio.run(until(lambda: _healthy(fresh.router, fresh.urls), "r1 back and r2 healthy again"))
    svc = store.open(run.run_id).state.service
    assert (svc.drains, svc.rejoins, svc.drained) == (1, 1, None)
