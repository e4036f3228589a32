"""A fake of SGLang's router (the sglang-router 0.3.2 API) for the fleet window's engine sweep: the fake
world's service (`tests/engine_fakes.py`) is replica r1 (`in_world`: r2, for a run's second window
on it), the other always serves. It answers as the real
router does (docs/sglang.md, "Router"; checked against the real one in tests/test_router.py and
tests/test_fleet_steps.py): a removal drops the worker from the listing and from the rotation at once;
an add lists it healthy once the replica answers its health check, with a new id; an add of a listed
URL changes nothing (the real one fails it in the background); inference requests go round-robin
over the listed workers. Every removal and add is recorded, so the sweep can count them.

Each console gets its own clients (`clients(hosts)`): a dead console's calls never reach the world."""

from __future__ import annotations

import itertools
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from console.service.router import SGLANG_ROUTER, Gateway, RouterError, Worker
from console.service.sglang_api import HttpAnswer, ServerUnreachable

R2 = "http://127.0.0.1:30002"


@dataclass
class FakeRouter:
    world: Any  # the fake world: its service is r1
    r1: str
    workers: dict[str, str] = field(default_factory=dict)  # url -> id, the listing
    removals: list[str] = field(default_factory=list)
    adds: list[str] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)  # url -> requests it answered
    in_world: str = ""  # the replica whose server is the world's service ("": r1); the others always serve
    # Faults (tests/test_fleet_guard_sweep.py): workers the router's health check finds unhealthy, and
    # the router itself down (stopped, before its restart).
    sick: set[str] = field(default_factory=set)
    down: bool = False
    before_idle: Any = None  # an async hook awaited before a replica's /v1/loads answers (a fault's moment)
    _turn: Any = None

    def __post_init__(self) -> None:
        self.workers = {self.r1: str(uuid.uuid4()), R2: str(uuid.uuid4())}
        self.served = {self.r1: 0, R2: 0}
        self._turn = itertools.count()

    def replica_up(self, url: str) -> bool:
        if url != (self.in_world or self.r1):
            return True
        service = self.world.service
        return service.state == "active" and bool(service.ready)


class RouterClientView:
    """What `console.service.router.RouterClient` offers, over the fake router, for one console."""

    def __init__(self, router: FakeRouter, hosts: Any):
        self.router, self.hosts = router, hosts
        self.inference = InferenceView(router, hosts)

    async def health(self) -> int:
        self.hosts._alive()
        self._up()
        return 200

    def _up(self) -> None:
        if self.router.down:
            raise ServerUnreachable("router fake: connection refused (the router is down)")

    async def gateway(self) -> Gateway:
        return Gateway(SGLANG_ROUTER)

    async def settle(self) -> float:
        return 0.0  # the sweep's world has no request on its way

    async def workers(self) -> list[Worker]:
        self.hosts._alive()
        self._up()
        return [Worker(wid, url, url not in self.router.sick, "fake", 0) for url, wid in self.router.workers.items()]

    async def worker(self, url: str) -> Worker | None:
        return next((w for w in await self.workers() if w.url == url), None)

    async def remove_worker(self, url: str) -> str:
        self.hosts._alive()
        self._up()
        wid = self.router.workers.pop(url, None)
        if wid is None:
            raise RouterError(f"router fake: no worker listed at {url}: nothing to remove")
        self.router.removals.append(url)
        self.router.in_world = url  # the world's unit stands for the replica drained now (its window)
        return wid

    async def add_worker(self, url: str, spec: dict | None = None) -> str:
        self.hosts._alive()
        self._up()
        self.router.adds.append(url)
        wid = str(uuid.uuid4())
        if url not in self.router.workers and self.router.replica_up(url):  # its health check passed
            self.router.workers[url] = wid
        return wid

    async def wait_listed(self, url: str, timeout_s: float, healthy: bool = True) -> Worker:
        found = await self.worker(url)
        if found is None:
            raise RouterError(f"router fake: {url} was not listed {timeout_s:g} s after it was added")
        return found

    async def wait_gone(self, url: str, timeout_s: float) -> None:
        if await self.worker(url) is not None:
            raise RouterError(f"router fake: {url} still listed {timeout_s:g} s after its removal")


class InferenceView:
    """The router's inference routes: round-robin over the listed workers."""

    def __init__(self, router: FakeRouter, hosts: Any):
        self.router, self.hosts = router, hosts

    async def post(self, path: str, body: dict) -> HttpAnswer:
        self.hosts._alive()
        listed = list(self.router.workers)
        url = listed[next(self.router._turn) % len(listed)]
        if not self.router.replica_up(url):
            return HttpAnswer(502, b'{"error": "worker unreachable"}', "application/json")
        self.router.served[url] += 1
        return HttpAnswer(200, b'{"text": "x"}', "application/json")


class ReplicaView:
    """A replica's own routes the fleet steps read: /v1/loads and /metrics (idle: the fake world runs
    no user requests), /health_generate, /server_info."""

    def __init__(self, router: FakeRouter, hosts: Any, url: str):
        self.router, self.hosts, self.base_url = router, hosts, url
        self._snapshots = itertools.count(1)  # each reading a newer snapshot (the replica's own clock)

    async def metrics(self) -> dict[str, float]:
        self.hosts._alive()
        return {"sglang:num_running_reqs": 0.0, "sglang:num_queue_reqs": 0.0,
                "sglang:num_requests_total": float(self.router.served.get(self.base_url, 0))}

    async def get(self, path: str, timeout: float | None = None) -> HttpAnswer:
        self.hosts._alive()
        if path.startswith("/v1/loads"):  # idle, in a snapshot taken now
            if self.router.before_idle is not None:
                await self.router.before_idle(self.base_url)
            load = {"timestamp": float(next(self._snapshots)), "dp_rank": 0, "num_running_reqs": 0,
                    "num_waiting_reqs": 0}
            return HttpAnswer(200, json.dumps({"loads": [load]}).encode(), "application/json")
        assert path == "/health_generate", path
        return HttpAnswer(200 if self.router.replica_up(self.base_url) else 503, b"", "text/plain")

    async def server_info(self) -> dict:
        self.hosts._alive()
        return {}


def attach(hosts: Any, router: FakeRouter) -> None:
    """Give one console's hosts the router's and the replicas' clients (what fleet.router_of reads)."""
    hosts.router_client = lambda: RouterClientView(router, hosts)
    hosts.replica_client = lambda replica: ReplicaView(router, hosts, replica.service.url)
