"""SGLang's HTTP contract (docs/sglang.md), asserted the same way against two real servers on loopback:
the rehearsal server (a `remote.drill.standin` process) and a recorded-answer server replaying the
answers in `tests/data/sglang/`, written from SGLang 0.5.23's source. The console's client and the
completions worker meet both; the older release's route names are checked on its recording."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from console.service.control import probe_health
from console.service.sglang_api import ServerAnswerError, SglangClient, parse_prometheus
from remote import completions
from remote.drill.sglang_contract import SAMPLING_FIELDS, resolve_sampling_params
from remote.prompts import Prompt
from remote.sglang_sampling import GREEDY, NEUTRAL, TEXT_ONLY, PreferredParamsRefused, greedy_sampling_params
from tests.standin_helpers import running_standin

DATA = Path(__file__).parent / "data" / "sglang"
RECORDED = json.loads((DATA / "0.5.23.json").read_text())
EXCHANGES = {e["name"]: e for e in RECORDED["exchanges"]}
STANDIN_KEY = "contract-key"

MODEL_INFO_KEYS = {"model_path", "served_model_name", "tokenizer_path", "is_generation", "preferred_sampling_params",
                   "weight_version", "model_type", "architectures"}
META_INFO_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}


class Replay:
    """A real HTTP server answering each request with the recorded answer for its method, path, body
    and whether it carries the recording's API key (HTTP 599 naming the request when none is). An
    exchange recorded with `auth` was sent with the key; one recorded as a 401 without it; any other
    is a public route, answered either way."""

    def __init__(self, recording: dict):
        self.recording = recording
        replay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                status, content_type, data = replay.answer(self.command, self.path, self.headers.get("Authorization"), raw)
                self.send_response(status)
                if content_type:
                    self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer  # noqa: N815 - http.server's naming

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def answer(self, method: str, path: str, authorization: str | None, raw: bytes) -> tuple[int, str | None, bytes]:
        key = self.recording["api_key"]
        authorized = key is not None and authorization == f"Bearer {key}"
        body = json.loads(raw) if raw else None
        for exchange in self.recording["exchanges"]:
            request = exchange["request"]
            # auth true: sent with the key; a recorded 401: sent without it; else public (either way).
            wants = True if request["auth"] else False if exchange["response"]["status"] == 401 else authorized
            if (request["method"], request["path"], request.get("body")) == (method, path, body) and wants == authorized:
                response = exchange["response"]
                data = response["body"]
                encoded = b"" if data is None else data.encode() if isinstance(data, str) else json.dumps(data).encode()
                return response["status"], response["content_type"], encoded
        return 599, "text/plain", f"no recorded answer for {method} {path} {raw[:200]!r}".encode()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _standin(tiny_target: Path, tmp: Path, *args: str) -> Iterator[str]:
    with running_standin(tiny_target, tmp / "log", "--metrics", "--api-key", STANDIN_KEY, *args) as url:
        yield url


@pytest.fixture(scope="module")
def standin_url(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield from _standin(tiny_target, tmp_path_factory.mktemp("contract"))


@pytest.fixture(scope="module")
def nan_standin_url(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The rehearsal server whose logits turn NaN after two tokens (--nan-after 2)."""
    yield from _standin(tiny_target, tmp_path_factory.mktemp("contract-nan"), "--nan-after", "2")


@pytest.fixture(scope="module")
def recorded() -> Iterator[Replay]:
    replay = Replay(RECORDED)
    yield replay
    replay.close()


@pytest.fixture(params=["standin", "recorded"])
def server(request: pytest.FixtureRequest) -> tuple[str, str]:
    """(url, api key) of each server in turn."""
    if request.param == "standin":
        return request.getfixturevalue("standin_url"), STANDIN_KEY
    return request.getfixturevalue("recorded").url, RECORDED["api_key"]


@pytest.fixture(params=["standin", "recorded"])
def nan_server(request: pytest.FixtureRequest) -> tuple[str, str]:
    if request.param == "standin":
        return request.getfixturevalue("nan_standin_url"), STANDIN_KEY
    return request.getfixturevalue("recorded").url, RECORDED["api_key"]


def exchange(url: str, key: str, name: str) -> tuple[int, str, Any]:
    """Send the recorded request `name` (with the key when it is recorded with one): (status,
    content type, decoded body: JSON, text, or None when empty)."""
    request = EXCHANGES[name]["request"]
    headers = {"Content-Type": "application/json"} if "body" in request else {}
    if request["auth"]:
        headers["Authorization"] = f"Bearer {key}"
    data = json.dumps(request["body"]).encode() if "body" in request else None
    req = urllib.request.Request(url + request["path"], data, headers, method=request["method"])
    try:
        with urllib.request.urlopen(req, timeout=120) as response:
            status, content_type, raw = response.status, response.headers.get("Content-Type", ""), response.read()
    except urllib.error.HTTPError as exc:
        status, content_type, raw = exc.code, exc.headers.get("Content-Type", ""), exc.read()
    if not raw:
        return status, content_type, None
    return status, content_type, json.loads(raw) if content_type.startswith("application/json") else raw.decode()


