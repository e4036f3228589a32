"""Servers that answer badly: bodies cut half-way, answers trickled a byte at a time, lines that are
not HTTP. Against real sockets on 127.0.0.1: the console's SGLang client, `probe_health`,
`wait_ready`, the service monitor, and `remote.completions`' client all end on time with their own
error naming the URL and what arrived."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from console.messages import ServiceView
from console.service.control import ReadyTimeout, ServiceMonitor, SystemdManager, probe_health, wait_ready
from console.service.sglang_api import ServerAnswerError, ServerUnreachable, SglangClient
from remote import completions
from tests.test_service_systemd import RecordedSystemctl

Behaviour = Callable[[socket.socket], None]


def answer(status: str = "200 OK", body: bytes = b"", headers: dict[str, str] | None = None) -> bytes:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in (headers or {}).items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def whole(body: bytes) -> Behaviour:
    return lambda conn: conn.sendall(answer(body=body, headers={"Content-Length": str(len(body))}))


def cut(body: bytes, declared: int) -> Behaviour:
    """Declares `declared` bytes, sends `body`, closes."""
    return lambda conn: conn.sendall(answer(body=body, headers={"Content-Length": str(declared)}))


def cut_chunked(conn: socket.socket) -> None:
    conn.sendall(answer(headers={"Transfer-Encoding": "chunked"}) + b"20\r\n" + b'{"model_path": "/m", ')


def trickle(body: bytes, every: float = 0.1) -> Behaviour:
    """Headers at once, then the body one byte per `every` seconds."""
    def send(conn: socket.socket) -> None:
        conn.sendall(answer(headers={"Content-Length": str(len(body))}))
        for byte in body:
            time.sleep(every)
            conn.sendall(bytes([byte]))
    return send


def trickle_status(conn: socket.socket, every: float = 0.1) -> None:
    for byte in answer(body=b"{}", headers={"Content-Length": "2"}):
        time.sleep(every)
        conn.sendall(bytes([byte]))


def stuck(conn: socket.socket) -> None:
    """A stuck scheduler's /health: nothing until the client gives up (SGLang answers 503 only after
    SGLANG_HEALTH_CHECK_TIMEOUT, 20 s)."""
    conn.settimeout(60)
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass


def garbage(conn: socket.socket) -> None:
    conn.sendall(b"SSH-2.0-OpenSSH_9.6 not http at all\r\n")


class RawServer:
    """A TCP server on 127.0.0.1 that reads one HTTP request per connection and then does what
    `routes[path]` says with the raw socket (unknown paths: 404)."""

    def __init__(self) -> None:
        self.routes: dict[str, Behaviour] = {}
        self.seen: list[str] = []
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._stop = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
            head, _, rest = data.partition(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            length = next((int(v) for k, _, v in (line.partition(": ") for line in lines[1:])
                           if k.lower() == "content-length"), 0)
            while len(rest) < length:
                rest += conn.recv(65536)
            path = lines[0].split()[1]
            self.seen.append(path)
            self.routes.get(path, _not_found)(conn)

    def close(self) -> None:
        self._stop = True
        self._sock.close()


def _not_found(conn: socket.socket) -> None:
    body = b'{"detail":"Not Found"}'
    conn.sendall(answer("404 Not Found", body, {"Content-Length": str(len(body))}))


@pytest.fixture
def raw() -> Iterator[RawServer]:
    server = RawServer()
    yield server
    server.close()


# --- the console's SGLang client -------------------------------------------------------------------


async def test_a_body_cut_half_way_is_an_answer_error_with_the_url_and_what_came(raw: RawServer) -> None:
    raw.routes["/model_info"] = cut(b'{"model_path": "/root/mo', declared=100)
    with pytest.raises(ServerAnswerError) as info:
        await SglangClient(raw.url).model_info()
    message = str(info.value)
    assert f"{raw.url}/model_info" in message
    assert "cut short after 24 of 100 bytes" in message and "model_path" in message


async def test_a_cut_chunked_body_is_an_answer_error(raw: RawServer) -> None:
    raw.routes["/server_info"] = cut_chunked
    with pytest.raises(ServerAnswerError, match=r"/server_info: HTTP 200 answer cut short"):
        await SglangClient(raw.url).server_info()


async def test_a_trickled_body_ends_at_the_deadline_not_at_the_last_byte(raw: RawServer) -> None:
    raw.routes["/model_info"] = trickle(b'{"model_path": "/root/models/Qwen3.6-27B", "x": 1}', every=0.1)
    began = time.monotonic()
    with pytest.raises(ServerAnswerError) as info:
        await SglangClient(raw.url, timeout=1.0).model_info()
    assert time.monotonic() - began < 2.5  # the whole body would take 5 s
    assert "not complete within 1 s" in str(info.value) and f"{raw.url}/model_info" in str(info.value)


async def test_a_trickled_status_line_is_no_answer_within_the_deadline(raw: RawServer) -> None:
    raw.routes["/health"] = trickle_status
    began = time.monotonic()
    with pytest.raises(ServerUnreachable, match=r"/health: no answer within 1 s"):
        await SglangClient(raw.url, timeout=1.0, health_timeout=1.0).health()
    assert time.monotonic() - began < 2.5


async def test_a_stuck_server_is_our_deadline_not_a_closed_connection(raw: RawServer) -> None:
    raw.routes["/health"] = stuck
    with pytest.raises(ServerUnreachable) as info:
        await SglangClient(raw.url, timeout=1.0, health_timeout=1.0).health()
    assert str(info.value) == f"{raw.url}/health: no answer within 1 s (our deadline)"
    health = await probe_health(SglangClient(raw.url, timeout=1.0, health_timeout=1.0))
    assert "(our deadline)" in health.error and "closed the connection" not in health.error


async def test_the_socket_timing_out_before_the_watchdog_is_still_our_deadline(raw: RawServer,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket's timeout and the watchdog share one deadline; whichever fires first, the message
    is the same. Here the watchdog is made late, so the socket's timeout always wins the race."""
    from remote import http_deadline

    real_timer = threading.Timer
    monkeypatch.setattr(http_deadline.threading, "Timer", lambda seconds, fn: real_timer(seconds + 30, fn))
    raw.routes["/health"] = stuck
    with pytest.raises(ServerUnreachable) as info:
        await SglangClient(raw.url, timeout=1.0, health_timeout=1.0).health()
    assert str(info.value) == f"{raw.url}/health: no answer within 1 s (our deadline)"


