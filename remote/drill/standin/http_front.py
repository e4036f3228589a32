"""The rehearsal server's HTTP front: SGLang's routes on the standard library's `http.server`.

It parses and checks what a client sends, in SGLang's order and error shapes (a contract violation
`{"error": "..."}`, a bad value `{"error": {"message": ...}}`, an unparsable body or an abort's HTTP
error `{"object": "error", "message", ...}`, an unknown route `{"detail": "Not Found"}`: see
`remote.drill.sglang_contract`), applies `--api-key` / `--admin-api-key` and `--metrics`, and asks the
model worker (`server.Server`) for everything else through its public methods alone: health,
readiness, the info bodies, tokenizing, sampling params, `run_request`, aborts, the memory saver's
routes. `/v1/chat/completions` is `remote.drill.chat`, which returns what this front sends.

`HttpFront` is what `__main__` starts: bound first (the port is taken, a clash told at once), listening
only once the weights are in (SGLang starts its HTTP server last), then served until SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.parse
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from remote.drill import chat, memory_saver, weights_checker
from remote.drill.memory_saver import Refused
from remote.drill.sglang_contract import ContractError, allowed, decode_sampling_params, error_response
from remote.drill.standin.server import QueueFull, Server

GET_ROUTES = ("/health", "/health_generate", "/ready", "/model_info", "/get_model_info", "/server_info",
              "/get_server_info", "/v1/models", "/metrics", "/v1/loads")
POST_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request")


class BadRequest(Exception):
    """An HTTP error answer: `status` and the body in SGLang's shape for it."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


def value_error(message: str) -> BadRequest:
    """A ValueError in SGLang's request path: 400 {"error": {"message": ...}} (_create_error_response)."""
    return BadRequest(400, {"error": {"message": message}})


def validation_error(message: str) -> BadRequest:
    """What FastAPI's validation of GenerateReqInput gives: 400 in the ErrorResponse shape."""
    return BadRequest(400, error_response(400, message, "Bad Request"))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


class HttpFront:
    """The server's HTTP listener: `bind`, later `listen`, then `serve` until SIGTERM, and `close`."""

    def __init__(self, server: Server, args: argparse.Namespace):
        self._server = server
        self._args = args
        self._httpd: ThreadingHTTPServer | None = None

    def bind(self) -> int:
        """Take the port without listening yet (a client is refused meanwhile); the port bound.
        OSError when it cannot be had."""
        self._httpd = ThreadingHTTPServer((self._args.host, self._args.port), make_handler(self._server, self._args),
                                          bind_and_activate=False)
        self._httpd.server_bind()
        self._httpd.daemon_threads = True
        return self._httpd.server_address[1]

    def listen(self) -> None:
        assert self._httpd is not None
        self._httpd.server_activate()

    def serve(self) -> None:
        """Answer requests until interrupted (SystemExit from the SIGTERM handler, or ^C)."""
        assert self._httpd is not None
        self._httpd.serve_forever(poll_interval=0.2)

    def close(self) -> None:
        assert self._httpd is not None
        self._httpd.server_close()


