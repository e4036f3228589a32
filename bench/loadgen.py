"""A client load on a server during a window: /generate at a steady, bounded rate, failures counted.

    python bench/loadgen.py URL [--rate 4] [--seconds 10] [--max-in-flight 16] [--api-key-env VAR] [--chat]

Users' requests keep coming while the window runs. On the stop route each one sent while the server is
down fails; on the pause route each one is held and answered after `/continue_generation`. This sends
greedy `/generate` requests at `--rate` per second (each in its own thread, at most `--max-in-flight`
at a time: a send that would pass the bound waits, and is counted late, not lost), to a loopback URL
only (`--chat`: OpenAI chat requests to `/v1/chat/completions` instead, the route real clients use
most; what a fleet's router forwards; they name the model as OpenAI clients do, the first the URL's
`/v1/models` lists, since smg routes a chat by its model and refuses one without), and reports what came back (`LoadReport`): completed, failed by kind, the longest wait (one
request's send to its answer) and how many were in flight at most.

Failure kinds: `refused` (nothing listens), `no answer` (the connection closed or reset before an
answer), `timeout`, `HTTP <status>`, `aborted` (a 200 whose finish reason is an abort), `bad answer`
(no `output_ids`; in chat, no message content).
Importable: `Load(url)` runs in the background (`with Load(url) as load: ...; load.report`), and
`run_load(url, seconds)` for a fixed time.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import os
import socket
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from dataclasses import dataclass, field

PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # any valid ids: the load is the requests, not their meaning
CHAT_MESSAGES = [{"role": "user", "content": "Write fizzbuzz in Python."}]
GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
          "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


@dataclass(frozen=True)
class LoadReport:
    """What a load saw: every request sent ends completed or failed (by kind) by the time it is made."""

    url: str
    seconds: float
    rate: float
    sent: int
    completed: int
    failures: dict[str, int]
    longest_wait_s: float  # the longest any request waited for its answer (completed or failed)
    max_in_flight: int  # the most requests waiting at once (held ones pile up here)
    late_sends: int  # sends that waited for the in-flight bound

    @property
    def failed(self) -> int:
        return sum(self.failures.values())

    def line(self) -> str:
        kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(self.failures.items())) or "none"
        return (f"{self.sent} requests in {self.seconds:.1f} s ({self.rate:g}/s): {self.completed} completed, "
                f"{self.failed} failed ({kinds}); longest wait {self.longest_wait_s:.2f} s, "
                f"at most {self.max_in_flight} in flight")


def loopback_url(url: str) -> str:
    """`url` when it is http:// on a loopback address; ValueError naming it otherwise (a load is for
    the drill and tests on this machine, never a real host's users)."""
    parsed = urllib.parse.urlsplit(url)
    host = parsed.hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if parsed.scheme != "http" or not loopback:
        raise ValueError(f"load generator: {url!r} is not an http:// URL on a loopback address (127.0.0.1, ::1, "
                         f"localhost); it only loads servers on this machine")
    return url.rstrip("/")


def failure_kind(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, ConnectionRefusedError):
        return "refused"
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return "timeout"
    if isinstance(reason, (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
                           http.client.IncompleteRead, ConnectionAbortedError)):
        return "no answer"
    return f"no answer ({type(reason).__name__})"


@dataclass
class _Tally:
    sent: int = 0
    completed: int = 0
    failures: Counter = field(default_factory=Counter)
    longest: float = 0.0
    in_flight: int = 0
    max_in_flight: int = 0
    late: int = 0


