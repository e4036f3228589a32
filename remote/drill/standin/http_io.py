"""The rehearsal server's HTTP plumbing under its routes (`routes`): JSON answers, the model worker's
blocking calls in worker threads, a client's disconnect watched and turned into its request's abort,
Server-Sent Events, and the error answers in SGLang's shapes (docs/sglang.md, "HTTP serving")."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import urllib.parse
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import Request
from starlette.background import BackgroundTask
from starlette.responses import Response, StreamingResponse

from remote.drill.memory_saver import Refused
from remote.drill.sglang_contract import error_response
from remote.drill.standin.generate_body import BadRequest, validation_error
from remote.drill.standin.server import QueueFull, Server, log

WAIT_TIMEOUT_S = float(os.environ.get("SGLANG_REQUEST_STATE_WAIT_TIMEOUT", 4))  # environ.py
STREAM_ABORT_AFTER_S = 2.0  # tokenizer_manager.py, create_abort_task: asyncio.sleep(2)
THREADS = 1024  # blocking calls at once (requests parked by a pause each hold one)


def json_response(status: int, body: Any) -> Response:
    """A JSON answer, compact and UTF-8 as SGLang's orjson writes it (`None` is JSON null, as a FastAPI
    route that returns None answers)."""
    return Response(json.dumps(body, separators=(",", ":"), ensure_ascii=False), status_code=status,
                    media_type="application/json")


def empty(status: int) -> Response:
    """An answer without a body or a media type: SGLang's `Response(status_code=...)`."""
    return Response(status_code=status)


async def in_thread(work: Callable[[], Any]) -> Any:
    """`work()` in a worker thread (the model worker's calls block)."""
    return await anyio.to_thread.run_sync(work, limiter=_limiter())


_LIMITER: list[anyio.CapacityLimiter] = []


def _limiter() -> anyio.CapacityLimiter:
    if not _LIMITER:
        _LIMITER.append(anyio.CapacityLimiter(THREADS))
    return _LIMITER[0]


async def watched(request: Request, work: Callable[[threading.Event], Any], rids: list[str]) -> Any:
    """`work(client_gone)` in a thread, its client asked every WAIT_TIMEOUT_S whether it is still there
    (`_stream_one_response`): gone, `client_gone` is set (its requests, `rids`, abort at their next
    step) and logged as SGLang logs it."""
    gone = threading.Event()
    task = asyncio.ensure_future(in_thread(lambda: work(gone)))
    while not task.done():
        await asyncio.wait({task}, timeout=WAIT_TIMEOUT_S)
        if not task.done() and not gone.is_set() and await request.is_disconnected():
            gone.set()
            log("[http_server] Error: Request is disconnected from the client side (type 1). "
                f"Abort request obj.rid={rids[-1] if len(rids) == 1 else rids!r}")
    return task.result()


def streamed(produce: Callable[[threading.Event, Callable[[str], None]], None], rids: list[str]) -> StreamingResponse:
    """Server-Sent Events from `produce(client_gone, emit)`, run in a thread: each `emit(line)` sent as
    it comes, then `data: [DONE]`. A client that leaves cancels the stream at once (Starlette's
    `listen_for_disconnect`); its requests, `rids`, are aborted STREAM_ABORT_AFTER_S later if still
    running (`create_abort_task`, the background task of SGLang's StreamingResponse)."""
    gone = threading.Event()
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()
    running: list[asyncio.Future] = []

    def emit(line: str | None) -> None:
        loop.call_soon_threadsafe(lines.put_nowait, line)

    def run() -> None:
        try:
            produce(gone, emit)
        finally:
            emit(None)

    async def body() -> Any:
        running.append(asyncio.ensure_future(in_thread(run)))
        while (line := await lines.get()) is not None:
            yield line
        await running[0]
        yield "data: [DONE]\n\n"

    async def abort_later() -> None:
        await asyncio.sleep(STREAM_ABORT_AFTER_S)
        if running and not running[0].done():
            gone.set()
            log(f"[http_server] Client disconnected: abort request {rids[-1] if len(rids) == 1 else rids!r}")

    return StreamingResponse(body(), media_type="text/event-stream", background=BackgroundTask(abort_later))


def query(request: Request) -> dict[str, list[str]]:
    """The query string as `urllib.parse.parse_qs` reads it (blank values left out)."""
    return urllib.parse.parse_qs(request.url.query)


async def json_body(request: Request, server: Server, checker: bool = False) -> dict:
    """The body as SGLang's route gets it: unparsable or not an object is FastAPI's validation 400;
    a server without its model (only with --flap-health) is 503."""
    raw = await request.body()
    try:
        body = json.loads(raw or b"null")
    except json.JSONDecodeError as exc:
        raise validation_error(f"JSON decode error: {exc.msg}") from None
    if body is None and checker and server.weights_checker.admin_optional():
        body = {}  # 0.5.23: Optional[CheckWeightsReqInput] = None, then CheckWeightsReqInput()
    if not isinstance(body, dict):
        raise validation_error(f"Input should be a valid dictionary, got {type(body).__name__}")
    not_serving = server.serving_error()
    if not_serving is not None:  # only with --flap-health: the port opened before the weights
        raise BadRequest(503, error_response(503, not_serving))
    return body


def error_answer(exc: Exception) -> Response:
    """What SGLang answers for an error raised while serving: QueueFull is its 503 abort."""
    if isinstance(exc, QueueFull):  # HTTP 503 through SGLang's _handle_abort_finish_reason
        return json_response(503, error_response(503, str(exc)))
    if isinstance(exc, BadRequest):
        return json_response(exc.status, exc.body)
    if isinstance(exc, Refused):
        return json_response(400, error_response(400, str(exc), "Bad Request")) if exc.status == 400 else \
            json_response(exc.status, error_response(exc.status, str(exc)))
    raise exc


def stream_error(exc: BadRequest | QueueFull) -> str:
    """A ValueError inside a stream: its error chunk (`stream_results`)."""
    status = exc.status if isinstance(exc, BadRequest) else 503
    message = exc.message if isinstance(exc, BadRequest) else str(exc)
    return "data: " + json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": status,
                                            "retryable": False}}, separators=(",", ":")) + "\n\n"
