"""The SGLang client against real HTTP servers that answer badly, and Prometheus text parsing."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given
from hypothesis import strategies as st

from console.service.control import probe_health
from console.service.sglang_api import (
    REPLICA_LABELS,
    ServerAnswerError,
    ServerUnreachable,
    SglangClient,
    parse_prometheus,
)


class Routes:
    """What the test server answers: path -> (status, body bytes)."""

    def __init__(self, routes: dict[str, tuple[int, bytes]]):
        self.routes = routes
        self.seen: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.bodies: list[bytes] = []


@pytest.fixture
def server() -> Iterator[tuple[str, Routes]]:
    routes = Routes({})

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def _answer(self) -> None:
            routes.seen.append(self.path)
            routes.headers.append(dict(self.headers))
            length = int(self.headers.get("Content-Length") or 0)
            routes.bodies.append(self.rfile.read(length) if length else b"")
            status, body = routes.routes.get(self.path, (404, b'{"detail":"Not Found"}'))
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer  # noqa: N815 - http.server's naming

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", routes
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize("body, message", [
    (b"<html>Bad Gateway</html>", "GET /model_info: expected JSON, got '<html>Bad Gateway</html>'"),
    (b'["model"]', "GET /model_info: expected a JSON object, got list"),
    (b'{"served_model_name": "qwen"}', "GET /model_info: expected an object with 'model_path'"),
    (b'{"model_path": "", "is_generation": true}', "model_path=''"),
    (b'{"model_path": "/m", "served_model_name": 7}', "'served_model_name' should be a string, got 7"),
])
async def test_malformed_model_info_gives_a_clear_error(server, body: bytes, message: str):
    url, routes = server
    routes.routes["/model_info"] = (200, body)
    with pytest.raises(ServerAnswerError) as err:
        await SglangClient(url).model_info()
    assert message in str(err.value)


async def test_old_endpoint_names_are_used_when_new_ones_are_missing(server):
    url, routes = server
    routes.routes["/get_model_info"] = (200, b'{"model_path": "/root/models/Qwen3.6-27B"}')
    routes.routes["/get_server_info"] = (200, b'{"version": "0.4.6"}')
    client = SglangClient(url)
    assert (await client.model_info())["model_path"] == "/root/models/Qwen3.6-27B"
    assert (await client.server_info())["version"] == "0.4.6"
    assert routes.seen[:2] == ["/model_info", "/get_model_info"]
    routes.routes.clear()
    with pytest.raises(ServerAnswerError, match="HTTP 404 on both: not an SGLang server"):
        await client.model_info()


async def test_metrics_off_is_none_not_an_error(server):
    url, routes = server
    assert await SglangClient(url).metrics() is None
    routes.routes["/metrics"] = (200, b'sglang:num_running_reqs{model_name="q"} 3\nsglang:num_queue_reqs{model_name="q"} 1\n')
    assert (await SglangClient(url).metrics())["sglang:num_running_reqs"] == 3.0


async def test_health_200_without_a_working_generate_is_not_ready(server):
    url, routes = server
    routes.routes["/health"] = (200, b"")
    routes.routes["/model_info"] = (200, b'{"model_path": "/m"}')
    routes.routes["/server_info"] = (200, b'{"version": "0.5.23"}')
    routes.routes["/generate"] = (200, json.dumps({"text": "x", "meta_info": {}}).encode())  # no output_ids
    health = await probe_health(SglangClient(url))
    assert health.health_status == 200 and not health.ready
    assert "one-token /generate failed" in health.error and "'output_ids'" in health.error
    routes.routes["/generate"] = (200, json.dumps({"text": "x", "output_ids": [5]}).encode())
    assert (await probe_health(SglangClient(url))).ready


async def test_nothing_listening_is_unreachable_not_a_crash():
    client = SglangClient("http://127.0.0.1:9", timeout=2)
    with pytest.raises(ServerUnreachable, match="no answer"):
        await client.health()
    health = await probe_health(client)
    assert health.health_status is None and not health.ready and "no answer" in health.error


def test_prometheus_text_from_sglang():
    text = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="0"} 2.0
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="1"} 2.0
sglang:gen_throughput{model_name="qwen"} 512.5 1732870000000
sglang:token_usage{model_name="a b {x}"} 0.25
sglang:cache_hit_rate NaN
"""
    values = parse_prometheus(text)
    # Every TP rank logs the same batch (--enable-metrics-for-all-schedulers): 2 running, not 4.
    assert values == {"sglang:num_running_reqs": 2.0, "sglang:gen_throughput": 512.5, "sglang:token_usage": 0.25}