def make_handler(server: Server, args: argparse.Namespace) -> type[BaseHTTPRequestHandler]:
    """The request handler class for `server`, with the front's flags from `args` (--api-key,
    --admin-api-key, --metrics)."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "sglang-standin"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # keep the log to SGLang's start-up lines

        def _send(self, status: int, body: Any = b"", content_type: str = "application/json") -> None:
            if isinstance(body, bytes):
                data = body
            else:
                data = (json.dumps(body) if content_type == "application/json" else body).encode()
            self.send_response(status)
            if data or content_type != "application/json":
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _send_events(self, events: list[str]) -> None:
            """A `text/event-stream` answer in HTTP/1.1 chunked transfer encoding (as uvicorn streams)."""
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream; charset=utf-8")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for event in events:
                data = event.encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

        def _authorized(self, path: str) -> bool:
            admin = path in memory_saver.CONTROL_ROUTES or path == memory_saver.FLUSH_ROUTE or (
                path == weights_checker.ROUTE and server.weights_checker.admin_optional())
            level = "admin_optional" if admin else "normal"
            if allowed(path, self.command, self.headers.get("Authorization"), args.api_key,
                       args.admin_api_key, level):
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if not self._authorized(path):
                return
            if path == memory_saver.FLUSH_ROUTE:
                self._flush()
            elif path in ("/health", "/health_generate"):
                self._send(server.health())
            elif path == "/ready":
                self._send(200 if server.ready() else 503)
            elif path in memory_saver.GET_TOO or (path == weights_checker.ROUTE
                                                  and "GET" in server.weights_checker.methods()):
                self.do_POST()
            elif path in ("/model_info", "/get_model_info"):
                self._send(200, server.model_info())
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, server.server_info())
            elif path == "/v1/models":
                self._send(200, server.model_list())
            elif path == "/v1/loads":
                query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
                include = {s.strip() for s in ",".join(query.get("include", [])).split(",")} if "include" in query else None
                try:
                    self._send(200, server.loads(include))
                except ValueError as exc:
                    self._send(400, {"detail": str(exc)})
            elif path == "/metrics" and args.metrics:
                self._send(200, server.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path in POST_ROUTES or path in memory_saver.CONTROL_ROUTES or (
                    path == weights_checker.ROUTE and server.weights_checker.methods()):
                self._send(405, {"detail": "Method Not Allowed"})
            else:
                self._send(404, {"detail": "Not Found"})

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized(path):
                return
            if path == memory_saver.FLUSH_ROUTE:  # its body is not read (only the `timeout` query)
                self._flush()
                return
            checker = path == weights_checker.ROUTE and bool(server.weights_checker.methods())
            if path not in POST_ROUTES and path not in memory_saver.CONTROL_ROUTES and not checker:
                self._send(405 if path in GET_ROUTES else 404,
                           {"detail": "Method Not Allowed" if path in GET_ROUTES else "Not Found"})
                return
            try:
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
                if path in memory_saver.CONTROL_ROUTES or checker:
                    try:
                        self._send(*(server.check_weights(body) if checker else server.control(path, body)))
                    except Refused as exc:
                        raise (validation_error(str(exc)) if exc.status == 400 else
                               BadRequest(exc.status, error_response(exc.status, str(exc)))) from None
                elif path == "/generate":
                    self._send(200, self._generate(body))
                elif path == "/v1/completions":
                    self._send(200, self._completions(body))
                elif path == "/v1/chat/completions":  # remote.drill.chat: JSON, or SSE with stream
                    answer = chat.answer(server, body, self._params, validation_error)
                    if isinstance(answer, list):
                        self._send_events(answer)
                    else:
                        self._send(200, answer)
                else:
                    server.abort(body.get("rid"), bool(body.get("abort_all")))
                    self._send(200)
            except QueueFull as exc:  # HTTP 503 through SGLang's _handle_abort_finish_reason
                self._send(503, error_response(503, str(exc)))
            except BadRequest as exc:
                self._send(exc.status, exc.body)

        def _flush(self) -> None:
            """/flush_cache: a text answer without a media type (FastAPI's Response(content=...))."""
            query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
            try:
                status, text = server.flush(query["timeout"][-1] if "timeout" in query else None)
            except Refused as exc:
                self._send(400, error_response(400, str(exc), "Bad Request"))
                return
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
            """(token ids per request, single): GenerateReqInput's text / input_ids, one or a batch."""
            text, ids = body.get("text"), body.get("input_ids")
            if text is not None and not (isinstance(text, str) or (isinstance(text, list)
                                                                   and all(isinstance(t, str) for t in text))):
                raise validation_error("text: Input should be a valid string or a list of strings")
            if ids is not None and not (_is_ids(ids) or (isinstance(ids, list) and all(_is_ids(i) for i in ids))):
                raise validation_error("input_ids: Input should be a valid list of integers or a list of lists")
            if text is None and ids is None:
                raise value_error("Either text, input_ids or input_embeds should be provided.")
            if text is not None:
                texts = [text] if isinstance(text, str) else text
                return [server.tokenize(t) for t in texts], isinstance(text, str)
            if not ids:
                raise value_error("input_ids cannot be empty.")
            batch = [ids] if _is_ids(ids) else ids
            vocab_size = server.vocab_size()
            for one in batch:
                if not one:
                    raise value_error("input_ids cannot be empty.")
                bad = next((t for t in one if not 0 <= t < vocab_size), None)
                if bad is not None:
                    raise value_error(f"The input_ids {bad} is out of the vocabulary (size {vocab_size}).")
            return batch, _is_ids(ids)

        def _params(self, raw: Any, n: int) -> list[dict[str, Any]]:
            """Each request's resolved sampling params: contract, then preferred, then verify."""
            try:
                given = [decode_sampling_params(p) for p in raw] if isinstance(raw, list) else \
                    [decode_sampling_params(raw if raw is not None else {})] * n
            except ContractError as exc:
                raise BadRequest(400, {"error": str(exc)}) from None
            if len(given) != n:
                raise value_error(f"The number of sampling_params ({len(given)}) does not match the batch size ({n}).")
            try:
                return [server.sampling_params(p) for p in given]
            except ValueError as exc:
                raise value_error(str(exc)) from None

        def _generate(self, body: dict) -> Any:
            batch, single = self._prompts(body)
            params = self._params(body.get("sampling_params"), len(batch))
            rids = body.get("rid")
            rids = [rids] if isinstance(rids, str) else rids if isinstance(rids, list) else [None] * len(batch)
            if len(rids) != len(batch):
                raise value_error(f"The number of rids ({len(rids)}) does not match the batch size ({len(batch)}).")
            answers = []
            for ids, p, rid in zip(batch, params, rids, strict=True):
                generation, meta = server.run_request(rid or uuid.uuid4().hex, ids, p)
                if generation.finish_reason.get("type") == "abort" and generation.finish_reason.get("status_code"):
                    raise BadRequest(generation.finish_reason["status_code"],
                                     error_response(generation.finish_reason["status_code"],
                                                    generation.finish_reason["message"]))
                text = server.decode(generation.output_ids)
                if generation.text_end is not None:
                    text = text[:generation.text_end]
                answers.append({"text": text, "output_ids": generation.output_ids, "meta_info": meta})
            return answers[0] if single else answers

        def _completions(self, body: dict) -> dict:
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = server.tokenize(prompt)
            elif _is_ids(prompt) and prompt:
                ids = prompt
            else:
                raise validation_error("prompt: Input should be a valid string or a list of integers")
            # serving_completions / protocol.py CompletionRequest: OpenAI's defaults (temperature 1.0).
            fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                      "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop": None, "stop_token_ids": None,
                      "ignore_eos": False, "logit_bias": None}
            request = {k: body.get(k, v) for k, v in fields.items()}
            request["max_new_tokens"] = body.get("max_tokens", 16)
            request["min_new_tokens"] = body.get("min_tokens", 0)
            if body.get("seed") is not None:
                request["sampling_seed"] = body["seed"]
            (params,) = self._params(request, 1)
            generation, meta = server.run_request(f"cmpl-{uuid.uuid4().hex}", ids, params)
            reason = generation.finish_reason
            choice = {"index": 0, "text": server.decode(generation.output_ids)[:generation.text_end],
                      "logprobs": None, "finish_reason": reason["type"], "matched_stop": reason.get("matched")}
            if body.get("return_token_ids"):
                choice["token_ids"] = generation.output_ids
                choice["prompt_token_ids"] = ids
            return {"id": meta["id"], "object": "text_completion", "created": int(time.time()),
                    "model": server.served_name, "choices": [choice],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(generation.output_ids),
                              "total_tokens": len(ids) + len(generation.output_ids)}}

    return Handler
