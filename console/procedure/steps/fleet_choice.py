"""What the fleet window reads of the fleet before it changes it: each replica as the router lists it
and as it reports itself (`measure`), and the choice of the replica to drain or the refusal, with
its numbers (`choose`): every replica listed healthy, never the last healthy one, the load it carries
absorbed by the others' `max_running_requests` when they report it. Read at preflight (the choice,
console/procedure/steps/fleet.py) and again right before the removal (steps/fleet_guard.py).

The router's and the replicas' clients (`router_of`, `replica_client`) are the hosts' own when they
give them: the live session's, each URL reached from the host [fleet] says it is seen from
(console/session/fleet_reach.py), or the engine sweep's fake world (tests/fake_router.py); else the
URLs as written, from the console."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from console.service.replica_loads import read_loads
from console.service.router import RouterClient, RouterError
from console.service.sglang_api import ServerUnreachable, SglangClient

if TYPE_CHECKING:
    from console.config.fleet import FleetConfig, ReplicaConfig
    from console.procedure.window import Window

FLEET_ERRORS = (RouterError, ServerUnreachable)


@dataclass(frozen=True)
class ReplicaLoad:
    """What the choice reads of one replica: the router's listing and the replica's own figures."""

    name: str
    listed: bool
    healthy: bool
    running: int | None  # its /v1/loads num_running_reqs (+ waiting); None when unreadable
    capacity: int | None  # its /server_info max_running_requests; None when it does not say
    listed_as: str | None = None  # how the router lists it when not healthy (smg: "draining", ...)


@dataclass(frozen=True)
class Choice:
    replica: str | None  # the replica to drain, or None: refused
    why: str  # the reason it was chosen, or the refusal


def choose(loads: list[ReplicaLoad], eligible: set[str] | None = None) -> Choice:
    """The replica to drain, or the refusal (with its numbers). `eligible`: the replicas whose GPUs
    fit the extraction and that have the drafters' kernels (None: all)."""
    unhealthy = [r.name for r in loads if not (r.listed and r.healthy)]
    if unhealthy:
        said = ", ".join(f"{r.name} ({r.listed_as or 'unhealthy' if r.listed else 'not listed'})" for r in loads
                         if r.name in unhealthy)
        return Choice(None, f"the router does not list every replica healthy: {said}; the fleet window runs only "
                            f"while all are")
    unknown = [r.name for r in loads if r.running is None]
    if unknown:
        return Choice(None, f"the running requests of {', '.join(unknown)} cannot be read (its /v1/loads): the "
                            f"load the others would take cannot be measured")
    if len(loads) < 2:
        return Choice(None, f"{loads[0].name if loads else 'no replica'} is the last healthy replica: it is never "
                            f"drained")
    candidates = [r for r in loads if eligible is None or r.name in eligible]
    if not candidates:
        return Choice(None, "no replica can take the window (GPUs that hold the extraction, the drafters' kernels) "
                            "as the last preflight found; `dflash-ops run --replica NAME` tries one again")
    chosen = min(candidates, key=lambda r: (r.running, r.name))
    others = [r for r in loads if r.name != chosen.name]
    total = sum(r.running or 0 for r in loads)
    caps = [r.capacity for r in others]
    if all(c is not None for c in caps):
        room = sum(c for c in caps if c is not None)
        if total > room:
            return Choice(None, f"the others cannot absorb the load: {total} running request(s) in the fleet, the "
                                f"replicas left ({', '.join(r.name for r in others)}) take at most {room} "
                                f"(max_running_requests)")
        fit = f"{total} running in the fleet, the others take up to {room}"
    else:
        fit = f"{total} running in the fleet; the others' max_running_requests not reported, not checked"
    how = f"the fewest running requests ({chosen.running})" if len(candidates) > 1 else \
        f"{chosen.running} running request(s)"  # the one candidate (named with --replica, or the only one that fits)
    return Choice(chosen.name, f"{chosen.name}: {how}; {fit}")


def _router(fleet: FleetConfig) -> RouterClient:
    return RouterClient(fleet.router, api_key=fleet.api_key())


def router_of(window: Window) -> Any:
    """The router's client for this run: the hosts' own when they give one (the engine sweep's fake
    world: tests/fake_router.py), else the router at [fleet] router."""
    made = getattr(getattr(window, "hosts", None), "router_client", None)
    return made() if made is not None else _router(window.config.fleet)


def replica_client(window: Window, replica: ReplicaConfig) -> Any:
    """The replica's own HTTP client (its /metrics, /health_generate), the hosts' own when they give one."""
    made = getattr(getattr(window, "hosts", None), "replica_client", None)
    return made(replica) if made is not None else SglangClient(replica.service.url)


async def _capacity(client: SglangClient) -> int | None:
    try:
        info = await client.server_info()
    except Exception:  # an unreadable /server_info: capacity unknown (said in the choice's reason)
        return None
    for source in (info, *(info.get("internal_states") or [])[:1]):
        value = source.get("max_running_requests") if isinstance(source, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


async def measure(fleet: FleetConfig, via: Any = None) -> list[ReplicaLoad]:
    """Each replica as the router lists it and as it reports itself. RouterError when the router
    does not answer /health 200. `via`: hosts that give the router's and replicas' clients (the
    sweep's fake world: tests/fake_router.py), else the router at [fleet] router."""
    router = via.router_client() if via is not None else _router(fleet)
    status = await router.health()
    if status != 200:
        raise RouterError(f"router {fleet.router}: GET /health answers {status}: the fleet window needs the router up")
    workers = await router.workers()

    async def one(replica: ReplicaConfig) -> ReplicaLoad:
        listed = next((w for w in workers if w.url.rstrip("/") == replica.worker_url.rstrip("/")), None)
        client = via.replica_client(replica) if via is not None else SglangClient(replica.service.url)
        running = None
        try:
            loads = await read_loads(client)
            running = loads.running + loads.queued
        except Exception:  # unreadable: the choice refuses and says so
            pass
        return ReplicaLoad(replica.name, listed is not None, bool(listed and listed.healthy), running,
                           await _capacity(client), listed.status if listed is not None and not listed.healthy else None)

    return list(await asyncio.gather(*(one(r) for r in fleet.replicas)))


