"""Sending notifications through apprise, off the event loop: one thread and one bounded queue per
target, so a slow or dead target never holds back the window, nor the other targets.

apprise's calls block (HTTP through requests): each target's thread makes them, bounded by
apprise's own socket timeouts (4 s to connect, 4 s to read, unless the URL sets `cto` / `rto`).
`post` only enqueues: when a target's queue is full the notification is dropped for it, and said (by
the target's thread, after its send in progress).
Every outcome goes to `report(notification, target, error)` (error None: delivered), called on the
target's thread.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable

from console.notify.events import Notification

QUEUE_SIZE = 16  # notifications waiting per target; a window makes about five

Report = Callable[[Notification, str, str | None], None]
_DONE = object()


def target_name(url: str) -> str:
    """The target as the journal names it: apprise's privacy form (tokens and passwords masked),
    without its query."""
    import apprise

    plugin = apprise.Apprise.instantiate(url, suppress_exceptions=True)
    if plugin is None:
        return url.split("://", 1)[0] + "://..."
    return plugin.url(privacy=True).split("?", 1)[0]


class _Capture(logging.Handler):
    """The last warning apprise logged on this thread: why a send failed, in apprise's words."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.thread = threading.get_ident()
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:
            self.last = record.getMessage()


class Target:
    """One apprise URL, its thread and its queue."""

    def __init__(self, url: str, report: Report, queue_size: int = QUEUE_SIZE):
        self.url = url
        self.name = target_name(url)
        self.report = report
        self.queue: queue.Queue = queue.Queue(maxsize=queue_size)
        self._dropped: list[Notification] = []  # dropped while the queue was full: said by the thread
        self._lock = threading.Lock()
        self._closed = False
        self.thread = threading.Thread(target=self._work, name=f"notify {self.name}", daemon=True)
        self.thread.start()

    def post(self, notification: Notification) -> None:
        """Enqueue, never wait: with the queue full it is dropped, and said from the target's thread
        (the journal's fsync is no work for the event loop)."""
        try:
            self.queue.put_nowait(notification)
        except queue.Full:
            with self._lock:
                self._dropped.append(notification)

    def close(self) -> None:
        """No more notifications: the thread ends once it has sent what waits."""
        self._closed = True
        with contextlib.suppress(queue.Full):  # full: busy sending, it sees `_closed` once the queue is empty
            self.queue.put_nowait(_DONE)

    def _say_dropped(self) -> None:
        with self._lock:
            dropped, self._dropped = self._dropped, []
        for notification in dropped:
            self.report(notification, self.name, f"not sent: {self.queue.maxsize} notifications were already "
                                                 f"waiting for this target")

    def _work(self) -> None:
        import apprise

        plugin = apprise.Apprise.instantiate(self.url, suppress_exceptions=True)
        capture = _Capture()
        logging.getLogger("apprise").addHandler(capture)
        try:
            while not (self._closed and self.queue.empty()):
                notification = self.queue.get()
                if notification is _DONE:
                    continue
                capture.last = None
                try:
                    sent = plugin is not None and plugin.notify(body=notification.body, title=notification.title,
                                                               notify_type=apprise.NotifyType(notification.level))
                    error = None if sent else (capture.last or "apprise could not send it")
                except Exception as exc:  # noqa: BLE001 - a plugin's own bug is one failed send, not a dead thread
                    error = f"{type(exc).__name__}: {exc}"
                self.report(notification, self.name, error)
                self._say_dropped()
        finally:
            self._say_dropped()
            logging.getLogger("apprise").removeHandler(capture)