def slow_503(seconds: float) -> Behaviour:
    """SGLang's /health with its scheduler stuck: 503 once its own check has waited `seconds`."""
    def behave(conn: socket.socket) -> None:
        time.sleep(seconds)
        conn.sendall(answer("503 Service Unavailable", headers={"Content-Length": "0"}))
    return behave


async def test_a_stuck_scheduler_is_waited_for_and_what_the_server_said_is_shown(
        raw: RawServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: SGLang answers /health 503 only after its own check (SGLANG_HEALTH_CHECK_TIMEOUT, 20 s
    by default). The console waits that long, whatever its other requests' timeout, and shows the
    server's verdict, never "no answer" (here the check is 1.5 s and other requests get 1 s)."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1.5")
    raw.routes["/health"] = slow_503(1.5)
    raw.routes["/model_info"] = whole(b'{"model_path": "/m"}')
    raw.routes["/server_info"] = whole(b'{"version": "0.5.23"}')
    client = SglangClient(raw.url, timeout=1.0)
    assert await client.health() == 503
    health = await probe_health(client, want_metrics=False)
    assert health.health_status == 503 and not health.ready
    assert "SGLang's own health check got no answer from its scheduler within 1.5 s" in health.error
    assert "our deadline" not in health.error


async def test_a_line_that_is_not_http_is_an_answer_error(raw: RawServer) -> None:
    raw.routes["/health"] = garbage
    with pytest.raises(ServerAnswerError, match=r"/health: not an HTTP answer: .*SSH-2.0-OpenSSH"):
        await SglangClient(raw.url).health()


async def test_a_server_that_closes_without_answering_is_unreachable(raw: RawServer) -> None:
    raw.routes["/health"] = lambda conn: None
    with pytest.raises(ServerUnreachable, match="closed the connection without answering"):
        await SglangClient(raw.url).health()


async def test_probe_health_says_what_a_cut_answer_did_instead_of_raising(raw: RawServer) -> None:
    raw.routes["/health"] = whole(b"")
    raw.routes["/model_info"] = cut(b'{"model_path"', declared=50)
    health = await probe_health(SglangClient(raw.url))
    assert health.health_status == 200 and not health.ready
    assert "/model_info: HTTP 200 answer cut short after 13 of 50 bytes" in health.error
    raw.routes["/health"] = garbage
    health = await probe_health(SglangClient(raw.url))
    assert health.health_status is None and "not an HTTP answer" in health.error


async def test_wait_ready_ends_on_time_when_the_server_trickles(raw: RawServer) -> None:
    raw.routes["/health"] = trickle(b"x" * 60, every=0.1)  # each answer would take 6 s
    began = time.monotonic()
    with pytest.raises(ReadyTimeout, match=r"not ready after 2 s .*not complete within"):
        await wait_ready(SglangClient(raw.url), timeout=1.5, poll_s=0.1)
    assert time.monotonic() - began < 3.0


# --- the service monitor -----------------------------------------------------------------------------


async def _views(monitor: ServiceMonitor, count: int, timeout: float = 10.0) -> list[ServiceView]:
    seen: list[ServiceView] = []
    monitor.subscribe(seen.append)
    task = monitor.start()
    try:
        deadline = time.monotonic() + timeout
        while len(seen) < count and time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.02)
        assert not task.done(), f"the monitor ended: {task.exception() if not task.cancelled() else 'cancelled'}"
        return seen
    finally:
        await monitor.stop()


