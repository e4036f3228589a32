"""The router client against SGLang's real routers, smg 1.13.0 and sglang-router 0.3.2, in front of two
real rehearsal servers: which gateway answers, listing, removing (the router stops routing there; smg
keeps it draining for its settle first), adding back (it routes there again, with its settings), the
admin key, and every bad answer told with the router's URL, the route and what came back. What both
gateways must be seen to do runs on each (`any_router_fleet`); the rest on smg, the default."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from console.drill.fleet import DRAIN_SETTLE_S, GATEWAYS, SMG
from console.service.replica_loads import read_loads
from console.service.router import SGLANG_ROUTER, Gateway, RouterClient, RouterError, wait_idle
from console.service.sglang_api import ServerUnreachable, SglangClient, server_summary
from tests.router_helpers import need_router, running_router
from tests.standin_helpers import free_port

need_router()

ADMIN_KEY = "router-admin-secret"
USER_KEY = "router-user-secret"


@pytest.fixture
def fleet(router_fleet: tuple[str, list[str]]) -> tuple[str, list[str]]:
    return router_fleet  # tests/router_helpers.py: started once for this file and tests/test_fleet_steps.py


def served(url: str) -> float:
    """Requests the replica has finished (its own /metrics counter)."""
    values = asyncio.run(SglangClient(url).metrics())
    assert values is not None
    return values["sglang:num_requests_total"]


def send_through(router: str, count: int, tag: str) -> None:
    """`count` greedy /generate requests through the router, each a different prompt, one after another."""
    async def go() -> None:
        client = SglangClient(router, timeout=60)
        for i in range(count):
            # a prefix no earlier prompt shares: cache_aware routing then goes by the replicas' trees
            answer = await client.post("/generate", {"text": f"{uuid.uuid4().hex} {tag} {i}",
                                                     "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
            assert answer.status == 200, answer.body[:200]
    asyncio.run(go())


def gateway_of(request: pytest.FixtureRequest) -> str:
    """Which gateway `any_router_fleet` gave this test."""
    return request.node.callspec.params["any_router_fleet"]


def test_the_gateway_is_told_and_lists_both_replicas_healthy_with_their_model_and_load(any_router_fleet, tiny_target,
                                                                                       request):
    router, replicas = any_router_fleet
    client = RouterClient(router)
    workers = asyncio.run(client.workers())
    assert sorted(w.url for w in workers) == sorted(replicas)
    assert all(w.healthy and w.model == str(tiny_target) and w.load == 0 for w in workers)  # none in flight
    assert len({w.id for w in workers}) == 2  # the router names each by its own id
    assert asyncio.run(client.loads()) == dict.fromkeys(replicas, 0)
    gateway = asyncio.run(client.gateway())
    if gateway_of(request) == SMG:
        assert gateway == Gateway(SMG, "1.13.0") and str(gateway) == "smg 1.13.0" and gateway.settles
        assert all(w.status == "ready" and w.settle_s == DRAIN_SETTLE_S for w in workers)  # the drill's settle
    else:
        assert gateway == Gateway(SGLANG_ROUTER) and str(gateway) == "sglang-router" and not gateway.settles
        assert all(w.status is None and w.settle_s is None for w in workers)  # no status, no settle


def test_removed_replica_gets_no_requests_and_gets_them_again_once_added_back(any_router_fleet, request):
    router, (kept, drained) = any_router_fleet
    client = RouterClient(router)
    was = asyncio.run(client.worker(drained))
    assert was is not None
    removed_id = asyncio.run(client.remove_worker(drained))
    try:
        if asyncio.run(client.gateway()).settles:  # smg: listed draining for its settle, routed nothing
            assert gateway_of(request) == SMG
            out = asyncio.run(client.worker(drained))
            assert out is not None and out.draining and not out.healthy and out.id == removed_id
            assert asyncio.run(client.remove_worker(drained)) == removed_id  # nothing sent: the settle is not cut
            assert asyncio.run(client.worker(drained)) is not None
        asyncio.run(client.wait_gone(drained, timeout_s=10 + DRAIN_SETTLE_S))
        assert [w.url for w in asyncio.run(client.workers())] == [kept]
        before = served(kept), served(drained)
        send_through(router, 6, "drained")
        assert served(drained) == before[1]  # not one request reached the removed replica
        assert served(kept) == before[0] + 6
    finally:
        new_id = asyncio.run(client.add_worker(drained, was.spec))
    back = asyncio.run(client.wait_listed(drained, timeout_s=30))
    assert back.healthy and back.id == new_id != removed_id
    assert back.spec == was.spec  # smg: its settings given back (the drill's settle); sglang-router: none listed
    # The router takes it back into rotation: fresh prompts reach it again.
    before = served(drained)
    send_through(router, 8, "rejoined")
    assert served(drained) > before


def test_removing_a_replica_the_router_does_not_list_names_router_and_url(fleet):
    router, _ = fleet
    missing = "http://127.0.0.1:9"
    with pytest.raises(RouterError) as caught:
        asyncio.run(RouterClient(router).remove_worker(missing))
    assert router in str(caught.value) and missing in str(caught.value) and "nothing to remove" in str(caught.value)


def test_wait_listed_gives_up_with_what_it_saw(fleet):
    router, _ = fleet
    with pytest.raises(RouterError, match=r"http://127.0.0.1:9 was not listed 0.3 s after it was added"):
        asyncio.run(RouterClient(router).wait_listed("http://127.0.0.1:9", timeout_s=0.3))


def test_a_server_that_is_not_a_router_is_named_with_the_route_and_its_answer(fleet):
    _, (replica, _) = fleet  # a rehearsal server: SGLang has no /workers
    with pytest.raises(RouterError) as caught:
        asyncio.run(RouterClient(replica).workers())
    # FastAPI's own 404, compact JSON as SGLang's (the rehearsal server serves on FastAPI)
    assert str(caught.value) == f"router {replica}: GET /workers: HTTP 404: '{{\"detail\":\"Not Found\"}}'"


def test_no_router_listening_is_unreachable_with_its_url():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerUnreachable, match=rf"{url}/workers: no answer"):
        asyncio.run(RouterClient(url, timeout=2).workers())


class _Broken(BaseHTTPRequestHandler):
    """A server answering /workers wrongly, as a broken proxy or another release might: the answers the
    real router never gives, so the client's checks are seen to fire."""

    answers: dict[str, tuple[int, bytes]] = {}

    def log_message(self, *args) -> None:
        pass

    def _answer(self) -> None:
        status, body = self.answers[self.command]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer  # noqa: N815 - http.server's naming


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A scripted HTTP peer on loopback for the test's duration: its URL."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def broken() -> Iterator[str]:
    yield from _serve(_Broken)


