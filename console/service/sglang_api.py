"""A small client for SGLang's HTTP API (and the rehearsal server), reached through a forwarded port.

Endpoints (KERNELS.md, SGLang 0.5.23): `/health` (503 while starting), `/model_info` then the older
`/get_model_info`, `/server_info` then `/get_server_info`, optional `/metrics` (Prometheus text),
`/generate`. Every answer is checked: a malformed one raises `ServerAnswerError` naming the
endpoint, what was expected and what came back. Blocking http.client calls run in a thread.

Every request has a total deadline (connect, status line, headers and the whole body), not only a
per-read timeout: a server that trickles its answer a byte at a time must not hold the console. Any
transport failure is one of this module's two errors, with the URL and what had arrived:
`ServerUnreachable` (no HTTP answer at all) or `ServerAnswerError` (an answer that is not HTTP, is
cut short, or did not complete in time).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import re
import time
from dataclasses import dataclass
from typing import Any

from remote import http_deadline

DEFAULT_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 64 << 20  # no SGLang answer the console asks for comes near this
READY_PROMPT_IDS = [1, 2, 3]  # any valid ids: readiness asks for one generated token, not its meaning


class ServerAnswerError(Exception):
    """The server answered, but not as SGLang does; the message names the endpoint and the answer."""


class ServerUnreachable(Exception):
    """No HTTP answer at all (connection refused, reset, timed out)."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes
    content_type: str


def _excerpt(body: bytes) -> str:
    text = body.decode(errors="replace").strip()
    return repr(text[:120] + ("..." if len(text) > 120 else ""))


def _request(url: str, data: bytes | None, timeout: float) -> HttpAnswer:
    """GET (or POST `data`) with a total deadline of `timeout` seconds; any HTTP status is returned.

    The request is `remote.http_deadline.request` (a watchdog ends a blocked read at the deadline;
    a short body is an error, never taken for the whole answer); its failures become this module's
    two errors.
    """
    try:
        answer = http_deadline.request(url, data, timeout, max_body=MAX_BODY_BYTES)
    except http_deadline.HttpDeadlineError as err:
        exc = err.cause
        if err.kind == "bad_url":
            raise ServerUnreachable(f"{url}: {exc}" if exc is not None else f"{url}: not an http(s) URL") from None
        if err.kind == "no_answer":
            if isinstance(exc, http.client.RemoteDisconnected):  # also a BadStatusLine: nothing came back at all
                raise ServerUnreachable(f"{url}: no answer (the server closed the connection without answering)") from None
            if isinstance(exc, http.client.BadStatusLine) and not err.expired:
                raise ServerAnswerError(f"{url}: not an HTTP answer: {_excerpt(str(exc.args[0] if exc.args else '').encode())}") from None
            if isinstance(exc, http.client.HTTPException) and not isinstance(exc, http.client.BadStatusLine):
                raise ServerAnswerError(f"{url}: malformed HTTP answer ({type(exc).__name__}: {exc})") from None
            if err.expired:
                raise ServerUnreachable(f"{url}: no answer within {timeout:g} s") from None
            raise ServerUnreachable(f"{url}: no answer ({exc})") from None
        if err.kind == "too_large":
            raise ServerAnswerError(f"{url}: HTTP {err.status} answer larger than {MAX_BODY_BYTES >> 20} MiB") from None
        raise ServerAnswerError(f"{url}: HTTP {err.status} answer {err.cut_short(exc_message=True)} after "
                                f"{err.received()}: {_excerpt(err.body)}") from None
    return HttpAnswer(answer.status, answer.body, answer.content_type)