async def test_the_monitor_survives_answers_that_are_cut_or_not_http(raw: RawServer) -> None:
    flip = iter(range(10_000))
    raw.routes["/health"] = lambda conn: (garbage if next(flip) % 2 else cut(b"ok", declared=10))(conn)
    monitor = ServiceMonitor(SystemdManager(RecordedSystemctl("active"), "sglang-qwen"), SglangClient(raw.url),
                             interval=0.02)
    views = await _views(monitor, 4)
    assert len(views) >= 4
    errors = [v.error or "" for v in views]
    assert all(f"{raw.url}/health" in e for e in errors), errors
    assert any("not an HTTP answer" in e for e in errors) and any("cut short" in e for e in errors)
    assert all(v.status is not None and v.status.active for v in views)


async def test_a_subscriber_that_raises_is_logged_and_the_others_still_get_views(
        raw: RawServer, caplog: pytest.LogCaptureFixture) -> None:
    def broken(view: ServiceView) -> None:
        raise RuntimeError("panel bug")

    monitor = ServiceMonitor(SystemdManager(RecordedSystemctl("active"), "sglang-qwen"), SglangClient(raw.url),
                             interval=0.02)
    monitor.subscribe(broken)
    with caplog.at_level(logging.ERROR, logger="console.service.control"):
        views = await _views(monitor, 3)
    assert len(views) >= 3
    assert any("subscriber" in r.getMessage() and r.exc_info and "panel bug" in str(r.exc_info[1])
               for r in caplog.records)


# --- remote.completions' client ----------------------------------------------------------------------


def test_completions_client_cut_body_is_its_own_error_with_the_url(raw: RawServer) -> None:
    raw.routes["/generate"] = cut(b'{"output_ids": [1, 2', declared=80)
    with pytest.raises(completions.ServerError) as info:
        completions.http_json(raw.url + "/generate", {"input_ids": [1]}, timeout=5)
    assert f"{raw.url}/generate" in str(info.value) and "cut short after 20 of 80 bytes" in str(info.value)
    assert '"output_ids": [1, 2' in str(info.value)


def test_completions_client_trickle_ends_at_the_deadline(raw: RawServer) -> None:
    raw.routes["/model_info"] = trickle(b'{"model_path": "/m", "pad": "' + b"x" * 40 + b'"}', every=0.1)
    began = time.monotonic()
    with pytest.raises(completions.ServerError, match=r"/model_info.*not complete within 1 s"):
        completions.http_json(raw.url + "/model_info", timeout=1.0)
    assert time.monotonic() - began < 2.5


def test_completions_client_garbage_and_silence_are_its_own_error(raw: RawServer) -> None:
    raw.routes["/model_info"] = garbage
    with pytest.raises(completions.ServerError, match="not an HTTP answer"):
        completions.http_json(raw.url + "/model_info", timeout=5)
    raw.routes["/model_info"] = trickle_status
    with pytest.raises(completions.ServerError, match=r"no answer within 1 s \(our deadline\)"):
        completions.http_json(raw.url + "/model_info", timeout=1.0)
    raw.routes["/model_info"] = stuck
    with pytest.raises(completions.ServerError, match=r"no answer within 1 s \(our deadline\)"):
        completions.http_json(raw.url + "/model_info", timeout=1.0)
