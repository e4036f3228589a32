"""The rehearsal server's HTTP front: SGLang's routes on FastAPI, served by uvicorn, as SGLang serves them.

It parses and checks what a client sends, in SGLang's order and error shapes (a contract violation
`{"error": "..."}`, a bad value `{"error": {"message": ...}}`, an unparsable body or an abort's HTTP
error `{"object": "error", "message", ...}`, an unknown route or method FastAPI's `{"detail": ...}`:
see `remote.drill.sglang_contract` and `generate_body`), applies `--api-key` / `--admin-api-key` in a
middleware before any route (SGLang's auth middleware) and `--metrics`, and asks the model worker
(`server.Server`) for everything else through its public methods alone. Each blocking call runs in a
worker thread, so the event loop keeps answering (SGLang's tokenizer manager is async too).

Read from SGLang 0.5.23 (`sglang/srt/entrypoints/http_server.py`, docs/sglang.md, "HTTP serving"):
- a client that disconnects aborts its request (`tokenizer_manager.py`, `_stream_one_response`: while
  waiting it asks `request.is_disconnected()` every SGLANG_REQUEST_STATE_WAIT_TIMEOUT seconds, 4 by
  default, then `abort_request(rid)` and logs "Request is disconnected from the client side (type 1)");
- `stream: true` on /generate and /v1/chat/completions answers Server-Sent Events, `data: {json}` per
  chunk and `data: [DONE]` last (`generate_request`'s `stream_results`); a stream cut by its client
  is cancelled at once (Starlette's `listen_for_disconnect`) and its request aborted two seconds later
  (`create_abort_task`); a ValueError inside a stream is an error chunk, not an HTTP error;
- uvicorn with its keep-alive of SGLANG_TIMEOUT_KEEP_ALIVE (5 s), its access log left out here.

`HttpFront` is what `__main__` starts: bound first (the port is taken, a clash told at once), listening
only once the weights are in (SGLang starts its HTTP server last), then served until SIGTERM (uvicorn's
shutdown: no new connection, the answers under way given a second to finish).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import logging
import os
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from remote.drill import memory_saver, weights_checker
from remote.drill.sglang_contract import allowed
from remote.drill.standin.http_io import json_response
from remote.drill.standin.routes import add_routes
from remote.drill.standin.server import Server, log

KEEP_ALIVE_S = int(os.environ.get("SGLANG_TIMEOUT_KEEP_ALIVE", 5))  # environ.py
SHUTDOWN_GRACE_S = 1.0  # answers under way at SIGTERM; the service's stop waits 10 s in all


class ApiKeys:
    """SGLang's auth middleware (utils/auth.py): 401 `{"error": "Unauthorized"}` before any route."""

    def __init__(self, app: ASGIApp, server: Server, args: argparse.Namespace):
        self.app, self.server, self.args = app, server, args

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            checker = self.server.weights_checker
            admin = path in memory_saver.CONTROL_ROUTES or path == memory_saver.FLUSH_ROUTE or (
                path == weights_checker.ROUTE and checker.admin_optional())
            authorization = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
            if not allowed(path, scope["method"], authorization, self.args.api_key, self.args.admin_api_key,
                           "admin_optional" if admin else "normal"):
                await json_response(401, {"error": "Unauthorized"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


class Uvicorn(uvicorn.Server):
    """uvicorn's server, its shutdown bounded. At SIGTERM the requests under way are aborted (`on_exit`),
    so each is answered, with SGLang's abort finish, within SHUTDOWN_GRACE_S (SGLang drains them: the
    drill's service stop waits 10 s in all); should anything still hold the server (a request parked
    by a pause, a connection its asyncio server waits for), the process ends a little later all the
    same, as `__main__` ends it ("Shutting down", exit 0)."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit
        self._exiting = False

    def handle_exit(self, sig: int, frame: Any) -> None:
        super().handle_exit(sig, frame)
        if self._exiting:
            return
        self._exiting = True
        threading.Thread(target=self._on_exit, name="abort-all", daemon=True).start()
        timer = threading.Timer(SHUTDOWN_GRACE_S + 2.0, self._hard_exit)
        timer.daemon = True
        timer.start()

    @staticmethod
    def _hard_exit() -> None:
        log("Shutting down")
        sys.stdout.flush()
        os._exit(0)


class NoShutdownTracebacks(logging.Filter):
    """A request uvicorn cancels at the end of its shutdown's grace is one line ("Cancel N running
    task(s)"), not also a traceback of the cancellation."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


class HttpFront:
    """The server's HTTP listener: `bind`, later `listen`, then `serve` until SIGTERM, and `close`."""

    def __init__(self, server: Server, args: argparse.Namespace):
        self._server = server
        self._args = args
        self._sock: socket.socket | None = None
        self._uvicorn: Uvicorn | None = None

    def bind(self) -> int:
        """Take the port without listening yet (a client is refused meanwhile); the port bound.
        OSError when it cannot be had."""
        family = socket.AF_INET6 if ":" in self._args.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._args.host, self._args.port))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        return sock.getsockname()[1]

    def listen(self) -> None:
        assert self._sock is not None
        self._sock.listen(2048)  # uvicorn's backlog; connections wait there until it serves

    def serve(self) -> None:
        """Answer requests until SIGTERM or ^C: the requests under way aborted, uvicorn's shutdown, then
        its signal raised again for `__main__`'s handler."""
        assert self._sock is not None
        log_config = copy.deepcopy(uvicorn.config.LOGGING_CONFIG)  # SGLang's format (set_uvicorn_logging_configs)
        log_config["formatters"]["default"]["fmt"] = "[%(asctime)s] %(levelprefix)s %(message)s"
        log_config["formatters"]["default"]["datefmt"] = "%Y-%m-%d %H:%M:%S"
        config = uvicorn.Config(make_app(self._server, self._args), log_level="warning", access_log=False,
                                log_config=log_config, timeout_keep_alive=KEEP_ALIVE_S, lifespan="off",
                                timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
        logging.getLogger("uvicorn.error").addFilter(NoShutdownTracebacks())
        self._uvicorn = Uvicorn(config, on_exit=lambda: self._server.abort(None, True))
        self._uvicorn.run(sockets=[self._sock])

    def shutdown(self) -> None:
        """Stop `serve` from another thread (a test that serves in a thread of its own)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()


def make_app(server: Server, args: argparse.Namespace) -> Any:
    """SGLang's routes for `server`, with the front's flags from `args` (--api-key, --admin-api-key,
    --metrics): a FastAPI app behind the API-key middleware."""
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)  # SGLang's /docs are no part of its contract
    add_routes(app, server, args)
    return ApiKeys(app, server, args)
