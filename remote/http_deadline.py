"""One HTTP request with a total deadline (stdlib only; shared by the worker and the console).

The deadline covers connecting, the status line, the headers and the whole body: a watchdog timer
shuts the socket down when it passes, which ends a blocked read at once whatever the server does,
so a server that trickles its answer a byte at a time cannot hold the caller. A short body (fewer
bytes than Content-Length, a cut chunk, or a read-until-close ended by the deadline) is an error,
never taken for the whole answer.

Every failure is one `HttpDeadlineError` with a `kind` and what was received; callers translate it
into their own errors and messages.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str


class HttpDeadlineError(Exception):
    """A request that gave no usable answer.

    `kind`: "bad_url" (not an http(s) URL; `cause` a ValueError when the URL's port is bad),
    "no_answer" (connecting, sending or reading the status line and headers failed; `cause` is the
    http.client or OSError exception), "too_large" (the body passed `max_body` bytes) or
    "cut_short" (the body ended early; `cause` the read's exception, if any). `expired` says the
    deadline had passed; `status`, `body` and `expected` (Content-Length, None when unknown) are
    what had arrived.
    """

    def __init__(self, kind: str, url: str, timeout: float, *, expired: bool = False,
                 cause: BaseException | None = None, status: int | None = None, body: bytes = b"",
                 expected: int | None = None):
        super().__init__(f"{url}: {kind}" + (f" ({cause})" if cause is not None else ""))
        self.kind, self.url, self.timeout, self.expired, self.cause = kind, url, timeout, expired, cause
        self.status, self.body, self.expected = status, body, expected

    def cut_short(self, exc_message: bool) -> str:
        """For "cut_short": "not complete within T s", or "cut short", with the read's exception in
        parentheses when it was not a plain IncompleteRead (its type, and its message if `exc_message`)."""
        if self.expired:
            return f"not complete within {self.timeout:g} s"
        exc = self.cause
        if exc is None or isinstance(exc, http.client.IncompleteRead):
            return "cut short"
        return f"cut short ({type(exc).__name__}: {exc})" if exc_message else f"cut short ({type(exc).__name__})"

    def received(self) -> str:
        """How much of the body came: "N bytes", or "N of M bytes" when its length was announced."""
        return f"{len(self.body)}" + (f" of {self.expected}" if self.expected is not None else "") + " bytes"


def request(url: str, data: bytes | None, timeout: float, max_body: int | None = None,
            headers: dict[str, str] | None = None, method: str | None = None) -> Answer:
    """GET (or POST `data` as JSON) with a total deadline of `timeout` seconds; any HTTP status is returned.
    `method` names another verb (the router's DELETE /workers/{id}).

    `headers` are sent as they are (e.g. `Authorization`); never put them in an error message."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpDeadlineError("bad_url", url, timeout)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    connection_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    try:
        conn = connection_class(parts.hostname, parts.port, timeout=timeout)
    except ValueError as exc:  # e.g. a port that is not a number
        raise HttpDeadlineError("bad_url", url, timeout, cause=exc) from None
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    def ran_out(exc: BaseException | None) -> bool:
        # The socket's own timeout (the same `timeout`, per operation) may fire a moment before the
        # watchdog does: either one is our deadline, never the server closing the connection.
        return expired.is_set() or isinstance(exc, TimeoutError)

    watchdog = threading.Timer(timeout, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        sent = {**({"Content-Type": "application/json"} if data is not None else {}), **(headers or {})}
        try:
            conn.request(method or ("POST" if data is not None else "GET"), target, body=data, headers=sent)
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as exc:
            raise HttpDeadlineError("no_answer", url, timeout, expired=ran_out(exc), cause=exc) from None
        status, content_type = response.status, response.getheader("Content-Type", "") or ""
        expected = response.length  # None: chunked, or read until the server closes
        body = bytearray()
        cut, cause = False, None
        try:
            while chunk := response.read(65536):
                body += chunk
                if max_body is not None and len(body) > max_body:
                    raise HttpDeadlineError("too_large", url, timeout, expired=expired.is_set(), status=status,
                                            body=bytes(body), expected=expected)
        except http.client.IncompleteRead as exc:
            body += exc.partial
            cut, cause = True, exc
        except (OSError, http.client.HTTPException) as exc:
            cut, cause = True, exc
        watchdog.cancel()
        if expected is not None and len(body) < expected:
            cut = True
        elif expected is None and expired.is_set():
            cut = True  # read until close: the deadline's shutdown may have ended it
        if cut:
            raise HttpDeadlineError("cut_short", url, timeout, expired=ran_out(cause), cause=cause, status=status,
                                    body=bytes(body), expected=expected)
        return Answer(status, bytes(body), content_type)
    finally:
        watchdog.cancel()
        conn.close()
