"""The fleet window's drain and rejoin (console/procedure/steps/fleet.py) against SGLang's real router
(smg 1.13.0; drain then rejoin and the load across them on sglang-router 0.3.2 too) in front of two
real rehearsal servers: the choice of the replica and its refusals, drain then rejoin, a crash at each
of the steps' crash points then the resume (the replica ends in the router, one drain and one rejoin),
and a replica that does not drain within its bound (put back by the compensation). The steps run on a real run directory (state.json written and read
back); only the engine around them is the small `StepsOnly` below: the route's inner steps (stop ...
restart) are the sweep's business (tests/test_engine_sweep.py), not this file's. Last, the console
over the same fleet (Pilot): its fleet panel, and `r` putting a DRAINED replica back."""

from __future__ import annotations

import asyncio
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from textual.widgets import Static

from bench.loadgen import Load
from console import messages as m
from console.cli.run import runs_rows
from console.config import config_to_dict, dump_toml, parse_config
from console.procedure import identity
from console.procedure.outcomes import SimulatedCrash, StepFailed
from console.procedure.steps import fleet
from console.procedure.steps.fleet_choice import Choice, ReplicaLoad, choose
from console.procedure.store import RunStore, left_line, what_next
from console.service.fleet_watch import look, with_runs
from console.service.replica_loads import read_loads
from console.service.router import RouterClient
from console.service.sglang_api import SglangClient
from console.views.fleet import fleet_renderable
from screens.app import ConsoleApp
from screens.modals.confirm import ConfirmModal
from screens.widgets.fleet_panel import FleetPanel
from tests.router_helpers import need_router
from tests.test_config_fleet import one_server
from tests.tui.standin import StandinOperator, wall_clock
from tests.tui.test_tui_operator import plain, text_of, until

need_router()


# --- the choice (pure: what the router and the replicas reported) --------------------------------


def test_the_least_loaded_replica_is_chosen_and_the_numbers_are_said():
    loads = [ReplicaLoad("r1", True, True, 5, 8), ReplicaLoad("r2", True, True, 2, 8)]
    assert choose(loads) == Choice("r2", "r2: the fewest running requests (2); 7 running in the fleet, the others "
                                         "take up to 8")


def test_refusals_name_the_replica_and_the_numbers():
    assert choose([ReplicaLoad("r1", True, True, 0, 8), ReplicaLoad("r2", True, False, 0, 8)]).why.startswith(
        "the router does not list every replica healthy: r2 (unhealthy)")
    assert "r1 (not listed)" in choose([ReplicaLoad("r1", False, False, 0, 8), ReplicaLoad("r2", True, True, 0, 8)]).why
    assert choose([ReplicaLoad("r1", True, True, 6, 8), ReplicaLoad("r2", True, True, 5, 8)]).why == (
        "the others cannot absorb the load: 11 running request(s) in the fleet, the replicas left (r1) take at most "
        "8 (max_running_requests)")
    assert "r1 is the last healthy replica" in choose([ReplicaLoad("r1", True, True, 0, 8)]).why
    assert choose([ReplicaLoad("r1", True, True, 0, 8), ReplicaLoad("r2", True, True, 0, 8)], eligible=set()).replica is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 50), st.one_of(st.none(), st.integers(1, 64))),
                min_size=1, max_size=5))
def test_a_chosen_replica_is_never_the_last_healthy_one_nor_leaves_the_others_overloaded(rows):
    loads = [ReplicaLoad(f"r{i}", True, healthy, running, cap) for i, (healthy, running, cap) in enumerate(rows)]
    choice = choose(loads)
    if choice.replica is None:
        return
    assert all(r.healthy for r in loads) and len(loads) >= 2
    chosen = next(r for r in loads if r.name == choice.replica)
    assert chosen.running == min(r.running for r in loads)
    others = [r for r in loads if r is not chosen]
    if all(r.capacity is not None for r in others):
        assert sum(r.running for r in loads) <= sum(r.capacity for r in others)


# --- the steps on the real router ----------------------------------------------------------------


def fleet_config(router: str, urls: list[str], drain_timeout_s: float = 30):
    data = one_server()
    service = data.pop("service")
    data["fleet"] = {"router": router, "drain_timeout_s": drain_timeout_s,
                     "replicas": [{"name": f"r{i + 1}", **service, "url": url} for i, url in enumerate(urls)]}
    return parse_config(dump_toml(data), "fleet.toml")


class StepsOnly:
    """What the fleet steps read of the window (console/procedure/window.py): the config, the run (its state.json on disk), the
    journal, the operator's yes, the crash hook. Every answer is yes; `crash_at` dies at one point."""

    def __init__(self, config: Any, run: Any, crash_at: str | None = None):
        self.config, self.run, self.crash_at = config, run, crash_at
        self.asked: list[str] = []

    @property
    def state(self) -> Any:
        return self.run.state

    def journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.run.journal(step, message, **fields)

    async def ask(self, confirmation: Any) -> bool:
        self.asked.append(confirmation.action)
        return True

    def crash_point(self, point: str) -> None:
        if point == self.crash_at:
            raise SimulatedCrash(point)


