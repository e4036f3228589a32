"""The console over a fleet (issue 29), against SGLang's real router 0.3.2 in front of two rehearsal
servers (tests/router_helpers.py's fleet): the fleet panel shows the router's health and each
replica's state, requests, host and GPUs; a replica a run left DRAINED is put back by `r` (asked
first, as the engine asks), after which the panel shows it serving; `status`'s fleet text and `runs`
name the drained replica the same way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from textual.widgets import Static

from console import messages as m
from console.cli.run import runs_rows
from console.procedure.steps import fleet
from console.procedure.store import RunStore
from console.service.fleet_watch import look, with_runs
from console.service.router import RouterClient
from console.views.fleet import fleet_renderable
from screens.app import ConsoleApp
from screens.modals.confirm import ConfirmModal
from screens.widgets.fleet_panel import FleetPanel
from tests.test_fleet_steps import StepsOnly, fleet_config
from tests.tui.standin import StandinOperator, wall_clock
from tests.tui.test_tui_operator import plain, text_of, until

pytest.importorskip("sglang_router", reason="the fleet extra (sglang-router) is not installed")


async def listed(router: str) -> dict[str, bool]:
    return {w.url: w.healthy for w in await RouterClient(router).workers()}


class AskingSteps(StepsOnly):
    """The fleet steps' view of the engine, asking the console's decider (as the engine does)."""

    def __init__(self, config: Any, run: Any, decider: Any, operator: FleetOperator):
        super().__init__(config, run)
        self.decider, self.operator = decider, operator

    async def _ask(self, confirmation: Any) -> bool:
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
    try:
        await fleet.run_drain(StepsOnly(placed, run))  # out of the real router, idle
        run.state.status = "failed"  # ... and the run ended there: r2 is DRAINED by it
        run.save()
        # `status` and `runs` say the same of it, in text.
        status_text = plain(fleet_renderable(with_runs(await look(config.fleet), [run.state])))
        assert f"r2       DRAINED by run {run.run_id}" in status_text and "not listed" in status_text
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
            assert f"router {router} up, 1 of 2 replicas healthy" in shown
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
        if urls[1] not in await listed(router):
            await client.add_worker(urls[1])
        await client.wait_listed(urls[1], 30)
    svc = store.open(run.run_id).state.service
    assert svc.drained is None and (svc.drains, svc.rejoins) == (1, 1)
    assert await listed(router) == dict.fromkeys(urls, True)
