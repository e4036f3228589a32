"""A client for SGLang's router (`sglang-router` 0.3.2, the Rust model gateway): its workers, their
health and load, adding and removing one.

The contract, each fact with where it was read or seen: docs/sglang.md, "Router". In short:
`GET /workers` lists `{"workers": [{"id" (a UUID), "url", "model_id", "is_healthy", "load", ...}],
"total", "stats"}`; `POST /workers {"url"}` and `DELETE /workers/{id}` answer 202 "queued for
background processing" (the change lands a moment later: callers wait for the listing to show it);
an unknown id is 404 `{"error", "code": "WORKER_NOT_FOUND"}`, a malformed one 400. With
`--control-plane-api-keys` the worker routes want `Authorization: Bearer KEY` of an admin key (401
without or with a wrong one, 403 for a user key); `/health`, `/readiness` and the inference routes
stay open.

Requests go through `console.service.sglang_api`'s machinery (one total deadline per request, its
two transport errors); every answer the router should not give is a `RouterError` naming the router's
URL, the route and what came back.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

from console.service.sglang_api import (
    DEFAULT_TIMEOUT_S,
    HttpAnswer,
    ServerUnreachable,
    SglangClient,
    _excerpt,
    _request,
    server_summary,
)

__all__ = ["RouterClient", "RouterError", "ServerUnreachable", "Worker", "wait_idle"]

UNAUTHORIZED = "the router wants an admin API key: set [fleet] api_key_env"
FORBIDDEN = "the router refused the key: worker routes need a key with the admin role"
POLL_S = 0.2  # how often a wait reads the listing again (the router applies changes in the background)


class RouterError(Exception):
    """The router answered, but not as sglang-router 0.3.2 does, or refused; the message names the
    router's URL, the route and the answer."""


@dataclass(frozen=True)
class Worker:
    """One worker as the router lists it. `load`: the router's own count of its requests in flight to
    that worker (counted under load-tracking policies such as cache_aware; 0 under round_robin)."""

    id: str
    url: str
    healthy: bool
    model: str
    load: int
    worker_type: str = "regular"


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


class RouterClient:
    """Talks to one router at `base_url` (e.g. "http://127.0.0.1:30000")."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # never shown or logged

    def __repr__(self) -> str:
        return f"RouterClient({self.base_url!r}, api key {'set' if self._headers else 'none'})"

    async def _call(self, method: str, path: str, body: dict | None = None) -> HttpAnswer:
        data = json.dumps(body).encode() if body is not None else None
        return await asyncio.to_thread(_request, self.base_url + path, data, self.timeout, self._headers,
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

    async def workers(self) -> list[Worker]:
        """GET /workers: every worker the router knows, healthy or not."""
        route = "GET /workers"
        data = self._json(route, await self._call("GET", "/workers"))
        listed = data.get("workers")
        if not isinstance(listed, list):
            raise RouterError(f"router {self.base_url}: {route}: expected 'workers' (a list), got keys {sorted(data)[:8]}")
        return [self._worker(route, item) for item in listed]

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
        model = item.get("model_id")
        return Worker(id=wid, url=url, healthy=healthy, model=model if isinstance(model, str) else "",
                      load=load, worker_type=str(item.get("worker_type", "regular")))

    async def worker(self, url: str) -> Worker | None:
        """The worker listed under `url`, or None when the router does not list it."""
        return next((w for w in await self.workers() if _same_url(w.url, url)), None)

    async def loads(self) -> dict[str, int]:
        """Each listed worker's load (the router's requests in flight to it), by URL."""
        return {w.url: w.load for w in await self.workers()}

    async def add_worker(self, url: str) -> str:
        """POST /workers {"url"}: the router checks the worker and adds it in the background. Returns
        the worker id it announced; `wait_listed` sees it land."""
        route = "POST /workers"
        data = self._json(route, await self._call("POST", "/workers", {"url": url}), (200, 202))
        wid = data.get("worker_id")
        if not isinstance(wid, str) or not wid:
            raise RouterError(f"router {self.base_url}: {route}: expected 'worker_id' in the answer, got "
                              f"{_excerpt(json.dumps(data).encode())}")
        return wid

    async def remove_worker(self, url: str) -> str:
        """DELETE /workers/{id} of the worker listed under `url` (the router takes ids, not URLs):
        it stops routing to it. Returns the id; `wait_gone` sees it leave the listing. A worker that is
        not listed is a RouterError (nothing to remove)."""
        found = await self.worker(url)
        if found is None:
            raise RouterError(f"router {self.base_url}: no worker listed at {url}: nothing to remove")
        route = f"DELETE /workers/{found.id}"
        answer = await self._call("DELETE", f"/workers/{found.id}")
        if answer.status == 404:
            raise RouterError(f"router {self.base_url}: {route} ({url}): HTTP 404, the router no longer knows it: "
                              f"{_excerpt(answer.body)}")
        self._json(route, answer, (200, 202))
        return found.id

    async def wait_listed(self, url: str, timeout_s: float, healthy: bool = True) -> Worker:
        """Until the router lists `url` (healthy, unless `healthy` is False); RouterError after
        `timeout_s`, saying what the listing showed last."""
        deadline = time.monotonic() + timeout_s
        last: Worker | None = None
        while True:
            last = await self.worker(url)
            if last is not None and (last.healthy or not healthy):
                return last
            if time.monotonic() >= deadline:
                seen = "not listed" if last is None else "listed but unhealthy"
                raise RouterError(f"router {self.base_url}: {url} was {seen} {timeout_s:g} s after it was added")
            await asyncio.sleep(POLL_S)

    async def wait_gone(self, url: str, timeout_s: float) -> None:
        """Until the router no longer lists `url`; RouterError after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while await self.worker(url) is not None:
            if time.monotonic() >= deadline:
                raise RouterError(f"router {self.base_url}: {url} still listed {timeout_s:g} s after its removal")
            await asyncio.sleep(POLL_S)


async def wait_idle(replica: SglangClient, bound_s: float, poll_s: float = POLL_S) -> float:
    """Until the replica itself runs and queues no request (its /metrics `sglang:num_running_reqs` and
    `sglang:num_queue_reqs`, SGLang's `--enable-metrics`): what a drained replica waits for once the
    router stops sending it requests. Returns the seconds waited; RouterError naming the replica, what
    it still had and the bound when it is not idle within `bound_s`, or when it serves no /metrics."""
    began = time.monotonic()
    while True:
        values = await replica.metrics()
        if values is None:
            raise RouterError(f"replica {replica.base_url}: GET /metrics: HTTP 404: it serves no metrics, so its "
                              "requests cannot be seen to end (start it with --enable-metrics)")
        summary = server_summary(values)
        running, queued = summary["running_requests"], summary["queued_requests"]
        if running is None:
            raise RouterError(f"replica {replica.base_url}: GET /metrics: no sglang:num_running_reqs in it")
        if running == 0 and not queued:
            return time.monotonic() - began
        if time.monotonic() - began >= bound_s:
            raise RouterError(f"replica {replica.base_url}: still {running:g} running and {queued or 0:g} queued "
                              f"request(s) {bound_s:g} s after it left the router (the bound)")
        await asyncio.sleep(poll_s)
