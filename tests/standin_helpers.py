"""Starting the rehearsal server (`remote.drill.standin`) as a real local process, for tests and benches."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# Greedy decoding's sampling params as SGLang takes them (docs/sglang.md), written out independently
# of remote.sglang_sampling so tests can check what it sends.
GREEDY_PARAMS = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                 "presence_penalty": 0.0, "repetition_penalty": 1.0, "min_new_tokens": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The HTTP status of GET url, or None when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def start_standin(model: Path, port: int, log: Path, *args: str) -> subprocess.Popen:
    """Start the standin in its own session (like a detached service); returns the process."""
    with log.open("w") as fh:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "remote.drill.standin", "--model", str(model), "--port", str(port),
                                 *args], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)


def wait_status(url: str, want: int, timeout: float = 60.0,
                proc: subprocess.Popen | None = None) -> list[int | None]:
    """Poll until GET url answers `want`; returns every status seen (TimeoutError when it never does,
    RuntimeError at once when the server process `proc` has exited)."""
    seen: list[int | None] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode} before {url} answered {want}")
        status = http_status(url)
        seen.append(status)
        if status == want:
            return seen
        time.sleep(0.1)
    raise TimeoutError(f"{url} never answered {want}; saw {seen[-5:]}")


def watch_start(url: str, log: Path, proc: subprocess.Popen, timeout: float = 90.0) -> list[dict]:
    """Poll a starting server until /health answers 200: each look's /model_info, /health and /ready
    statuses (None: refused), whether the log had "Load weight end" before the look (`loading`: not
    yet), and whether it had it, and "fired up", after the look's answers."""
    looks: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with status {proc.returncode}: {log.read_text()[-2000:]}")
        before = log.read_text() if log.exists() else ""
        look = {"loading": "Load weight end" not in before, "model_info": http_status(url + "/model_info"),
                "ready": http_status(url + "/ready"), "health": http_status(url + "/health", timeout=30)}
        after = log.read_text() if log.exists() else ""
        look.update(weights_loaded="Load weight end" in after, fired_up="fired up" in after)
        looks.append(look)
        if look["health"] == 200:
            return looks
        time.sleep(0.1)
    raise TimeoutError(f"{url}/health never answered 200; saw {looks[-3:]}")


@contextlib.contextmanager
def running_standin(model: Path, log: Path, *args: str) -> Iterator[str]:
    """A standin on a free port, ready (/health 200), as its URL; stopped afterwards. A server that
    exits or never gets ready fails with the last of its log."""
    port = free_port()
    proc = start_standin(model, port, log, *args)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_status(url + "/health", 200, timeout=90, proc=proc)
        except (TimeoutError, RuntimeError) as exc:
            raise AssertionError(f"{exc}\n{log.read_text()[-2000:]}") from None
        yield url
    finally:
        stop(proc)


def stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def standin_in_process(model: Path, *args: str) -> Iterator[tuple[str, Any]]:
    """The rehearsal server's HTTP front and model worker in this process, its model loaded (no warm-up,
    so not Up until `server.up()`): its URL and its `Server`; the front shut down at the end."""
    from remote.drill.standin.arguments import parse_args
    from remote.drill.standin.http_front import HttpFront
    from remote.drill.standin.model import Model
    from remote.drill.standin.server import Server

    parsed = parse_args(["--model", str(model), "--port", "0", *args])
    server = Server(parsed)
    server.model = Model(model)
    front = HttpFront(server, parsed)
    parsed.port = front.bind()
    front.listen()
    serving = threading.Thread(target=front.serve, daemon=True)
    serving.start()
    try:
        yield f"http://127.0.0.1:{parsed.port}", server
    finally:
        front.shutdown()
        serving.join(10)
        front.close()
