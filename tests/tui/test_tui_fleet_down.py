"""The fleet's own screens tell the truth (issue 41, section 2), in the console: with r1 down for its
window and the router serving through r2, the banner and the service panel say "REPLICA r1 DOWN ·
out of the router, r2 serving" on the warning colour, not a red SERVICE DOWN; once r2 falls too,
SERVICE DOWN in red with the fleet's state. Repainted at the fleet's next look, not the next tick."""

from __future__ import annotations

from console import messages as m
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.service_panel import ServicePanel
from tests.test_fleet_steps import fleet_config
from tests.tui.standin import T0, StandinOperator
from tests.tui.test_tui_console import SIZE, app_for, text_of, wait_for


def look(r2_healthy: bool) -> m.FleetView:
    r1 = m.ReplicaView("r1", "ct129", (0, 1), False, False, None, None, None, state="out of the router")
    r2 = m.ReplicaView("r2", "ct129", (2, 3), True, r2_healthy, 0, 0, 0,
                       state="serving" if r2_healthy else "unhealthy")
    return m.FleetView("http://127.0.0.1:9", True, (r1, r2), T0, None, "smg 1.13.0")


async def test_r1_down_while_r2_serves_says_the_fleet_not_service_down():
    from console.procedure.steps.fleet import on_replica

    fleet = fleet_config("http://127.0.0.1:9", ["http://127.0.0.1:10", "http://127.0.0.1:11"])
    op = StandinOperator(on_replica(fleet, fleet.fleet.replicas[0]))  # the console's window is on r1
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        op.publish(m.Downtime("run-1", T0 - 30))
        op.publish(look(r2_healthy=True))
        banner, panel = app.screen.query_one(DowntimeBanner), app.screen.query_one(ServicePanel)
        await wait_for(pilot, lambda: "REPLICA r1 DOWN" in text_of(banner))
        assert "out of the router, r2 serving" in text_of(banner) and "SERVICE DOWN" not in text_of(banner)
        assert banner.has_class("fleet-serving")
        assert "r1 out of the router, r2 serving" in text_of(panel) and not panel.has_class("down")
        op.publish(look(r2_healthy=False))  # r2 falls: nobody serves
        await wait_for(pilot, lambda: "SERVICE DOWN" in text_of(banner))
        assert "r1 out of the router, no other replica serving" in text_of(banner)
        assert not banner.has_class("fleet-serving") and panel.has_class("down")
        assert "r1 out of the router, no other replica serving" in text_of(panel)
