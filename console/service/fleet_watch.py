"""The fleet as every view shows it: the router's health, and per replica whether the router lists it
healthy, its load, its GPUs and what a run is doing with it (serving / draining / in window /
rejoining / DRAINED by run X).

`look` asks the router (`GET /health`, `GET /workers`, which gateway it is: smg or sglang-router)
and each replica (its own `/v1/loads`); it never raises: what cannot be read is said in the view. `with_runs` adds each replica's state from the runs'
states (the run store's, the one source `status`, `runs` and the console share): a replica a live
run has drained is "draining" while its drain step runs, "rejoining" while its rejoin runs, else "in
window"; one a run left out of the router and no console drives is "DRAINED" by that run (`r` in the
console, `run --resume` put it back). The session polls `look` while the config has `[fleet]`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from typing import Any

from console.config import ConfigError
from console.messages import FleetView, ReplicaView
from console.service.replica_loads import LoadsUnreadable, read_loads
from console.service.router import RouterClient, RouterError, Worker
from console.service.sglang_api import ServerAnswerError, ServerUnreachable, SglangClient

LOOK_TIMEOUT_S = 5.0  # one look at the fleet; a replica that does not answer in time is said so


async def _replica(replica: Any, listed: Worker | None, via: Any) -> ReplicaView:
    service = replica.service
    running = queued = None
    error = None
    try:
        client = via.replica_client(replica, timeout=LOOK_TIMEOUT_S) if via is not None else \
            SglangClient(service.url, timeout=LOOK_TIMEOUT_S)
        loads = await read_loads(client)
        running, queued = loads.running, loads.queued
    except LoadsUnreadable as exc:
        error = str(exc)
    except (ServerUnreachable, ServerAnswerError, OSError, ValueError) as exc:
        error = f"no answer: {exc}"
    return ReplicaView(replica.name, service.host, tuple(service.gpus), listed is not None,
                       bool(listed and listed.healthy), listed.load if listed else None, running, queued, error,
                       router_status=listed.status if listed else None)


async def look(fleet: Any, via: Any = None) -> FleetView:
    """The router and every replica, now. Never raises. `via`: the session's `FleetReach`
    (console/session/fleet_reach.py: each URL from the host it is seen from), else all from here."""
    workers: list[Worker] = []
    error = gateway = None
    up = False
    try:
        router = via.router_client(timeout=LOOK_TIMEOUT_S) if via is not None else \
            RouterClient(fleet.router, timeout=LOOK_TIMEOUT_S, api_key=fleet.api_key())
        up = await router.health() == 200
        workers = await router.workers()
        gateway = str(await router.gateway())
    except (RouterError, ServerUnreachable, ServerAnswerError, ConfigError, OSError, ValueError) as exc:
        error = str(exc)

    def listed(replica: Any) -> Worker | None:
        return next((w for w in workers if w.url.rstrip("/") == replica.worker_url.rstrip("/")), None)

    replicas = await asyncio.gather(*(_replica(r, listed(r), via) for r in fleet.replicas))
    if error is not None:  # the listing is unknown: never say "out of the router" for what was not read
        replicas = [dataclasses.replace(r, state="unknown") for r in replicas]
    else:
        replicas = [dataclasses.replace(r, state=listing_state(r)) for r in replicas]
    return FleetView(fleet.router, up, tuple(replicas), time.time(), error, gateway)


def listing_state(replica: ReplicaView) -> str:
    """A replica's state as the router's listing alone says it (no run holds it)."""
    if replica.listed and replica.healthy:
        return "serving"
    if replica.router_status == "draining":  # smg's settle after a removal: no new request reaches it
        return "draining"
    return "unhealthy" if replica.listed else "out of the router"


def _live(state: Any) -> bool:
    """A console drives the run now (ours, another one, or one on another machine that cannot be told)."""
    from console.procedure.store import driven_elsewhere

    return state.status == "running" and driven_elsewhere(state) is not False


def run_state_of(name: str, states: Iterable[Any]) -> tuple[str, str] | None:
    """(state, run id) of replica `name` from the runs' states, newest first; None when no run holds it."""
    for state in states:
        svc = state.service
        drained = svc.drained or {}
        replica = drained.get("replica") or state.facts.get("fleet_replica")
        if replica != name:
            continue
        live = _live(state)
        if live and state.status_of("drain") == "running":
            return "draining", state.run_id
        if live and state.status_of("rejoin") == "running":
            return "rejoining", state.run_id
        if svc.drained is not None:
            return ("in window" if live else "DRAINED"), state.run_id
        return None  # the newest run on this replica has it back in the router
    return None


def with_runs(view: FleetView, states: Iterable[Any]) -> FleetView:
    """`view` with each replica's state as the runs say (newest run first)."""
    states = list(states)
    replicas = []
    for replica in view.replicas:
        found = run_state_of(replica.name, states)
        replicas.append(dataclasses.replace(replica, state=found[0], run_id=found[1]) if found else replica)
    return dataclasses.replace(view, replicas=tuple(replicas))


def drained_run(view: FleetView | None) -> str | None:
    """The run that left a replica DRAINED (no console drives it): what `r` resumes to put it back."""
    if view is None:
        return None
    return next((r.run_id for r in view.replicas if r.state == "DRAINED"), None)


def all_serving(view: FleetView | None) -> bool:
    """The router answers and lists every replica healthy (what `status` exits 0 for)."""
    return view is not None and view.error is None and view.router_up and view.healthy_count == len(view.replicas)