def test_priority_scheduling_totals_are_the_empty_priority_series():
    """metrics_collector.py, _log_gauge_queue_count: the total under priority="", then one series per
    priority. 3 running (1 + 2 by priority) is 3, not 6."""
    text = """sglang:num_running_reqs{model_name="q",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",priority=""} 3.0
sglang:num_running_reqs{model_name="q",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",priority="0"} 1.0
sglang:num_running_reqs{model_name="q",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",priority="5"} 2.0
sglang:num_queue_reqs{model_name="q",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",priority=""} 0.0
sglang:num_queue_reqs{model_name="q",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0",priority="5"} 0.0
"""
    values = parse_prometheus(text)
    assert values["sglang:num_running_reqs"] == 3.0 and values["sglang:num_queue_reqs"] == 0.0


dp_ranks = st.lists(st.tuples(st.integers(0, 64), st.integers(0, 8), st.floats(0, 1)), min_size=1, max_size=8)


@given(dp_ranks, st.integers(1, 4), st.booleans())
def test_dp_attention_ranks_add_up_and_their_token_usage_is_the_mean(ranks, tp_per_dp, priorities):
    """With DP attention each DP rank's scheduler logs under its dp_rank (its TP ranks, when they all
    log, the same values again): running and queued add up over the DP ranks, token_usage (a share of
    each rank's own KV pool, all of one size) is their mean; per-priority series are breakdowns."""
    lines = []
    for dp, (running, queued, usage) in enumerate(ranks):
        for tp in range(dp * tp_per_dp, (dp + 1) * tp_per_dp):
            base = f'model_name="q",engine_type="unified",tp_rank="{tp}",pp_rank="0",moe_ep_rank="0",dp_rank="{dp}"'
            total = ',priority=""' if priorities else ""
            lines += [f"sglang:num_running_reqs{{{base}{total}}} {float(running)}",
                      f"sglang:num_queue_reqs{{{base}{total}}} {float(queued)}",
                      f"sglang:token_usage{{{base}}} {usage!r}"]
            if priorities:
                lines += [f'sglang:num_running_reqs{{{base},priority="1"}} {float(running)}',
                          f'sglang:num_queue_reqs{{{base},priority="2"}} {float(queued)}']
    values = parse_prometheus("\n".join(lines))
    assert values["sglang:num_running_reqs"] == sum(r for r, _, _ in ranks)
    assert values["sglang:num_queue_reqs"] == sum(q for _, q, _ in ranks)
    assert values["sglang:token_usage"] == pytest.approx(sum(u for _, _, u in ranks) / len(ranks))


names = st.from_regex(r"[a-z_][a-z0-9_:]{0,20}", fullmatch=True).filter(lambda n: not n.endswith(("_usage", "_rate")))
labels = st.dictionaries(st.from_regex(r"[a-oq-z_]{1,8}", fullmatch=True).filter(lambda k: k not in REPLICA_LABELS),
                         st.text(st.characters(blacklist_characters='"\\\n', codec="ascii"), max_size=10), max_size=3)
finite = st.floats(allow_nan=False, allow_infinity=False, width=32)


@given(st.lists(st.tuples(names, labels, finite), max_size=20))
def test_prometheus_adds_up_distinct_label_sets(samples):
    lines = ["# HELP anything at all"]
    series: dict[tuple[str, frozenset], float] = {}
    for name, label_set, value in samples:
        rendered = ",".join(f'{k}="{v}"' for k, v in label_set.items())
        lines.append(f"{name}{{{rendered}}} {value!r}" if label_set else f"{name} {value!r}")
        key = (name, frozenset(label_set.items()))
        series[key] = max(series[key], value) if key in series else value  # the same series again: one value
    expected: dict[str, float] = {}
    for (name, _), value in series.items():
        expected[name] = expected.get(name, 0.0) + value
    parsed = parse_prometheus("\n".join(lines))
    assert parsed.keys() == expected.keys()
    for key, value in expected.items():
        assert parsed[key] == pytest.approx(value)


