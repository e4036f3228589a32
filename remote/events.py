"""The job event protocol: one JSON object per line, appended to the job's events file.

Every worker (`python -m remote.<name>`) reports through an `EventWriter`. The console follows the
file by byte offset, so each event is written with one `write` of a complete line (O_APPEND) and
flushed at once: a reader never sees half a line as an event, and a reconnect resumes exactly.

Event types (all carry `seq`, counting from 0, and `t`, unix seconds):
  phase     {"name": str}                                  a new stage of the work began
  progress  {"key": str, "done": num, "total": num|null, "unit": str, "label"?: str}
  log       {"level": "info"|"warning"|"error", "msg": str}
  artifact  {"path": str, "kind": str, ...}                  a finished, renamed file or folder
  result    {"data": object}                               the worker's answer
  error     {"msg": str, "where"?: str}                    a clear, human error (then exit != 0)
  exit      {"code": int}                                  always the last event of a job
  heartbeat {}                                             "still alive", every $DFLASH_HEARTBEAT_S s
                                                           (default 5; 0 turns it off) from a thread
  (workers may add other types, e.g. extract's `gpu_released`; readers ignore unknown ones.)

Where the events go: the file named by $DFLASH_EVENTS when set (the console sets it), else stdout.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

EVENTS_ENV = "DFLASH_EVENTS"
HEARTBEAT_ENV = "DFLASH_HEARTBEAT_S"
DEFAULT_HEARTBEAT_S = 5.0


class WorkerError(Exception):
    """A failure the operator can act on: reported as an `error` event with no traceback."""

    def __init__(self, msg: str, where: str | None = None):
        super().__init__(msg)
        self.msg = msg
        self.where = where


class EventWriter:
    """Appends events to a file (or a stream) as complete, flushed JSON lines."""

    def __init__(self, path: str | None = None, stream: Any = None):
        self._lock = threading.Lock()
        self._seq = 0
        self._fd: int | None = None
        self._stream = stream
        self._closed = False
        self._heartbeat: threading.Thread | None = None
        self._heartbeat_stop = threading.Event()
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        elif stream is None:
            self._stream = sys.stdout

    @classmethod
    def from_env(cls) -> EventWriter:
        path = os.environ.get(EVENTS_ENV)
        return cls(path=path) if path else cls()

    def emit(self, type_: str, **fields: Any) -> None:
        with self._lock:
            if self._closed:  # nothing follows `exit`
                return
            event = {"seq": self._seq, "t": round(time.time(), 3), "type": type_, **fields}
            line = json.dumps(event, separators=(",", ":"), default=str) + "\n"
            if self._fd is not None:
                os.write(self._fd, line.encode())
            else:
                self._stream.write(line)
                self._stream.flush()
            self._seq += 1

    def phase(self, name: str) -> None:
        self.emit("phase", name=name)

    def progress(self, key: str, done: float, total: float | None, unit: str, label: str | None = None) -> None:
        fields: dict[str, Any] = {"key": key, "done": done, "total": total, "unit": unit}
        if label is not None:
            fields["label"] = label
        self.emit("progress", **fields)

    def log(self, msg: str, level: str = "info") -> None:
        self.emit("log", level=level, msg=msg)

    def artifact(self, path: str, kind: str, **fields: Any) -> None:
        self.emit("artifact", path=path, kind=kind, **fields)

    def result(self, data: Any) -> None:
        self.emit("result", data=data)

    def error(self, msg: str, where: str | None = None) -> None:
        fields: dict[str, Any] = {"msg": msg}
        if where is not None:
            fields["where"] = where
        self.emit("error", **fields)

    def exit(self, code: int) -> None:
        """The last event: stops the heartbeat first, and nothing is written after it."""
        self.stop_heartbeat()
        self.emit("exit", code=code)
        with self._lock:
            self._closed = True

    def start_heartbeat(self, interval: float) -> None:
        """Write a `heartbeat` event every `interval` seconds from a daemon thread, so the console
        can tell a worker that is busy (a long load, a long forward pass) from one that hangs."""
        if interval <= 0 or self._heartbeat is not None:
            return

        def beat() -> None:
            while not self._heartbeat_stop.wait(interval):
                try:
                    self.emit("heartbeat")
                except OSError:  # the events file went away: nothing to tell
                    return

        self._heartbeat = threading.Thread(target=beat, name="heartbeat", daemon=True)
        self._heartbeat.start()

    def stop_heartbeat(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat is not None and self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=5)
        self._heartbeat = None

    def close(self) -> None:
        self.stop_heartbeat()
        with self._lock:
            self._closed = True
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def heartbeat_interval(environ: Any = None) -> float:
    """$DFLASH_HEARTBEAT_S as seconds (default 5; 0 or less: no heartbeat)."""
    raw = (os.environ if environ is None else environ).get(HEARTBEAT_ENV, "")
    try:
        return float(raw) if raw.strip() else DEFAULT_HEARTBEAT_S
    except ValueError:
        return DEFAULT_HEARTBEAT_S


def run_worker(main: Callable[[EventWriter], Any]) -> None:
    """Run a worker's main under the protocol: result on success, error + exit code otherwise.

    `main` returns the result data (or None). A `WorkerError` becomes a clean `error` event; any
    other exception an `error` with the traceback's last frame and the full traceback on stderr.
    The `exit` event is always the last thing written. SIGTERM is turned into SystemExit so a
    cancelled worker still writes `exit`. A heartbeat thread writes `heartbeat` every
    $DFLASH_HEARTBEAT_S seconds (default 5) until then.
    """
    import signal

    def _on_term(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _on_term)
    events = EventWriter.from_env()
    events.start_heartbeat(heartbeat_interval())
    code = 0
    try:
        data = main(events)
        if data is not None:
            events.result(data)
    except WorkerError as exc:
        events.error(exc.msg, exc.where)
        code = 2
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
        if code:
            events.log(f"stopped (exit {code})", level="warning")
    except KeyboardInterrupt:
        code = 130
    except BaseException as exc:  # noqa: BLE001 - the protocol reports every failure
        traceback.print_exc(file=sys.stderr)
        events.error(f"{type(exc).__name__}: {exc}")
        code = 1
    events.exit(code)
    events.close()
    sys.exit(code)
