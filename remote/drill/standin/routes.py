"""The rehearsal server's routes on FastAPI, each as SGLang 0.5.23 declares it (`entrypoints/http_server.py`:
the same paths and methods, so an unknown route is FastAPI's 404 and a wrong method its 405).

Every route asks the model worker (`server.Server`) in a worker thread (`http_io.in_thread`); the ones
that generate watch their client and abort on its disconnect (`http_io.watched`, `http_io.streamed`).
`/v1/chat/completions` is `remote.drill.chat`'s request, answered whole or streamed here.
"""

from __future__ import annotations

import argparse
import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from starlette.responses import Response

from remote.drill import chat, memory_saver, weights_checker
from remote.drill.memory_saver import Refused
from remote.drill.standin import generate_body as gb
from remote.drill.standin.generate_body import BadRequest, validation_error
from remote.drill.standin.http_io import (
    empty,
    error_answer,
    in_thread,
    json_body,
    json_response,
    query,
    stream_error,
    streamed,
    watched,
)
from remote.drill.standin.server import QueueFull, Server


def add_routes(app: FastAPI, server: Server, args: argparse.Namespace) -> None:
    """SGLang's routes for `server`, /metrics with --metrics, /weights_checker as its release has it."""
    async def refused(request: Request, exc: Exception) -> Response:
        return error_answer(exc)

    for error in (BadRequest, QueueFull, Refused):
        app.add_exception_handler(error, refused)

    def info(path: str, body: Callable[[], Any]) -> None:
        async def route() -> Response:
            return json_response(200, await in_thread(body))
        app.add_api_route(path, route, methods=["GET"])

    @app.get("/health")
    @app.get("/health_generate")
    async def health() -> Response:
        return empty(await in_thread(server.health))

    @app.get("/ready")
    async def ready() -> Response:
        return empty(200 if await in_thread(server.ready) else 503)

    for path in ("/model_info", "/get_model_info"):
        info(path, server.model_info)
    for path in ("/server_info", "/get_server_info"):
        info(path, server.server_info)
    info("/v1/models", server.model_list)

    @app.get("/v1/loads")
    async def loads(request: Request) -> Response:
        asked = query(request)
        include = {s.strip() for s in ",".join(asked.get("include", [])).split(",")} if "include" in asked else None
        try:
            return json_response(200, await in_thread(lambda: server.loads(include)))
        except ValueError as exc:
            return json_response(400, {"detail": str(exc)})

    if args.metrics:
        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(await in_thread(server.metrics_text), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        admitted = gb.admit(await json_body(request, server))
        rids: list[str] = []
        if admitted.stream:
            return streamed(lambda gone, emit: stream_generation(server, admitted, rids, gone, emit), rids)

        def work(gone: threading.Event) -> Any:
            answers = []
            for rid, ids, params in admitted.resolve(server):
                rids.append(rid)
                answers.append(gb.generation_answer(server, *server.run_request(rid, ids, params, client_gone=gone)))
            return answers[0] if admitted.single else answers

        return json_response(200, await watched(request, work, rids))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await json_body(request, server)
        rids = [f"cmpl-{uuid.uuid4().hex}"]

        def work(gone: threading.Event) -> dict:
            ids, params = gb.completions_request(server, body)
            generation, meta = server.run_request(rids[0], ids, params, client_gone=gone)
            return gb.completions_answer(server, body, ids, generation, meta)

        return json_response(200, await watched(request, work, rids))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await json_body(request, server)
        asked = await in_thread(lambda: chat.prepare(server, body, gb.params_of(server), validation_error))
        if body.get("stream"):
            return streamed(lambda gone, emit: stream_chat(server, asked, gone, emit), [asked.rid])
        generation, _ = await watched(request, lambda gone: server.run_request(
            asked.rid, asked.ids, asked.params, client_gone=gone), [asked.rid])
        return json_response(200, asked.response(generation))

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        body = await json_body(request, server)
        await in_thread(lambda: server.abort(body.get("rid"), bool(body.get("abort_all"))))
        return empty(200)

    for path in memory_saver.CONTROL_ROUTES:
        app.add_api_route(path, control_route(server, path),
                          methods=["GET", "POST"] if path in memory_saver.GET_TOO else ["POST"])

    @app.api_route(memory_saver.FLUSH_ROUTE, methods=["GET", "POST"])
    async def flush_cache(request: Request) -> Response:
        """A text answer without a media type (FastAPI's Response(content=...)); its body is not read."""
        asked = query(request)
        status, text = await in_thread(lambda: server.flush(asked["timeout"][-1] if "timeout" in asked else None))
        return Response(text, status_code=status)

    if server.weights_checker.methods():
        @app.api_route(weights_checker.ROUTE, methods=list(server.weights_checker.methods()))
        async def check_weights(request: Request) -> Response:
            body = await json_body(request, server, checker=True)
            return json_response(*await in_thread(lambda: server.check_weights(body)))


def control_route(server: Server, path: str) -> Callable[[Request], Any]:
    """One of the memory saver's four routes: `server.control`'s status and JSON body."""

    async def route(request: Request) -> Response:
        body = await json_body(request, server)
        return json_response(*await in_thread(lambda: server.control(path, body)))

    route.__name__ = path.strip("/")
    return route


def stream_generation(server: Server, admitted: gb.Admitted, rids: list[str], gone: threading.Event,
                      emit: Callable[[str], None]) -> None:
    """A streamed /generate (in its thread): a chunk per token, text and ids so far, the last with the
    finish; a batch's chunks carry their prompt's `index`. A ValueError is an error chunk."""

    def send(chunk: dict, index: int) -> None:
        if not admitted.single:
            chunk["index"] = index
        emit("data: " + json.dumps(chunk, separators=(",", ":"), ensure_ascii=False) + "\n\n")

    try:
        for index, (rid, ids, params) in enumerate(admitted.resolve(server)):
            rids.append(rid)
            generation, meta = server.run_request(
                rid, ids, params, client_gone=gone,
                on_token=lambda out, rid=rid, ids=ids, index=index: send(gb.partial_answer(server, rid, len(ids), out), index))
            send(gb.generation_answer(server, generation, meta), index)
    except (BadRequest, QueueFull) as exc:
        emit(stream_error(exc))


def stream_chat(server: Server, asked: chat.Chat, gone: threading.Event, emit: Callable[[str], None]) -> None:
    """A streamed chat completion (in its thread): the role chunk, a content chunk as the text grows,
    then the finish (and usage) chunks (`remote.drill.chat`); a full queue is an error chunk."""
    emit(asked.first())
    sent = ""

    def on_token(output_ids: list[int]) -> None:
        nonlocal sent
        grown = asked.live_delta(sent, output_ids)
        if grown is not None:
            emit(asked.chunk({"content": grown[len(sent):]}))
            sent = grown

    try:
        generation, _ = server.run_request(asked.rid, asked.ids, asked.params, client_gone=gone, on_token=on_token)
    except QueueFull as exc:
        emit(stream_error(exc))
        return
    for line in asked.last(generation, sent):
        emit(line)