class Load:
    """A steady load on `url` in background threads, from `start()` (or `with`) until `stop()`."""

    def __init__(self, url: str, rate: float = 4.0, max_in_flight: int = 16, max_new_tokens: int = 8,
                 api_key: str | None = None, timeout_s: float = 300.0, chat: bool = False, model: str | None = None):
        if rate <= 0 or max_in_flight < 1:
            raise ValueError(f"load generator: rate must be > 0 and max_in_flight >= 1, got {rate} and {max_in_flight}")
        self.url = loopback_url(url)
        self.rate, self.bound, self.timeout_s = rate, max_in_flight, timeout_s
        self.chat = chat
        self.route = "/v1/chat/completions" if chat else "/generate"
        self.max_new_tokens, self.model = max_new_tokens, model
        self.body = json.dumps({"input_ids": PROMPT_IDS,
                                "sampling_params": {**GREEDY, "max_new_tokens": max_new_tokens}}).encode()
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self.tally = _Tally()
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_in_flight)
        self.stopping = threading.Event()
        self.requests: list[threading.Thread] = []
        self.sender: threading.Thread | None = None
        self.began = self.ended = 0.0
        self.report: LoadReport | None = None
        # (sent, answered, completed) per request in wall-clock time (time.time(), the run state's
        # clock): what a bench splits into before, during and after a window.
        self.answers: list[tuple[float, float, bool]] = []

    def __enter__(self) -> Load:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _listed_model(self) -> str | None:
        """The first model the URL's GET /v1/models lists (what an OpenAI client names), else None."""
        request = urllib.request.Request(self.url + "/v1/models", headers=self.headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as answer:
                data = json.loads(answer.read()).get("data") or []
        except (OSError, ValueError, AttributeError):
            return None
        first = data[0] if data and isinstance(data[0], dict) else {}
        return first.get("id") if isinstance(first.get("id"), str) else None

    def start(self) -> None:
        if self.chat:
            model = self.model or self._listed_model()
            self.body = json.dumps({**({"model": model} if model else {}), "messages": CHAT_MESSAGES,
                                    "temperature": 0.0, "max_tokens": self.max_new_tokens}).encode()
        self.began = time.monotonic()
        self.sender = threading.Thread(target=self._send_loop, name="loadgen", daemon=True)
        self.sender.start()

    def stop(self) -> LoadReport:
        """Stop sending, wait for every request sent to end (answered, failed or timed out), report."""
        if self.report is not None:
            return self.report
        self.stopping.set()
        if self.sender is not None:
            self.sender.join()
        self.ended = time.monotonic()
        for thread in self.requests:
            thread.join()
        t = self.tally
        self.report = LoadReport(self.url, round(self.ended - self.began, 3), self.rate, t.sent, t.completed,
                                 dict(t.failures), round(t.longest, 3), t.max_in_flight, t.late)
        return self.report

    def _send_loop(self) -> None:
        n = 0
        while not self.stopping.is_set():
            due = self.began + n / self.rate
            if self.stopping.wait(max(0.0, due - time.monotonic())):
                return
            if not self.slots.acquire(blocking=False):
                with self.lock:
                    self.tally.late += 1
                while not self.slots.acquire(timeout=0.1):
                    if self.stopping.is_set():
                        return
            thread = threading.Thread(target=self._one, name=f"loadgen-{n}", daemon=True)
            with self.lock:
                self.tally.sent += 1
                self.tally.in_flight += 1
                self.tally.max_in_flight = max(self.tally.max_in_flight, self.tally.in_flight)
            self.requests.append(thread)
            thread.start()
            n += 1

    def _one(self) -> None:
        begin, sent_at = time.monotonic(), time.time()
        kind = None
        try:
            request = urllib.request.Request(self.url + self.route, self.body, self.headers)
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
            kind = chat_failure(answer) if self.chat else generate_failure(answer)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            kind = "bad answer" if isinstance(exc, ValueError) else failure_kind(exc)
        finally:
            waited = time.monotonic() - begin
            with self.lock:
                t = self.tally
                t.in_flight -= 1
                t.longest = max(t.longest, waited)
                self.answers.append((sent_at, sent_at + waited, kind is None))
                if kind is None:
                    t.completed += 1
                else:
                    t.failures[kind] += 1
            self.slots.release()


def generate_failure(answer: dict) -> str | None:
    """What is wrong with a /generate answer (None: a completed request)."""
    finish = (answer.get("meta_info") or {}).get("finish_reason") or {}
    if not isinstance(answer.get("output_ids"), list):
        return "bad answer"
    return "aborted" if finish.get("type") == "abort" else None


def chat_failure(answer: dict) -> str | None:
    """What is wrong with a /v1/chat/completions answer (None: a completed request)."""
    choices = answer.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
    if not isinstance((choice.get("message") or {}).get("content"), str):
        return "bad answer"
    return "aborted" if choice.get("finish_reason") == "abort" else None


def run_load(url: str, seconds: float, rate: float = 4.0, **kwargs: object) -> LoadReport:
    """A load for `seconds`, then its report (every request sent has ended)."""
    with Load(url, rate, **kwargs) as load:  # type: ignore[arg-type]
        time.sleep(seconds)
    assert load.report is not None
    return load.report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the server, on this machine (http://127.0.0.1:PORT)")
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second (default 4)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to send (default 10)")
    parser.add_argument("--max-in-flight", type=int, default=16, help="at most this many waiting at once")
    parser.add_argument("--api-key-env", metavar="VAR", help="the environment variable holding the server's API key")
    parser.add_argument("--chat", action="store_true", help="chat requests (/v1/chat/completions) instead of /generate")
    args = parser.parse_args()
    try:
        report = run_load(args.url, args.seconds, args.rate, max_in_flight=args.max_in_flight,
                          api_key=os.environ.get(args.api_key_env) if args.api_key_env else None, chat=args.chat)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(report.line())
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