async def window(engine: StepsOnly) -> None:
    """The fleet's part of a window as the engine runs it: each step's check, else its run and verify."""
    for check, run, verify in ((fleet.check_drain, fleet.run_drain, fleet.verify_drain),
                               (fleet.check_rejoin, fleet.run_rejoin, fleet.verify_rejoin)):
        if await check(engine) is None:
            await run(engine)
            await verify(engine)


def listed(router: str) -> dict[str, bool]:
    return {w.url: w.healthy for w in asyncio.run(RouterClient(router).workers())}


@pytest.fixture
def store(tmp_path: Path) -> RunStore:
    return RunStore(tmp_path / "runs")


def test_drain_then_rejoin_on_the_real_router(any_router_fleet, store):
    router, urls = any_router_fleet
    config, why = asyncio.run(fleet.fleet_config(fleet_config(router, urls)))
    assert why is not None and "the fewest running requests (0)" in why
    engine = StepsOnly(config, store.create(None, None))
    name = fleet.replica_of(engine).name
    assert asyncio.run(fleet.check_drain(engine)) is None
    assert asyncio.run(fleet.run_drain(engine)).startswith(f"{name} out of the router and idle after")
    asyncio.run(fleet.verify_drain(engine))
    out = fleet.replica_of(engine).worker_url
    assert out not in listed(router) and len(listed(router)) == 1
    reread = store.open(engine.run.run_id)  # the state on disk names it
    assert reread.state.service.drained["replica"] == name and left_line(reread).startswith(f"DRAINED by run {reread.run_id}")
    assert "finishes its window and puts it back" in what_next(reread) and store.left_down().run_id == reread.run_id
    _, rows, styles = runs_rows(store.summaries())  # `dflash-ops runs`
    assert f"DRAINED ({name} out of the router)" in rows[0][2] and styles[0] == "bold red"
    asyncio.run(window(engine))  # drain found done; rejoin
    assert listed(router) == dict.fromkeys(urls, True)
    back = asyncio.run(RouterClient(router).worker(out))
    assert back is not None and back.spec == reread.state.service.drained["spec"]  # smg: its settings given back
    svc = store.open(engine.run.run_id).state.service
    assert (svc.drains, svc.rejoins, svc.drained) == (1, 1, None) and store.left_down() is None
    assert engine.asked == [f"take replica {name} out of the router", f"put replica {name} back in the router"]


POINTS = ("before-drain-recorded", "drain-recorded", "draining", "before-add", "added")


@pytest.mark.parametrize("point", POINTS)
def test_a_crash_at_each_point_then_the_resume_ends_with_the_replica_back_once(router_fleet, store, point):
    router, urls = router_fleet
    config, _ = asyncio.run(fleet.fleet_config(fleet_config(router, urls)))
    run = store.create(None, None)
    with pytest.raises(SimulatedCrash):
        asyncio.run(window(StepsOnly(config, run, crash_at=point)))
    run.close()
    again = store.open(run.run_id)  # a new console: only what state.json says
    resumed_config, _ = asyncio.run(fleet.fleet_config(fleet_config(router, urls), again.state))
    if point != "before-drain-recorded":  # recorded: the resume keeps the same replica
        assert resumed_config.service == config.service
    asyncio.run(window(StepsOnly(resumed_config, again)))
    assert listed(router) == dict.fromkeys(urls, True)
    svc = store.open(run.run_id).state.service
    assert svc.drained is None and svc.drains == 1 and svc.rejoins == 1, (svc.drains, svc.rejoins)


def test_the_operator_may_name_the_replica_and_a_name_the_fleet_lacks_is_refused(router_fleet):
    router, urls = router_fleet
    config, why = asyncio.run(fleet.fleet_config(fleet_config(router, urls), None, "r2"))  # `run --replica r2`
    assert config.service.url == urls[1] and why is not None and why.startswith("r2: 0 running request(s); ")
    with pytest.raises(StepFailed) as caught:
        asyncio.run(fleet.fleet_config(fleet_config(router, urls), None, "r9"))
    assert caught.value.msg == "--replica r9: [fleet] has no such replica (it lists r1, r2)"


