"""A client for SGLang's router, whichever of its two gateways answers: `smg` (the Shepherd Model
Gateway, 1.13.0: what SGLang's router became) or the older `sglang-router` (0.3.2). It finds out which
one it talks to (`gateway`), says so, and speaks each one's worker API through the same methods.

The contract, each fact with where it was read or seen: docs/sglang.md, "Router". In short, both:
`GET /workers` lists `{"workers": [{"id", "url", "model_id", "is_healthy", "load", ...}], "total",
"stats"}`; `POST /workers {"url"}` and `DELETE /workers/{id}` answer 202 "queued for background
processing" (the change lands a moment later: callers wait for the listing to show it); an unknown id
is 404 `{"error", "code": "WORKER_NOT_FOUND"}`, a malformed one 400. With `--control-plane-api-keys`
the worker routes want `Authorization: Bearer KEY` of an admin key (401 without or with a wrong one,
403 for a user key); `/health`, `/readiness` and the inference routes stay open. Where they differ:

- smg lists each worker's `status` (pending, ready, not_ready, failed, draining) and its spec
  (`priority`, `cost`, per-worker `health` overrides, ...). A removal marks the worker `draining` (no
  new requests, `is_healthy` false) and removes it `drain_settle_secs` later (5 s unless the worker's
  `health` says otherwise): the gateway's own settle. A second DELETE while it drains removes it at
  once, cutting that settle short: `remove_worker` never sends one. An add of a URL it lists (draining
  included) is refused at once, 409 `WORKER_ALREADY_EXISTS`; its `/get_loads` says `"version":
  "smg-1.13.0"`.
- sglang-router drops a removed worker at once (no settle: `settle` waits `LEGACY_SETTLE_S` of our own
  for requests already on their way), lists no `status`, and takes an add of a listed URL with 202
  (failing it in the background).

Requests go through `console.service.sglang_api`'s machinery (one total deadline per request, its
two transport errors); every answer the router should not give is a `RouterError` naming the router's
URL, the route and what came back.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from console.service.replica_loads import Loads, LoadsUnreadable, read_loads
from console.service.sglang_api import (
    DEFAULT_TIMEOUT_S,
    HttpAnswer,
    ServerUnreachable,
    _excerpt,
    _request,
)

__all__ = ["SMG", "SGLANG_ROUTER", "Gateway", "RouterClient", "RouterError", "ServerUnreachable", "Worker",
           "wait_idle"]

UNAUTHORIZED = "the router wants an admin API key: set [fleet] api_key_env"
FORBIDDEN = "the router refused the key: worker routes need a key with the admin role"
POLL_S = 0.2  # how often a wait reads the listing again (the router applies changes in the background)
REMOVAL_SEEN_S = 5.0  # a removal smg accepted (202) shows in its listing within this
SMG = "smg"
SGLANG_ROUTER = "sglang-router"
# sglang-router drops a removed worker at once; a request it forwarded just before may still be on its
# way into the replica's scheduler (tokenizing), where no load snapshot counts it yet. smg waits its
# own settle (drain_settle_secs) before it lets the worker go; for the old router we wait this long.
LEGACY_SETTLE_S = 1.0
SMG_DEFAULT_SETTLE_S = 5  # smg 1.13's drain_settle_secs when neither the worker nor the binary says
# What a rejoin gives smg back of the worker's spec as it was listed before its removal: the
# operator's own settings (the rest, models and labels, smg discovers from the worker again).
# `api_key` is never listed: a worker registered with its own key gets the gateway's --api-key back.
REJOIN_SPEC_KEYS = ("priority", "cost", "health", "http_pool", "resilience")
VERSION_TIMEOUT_S = 5.0  # smg's /get_loads asks every worker: a short look, only to name the version
_SMG_VERSIONS: dict[str, str] = {}  # router URL -> the version smg said, asked once per process


class RouterError(Exception):
    """The router answered, but not as smg 1.13 or sglang-router 0.3.2 do, or refused; the message
    names the router's URL, the route and the answer."""