# --- the API key, greedy params -----------------------------------------------------------------------


async def test_a_401_says_plainly_that_the_server_wants_an_api_key(server):
    url, routes = server
    routes.routes["/model_info"] = (401, b'{"error": "Unauthorized"}')
    with pytest.raises(ServerAnswerError) as err:
        await SglangClient(url).model_info()
    assert str(err.value) == "GET /model_info: HTTP 401 Unauthorized: the server wants an API key: set [service] api_key_env"
    with pytest.raises(ServerAnswerError, match="api_key_env; the key given was refused"):
        await SglangClient(url, api_key="wrong-key").model_info()


async def test_the_api_key_goes_as_a_bearer_token_and_is_never_shown(server):
    url, routes = server
    routes.routes["/model_info"] = (200, b'{"model_path": "/m"}')
    routes.routes["/server_info"] = (500, b"boom")
    client = SglangClient(url, api_key="s3cret-key").within(30)  # a derived client keeps it
    await client.model_info()
    assert routes.headers[-1]["Authorization"] == "Bearer s3cret-key"
    with pytest.raises(ServerAnswerError) as err:
        await client.server_info()
    assert "s3cret" not in str(err.value) and "s3cret" not in repr(client)
    await SglangClient(url).model_info()
    assert "Authorization" not in routes.headers[-1]


async def test_generate_sends_every_greedy_param(server):
    url, routes = server
    routes.routes["/generate"] = (200, json.dumps({"text": "x", "output_ids": [5]}).encode())
    await SglangClient(url).generate([1, 2], 3)
    sent = json.loads(routes.bodies[-1])["sampling_params"]
    assert sent == {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                    "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0, "max_new_tokens": 3}


# --- [service] api_key_env ----------------------------------------------------------------------------


def _config(extra: str):
    from console.config import parse_config

    return parse_config(f'[hosts.ct129]\naddress = "10.0.0.1"\n[service]\nhost = "ct129"\nunit = "sglang"\n{extra}\n'
                        '[target]\nmodel_path = "/m"\n[[drafters]]\nname = "d"\nhost = "ct129"\npath = "/d"\n',
                        "dflash-ops.toml")


def test_api_key_env_names_a_variable_read_on_the_console_side(monkeypatch):
    from console.config import ConfigError, dump_config

    assert _config("").service.api_key() is None
    service = _config('api_key_env = "SGLANG_TEST_KEY"').service
    monkeypatch.delenv("SGLANG_TEST_KEY", raising=False)
    with pytest.raises(ConfigError) as err:
        service.api_key()
    assert str(err.value) == ("[service] api_key_env names SGLANG_TEST_KEY, which is not set in this console's "
                              "environment (export it, or remove api_key_env)")
    monkeypatch.setenv("SGLANG_TEST_KEY", "k-123")
    assert service.api_key() == "k-123"
    assert "k-123" not in dump_config(_config('api_key_env = "SGLANG_TEST_KEY"'))  # the file holds the name only
    with pytest.raises(ConfigError) as err:
        _config('api_key_env = "sk-live-abc=1"')
    assert "service.api_key_env" in str(err.value) and "the name of an environment variable" in str(err.value)


async def test_a_server_whose_ready_is_503_is_not_ready_and_is_not_asked_to_generate(server):
    url, routes = server
    routes.routes.update({"/health": (200, b""), "/ready": (503, b""), "/model_info": (200, b'{"model_path": "/m"}'),
                          "/server_info": (200, b'{"version": "0.5.23"}'),
                          "/generate": (200, json.dumps({"text": "x", "output_ids": [5]}).encode())})
    health = await probe_health(SglangClient(url))
    assert not health.ready and health.error == "/health is 200 but /ready is 503 (starting, unhealthy or paused)"
    assert "/generate" not in routes.seen
    routes.routes["/ready"] = (200, b"")
    assert (await probe_health(SglangClient(url))).ready and routes.seen[-1] == "/generate"