@pytest.mark.parametrize(("get", "post", "call", "message"), [
    ((200, b"not json"), None, "workers", "GET /workers: expected a JSON object, got HTTP 200 'not json'"),
    ((200, b'{"workers": 3}'), None, "workers", "GET /workers: expected 'workers' (a list)"),
    ((200, b'{"workers": [{"id": "a", "url": "http://x", "is_healthy": "yes"}]}'), None, "workers",
     "GET /workers: a worker without 'is_healthy' (true or false)"),
    ((200, b'{"workers": [{"url": "http://x", "is_healthy": true}]}'), None, "workers",
     "GET /workers: a worker without an 'id'"),
    (None, (202, b'{"status": "accepted"}'), "add", "POST /workers: expected 'worker_id' in the answer"),
    (None, (422, b"Failed to deserialize the JSON body"), "add",
     "POST /workers: HTTP 422: 'Failed to deserialize the JSON body'"),
    ((502, b"bad gateway"), None, "workers", "GET /workers: HTTP 502: 'bad gateway'"),
])
def test_bad_router_answers_are_clear_errors(broken, get, post, call, message):
    _Broken.answers = {"GET": get or (200, b'{"workers": []}'), "POST": post or (202, b"{}")}
    client = RouterClient(broken)
    with pytest.raises(RouterError) as caught:
        asyncio.run(client.workers() if call == "workers" else client.add_worker("http://127.0.0.1:1"))
    assert str(caught.value).startswith(f"router {broken}: {message}")