def test_the_choice_skips_a_replica_the_last_preflight_found_unable_to_take_the_window(router_fleet, store):
    router, urls = router_fleet
    config = fleet_config(router, urls)
    earlier = store.create(identity.config_path(config), None)  # a run on this config whose preflight checked them
    earlier.state.facts["fleet_fits"] = {"r1": {"fits": False, "why": "its GPUs (GPU0 on ct129) hold 599 MiB, ..."},
                                         "r2": {"fits": True, "why": "its GPUs ..."}}
    earlier.save()
    placed, why = asyncio.run(fleet.fleet_config(config, None, None, [store.open(earlier.run_id).state]))
    assert placed.service.url == urls[1] and why is not None
    assert why.endswith("of those the last preflight found able to take the window (r2)")
    other = store.create("/elsewhere/another.toml", None)  # another config's verdicts are not this fleet's
    other.state.facts["fleet_fits"] = {"r1": {"fits": False}, "r2": {"fits": False}}
    assert fleet.known_fits(config, [other.state]) is None
    earlier.state.facts["fleet_fits"]["r2"]["fits"] = False  # none could: refused, saying how to try one
    with pytest.raises(StepFailed) as caught:
        asyncio.run(fleet.fleet_config(config, None, None, [earlier.state]))
    assert "no replica can take the window (GPUs that hold the extraction, the drafters' kernels) as the last " \
           "preflight found; `dflash-ops run --replica NAME` tries one again" in caught.value.msg


def test_the_fleet_window_is_refused_while_a_replica_is_out_and_names_it(router_fleet):
    router, urls = router_fleet
    client = RouterClient(router)
    was = asyncio.run(client.worker(urls[1]))
    assert was is not None
    asyncio.run(client.remove_worker(urls[1]))
    try:
        asyncio.run(client.wait_gone(urls[1], 15))
        with pytest.raises(StepFailed) as caught:
            asyncio.run(fleet.fleet_config(fleet_config(router, urls)))
        assert caught.value.msg == ("the fleet window is refused: the router does not list every replica healthy: "
                                    "r2 (not listed); the fleet window runs only while all are; nothing was changed")
    finally:
        asyncio.run(client.add_worker(urls[1], was.spec))
        asyncio.run(client.wait_listed(urls[1], 30))