class SglangClient:
    """Talks to one server at `base_url` (e.g. "http://127.0.0.1:40123", the forwarded port)."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, deadline: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout  # seconds per request, all of it
        self.deadline = deadline  # time.monotonic() after which no request is made or waited for

    def within(self, seconds: float) -> SglangClient:
        """This client with every request also ending within `seconds` from now (e.g. a wait's end)."""
        deadline = time.monotonic() + max(0.0, seconds)
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        return SglangClient(self.base_url, self.timeout, deadline)

    def _budget(self, url: str, timeout: float | None) -> float:
        budget = timeout or self.timeout
        if self.deadline is not None:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise ServerUnreachable(f"{url}: not asked: the time allowed has run out")
            budget = min(budget, left)
        return budget

    async def get(self, path: str, timeout: float | None = None) -> HttpAnswer:
        url = self.base_url + path
        return await asyncio.to_thread(_request, url, None, self._budget(url, timeout))

    async def post(self, path: str, body: dict, timeout: float | None = None) -> HttpAnswer:
        url = self.base_url + path
        data = json.dumps(body).encode()
        return await asyncio.to_thread(_request, url, data, self._budget(url, timeout))

    async def health(self) -> int:
        """HTTP status of GET /health (200 up, 503 starting); raises ServerUnreachable or
        ServerAnswerError when no whole HTTP answer came back."""
        return (await self.get("/health")).status

    @staticmethod
    def _json_object(request: str, answer: HttpAnswer) -> dict:
        """The answer's JSON object; anything else is a ServerAnswerError naming `request` ("GET /x")."""
        if answer.status != 200:
            raise ServerAnswerError(f"{request}: HTTP {answer.status}: {_excerpt(answer.body)}")
        try:
            data = json.loads(answer.body)
        except json.JSONDecodeError:
            raise ServerAnswerError(f"{request}: expected JSON, got {_excerpt(answer.body)}") from None
        if not isinstance(data, dict):
            raise ServerAnswerError(f"{request}: expected a JSON object, got {type(data).__name__} {_excerpt(answer.body)}")
        return data

    async def _get_first(self, paths: tuple[str, ...]) -> tuple[str, dict]:
        """GET the first of `paths` that exists (new name first, then the deprecated alias)."""
        answer = None
        for path in paths:
            answer = await self.get(path)
            if answer.status != 404:
                return path, self._json_object(f"GET {path}", answer)
        assert answer is not None
        raise ServerAnswerError(f"GET {' and '.join(paths)}: HTTP 404 on both: not an SGLang server?")

    async def model_info(self) -> dict:
        """`/model_info` (or `/get_model_info`), checked: `model_path` must be a non-empty string."""
        path, info = await self._get_first(("/model_info", "/get_model_info"))
        model_path = info.get("model_path")
        if not isinstance(model_path, str) or not model_path:
            raise ServerAnswerError(
                f"GET {path}: expected an object with 'model_path' (a non-empty string), "
                f"got keys {sorted(info)[:8]} with model_path={model_path!r}"
            )
        for key in ("served_model_name", "tokenizer_path", "model_type"):
            if key in info and info[key] is not None and not isinstance(info[key], str):
                raise ServerAnswerError(f"GET {path}: '{key}' should be a string, got {info[key]!r}")
        return info

    async def server_info(self) -> dict:
        """`/server_info` (or `/get_server_info`) as a JSON object."""
        return (await self._get_first(("/server_info", "/get_server_info")))[1]

    async def metrics(self) -> dict[str, float] | None:
        """`/metrics` summed per metric name, or None when the server has metrics off (404)."""
        answer = await self.get("/metrics")
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise ServerAnswerError(f"GET /metrics: HTTP {answer.status}: {_excerpt(answer.body)}")
        return parse_prometheus(answer.body.decode(errors="replace"))

    async def generate(self, input_ids: list[int], max_new_tokens: int, timeout: float | None = None) -> dict:
        """POST /generate with token ids, greedy; returns the answer, checked for `output_ids`."""
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}
        answer = await self.post("/generate", body, timeout)
        data = self._json_object("POST /generate", answer)
        ids = data.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise ServerAnswerError(f"POST /generate: expected 'output_ids' (a list of token ids), got {_excerpt(answer.body)}")
        return data

    async def generates_one_token(self) -> bool:
        """The readiness probe: a one-token generation comes back with one token."""
        data = await self.generate(READY_PROMPT_IDS, 1)
        return len(data["output_ids"]) >= 1


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: value summed over its label sets}.

    Comments and lines that are not samples are skipped; NaN values are ignored.
    """
    values: dict[str, float] = {}
    # split("\n"), not splitlines(): label values may hold characters splitlines breaks on (\x1e ...).
    for line in text.split("\n"):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        try:
            value = float(match.group("value"))
        except ValueError:
            continue
        if math.isnan(value):
            continue
        name = match.group("name")
        values[name] = values.get(name, 0.0) + value
    return values


def metric(values: dict[str, float] | None, *names: str) -> float | None:
    """The first of `names` present (SGLang renamed a few metrics between versions)."""
    if not values:
        return None
    return next((values[n] for n in names if n in values), None)


def server_summary(values: dict[str, float] | None) -> dict[str, Any]:
    """The few metrics the service panel shows."""
    return {
        "running_requests": metric(values, "sglang:num_running_reqs"),
        "queued_requests": metric(values, "sglang:num_queue_reqs"),
        "token_usage": metric(values, "sglang:token_usage"),
        "gen_throughput": metric(values, "sglang:gen_throughput"),
    }
