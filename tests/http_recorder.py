"""A loopback HTTP server that records the JSON posted to it: the far end of apprise's `json://`
target in the notification tests (real HTTP, real delivery). `hold` keeps every answer back until
it is set, as a target that has stopped answering; `closed_port()` is one where nothing listens."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Recorder:
    def __init__(self) -> None:
        self.posts: list[dict[str, Any]] = []
        self.changed = threading.Condition()
        self.hold = threading.Event()
        self.hold.set()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with recorder.changed:
                    recorder.posts.append({"path": self.path, "json": json.loads(body or b"null")})
                    recorder.changed.notify_all()
                recorder.hold.wait(60)
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.url = f"json://127.0.0.1:{self.port}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float = 60) -> list[dict[str, Any]]:
        """Until the posts so far satisfy `predicate` (TimeoutError past `timeout`)."""
        with self.changed:
            if not self.changed.wait_for(lambda: predicate(self.posts), timeout):
                raise TimeoutError(f"the recorder got {[p['json'].get('title') for p in self.posts]}")
            return list(self.posts)

    def titles(self) -> list[str]:
        with self.changed:
            return [p["json"]["title"] for p in self.posts]

    def close(self) -> None:
        self.hold.set()
        self.server.shutdown()
        self.server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