def _valid_generation(answer: Any, input_ids: list[int], max_new_tokens: int) -> None:
    """One generation as tokenizer_manager fills it, finished by a stop token or the length limit."""
    assert isinstance(answer, dict) and isinstance(answer["text"], str)
    ids = answer["output_ids"]
    assert isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids)
    meta = answer["meta_info"]
    assert meta.keys() >= META_INFO_KEYS, sorted(meta)
    assert isinstance(meta["id"], str) and meta["id"]
    assert meta["prompt_tokens"] == len(input_ids) and meta["completion_tokens"] == len(ids)
    assert 0 <= meta["cached_tokens"] < len(input_ids) and meta["e2e_latency"] >= 0
    reason = meta["finish_reason"]
    assert reason in ({"type": "length", "length": max_new_tokens}, {"type": "stop", "matched": ids[-1]}), reason
    if reason["type"] == "length":
        assert len(ids) == max_new_tokens


def _generation_check(name: str) -> Callable[[int, Any], None]:
    body = EXCHANGES[name]["request"]["body"]

    def check(status: int, answer: Any) -> None:
        assert status == 200
        _valid_generation(answer, body["input_ids"], body["sampling_params"]["max_new_tokens"])
    return check


def _batch_check(status: int, answer: Any) -> None:
    body = EXCHANGES["generate_batch"]["request"]["body"]
    assert status == 200 and isinstance(answer, list) and len(answer) == len(body["input_ids"])
    for one, ids in zip(answer, body["input_ids"], strict=True):
        _valid_generation(one, ids, body["sampling_params"]["max_new_tokens"])


def _exactly(status: int, body: Any) -> Callable[[int, Any], None]:
    def check(got_status: int, got: Any) -> None:
        assert (got_status, got) == (status, body)
    return check


def _model_info_check(status: int, info: Any) -> None:
    assert status == 200 and info.keys() >= MODEL_INFO_KEYS, sorted(info)
    assert isinstance(info["model_path"], str) and info["model_path"] and info["is_generation"] is True
    assert info["preferred_sampling_params"] is None


def _server_info_check(status: int, info: Any) -> None:
    assert status == 200 and str(info["version"]).startswith("0.5.23")


def _validation_error_check(status: int, body: Any) -> None:
    assert status == 400 and set(body) == {"object", "message", "type", "param", "code"}
    assert (body["object"], body["type"], body["param"], body["code"]) == ("error", "Bad Request", None, 400)
    assert isinstance(body["message"], str) and body["message"]


def _metrics_check(status: int, text: Any) -> None:
    assert status == 200 and isinstance(text, str)
    totals = parse_prometheus(text)
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:gen_throughput"} <= totals.keys()


FIELDS = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
CHECKS: dict[str, Callable[[int, Any], None]] = {
    "health_up": _exactly(200, None),
    "health_generate_up": _exactly(200, None),
    "ready_up": _exactly(200, None),
    "model_info": _model_info_check,
    "get_model_info": _model_info_check,
    "server_info": _server_info_check,
    "get_server_info": _server_info_check,
    "generate_greedy": _generation_check("generate_greedy"),
    "generate_stop": _generation_check("generate_stop"),
    "generate_one_token": _generation_check("generate_one_token"),
    "generate_batch": _batch_check,
    "unknown_sampling_key": _exactly(400, {"error": f"unknown field `temprature`, expected one of {FIELDS}"}),
    "sampling_wrong_type": _exactly(400, {"error": 'invalid type: string "cold", expected f64'}),
    "sampling_out_of_range": _exactly(400, {"error": {"message": "top_p must be in (0, 1], got 0.0."}}),
    "no_prompt": _exactly(400, {"error": {"message": "Either text, input_ids or input_embeds should be provided."}}),
    "unparsable_prompt": _validation_error_check,
    "unknown_route": _exactly(404, {"detail": "Not Found"}),
    "wrong_method": _exactly(405, {"detail": "Method Not Allowed"}),
    "unauthorized_model_info": _exactly(401, {"error": "Unauthorized"}),
    "unauthorized_generate": _exactly(401, {"error": "Unauthorized"}),
    "metrics_public": _metrics_check,
}


def test_every_recorded_exchange_has_a_check_and_names_its_source():
    assert set(CHECKS) == set(EXCHANGES) - {"generate_nan"}
    assert all(e["source"] for e in RECORDED["exchanges"])


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_the_http_contract(server, name):
    url, key = server
    status, _, body = exchange(url, key, name)
    CHECKS[name](status, body)