@pytest.mark.parametrize("gateway", GATEWAYS)
def test_admin_key_is_needed_for_worker_routes_and_inference_stays_open(fleet, tmp_path, gateway):
    _, replicas = fleet
    keys = (f"ops:Operator:admin:{ADMIN_KEY}", f"ro:Reader:user:{USER_KEY}")
    with running_router(replicas[:1], tmp_path / "router.log", "--control-plane-api-keys", *keys,
                        key=ADMIN_KEY, gateway=gateway) as router:
        admin = RouterClient(router, api_key=ADMIN_KEY)
        workers = asyncio.run(admin.workers())
        assert [w.url for w in workers] == replicas[:1]
        assert asyncio.run(admin.gateway()).kind == gateway
        with pytest.raises(RouterError, match=r"HTTP 401: the router wants an admin API key: set \[fleet\] api_key_env$"):
            asyncio.run(RouterClient(router).workers())
        with pytest.raises(RouterError, match="HTTP 401: .*; the key given was refused"):
            asyncio.run(RouterClient(router, api_key="wrong").remove_worker(replicas[0]))
        with pytest.raises(RouterError, match="HTTP 403: the router refused the key: worker routes need a key with the admin role"):
            asyncio.run(RouterClient(router, api_key=USER_KEY).add_worker(replicas[1]))
        assert asyncio.run(RouterClient(router).health()) == 200
        answer = asyncio.run(SglangClient(router, timeout=60).post(
            "/generate", {"text": "open", "sampling_params": {"max_new_tokens": 1}}))
        assert answer.status == 200 and json.loads(answer.body)["meta_info"]["completion_tokens"] == 1


# ---- /v1/chat/completions through the router, answered by a rehearsal server (remote.drill.chat)

MESSAGES = [{"role": "system", "content": "You write Python."},
            {"role": "user", "content": [{"type": "text", "text": "fizzbuzz, "}, {"type": "text", "text": "please"}]}]


def chat(url: str, body: dict) -> tuple[int, str, bytes]:
    """(status, content type, raw body) of POST url/v1/chat/completions."""
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, answer.headers.get("Content-Type", ""), answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get("Content-Type", ""), exc.read()