def test_a_replica_that_does_not_drain_in_its_bound_fails_and_is_put_back(router_fleet, store):
    router, urls = router_fleet
    config = fleet.on_replica(fleet_config(router, urls, drain_timeout_s=0.5), fleet_config(router, urls).fleet.replicas[0])
    replica = SglangClient(urls[0], timeout=120)
    rid = f"drain-bound-{uuid.uuid4().hex[:8]}"
    long = {"text": "sent before the drain", "rid": rid,
            "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 0}}
    sender = threading.Thread(target=lambda: asyncio.run(replica.post("/generate", long)))
    sender.start()
    engine = StepsOnly(config, store.create(None, None))
    try:
        async def running() -> None:
            while (await read_loads(replica)).running != 1:
                await asyncio.sleep(0.05)
        asyncio.run(asyncio.wait_for(running(), 60))
        with pytest.raises(StepFailed) as caught:
            asyncio.run(fleet.run_drain(engine))
        assert "still 1 running and 0 queued request(s) 0.5 s after it left the router" in caught.value.msg
        assert urls[0] not in listed(router) and engine.state.service.drained is not None
    finally:
        asyncio.run(replica.post("/abort_request", {"rid": rid}))
        sender.join(60)
    asyncio.run(fleet.rejoin_after(engine, "the drain failed"))  # the engine's compensation's last part
    assert listed(router) == dict.fromkeys(urls, True) and engine.state.service.drained is None


def test_one_server_leaves_drain_and_rejoin_out():
    config = parse_config(dump_toml(config_to_dict(parse_config(dump_toml(one_server())))))
    assert asyncio.run(fleet.fleet_config(config)) == (config, None)
    engine = StepsOnly(config, None)
    assert fleet.plan_acts(engine) == {"drain": (False, "left out: one server (no [fleet] router)"),
                                       "rejoin": (False, "left out: one server (no [fleet] router)")}


def test_a_load_through_the_router_sees_no_failure_across_drain_and_rejoin(any_router_fleet, store):
    """Users' requests keep coming through the router the whole time: none fails, and none reaches the
    drained replica while it is out (its own counter stands still)."""
    router, urls = any_router_fleet
    config = fleet.on_replica(fleet_config(router, urls), fleet_config(router, urls).fleet.replicas[1])
    engine = StepsOnly(config, store.create(None, None))
    drained = SglangClient(urls[1])
    with Load(router, rate=8.0) as load:
        asyncio.run(fleet.run_drain(engine))
        out_at = asyncio.run(drained.metrics())["sglang:num_requests_total"]
        sent_before = load.tally.sent
        while load.tally.sent < sent_before + 8:  # 8 more sent through the router while it is out
            asyncio.run(asyncio.sleep(0.05))
        assert asyncio.run(drained.metrics())["sglang:num_requests_total"] == out_at
        asyncio.run(fleet.run_rejoin(engine))
        asyncio.run(fleet.verify_rejoin(engine))
    report = load.report
    assert report is not None and report.sent > 8 and report.failed == 0, report.line()
    assert listed(router) == dict.fromkeys(urls, True)


# --- the console over the fleet (Pilot) ------------------------------------------------------------
# Here rather than in tests/tui/: this file's process has the real router's fleet running already
# (CI runs each file in one process), so the console's test costs no second fleet.


async def listed_now(router: str) -> dict[str, bool]:
    return {w.url: w.healthy for w in await RouterClient(router).workers()}


class AskingSteps(StepsOnly):
    """The fleet steps' view of the window, asking the console's decider (as the engine does)."""

    def __init__(self, config: Any, run: Any, decider: Any, operator: FleetOperator):
        super().__init__(config, run)
        self.decider, self.operator = decider, operator

    async def ask(self, confirmation: Any) -> bool:
        return await self.operator._ask(self.decider, confirmation)


class FleetOperator(StandinOperator):
    """The stand-in operator (tests/tui/standin.py) over a real run store and the real router. Its
    session's fleet look is `look()` (published, as `Session.check_fleet` does); its `run(resume=X)`
    does what `Operator.run` does for a finished run that left its replica drained
    (`Engine._rejoin_only`): the fleet steps' `rejoin_after`, each question asked of the console."""

    def __init__(self, config: Any, runs_dir: Path):
        super().__init__(config, runs_dir)
        self.store = RunStore(runs_dir)
        self.resumed: list[Any] = []

    async def look(self) -> m.FleetView:
        view = await look(self.config.fleet)
        self.publish(view)
        return view

    async def run(self, decider: Any, resume: str | bool | None = None, **_: Any) -> m.RunFinished:
        self.resumed.append(resume)
        run = self.store.open(str(resume))
        await fleet.rejoin_after(AskingSteps(self.config, run, decider, self), f"run {resume} ended with it drained")
        await self.look()
        return self._finish(run.state.status, 0, True, "the rejoin was asked for")


async def test_the_fleet_panel_shows_every_replica_and_r_puts_a_drained_one_back(router_fleet, tmp_path: Path):
    router, urls = router_fleet
    config = fleet_config(router, urls)
    placed = fleet.on_replica(config, config.fleet.replicas[1])
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    was = await RouterClient(router).worker(urls[1])
    assert was is not None
    try:
        await fleet.run_drain(StepsOnly(placed, run))  # out of the real router, idle
        run.state.status = "failed"  # ... and the run ended there: r2 is DRAINED by it
        run.save()
        # `status` and `runs` say the same of it, in text.
        status_text = plain(fleet_renderable(with_runs(await look(config.fleet), [run.state])))
        assert f"r2       DRAINED by run {run.run_id}" in status_text and "not listed" in status_text
        assert f"router {router} (smg 1.13.0) up" in status_text
        _, rows, _ = runs_rows(store.summaries())
        assert "DRAINED (r2 out of the router)" in rows[0][2]

        op = FleetOperator(placed, tmp_path / "runs")
        op.seed()
        app = ConsoleApp(op, clock=wall_clock)
        async with app.run_test(size=(120, 40)) as pilot:
            await op.look()
            panel = app.screen.query_one(FleetPanel)
            await until(pilot, lambda: "DRAINED" in text_of(panel))
            shown = text_of(panel)
            assert f"router {router} (smg 1.13.0) up, 1 of 2 replicas healthy" in shown  # which gateway, said
            assert "r1  serving" in shown and f"r2  DRAINED by run {run.run_id}" in shown
            assert "router not listed · 0 running, 0 queued · ct129 GPU" in shown and panel.has_class("drained")
            assert "(replica r2)" in app.screen.query_one("#service").border_title
            await pilot.press("r")
            await until(pilot, lambda: isinstance(app.screen, ConfirmModal))
            assert "put replica r2 back in the router" in " ".join(text_of(w) for w in app.screen.query(Static))
            await pilot.press("y")
            await until(pilot, lambda: "r2  serving" in text_of(panel), timeout=60)
            assert "2 of 2 replicas healthy" in text_of(panel) and not panel.has_class("drained")
            assert op.resumed == [run.run_id] and op.decisions == [("rejoin", True)]
            assert not app.check_action("restart_service", ())  # nothing left to put back
    finally:  # the shared fleet ends with both replicas in the router, whatever happened
        client = RouterClient(router)
        if urls[1] not in await listed_now(router):
            await client.add_worker(urls[1], was.spec)
        await client.wait_listed(urls[1], 30)
    svc = store.open(run.run_id).state.service
    assert svc.drained is None and (svc.drains, svc.rejoins) == (1, 1)
    assert await listed_now(router) == dict.fromkeys(urls, True)