@dataclass(frozen=True)
class Gateway:
    """Which router answers: `kind` smg or sglang-router, and its version when it says it."""

    kind: str
    version: str | None = None

    def __str__(self) -> str:
        return f"{self.kind} {self.version}" if self.version else self.kind

    @property
    def settles(self) -> bool:
        """It keeps a removed worker draining for a settle of its own before letting it go (smg)."""
        return self.kind == SMG


@dataclass(frozen=True)
class Worker:
    """One worker as the router lists it. `load`: the router's own count of its requests in flight to
    that worker (counted under load-tracking policies such as cache_aware; 0 under round_robin).
    `status`: smg's lifecycle state (None from sglang-router); `spec`: the settings smg lists and a
    rejoin gives back (`REJOIN_SPEC_KEYS`)."""

    id: str
    url: str
    healthy: bool
    model: str
    load: int
    worker_type: str = "regular"
    status: str | None = None
    spec: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def draining(self) -> bool:
        """Removed and settling (smg): routed no new request, listed until its settle ends."""
        return self.status == "draining"

    @property
    def settle_s(self) -> float | None:
        """The worker's own drain_settle_secs override, if it has one (smg)."""
        health = self.spec.get("health")
        value = health.get("drain_settle_secs") if isinstance(health, dict) else None
        return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class RouterClient:
    """Talks to one router at `base_url` (e.g. "http://127.0.0.1:30000"), smg or sglang-router."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # never shown or logged
        self._gateway: Gateway | None = None
        self._shape: str | None = None  # what the last listing looked like: SMG, SGLANG_ROUTER, or None (empty)

    def __repr__(self) -> str:
        return f"RouterClient({self.base_url!r}, api key {'set' if self._headers else 'none'})"

    async def _call(self, method: str, path: str, body: dict | None = None, timeout: float | None = None) -> HttpAnswer:
        data = json.dumps(body).encode() if body is not None else None
        return await asyncio.to_thread(_request, self.base_url + path, data, timeout or self.timeout, self._headers,
                                       method)

    def _fail(self, route: str, answer: HttpAnswer, expected: str | None = None) -> RouterError:
        where = f"router {self.base_url}: {route}"
        if answer.status == 401:
            return RouterError(f"{where}: HTTP 401: {UNAUTHORIZED}"
                               + ("; the key given was refused" if self._headers else ""))
        if answer.status == 403:
            return RouterError(f"{where}: HTTP 403: {FORBIDDEN}")
        if expected is not None:
            return RouterError(f"{where}: expected {expected}, got HTTP {answer.status} {_excerpt(answer.body)}")
        return RouterError(f"{where}: HTTP {answer.status}: {_excerpt(answer.body)}")

    def _json(self, route: str, answer: HttpAnswer, statuses: tuple[int, ...] = (200,)) -> dict:
        if answer.status not in statuses:
            raise self._fail(route, answer)
        try:
            data = json.loads(answer.body)
        except json.JSONDecodeError:
            raise self._fail(route, answer, "a JSON object") from None
        if not isinstance(data, dict):
            raise self._fail(route, answer, "a JSON object")
        return data

    async def health(self) -> int:
        """HTTP status of the router's own GET /health (200 while it serves)."""
        return (await self._call("GET", "/health")).status

    async def _listing(self) -> list[Any]:
        route = "GET /workers"
        data = self._json(route, await self._call("GET", "/workers"))
        listed = data.get("workers")
        if not isinstance(listed, list):
            raise RouterError(f"router {self.base_url}: {route}: expected 'workers' (a list), got keys {sorted(data)[:8]}")
        if listed:
            says_status = any(isinstance(item, dict) and "status" in item for item in listed)
            self._shape = SMG if says_status else SGLANG_ROUTER
        return listed

    async def workers(self) -> list[Worker]:
        """GET /workers: every worker the router knows, healthy or not (smg: draining ones too)."""
        return [self._worker("GET /workers", item) for item in await self._listing()]

    def _worker(self, route: str, item: Any) -> Worker:
        def bad(what: str) -> RouterError:
            return RouterError(f"router {self.base_url}: {route}: a worker without {what}: {_excerpt(json.dumps(item).encode())}")

        if not isinstance(item, dict):
            raise bad("its fields (not an object)")
        wid, url, healthy, load = item.get("id"), item.get("url"), item.get("is_healthy"), item.get("load", 0)
        if not isinstance(wid, str) or not wid:
            raise bad("an 'id'")
        if not isinstance(url, str) or not url:
            raise bad("a 'url'")
        if not isinstance(healthy, bool):
            raise bad("'is_healthy' (true or false)")
        if not isinstance(load, int) or isinstance(load, bool):
            raise bad("a 'load' (an integer)")
        status = item.get("status")
        if status is not None and not isinstance(status, str):
            raise bad("a 'status' (a string)")
        model = item.get("model_id")
        return Worker(id=wid, url=url, healthy=healthy, model=model if isinstance(model, str) else "",
                      load=load, worker_type=str(item.get("worker_type", "regular")), status=status,
                      spec={k: item[k] for k in REJOIN_SPEC_KEYS if k in item})

    async def gateway(self) -> Gateway:
        """Which gateway this is, asked once: smg lists each worker's `status` and names itself in
        `/get_loads` ("version": "smg-1.13.0"); sglang-router 0.3.2 does neither. With no worker
        listed, `/get_loads` alone tells (sglang-router's asks every worker, slowly: only then)."""
        if self._gateway is not None:
            return self._gateway
        if self._shape is None:
            await self._listing()
        version = await self._smg_version() if self._shape != SGLANG_ROUTER else None
        self._gateway = Gateway(SMG, version) if version is not None or self._shape == SMG else Gateway(SGLANG_ROUTER)
        return self._gateway

    async def _smg_version(self) -> str | None:
        """"1.13.0" from smg's GET /get_loads ("version": "smg-1.13.0"), else None."""
        if self.base_url in _SMG_VERSIONS:
            return _SMG_VERSIONS[self.base_url]
        try:
            answer = await self._call("GET", "/get_loads", timeout=min(self.timeout, VERSION_TIMEOUT_S))
            data = json.loads(answer.body) if answer.status == 200 else None
        except (ServerUnreachable, OSError, ValueError):
            return None
        said = data.get("version") if isinstance(data, dict) else None
        if not isinstance(said, str) or not said.startswith("smg-"):
            return None
        _SMG_VERSIONS[self.base_url] = said.removeprefix("smg-")
        return _SMG_VERSIONS[self.base_url]

    async def worker(self, url: str) -> Worker | None:
        """The worker listed under `url`, or None when the router does not list it."""
        return next((w for w in await self.workers() if _same_url(w.url, url)), None)

    async def loads(self) -> dict[str, int]:
        """Each listed worker's load (the router's requests in flight to it), by URL."""
        return {w.url: w.load for w in await self.workers()}

    async def add_worker(self, url: str, spec: dict[str, Any] | None = None, settle_bound_s: float = 60.0) -> str:
        """POST /workers {"url", ...}: the router checks the worker and adds it in the background.
        Returns the worker id it announced; `wait_listed` sees it land. To smg the body also carries
        `spec` (the worker's settings as listed before its removal, `REJOIN_SPEC_KEYS`); its 409 for a
        URL it still lists draining is waited out (within `settle_bound_s`) and the add sent again, and
        for one it lists otherwise, that worker's id is the answer (it is in already)."""
        gateway = await self.gateway()
        body = {"url": url, **{k: v for k, v in (spec or {}).items() if k in REJOIN_SPEC_KEYS}} \
            if gateway.kind == SMG else {"url": url}
        route = "POST /workers"
        answer = await self._call("POST", "/workers", body)
        if answer.status == 409:
            listed = await self.worker(url)
            if listed is not None and not listed.draining:
                return listed.id
            if listed is not None:
                await self.wait_gone(url, settle_bound_s)
            answer = await self._call("POST", "/workers", body)
        data = self._json(route, answer, (200, 202))
        wid = data.get("worker_id")
        if not isinstance(wid, str) or not wid:
            raise RouterError(f"router {self.base_url}: {route}: expected 'worker_id' in the answer, got "
                              f"{_excerpt(json.dumps(data).encode())}")
        return wid

    async def remove_worker(self, url: str) -> str:
        """DELETE /workers/{id} of the worker listed under `url` (the router takes ids, not URLs):
        it stops routing to it. Returns the id once the listing shows the removal under way (smg:
        draining; at most REMOVAL_SEEN_S); `wait_gone` sees it leave the listing (smg: after its
        settle). A worker smg lists draining is being removed already: nothing is sent (a second
        DELETE would cut its settle short). One not listed is a RouterError (nothing to remove)."""
        found = await self.worker(url)
        if found is None:
            raise RouterError(f"router {self.base_url}: no worker listed at {url}: nothing to remove")
        if found.draining:
            return found.id
        route = f"DELETE /workers/{found.id}"
        answer = await self._call("DELETE", f"/workers/{found.id}")
        if answer.status == 404:
            raise RouterError(f"router {self.base_url}: {route} ({url}): HTTP 404, the router no longer knows it: "
                              f"{_excerpt(answer.body)}")
        self._json(route, answer, (200, 202))
        # smg answers 202 and removes in a job of its own: until the listing shows it draining (or
        # gone), a look (this console's, after a crash another's) would still see it ready and send a
        # second DELETE, which cuts its settle short. Waited for here, on the listing, briefly.
        deadline = time.monotonic() + REMOVAL_SEEN_S
        while time.monotonic() < deadline:
            now = await self.worker(url)
            if now is None or now.draining:
                break
            await asyncio.sleep(POLL_S)
        return found.id

    async def wait_listed(self, url: str, timeout_s: float, healthy: bool = True) -> Worker:
        """Until the router lists `url` (healthy, unless `healthy` is False; never one draining);
        RouterError after `timeout_s`, saying what the listing showed last."""
        deadline = time.monotonic() + timeout_s
        last: Worker | None = None
        while True:
            last = await self.worker(url)
            if last is not None and not last.draining and (last.healthy or not healthy):
                return last
            if time.monotonic() >= deadline:
                seen = "not listed" if last is None else f"listed {last.status or 'unhealthy'}"
                raise RouterError(f"router {self.base_url}: {url} was {seen} {timeout_s:g} s after it was added")
            await asyncio.sleep(POLL_S)

    async def wait_gone(self, url: str, timeout_s: float) -> None:
        """Until the router no longer lists `url` (smg: once its settle is over); RouterError after
        `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while (last := await self.worker(url)) is not None:
            if time.monotonic() >= deadline:
                how = " (draining)" if last.draining else ""
                raise RouterError(f"router {self.base_url}: {url} still listed{how} {timeout_s:g} s after its removal")
            await asyncio.sleep(POLL_S)

    async def settle(self) -> float:
        """What follows a removal once the worker left the listing: nothing for smg (its settle was the
        draining that just ended), `LEGACY_SETTLE_S` for sglang-router. Returns the seconds waited."""
        if (await self.gateway()).settles:
            return 0.0
        await asyncio.sleep(LEGACY_SETTLE_S)
        return LEGACY_SETTLE_S


async def wait_idle(replica: Any, bound_s: float, poll_s: float = POLL_S) -> float:
    """Until the replica itself runs and queues no request, as its own /v1/loads says in a snapshot
    taken after the first one read here (`console.service.replica_loads`: never the /metrics gauges):
    what a replica waits for once the router stopped sending it requests and its settle is over.
    Returns the seconds waited; RouterError naming the replica, what it still had and the bound when
    it is not idle within `bound_s`, or when its /v1/loads cannot be read."""
    began = time.monotonic()
    try:
        first: Loads = await read_loads(replica)
        while True:
            now = await read_loads(replica)
            if now.idle and now.newer_than(first):
                return time.monotonic() - began
            if time.monotonic() - began >= bound_s:
                if not now.newer_than(first):
                    raise RouterError(f"replica {replica.base_url}: its /v1/loads snapshot was not renewed within "
                                      f"{bound_s:g} s after it left the router (the bound): it cannot be seen idle")
                raise RouterError(f"replica {replica.base_url}: still {now.running} running and {now.queued} queued "
                                  f"request(s) {bound_s:g} s after it left the router (the bound)")
            await asyncio.sleep(poll_s)
    except LoadsUnreadable as exc:
        raise RouterError(str(exc)) from None
