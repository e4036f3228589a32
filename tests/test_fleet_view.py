"""What every view says of a replica (console/service/fleet_watch.py): serving / draining / in window /
rejoining from a live run's steps, DRAINED by run X once no console drives the run that left it out,
and the router's own listing otherwise. The runs are real run directories (state.json written and read
back); the router's answer is a `FleetView` as `look` builds it (`look` itself runs against the real
router in tests/test_fleet_steps.py, with the console over it)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from console.messages import FleetView, ReplicaView
from console.procedure.state import Owner
from console.procedure.store import RunStore
from console.service.fleet_watch import drained_run, with_runs
from console.views.fleet import fleet_lines, gpus_text
from tests.tui.test_tui_operator import plain


def seen(r2_listed: bool = True) -> FleetView:
    replicas = (ReplicaView("r1", "ct129", (0, 1), True, True, 0, 2, 0, state="serving"),
                ReplicaView("r2", "ct130", (), r2_listed, r2_listed, 0 if r2_listed else None, 0, 0,
                            state="serving" if r2_listed else "out of the router"))
    return FleetView("http://127.0.0.1:30000", True, replicas, time.time())


def a_run(store: RunStore, step_status: dict[str, str], drained: bool, status: str = "running",
          live: bool = True):
    run = store.create(None, None)
    state = run.state
    state.status = status
    state.owner = Owner.this_process() if live else Owner("op", "nowhere-else", 1, time.time(), None)
    state.facts["fleet_replica"] = "r2"
    for name, value in step_status.items():
        state.step(name).status = value
    if drained:
        state.service.drained = {"replica": "r2", "router": "http://127.0.0.1:30000", "since": time.time()}
        state.service.drains = 1
    run.save()
    return store.open(run.run_id).state


@pytest.mark.parametrize(("steps", "drained", "status", "live", "expected"), [
    ({"drain": "running"}, True, "running", True, "draining"),
    ({"drain": "done", "stop": "running"}, True, "running", True, "in window"),
    ({"drain": "done", "rejoin": "running"}, True, "running", True, "rejoining"),
    ({"drain": "done", "rejoin": "running"}, False, "running", True, "rejoining"),  # added, being verified
    ({"drain": "done", "stop": "failed"}, True, "failed", True, "DRAINED"),
    ({"drain": "done"}, True, "running", False, "in window"),  # driven on another machine: cannot tell: live
    ({"drain": "done", "rejoin": "done"}, False, "done", True, "serving"),
])
def test_a_replicas_state_is_what_the_run_that_holds_it_says(tmp_path: Path, steps, drained, status, live, expected):
    state = a_run(RunStore(tmp_path), steps, drained, status, live)
    view = with_runs(seen(r2_listed=not drained), [state])
    r1, r2 = view.replicas
    assert r1.state == "serving" and r1.run_id is None
    assert r2.state == expected
    assert (r2.run_id == state.run_id) == (expected != "serving")
    assert drained_run(view) == (state.run_id if expected == "DRAINED" else None)


def test_a_dead_consoles_run_leaves_the_replica_drained_and_the_newest_run_decides(tmp_path: Path):
    store = RunStore(tmp_path)
    old = a_run(store, {"drain": "done", "rejoin": "done"}, False, "done")
    gone = a_run(store, {"drain": "done", "stop": "running"}, True, "running")
    gone.owner = Owner("op", gone.owner.host, 999_999_999, time.time(), 1)  # a pid that is not running
    view = with_runs(seen(r2_listed=False), [gone, old])  # newest first
    assert view.replicas[1].state == "DRAINED" and drained_run(view) == gone.run_id
    text = plain(fleet_lines(view))
    assert f"r2  DRAINED by run {gone.run_id}" in text and "router not listed" in text
    assert "router http://127.0.0.1:30000 up, 1 of 2 replicas healthy" in text
    assert "ct129 GPU 0,1" in text and "ct130 GPU all" in text and "2 running, 0 queued" in text


def test_gpus_are_written_as_ranges():
    assert gpus_text((0, 1, 2, 3, 5)) == "0-3,5" and gpus_text(()) == "all" and gpus_text((1,)) == "1"


def test_status_exits_0_only_while_the_router_lists_every_replica_healthy():
    import dataclasses

    from console.service.fleet_watch import all_serving

    assert all_serving(seen()) and not all_serving(seen(r2_listed=False)) and not all_serving(None)
    assert not all_serving(dataclasses.replace(seen(), router_up=False))
    assert not all_serving(dataclasses.replace(seen(), error="router http://127.0.0.1:30000: no answer"))


def test_the_gateway_is_named_and_a_replica_smg_lists_draining_says_so():
    import dataclasses

    from console.service.fleet_watch import listing_state

    view = dataclasses.replace(seen(), gateway="smg 1.13.0")
    r2 = dataclasses.replace(view.replicas[1], healthy=False, router_status="draining")  # smg's settle
    view = dataclasses.replace(view, replicas=(view.replicas[0], dataclasses.replace(r2, state=listing_state(r2))))
    text = plain(fleet_lines(view))
    assert "router http://127.0.0.1:30000 (smg 1.13.0) up, 1 of 2 replicas healthy" in text
    assert "r2  draining" in text and "router draining · 0 running, 0 queued" in text