def events(raw: bytes) -> list[str]:
    """The SSE stream's data payloads, in order (each event is `data: ...` and a blank line)."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-80:]
    blocks = text.split("\n\n")[:-1]
    assert all(b.startswith("data: ") for b in blocks), blocks
    return [b[len("data: "):] for b in blocks]


def greedy_reference(replica: str, tiny_target: Path, max_new: int) -> tuple[list[int], dict]:
    """The chat prompt as SGLang builds it (the tokenizer's chat template, generation prompt added,
    tokenized by it) and the replica's greedy /generate of it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    flat = [{"role": m["role"], "content": m["content"] if isinstance(m["content"], str)
             else "".join(p["text"] for p in m["content"])} for m in MESSAGES]
    ids = tokenizer.apply_chat_template(flat, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    answer = asyncio.run(SglangClient(replica, timeout=60).generate(ids, max_new))
    return ids, answer


def test_chat_completion_through_the_router(fleet, tiny_target):
    router, replicas = fleet
    model = str(tiny_target)  # smg routes a chat by its model: the replicas' served name
    status, _, raw = chat(router, {"model": "tiny", "messages": MESSAGES, "max_tokens": 6})
    assert status == 404 and json.loads(raw)["error"]["code"] == "model_not_found", raw[:200]
    status, _, raw = chat(router, {"messages": MESSAGES, "max_tokens": 6})  # no model: refused, never guessed
    assert status == 400 and json.loads(raw)["error"]["code"] == "missing_required_parameter", raw[:200]
    status, kind, raw = chat(router, {"model": model, "messages": MESSAGES, "max_tokens": 6, "temperature": 0})
    assert status == 200 and kind.startswith("application/json"), raw[:200]
    answer = json.loads(raw)
    ids, reference = greedy_reference(replicas[0], tiny_target, 6)
    (choice,) = answer["choices"]
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-") and answer["model"] == model
    assert choice["message"] == {"role": "assistant", "content": reference["text"], "reasoning_content": None}
    finish = reference["meta_info"]["finish_reason"]
    assert (choice["finish_reason"], choice["matched_stop"]) == (finish["type"], finish.get("matched"))
    assert answer["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(reference["output_ids"]),
                               "total_tokens": len(ids) + len(reference["output_ids"]), "prompt_tokens_details": None,
                               "reasoning_tokens": 0, "completion_tokens_details": None}


def test_streamed_chat_completion_through_the_router(fleet, tiny_target):
    router, replicas = fleet
    body = {"model": str(tiny_target), "messages": MESSAGES, "max_completion_tokens": 8, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    status, kind, raw = chat(router, body)
    assert status == 200 and kind.startswith("text/event-stream"), raw[:200]
    payloads = events(raw)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    # smg forwards the request and its SSE answer as they are (docs/sglang.md, Router): the model echoed
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == str(tiny_target) for c in chunks), chunks[:2]
    assert len({c["id"] for c in chunks}) == 1
    first, *middle, finish, usage = chunks
    assert first["choices"][0]["delta"] == {"reasoning_content": None, "role": "assistant", "content": ""}
    assert all(c["choices"][0]["finish_reason"] is None and set(c["choices"][0]["delta"]) == {"reasoning_content", "content"}
               for c in middle)
    ids, reference = greedy_reference(replicas[1], tiny_target, 8)
    assert "".join(c["choices"][0]["delta"]["content"] for c in middle) == reference["text"]
    reason = reference["meta_info"]["finish_reason"]
    assert finish["choices"][0]["delta"] == {"reasoning_content": None}
    assert (finish["choices"][0]["finish_reason"], finish["choices"][0]["matched_stop"]) == (reason["type"], reason.get("matched"))
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == len(reference["output_ids"])
    assert usage["usage"]["prompt_tokens"] == len(ids)


def test_chat_stream_without_usage_ends_with_the_finish_chunk_then_done(fleet, tiny_target):
    router, _ = fleet
    payloads = events(chat(router, {"model": str(tiny_target), "messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                                    "stream": True})[2])
    assert payloads[-1] == "[DONE]"
    last = json.loads(payloads[-2])
    assert last["choices"][0]["finish_reason"] == "length" and "usage" not in last


def test_chat_stop_string_and_bad_requests(fleet, tiny_target):
    router, (replica, _) = fleet
    plain = json.loads(chat(replica, {"messages": MESSAGES, "max_tokens": 8, "temperature": 0})[2])
    text = plain["choices"][0]["message"]["content"]
    assert plain["model"] == "default"  # SGLang's DEFAULT_MODEL_NAME when the request names none
    stop = text[2:4]  # two characters the greedy answer contains: it ends right before them
    assert stop and stop not in text[:2]
    stopped = json.loads(chat(router, {"model": str(tiny_target), "messages": MESSAGES, "max_tokens": 8, "temperature": 0,
                                       "stop": stop})[2])
    (choice,) = stopped["choices"]
    assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)
    assert text.startswith(choice["message"]["content"]) and stop not in choice["message"]["content"]
    status, _, raw = chat(replica, {"model": "x"})
    assert status == 400 and "messages" in json.loads(raw)["message"]
    status, _, raw = chat(replica, {"messages": MESSAGES, "n": 2})
    assert status == 400 and "n" in raw.decode()


# ---- a drained replica's own requests (wait_idle): what the drain waits for after the removal


def test_a_replica_busy_past_the_bound_is_named_then_seen_idle_once_its_request_ends(fleet):
    _, (replica, _) = fleet
    client = SglangClient(replica, timeout=120)
    long = {"text": "a request the router sent before the drain", "rid": "drain-test-long",
            "sampling_params": {"max_new_tokens": 100_000, "ignore_eos": True, "temperature": 0}}
    answers: list[int] = []
    sender = threading.Thread(target=lambda: answers.append(asyncio.run(client.post("/generate", long)).status))
    sender.start()
    try:
        async def running() -> None:  # until the replica reports it running (never a fixed sleep)
            while (await read_loads(client)).running != 1:
                await asyncio.sleep(0.05)
        asyncio.run(asyncio.wait_for(running(), 60))
        with pytest.raises(RouterError) as caught:
            asyncio.run(wait_idle(client, bound_s=0.3))
        assert str(caught.value) == (f"replica {replica}: still 1 running and 0 queued request(s) 0.3 s after it "
                                     "left the router (the bound)")
    finally:
        asyncio.run(client.post("/abort_request", {"rid": "drain-test-long"}))
        sender.join(60)
    assert answers == [200]  # it ended (aborted), answered
    assert asyncio.run(wait_idle(client, bound_s=30)) < 30


def test_a_replicas_load_snapshot_is_sglangs_shape_and_each_one_is_newer(fleet):
    _, (replica, _) = fleet
    client = SglangClient(replica)
    data = json.loads(asyncio.run(client.get("/v1/loads?include=core,queues")).body)
    assert set(data) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    (load,) = data["loads"]
    assert {"timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "max_running_requests"} <= set(load)
    assert set(load["queues"]) == {"waiting", "grammar", "paused", "retracted", "prealloc_ready"}
    assert "disaggregation" not in load  # only the sections asked for (v1_loads.py, LoadSnapshot.to_dict)
    bad = asyncio.run(client.get("/v1/loads?include=everything"))
    assert bad.status == 400 and json.loads(bad.body)["detail"].startswith("Invalid include sections: {'everything'}")
    first = asyncio.run(read_loads(client))
    second = asyncio.run(read_loads(client))
    assert first.idle and second.newer_than(first) and not first.newer_than(second)


def test_a_replica_without_a_load_snapshot_cannot_be_seen_idle(broken):
    _Broken.answers = {"GET": (404, b'{"detail": "Not Found"}')}  # SGLang 0.4.6 has no /v1/loads
    with pytest.raises(RouterError, match=r"GET /v1/loads: HTTP 404: it serves no load snapshot \(SGLang 0.5.23 does; "
                                          r"0.4.6 does not\), so its own requests cannot be seen to end"):
        asyncio.run(wait_idle(SglangClient(broken), bound_s=1))


class _Replica(BaseHTTPRequestHandler):
    """A replica whose /v1/loads snapshots are scripted (each GET the next; the last repeated) and
    whose /metrics gauge says 0 running, as SGLang's may just after a request arrived (it is set per
    prefill batch and every 40 decode steps): what the drain must read, and when."""

    snapshots: list[tuple[float, int]] = []  # (timestamp, running)
    reads = 0

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path.startswith("/v1/loads"):
            cls = type(self)
            stamp, running = cls.snapshots[min(cls.reads, len(cls.snapshots) - 1)]
            cls.reads += 1
            body = json.dumps({"loads": [{"timestamp": stamp, "dp_rank": 0, "num_running_reqs": running,
                                          "num_waiting_reqs": 0, "queues": {"grammar": 0}}]}).encode()
        else:
            body = b'sglang:num_running_reqs{tp_rank="0"} 0.0\nsglang:num_queue_reqs{tp_rank="0"} 0.0\n'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture
def scripted_replica() -> Iterator[str]:
    yield from _serve(_Replica)


def test_idle_is_a_snapshot_taken_after_the_first_one_read_never_the_metrics_gauge(scripted_replica):
    client = SglangClient(scripted_replica)
    assert server_summary(asyncio.run(client.metrics()))["running_requests"] == 0  # the gauge says idle
    # The snapshot read when the replica left the router says idle too, but it was taken before: the
    # request the router sent just before is not in it. It is never renewed: never seen idle.
    _Replica.snapshots, _Replica.reads = [(100.0, 0)], 0
    with pytest.raises(RouterError, match=r"its /v1/loads snapshot was not renewed within 0.4 s after it left the "
                                          r"router \(the bound\): it cannot be seen idle"):
        asyncio.run(wait_idle(client, bound_s=0.4, poll_s=0.05))
    # The next snapshots count that request running, then none: idle once a newer one says so.
    _Replica.snapshots, _Replica.reads = [(100.0, 0), (100.5, 1), (100.5, 1), (101.0, 0)], 0
    asyncio.run(wait_idle(client, bound_s=10, poll_s=0.01))
    assert _Replica.reads == 4
