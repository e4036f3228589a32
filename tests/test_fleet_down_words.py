"""The fleet's own screens tell the truth (issue 41, section 2): with r1 down for its window while the
router serves through r2, the console said "SERVICE DOWN" in red. The banner and the service panel
now say the fleet's state, from the session's last look at the router: "REPLICA r1 DOWN · out of the
router, r2 serving" on the warning colour; SERVICE DOWN in red only while no other replica serves."""

from __future__ import annotations

from console import messages as m
from console.views.fleet import fleet_serving
from screens.state import ConsoleState
from screens.widgets.downtime_banner import downtime_text
from screens.widgets.service_panel import service_renderable


def replica(name: str, listed: bool, healthy: bool, status: str | None = None) -> m.ReplicaView:
    return m.ReplicaView(name, "ct129", (0, 1), listed, healthy, 0, 0, 0, router_status=status)


def view(*replicas: m.ReplicaView, up: bool = True, error: str | None = None) -> m.FleetView:
    return m.FleetView("http://router:30000", up, tuple(replicas), 100.0, error, "smg 1.13.0")


def down_state(fleet: m.FleetView | None) -> ConsoleState:
    state = ConsoleState()
    state.apply(m.Downtime("run-1", 100.0), 100.0)
    if fleet is not None:
        state.apply(fleet, 100.0)
    return state


def test_r1_out_and_r2_serving_reads_as_the_fleet_state_not_service_down():
    fleet = view(replica("r1", False, False), replica("r2", True, True), replica("r3", True, True))
    serving = fleet_serving(fleet, "r1")
    assert serving is not None and serving.serving and serving.words == "r1 out of the router, r2, r3 serving"
    text = downtime_text(down_state(fleet), 130.0, can_restart=False, fleet=serving).plain
    assert text.startswith("REPLICA r1 DOWN 30 s · out of the router, r2, r3 serving") and "SERVICE DOWN" not in text
    lines = service_renderable(None, m.Downtime("run-1", 100.0), None, 130.0, fleet=serving).renderables
    assert lines[0].plain == " r1 DOWN 30 s " and lines[1].plain.startswith("stopped by this run at ")
    assert lines[2].plain == "r1 out of the router, r2, r3 serving"
    assert "red" not in str(lines[0].style) and "green" in str(lines[2].style)


def test_no_other_replica_serving_is_service_down_in_red_with_the_fleet_state():
    fleet = view(replica("r1", False, False), replica("r2", True, False))
    serving = fleet_serving(fleet, "r1")
    assert serving is not None and not serving.serving
    text = downtime_text(down_state(fleet), 130.0, can_restart=False, fleet=serving).plain
    assert text.startswith("SERVICE DOWN 30 s · r1 out of the router, no other replica serving")
    lines = service_renderable(None, m.Downtime("run-1", 100.0), None, 130.0, fleet=serving).renderables
    assert lines[0].plain == " DOWN 30 s " and "red" in str(lines[0].style)
    assert lines[2].plain == "r1 out of the router, no other replica serving" and "red" in str(lines[2].style)


def test_a_router_that_cannot_be_read_is_never_called_serving():
    serving = fleet_serving(view(replica("r1", False, False), replica("r2", True, True), error="timed out"), "r1")
    assert serving is not None and not serving.serving and serving.words.endswith("the router cannot be read")
    serving = fleet_serving(view(replica("r1", True, False, "draining"), replica("r2", True, True), up=False), "r1")
    assert serving is not None and not serving.serving and serving.words == "r1 draining, the router DOWN"


def test_one_server_and_no_look_yet_say_what_they_said():
    assert fleet_serving(None, "r1") is None and fleet_serving(view(replica("r1", True, True)), None) is None
    assert downtime_text(down_state(None), 130.0, can_restart=False).plain.startswith("SERVICE DOWN 30 s")
    assert service_renderable(None, m.Downtime("run-1", 100.0), None, 130.0).renderables[0].plain == " DOWN 30 s "
