"""The headless run's stdout and stderr, which never end nor stall the window (issue 43 #6).

`run --headless --yes 2>&1 | tee log` and Ctrl-C: the signal reaches `tee` too, and the console's
next line met a broken pipe; rich answered it with SystemExit(1) from inside a bus subscriber, in the
middle of the engine's restart (the run hung with the service down, or ended `running` with the
extractor alive). While a run is in progress every write to stdout and stderr (the views, rich's
bars, logging, a traceback) goes through `TerminalOutput`: it is queued, and one writer thread
writes it to the file descriptor, in the order written. So a write never raises into the engine
(EPIPE, EIO, a closed descriptor: the terminal is gone, the descriptor is pointed at /dev/null and
the rest goes nowhere; the run's journal keeps it all anyway), and never blocks the event loop (a
reader that stops reading without dying: the writer thread waits on it alone, and past
`PENDING_MAX` bytes the newest lines are dropped, said once the reader takes them again). At the
end, what is still queued gets `DRAIN_S` to reach the reader, then the terminal is let go.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from collections import deque
from collections.abc import Iterator
from typing import Any

PENDING_MAX = 4 << 20  # bytes queued for a reader that stopped reading; beyond, lines are dropped
DRAIN_S = 10.0  # at the end, how long what is queued waits for the reader before it is let go


class _Writer:
    """One thread that writes every stream's queued bytes to its descriptor, in the order written."""

    def __init__(self) -> None:
        self._queue: deque[tuple[int, bytes]] = deque()
        self._pending = 0
        self._dropped: dict[int, int] = {}  # per descriptor: lines dropped while the reader lagged
        self._busy = False
        self._closed = False
        self.gone: set[int] = set()  # descriptors whose reader is gone: pointed at /dev/null
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="terminal-output", daemon=True)
        self._thread.start()

    def put(self, fd: int, data: bytes) -> None:
        """Queued, never waited on: dropped (and counted) when the reader lags past PENDING_MAX."""
        with self._cond:
            if fd in self.gone or self._closed:
                return
            if self._pending + len(data) > PENDING_MAX:
                self._dropped[fd] = self._dropped.get(fd, 0) + data.count(b"\n")
                return
            self._queue.append((fd, data))
            self._pending += len(data)
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                fd, data = self._queue.popleft()
                self._busy = True
                dropped = self._dropped.pop(fd, 0) if not self._queue else 0
            try:
                if fd not in self.gone:
                    _write_all(fd, data)
                    if dropped:
                        _write_all(fd, f"[dflash-ops: {dropped} lines were not shown: the terminal did not take "
                                       f"them in time; the run's journal has every event]\n".encode())
            except OSError:
                self.let_go(fd)
            finally:
                with self._cond:
                    self._pending -= len(data)
                    self._busy = False
                    self._cond.notify_all()

    def let_go(self, fd: int) -> None:
        """The reader of `fd` is gone (or is given up on): the descriptor writes to /dev/null from
        now on, so that every other writer of it (the interpreter's last flush included) is quiet."""
        with self._cond:
            if fd in self.gone:
                return
            self.gone.add(fd)
            self._queue = deque(item for item in self._queue if item[0] != fd)
            self._cond.notify_all()
        with contextlib.suppress(OSError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
            os.close(devnull)

    def drain(self, timeout: float) -> bool:
        """Until everything queued is written; False when the reader did not take it in time."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:  # a descriptor someone made non-blocking: wait until it takes more
            select.select([], [fd], [], 1.0)
        except InterruptedError:
            continue


class TerminalOutput:
    """A text stream in place of sys.stdout or sys.stderr whose writes are queued for `_Writer`:
    `write` and `flush` return at once and never raise. It answers as the stream it replaces
    (isatty, fileno, encoding), so rich sizes and colours its output as before."""

    def __init__(self, stream: Any, writer: _Writer):
        self._stream = stream
        self._fd = stream.fileno()
        self._writer = writer
        self.encoding = getattr(stream, "encoding", None) or "utf-8"
        self.errors = "replace"
        self._tty = _isatty(stream)

    @property
    def gone(self) -> bool:
        return self._fd in self._writer.gone

    def write(self, text: str) -> int:
        if text:
            self._writer.put(self._fd, text.encode(self.encoding, "replace"))
        return len(text)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        """Never waits: the writer thread writes as fast as the reader takes it."""

    def isatty(self) -> bool:
        return self._tty and not self.gone

    def fileno(self) -> int:
        return self._fd

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    @property
    def closed(self) -> bool:
        return False


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (OSError, ValueError):
        return False


def _replacing(stream: Any, writer: _Writer) -> Any:
    """The stream's TerminalOutput; a stream with no descriptor (a test's capture) is kept."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return stream
    return TerminalOutput(stream, writer)


@contextlib.contextmanager
def terminal_output() -> Iterator[tuple[Any, Any]]:
    """sys.stdout and sys.stderr replaced by `TerminalOutput`s for the block (the run); restored at
    its end, after what is queued had DRAIN_S to be read. SIGPIPE is ignored meanwhile (Python's
    default), so a reader gone is an EPIPE to let go of, never the console's death with the
    service down."""
    stdout, stderr = sys.stdout, sys.stderr
    for stream in (stdout, stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    previous_sigpipe = None
    if threading.current_thread() is threading.main_thread():
        previous_sigpipe = signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    writer = _Writer()
    out, err = _replacing(stdout, writer), _replacing(stderr, writer)
    sys.stdout, sys.stderr = out, err
    try:
        yield out, err
    finally:
        if not writer.drain(DRAIN_S):  # a reader that stopped reading: the console still exits
            for stream in (out, err):
                if isinstance(stream, TerminalOutput):
                    writer.let_go(stream.fileno())
        writer.close()
        sys.stdout, sys.stderr = stdout, stderr
        if previous_sigpipe is not None:
            signal.signal(signal.SIGPIPE, previous_sigpipe)
        for stream in (stdout, stderr):  # what was buffered before: a gone reader takes it to /dev/null
            with contextlib.suppress(OSError, ValueError):
                stream.flush()

