"""The rehearsal server's HTTP serving as SGLang 0.5.23's (FastAPI on uvicorn; docs/sglang.md, "HTTP
serving"), over real sockets: a client that disconnects aborts its request, plain and streamed;
`stream: true` on /generate is Server-Sent Events ending `data: [DONE]`, a ValueError inside it an
error chunk; connections are kept alive; SIGTERM aborts a request under way (answered) and ends the
server at once.
One server for the module, slowed (`--step-delay`) so a long request is caught in flight, and its
disconnect check shortened through SGLang's own SGLANG_REQUEST_STATE_WAIT_TIMEOUT."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.standin_helpers import GREEDY_PARAMS, free_port, running_standin, start_standin, stop, wait_status
from tests.test_standin_memory_saver import call, until

STEP_S = 0.05  # --step-delay: a 2000-token request would run 100 s
WAIT_S = 0.3  # SGLANG_REQUEST_STATE_WAIT_TIMEOUT
PROMPT = [11, 22, 33, 44, 55, 66, 77]
LONG = {"input_ids": PROMPT, "sampling_params": {**GREEDY_PARAMS, "max_new_tokens": 2000, "ignore_eos": True}}


@pytest.fixture(scope="module")
def slow(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    log = tmp_path_factory.mktemp("http") / "log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", str(WAIT_S))
        with running_standin(tiny_target, log, "--step-delay", str(STEP_S), "--skip-server-warmup") as url:
            yield {"url": url, "log": log}


def running(url: str) -> int:
    status, loads = call(url, "/v1/loads")
    assert status == 200, loads
    return loads["loads"][0]["num_running_reqs"]


def open_request(url: str, body: dict, path: str = "/generate") -> socket.socket:
    """A POST sent on a raw socket, its answer left unread (the client may vanish)."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def sse_payloads(raw: str) -> list[str]:
    return [line[len("data: "):] for line in raw.split("\n\n") if line.startswith("data: ")]


def stream(url: str, body: dict, path: str = "/generate") -> tuple[int, str, list[str]]:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    answer = conn.getresponse()
    raw = answer.read().decode()
    conn.close()
    return answer.status, answer.getheader("Content-Type", ""), sse_payloads(raw) if answer.status == 200 else [raw]


def aborted_when_closed(sock, url: str, log, says: str) -> None:
    """The client's socket closed: its request ends well before it would have (100 s), and the log
    says why."""
    sock.close()
    left = time.monotonic()
    until(lambda: running(url) == 0, timeout=15)
    assert time.monotonic() - left < 15
    assert says in log.read_text()


def test_a_client_that_disconnects_aborts_its_request(slow) -> None:
    """tokenizer_manager.py, _stream_one_response: the client is asked every WAIT_S while its request
    runs; gone, the request is aborted (it would have run 100 s)."""
    url = slow["url"]
    sock = open_request(url, LONG)
    until(lambda: running(url) == 1, timeout=30)
    aborted_when_closed(sock, url, slow["log"], "Request is disconnected from the client side (type 1)")
    assert call(url, "/generate", {**LONG, "sampling_params": {**LONG["sampling_params"], "max_new_tokens": 2}})[0] == 200


def test_a_streamed_generate_is_sse_token_by_token_and_ends_as_the_plain_answer(slow) -> None:
    url = slow["url"]
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY_PARAMS, "max_new_tokens": 6, "ignore_eos": True}}
    plain = call(url, "/generate", body)[1]
    status, kind, payloads = stream(url, {**body, "stream": True})
    assert status == 200 and kind.startswith("text/event-stream"), payloads
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert [len(c["output_ids"]) for c in chunks] == [1, 2, 3, 4, 5, 6]  # cumulative, stream_interval 1
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["output_ids"] == plain["output_ids"] and chunks[-1]["text"] == plain["text"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}


def test_a_stream_refuses_the_contract_at_once_and_sends_a_bad_value_as_an_error_chunk(slow) -> None:
    url = slow["url"]
    status, _, (raw,) = stream(url, {"input_ids": PROMPT, "stream": True, "sampling_params": {"nope": 1}})
    assert status == 400 and json.loads(raw)["error"].startswith("unknown field `nope`")
    status, _, payloads = stream(url, {"input_ids": PROMPT, "stream": True, "sampling_params": {"temperature": -1}})
    assert status == 200 and payloads[-1] == "[DONE]"
    error = json.loads(payloads[0])["error"]
    assert error["code"] == 400 and error["type"] == "invalid_request_error" and "temperature" in error["message"]


def test_a_stream_cut_by_its_client_is_aborted(slow) -> None:
    """Starlette cancels the stream; create_abort_task aborts the request two seconds later."""
    url = slow["url"]
    sock = open_request(url, {**LONG, "stream": True})
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    until(lambda: running(url) == 1, timeout=30)
    aborted_when_closed(sock, url, slow["log"], "Client disconnected: abort request")


def test_a_chat_stream_comes_as_it_is_generated_and_is_aborted_when_cut(slow) -> None:
    """The content arrives before the generation has ended (a chunk as the text grows), the same text
    as the plain answer; a chat stream its client cuts is aborted as /generate's is."""
    url = slow["url"]
    messages = [{"role": "user", "content": "Count to twenty."}]
    body = {"messages": messages, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = call(url, "/v1/chat/completions", body)[1]["choices"][0]["message"]["content"]
    status, kind, payloads = stream(url, {**body, "stream": True}, "/v1/chat/completions")
    assert status == 200 and kind.startswith("text/event-stream") and payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == plain
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    sock = open_request(url, {"messages": messages, "max_tokens": 2000, "ignore_eos": True, "temperature": 0,
                              "stream": True}, "/v1/chat/completions")
    sock.settimeout(30)
    seen = b""
    while seen.count(b"data: ") < 3:  # the role chunk, then content while the request still runs
        seen += sock.recv(4096)
    assert running(url) == 1
    sock.close()
    until(lambda: running(url) == 0, timeout=15)


def test_a_connection_is_kept_alive_across_requests(slow) -> None:
    parts = urlsplit(slow["url"])
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    for path in ("/model_info", "/v1/loads", "/nowhere"):
        conn.request("GET", path)
        answer = answer_of(conn)
        assert answer[0] == (404 if path == "/nowhere" else 200)
    assert conn.sock is not None  # the same socket all along
    conn.close()


def answer_of(conn: http.client.HTTPConnection) -> tuple[int, bytes]:
    response = conn.getresponse()
    return response.status, response.read()


def test_sigterm_answers_the_request_under_way_as_aborted_and_ends_the_server_at_once(tiny_target: Path, tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_standin(tiny_target, port, tmp_path / "log", "--step-delay", str(STEP_S), "--skip-server-warmup")
    try:
        wait_status(url + "/health", 200, timeout=90, proc=proc)
        sock = open_request(url, LONG)
        until(lambda: running(url) == 1, timeout=30)
        asked = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        answer = b""
        while chunk := sock.recv(65536):  # answered, then the connection closed
            answer += chunk
        sock.close()
        assert answer.startswith(b"HTTP/1.1 200") and b'"finish_reason":{"type":"abort"' in answer, answer[-300:]
        assert proc.wait(10) == 0
        assert time.monotonic() - asked < 5
        log = (tmp_path / "log").read_text()
        assert "Shutting down" in log and "Traceback" not in log, log
    finally:
        stop(proc)
