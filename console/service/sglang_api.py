"""A small client for SGLang's HTTP API (and the rehearsal server), reached through a forwarded port.

Endpoints (KERNELS.md, SGLang 0.5.23): `/health` (503 while starting), `/model_info` then the older
`/get_model_info`, `/server_info` then `/get_server_info`, optional `/metrics` (Prometheus text),
`/generate`; the memory saver's `/pause_generation`, `/continue_generation`, `/release_memory_occupation`,
`/resume_memory_occupation` (`console.service.memory_saver`: the tags, modes and `/server_info`'s
report, re-exported here); `/weights_checker`'s checksum of the target's weights (`weights_checksum`). Every answer is checked: a malformed one raises `ServerAnswerError` naming the
endpoint, what was expected and what came back. Blocking http.client calls run in a thread.

Requests carry `Authorization: Bearer KEY` when the client has the server's `--api-key` (SGLang
leaves only `/health*`, `/ready` and `/metrics` open: sglang/srt/utils/auth.py, decide_request_auth);
a 401 says so plainly. `generate` sends every greedy sampling param explicitly
(`remote.sglang_sampling`). Metrics are read as SGLang's metrics_collector.py writes them (see
`metric_totals`). What each fact rests on in SGLang's source: docs/sglang.md.

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
import os
import re
import time
from dataclasses import dataclass
from typing import Any

from console.service.memory_saver import MEMORY_TAGS, PAUSE_MODES, MemorySaver, check_tags, memory_saver_of
from remote import http_deadline
from remote.sglang_sampling import greedy_sampling_params

__all__ = ["MEMORY_TAGS", "PAUSE_MODES", "MemorySaver", "NoWeightsChecksum", "ServerAnswerError", "ServerUnreachable",
           "SglangClient", "memory_saver_of"]

DEFAULT_TIMEOUT_S = 10.0
MAX_BODY_BYTES = 64 << 20  # no SGLang answer the console asks for comes near this
READY_PROMPT_IDS = [1, 2, 3]  # any valid ids: readiness asks for one generated token, not its meaning
UNAUTHORIZED = "the server wants an API key: set [service] api_key_env"
HEALTH_CHECK_DEFAULT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default (http_server.py, 0.5.23)
HEALTH_MARGIN_S = 5.0  # its one-second polls past the timeout, and the way back to us
CONTROL_TIMEOUT_S = 60.0  # pause in "abort" mode waits (1 s polls) until every request has ended
MEMORY_TIMEOUT_S = 180.0  # releasing 48 GiB of weights to a CPU backup took 19-20 s on an H200 (issue 26)
WEIGHTS_CHECK_TIMEOUT_S = 180.0  # a checksum reads every weight (SGLang hashes each tensor on its GPU)
WEIGHTS_CHECKER = "/weights_checker"
# What the console asks of it: the checksum of the target's weights alone. A speculating SGLang 0.5.23 brings
# its drafter's weights back wrong from a `weights` release (PR #31674), which the drafter check measures
# (a "degraded" run): the drafter's checksum would fail a window whose target came back whole.
WEIGHTS_CHECKSUM_BODY = {"action": "checksum", "selector": "target"}


def sglang_health_check_s() -> float:
    """How long SGLang's /health checks its scheduler before answering 503: its
    SGLANG_HEALTH_CHECK_TIMEOUT (20 s unless set; set it here as for the server, the console reads
    the same name)."""
    try:
        return max(0.0, float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_CHECK_DEFAULT_S)))
    except ValueError:
        return HEALTH_CHECK_DEFAULT_S


class ServerAnswerError(Exception):
    """The server answered, but not as SGLang does; the message names the endpoint and the answer."""


class ServerUnreachable(Exception):
    """No HTTP answer at all (connection refused, reset, timed out)."""


class NoWeightsChecksum(Exception):
    """The server cannot give its weights' checksum: it has no `/weights_checker` (404 or 405: SGLang 0.5.5
    and earlier), or its checker knows no "checksum" action (0.5.6's: snapshot, reset_tensors, compare);
    the message says which."""


@dataclass(frozen=True)
class HttpAnswer:
    status: int
    body: bytes
    content_type: str


def _excerpt(body: bytes) -> str:
    text = body.decode(errors="replace").strip()
    return repr(text[:120] + ("..." if len(text) > 120 else ""))


def _request(url: str, data: bytes | None, timeout: float, headers: dict[str, str] | None = None,
             method: str | None = None) -> HttpAnswer:
    """GET (or POST `data`) with a total deadline of `timeout` seconds; any HTTP status is returned.

    The request is `remote.http_deadline.request` (a watchdog ends a blocked read at the deadline;
    a short body is an error, never taken for the whole answer); its failures become this module's
    two errors.
    """
    try:
        answer = http_deadline.request(url, data, timeout, max_body=MAX_BODY_BYTES, headers=headers, method=method)
    except http_deadline.HttpDeadlineError as err:
        exc = err.cause
        if err.kind == "bad_url":
            raise ServerUnreachable(f"{url}: {exc}" if exc is not None else f"{url}: not an http(s) URL") from None
        if err.kind == "no_answer":
            if err.expired:  # first: the deadline's own shutdown also reads as the server closing
                raise ServerUnreachable(f"{url}: no answer within {timeout:g} s (our deadline)") from None
            if isinstance(exc, http.client.RemoteDisconnected):  # also a BadStatusLine: nothing came back at all
                raise ServerUnreachable(f"{url}: no answer (the server closed the connection without answering)") from None
            if isinstance(exc, http.client.BadStatusLine):
                raise ServerAnswerError(f"{url}: not an HTTP answer: {_excerpt(str(exc.args[0] if exc.args else '').encode())}") from None
            if isinstance(exc, http.client.HTTPException) and not isinstance(exc, http.client.BadStatusLine):
                raise ServerAnswerError(f"{url}: malformed HTTP answer ({type(exc).__name__}: {exc})") from None
            raise ServerUnreachable(f"{url}: no answer ({exc})") from None
        if err.kind == "too_large":
            raise ServerAnswerError(f"{url}: HTTP {err.status} answer larger than {MAX_BODY_BYTES >> 20} MiB") from None
        raise ServerAnswerError(f"{url}: HTTP {err.status} answer {err.cut_short(exc_message=True)} after "
                                f"{err.received()}: {_excerpt(err.body)}") from None
    return HttpAnswer(answer.status, answer.body, answer.content_type)


class SglangClient:
    """Talks to one server at `base_url` (e.g. "http://127.0.0.1:40123", the forwarded port)."""

    def __init__(self, base_url: str, timeout: float = DEFAULT_TIMEOUT_S, deadline: float | None = None,
                 api_key: str | None = None, health_timeout: float | None = None):
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout  # seconds per request, all of it
        # /health waits as long as the server's own health check (a stuck scheduler is answered 503
        # only after it): never "no answer" where SGLang would have said what is wrong.
        self.health_timeout = health_timeout if health_timeout is not None else max(
            timeout, sglang_health_check_s() + HEALTH_MARGIN_S)
        self.deadline = deadline  # time.monotonic() after which no request is made or waited for
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # never shown or logged

    def __repr__(self) -> str:
        return f"SglangClient({self.base_url!r}, api key {'set' if self._headers else 'none'})"

    def within(self, seconds: float) -> SglangClient:
        """This client with every request also ending within `seconds` from now (e.g. a wait's end)."""
        deadline = time.monotonic() + max(0.0, seconds)
        if self.deadline is not None:
            deadline = min(deadline, self.deadline)
        clone = SglangClient(self.base_url, self.timeout, deadline, health_timeout=self.health_timeout)
        clone._headers = self._headers
        return clone

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
        return await asyncio.to_thread(_request, url, None, self._budget(url, timeout), self._headers)

    async def post(self, path: str, body: dict, timeout: float | None = None) -> HttpAnswer:
        url = self.base_url + path
        data = json.dumps(body).encode()
        return await asyncio.to_thread(_request, url, data, self._budget(url, timeout), self._headers)

    async def ready(self) -> int:
        """HTTP status of GET /ready (SGLang 0.5.23: 200 once up and not paused, else 503; 404 on
        releases without it)."""
        return (await self.get("/ready")).status

    async def health(self) -> int:
        """HTTP status of GET /health (200 up, 503 starting or its scheduler stuck), waited for as
        long as SGLang's own health check takes (`health_timeout`); raises ServerUnreachable or
        ServerAnswerError when no whole HTTP answer came back."""
        return (await self.get("/health", self.health_timeout)).status

    def _json_object(self, request: str, answer: HttpAnswer) -> dict:
        """The answer's JSON object; anything else is a ServerAnswerError naming `request` ("GET /x")."""
        if answer.status == 401:
            raise ServerAnswerError(f"{request}: HTTP 401 Unauthorized: {UNAUTHORIZED}"
                                    + ("; the key given was refused" if self._headers else ""))
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
        """`/metrics` as one total per metric name (`metric_totals`), or None when the server has
        metrics off (404)."""
        answer = await self.get("/metrics")
        if answer.status == 404:
            return None
        if answer.status != 200:
            raise ServerAnswerError(f"GET /metrics: HTTP {answer.status}: {_excerpt(answer.body)}")
        return metric_totals(parse_samples(answer.body.decode(errors="replace")))

    async def generate(self, input_ids: list[int], max_new_tokens: int, timeout: float | None = None) -> dict:
        """POST /generate with token ids, greedy (every greedy param sent); returns the answer, checked
        for `output_ids`."""
        body = {"input_ids": input_ids, "sampling_params": greedy_sampling_params(max_new_tokens)[0]}
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

    # SGLang's memory saver routes (http_server.py; auth level ADMIN_OPTIONAL: with only --api-key the
    # API key, with --admin-api-key that one). Facts and sources: docs/sglang.md, "Pause and release".

    async def _control(self, path: str, body: dict, timeout: float | None) -> HttpAnswer:
        """POST a control route; anything but a 200 is a ServerAnswerError naming the route and what
        the server said (a 401: the API key is wanted)."""
        answer = await self.post(path, body, timeout)
        if answer.status == 401:
            raise ServerAnswerError(f"POST {path}: HTTP 401 Unauthorized: {UNAUTHORIZED}"
                                    + ("; the key given was refused" if self._headers else ""))
        if answer.status != 200:
            raise ServerAnswerError(f"POST {path}: HTTP {answer.status}: {_excerpt(answer.body)}")
        return answer

    async def pause_generation(self, mode: str = "retract", timeout: float | None = CONTROL_TIMEOUT_S) -> dict:
        """POST /pause_generation. "retract" (ours by default) puts running requests back in the
        waiting queue, held until /continue_generation; "in_place" holds them with their KV cache
        (a release then crashes SGLang: it is not idle); "abort" (SGLang's default) fails them. New
        requests wait at the server's front while it is paused, whatever the mode."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"POST /pause_generation: mode {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        return self._json_object("POST /pause_generation",
                                 await self._control("/pause_generation", {"mode": mode}, timeout))

    async def continue_generation(self, timeout: float | None = CONTROL_TIMEOUT_S) -> dict:
        """POST /continue_generation: held requests run again (answered on SGLang's own 200 even when
        the server was not paused)."""
        return self._json_object("POST /continue_generation",
                                 await self._control("/continue_generation", {}, timeout))

    async def release_memory_occupation(self, tags: list[str], timeout: float | None = MEMORY_TIMEOUT_S) -> None:
        """POST /release_memory_occupation with these tags (named: SGLang takes none for all). SGLang
        answers 200 with no body; it asserts the server is idle first, and a server that is not
        (requests running, not paused with "retract") dies, so the client sees the connection close."""
        tags = check_tags(tags, "POST /release_memory_occupation")
        await self._control("/release_memory_occupation", {"tags": tags}, timeout)

    async def resume_memory_occupation(self, tags: list[str], timeout: float | None = MEMORY_TIMEOUT_S) -> None:
        """POST /resume_memory_occupation with these tags. Resume only what was released: SGLang 0.5.23
        fails (and its server dies) on a tag that is not released."""
        tags = check_tags(tags, "POST /resume_memory_occupation")
        await self._control("/resume_memory_occupation", {"tags": tags}, timeout)

    async def weights_checksum(self, timeout: float | None = WEIGHTS_CHECK_TIMEOUT_S) -> str:
        """The target's weights checksum: `POST /weights_checker {"action": "checksum", "selector": "target"}`,
        its `per_engine_checksum` (SGLang 0.5.23, http_server.py `check_weights`: sha256 over each TP rank's
        checksum of its tensors; ADMIN_OPTIONAL as the memory saver's routes). NoWeightsChecksum where the
        server has none (a 404 or 405, or 0.5.6's 400 "Unsupported action='checksum'"); any other answer
        that is not a 200 with a checksum is a ServerAnswerError naming it. Never sent while the weights are
        released: SGLang would hash memory torch_memory_saver has unmapped."""
        request = f"POST {WEIGHTS_CHECKER} {json.dumps(WEIGHTS_CHECKSUM_BODY)}"
        answer = await self.post(WEIGHTS_CHECKER, WEIGHTS_CHECKSUM_BODY, timeout)
        if answer.status in (404, 405):
            raise NoWeightsChecksum(f"{request}: HTTP {answer.status}: the server has no weights checker "
                                    f"(SGLang 0.5.5 and earlier)")
        try:
            data = json.loads(answer.body)
        except json.JSONDecodeError:
            data = None
        message = data.get("message") if isinstance(data, dict) else None
        if answer.status == 400 and isinstance(message, str) and message.startswith("Unsupported action="):
            raise NoWeightsChecksum(f"{request}: HTTP 400 {message!r}: its weights checker takes no checksum "
                                    f"(SGLang 0.5.6's has snapshot and compare only)")
        data = self._json_object(request, answer)
        checksum = data.get("per_engine_checksum")
        if data.get("success") is not True or not isinstance(checksum, str) or not checksum:
            raise ServerAnswerError(f"{request}: expected success and a per_engine_checksum, got {_excerpt(answer.body)}")
        return checksum

    async def memory_saver(self) -> MemorySaver:
        """The memory saver as /server_info reports it (`memory_saver_of`)."""
        return memory_saver_of(await self.server_info())


_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)(?:\s+-?\d+)?\s*$"
)
_LABEL = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
_UNESCAPE = {"\\\\": "\\", '\\"': '"', "\\n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


def _labels(text: str | None) -> dict[str, str]:
    labels: dict[str, str] = {}
    for match in _LABEL.finditer(text or ""):
        labels[match.group(1)] = re.sub(r'\\[\\"n]', lambda m: _UNESCAPE[m.group(0)], match.group(2))
    return labels


def parse_samples(text: str) -> list[Sample]:
    """Prometheus text exposition -> its samples (name, labels, value).

    Comments and lines that are not samples are skipped; NaN values are ignored.
    """
    samples = []
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
        samples.append(Sample(match.group("name"), _labels(match.group("labels")), value))
    return samples


def _is_ratio(name: str) -> bool:
    """Gauges that are a share of one rank's pool (token_usage, full_/swa_token_usage, mamba_usage,
    cache_hit_rate): across DP ranks of equal pools the total is their mean, not their sum."""
    return name.endswith("_usage") or name.endswith("_rate")


REPLICA_LABELS = ("tp_rank", "pp_rank", "moe_ep_rank")  # ranks of one DP group: the same batch, logged again


def metric_totals(samples: list[Sample]) -> dict[str, float]:
    """One total per metric name, as SGLang's metrics_collector.py writes the series:

    - with priority scheduling each queue gauge has its total under `priority=""` and one series per
      priority (`_log_gauge_queue_count`): the per-priority series are left out;
    - each scheduler that logs stats has its own label set (`SchedulerMetricsCollector.init_new`:
      tp_rank, pp_rank, moe_ep_rank, and dp_rank with DP attention). Series that differ only in
      `REPLICA_LABELS` describe one DP rank's batch (every TP rank logs it under
      --enable-metrics-for-all-schedulers): the largest is taken. The rest add up, except shares of a
      pool (`_is_ratio`, e.g. token_usage per DP rank), which are averaged.
    """
    series: dict[tuple[str, frozenset], float] = {}
    for sample in samples:
        if sample.labels.get("priority"):
            continue
        key = (sample.name, frozenset((k, v) for k, v in sample.labels.items() if k not in REPLICA_LABELS))
        series[key] = max(series[key], sample.value) if key in series else sample.value
    per_name: dict[str, list[float]] = {}
    for (name, _), value in series.items():
        per_name.setdefault(name, []).append(value)
    return {name: sum(values) / len(values) if _is_ratio(name) else sum(values) for name, values in per_name.items()}


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {metric name: its total} (`metric_totals`)."""
    return metric_totals(parse_samples(text))


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