def test_a_nan_ends_as_stop_nan_happened_and_the_worker_caches_it_incomplete(nan_server):
    url, key = nan_server
    status, _, answer = exchange(url, key, "generate_nan")
    assert status == 200 and answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": "NaN happened"}
    assert answer["meta_info"]["completion_tokens"] == len(answer["output_ids"])
    body = EXCHANGES["generate_nan"]["request"]["body"]
    found = _ask_generate(url, key, body)
    complete, why = completions.completeness(found)
    assert not complete and "NaN or out-of-vocabulary token" in why


def _ask_generate(url: str, key: str, body: dict) -> dict:
    """The completions worker's own request for `body`'s prompt (its key from its environment)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(completions.API_KEY_ENV, key)
        sampling, _ = greedy_sampling_params(body["sampling_params"]["max_new_tokens"])
        prompt = Prompt("contract", body["sampling_params"]["max_new_tokens"])
        found = completions.ask_generate(url, prompt, body["input_ids"], sampling, timeout=120)
    assert found is not None
    return found


def test_the_worker_sends_the_recorded_greedy_request_and_caches_it_complete(server):
    url, key = server
    body = EXCHANGES["generate_greedy"]["request"]["body"]
    assert body["sampling_params"] == greedy_sampling_params(8)[0]  # the recording holds what the worker sends
    found = _ask_generate(url, key, body)
    assert completions.completeness(found) == (True, None)
    assert found["finish_reason"] in ("length", "stop") and len(found["completion_ids"]) <= 8


async def test_the_console_reads_info_and_readiness_with_the_key_and_says_401_without(server):
    url, key = server
    client = SglangClient(url, api_key=key)
    info = await client.model_info()
    assert info["model_path"] and (await client.server_info())["version"].startswith("0.5.23")
    health = await probe_health(client)
    assert health.health_status == 200 and health.ready and health.error is None, health
    assert health.running_requests == 0 and health.queued_requests == 0
    with pytest.raises(ServerAnswerError, match="the server wants an API key: set \\[service\\] api_key_env"):
        await SglangClient(url).model_info()


async def test_an_older_release_is_read_through_its_get_routes():
    """0.4.6: no /model_info, /server_info or /ready; the client falls back to the /get_* names and
    readiness is /health and a one-token /generate."""
    replay = Replay(json.loads((DATA / "0.4.6.json").read_text()))
    try:
        client = SglangClient(replay.url)
        assert (await client.model_info())["model_path"] == "/root/models/Qwen3.6-27B"
        assert (await client.server_info())["version"] == "0.4.6"
        health = await probe_health(client, want_metrics=False)
        assert health.ready and health.version == "0.4.6" and health.error is None, health
    finally:
        replay.close()


# --- the greedy params over any preference ---------------------------------------------------------

_values = st.one_of(st.none(), st.booleans(), st.integers(-5, 500), st.floats(-2, 2, allow_nan=False),
                    st.text(max_size=4), st.lists(st.integers(0, 50), max_size=3),
                    st.dictionaries(st.sampled_from(["3", "7"]), st.floats(-100, 100, allow_nan=False), max_size=2))
_known = st.dictionaries(st.sampled_from(sorted({*GREEDY, *NEUTRAL, *TEXT_ONLY, "max_new_tokens"})), _values, max_size=8)


@given(_known, st.integers(1, 64))
def test_whatever_the_server_prefers_the_request_resolves_to_greedy(preferred, max_new_tokens):
    """Laid over any preference of known keys as SGLang lays them ({**preferred, **request}), what the
    worker sends resolves to plain greedy decoding: top_k 1, no penalty, bias, stop or grammar."""
    sent, _ = greedy_sampling_params(max_new_tokens, preferred)
    params = resolve_sampling_params(sent, preferred)
    assert params["top_k"] == 1 and params["max_new_tokens"] == max_new_tokens
    assert (params["frequency_penalty"], params["presence_penalty"], params["repetition_penalty"],
            params["min_new_tokens"], params["min_p"], params["top_p"]) == (0.0, 0.0, 1.0, 0, 0.0, 1.0)
    assert not params["logit_bias"] and not params["stop"] and not params["stop_token_ids"] and not params["stop_regex"]
    assert params["ignore_eos"] is False and params["n"] == 1 and params["custom_params"] is None
    assert all(params[k] is None for k in ("json_schema", "regex", "ebnf", "structural_tag", "beam_width"))


@given(_known, st.from_regex(r"[a-z_]{3,12}", fullmatch=True), _values)
def test_a_preference_we_do_not_know_is_always_refused(preferred, unknown, value):
    if unknown in {*GREEDY, *NEUTRAL, *TEXT_ONLY, "max_new_tokens"}:
        return
    with pytest.raises(PreferredParamsRefused, match=f"sets .*{unknown}="):
        greedy_sampling_params(8, {**preferred, unknown: value})
