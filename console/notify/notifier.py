"""The notifier: one subscriber on the core's bus, for the runs this process drives.

Every operator starts one when `[notify] urls` names a target (a read-only view drives no run: it
tells only `console-gone`). It feeds the bus's messages of its own runs (the
store names the process that drives a run: a watching console's follower repeats other runs, never
notified twice) to the `Watcher`, sends what it answers through the `Target` threads, arms the
overrun timer, and journals every outcome in the run's journal. Of the runs it follows (other
consoles'), one thing is told: a run whose console is gone while it holds the server (`console-gone`),
once per gone console across every watching console (a marker made with O_EXCL in the run's folder). Nothing here waits on a target: the
window never waits on a notification, and one that fails is a journal line, not a failed step.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from console import messages as m
from console.config import Config
from console.notify.events import Notification, Watcher
from console.notify.sender import Target
from console.procedure.store import Run, RunStore, RunStoreError
from console.session.bus import MessageBus

CLOSE_WAIT_S = 5.0  # at the end, what still waits is given this long to go out (the run-ended note)


class Notifier:
    """Tells `config.notify.urls` about the window, from what `bus` carries."""

    def __init__(self, config: Config, store: RunStore, bus: MessageBus,
                 ours: Callable[[str], bool] | None = None):
        self.config = config
        self.store = store
        self.bus = bus
        self.events = set(config.notify.events)
        service = config.service
        name = service.unit if service.manager == "systemd" else "the server"
        self.watcher = Watcher(config, self._run_of, f"{name} on {service.host}")
        self._ours = ours or self._driven_here
        self._known: set[str] = set()
        self.targets = [Target(url, self._report) for url in config.notify.urls]
        self._loop: asyncio.AbstractEventLoop | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._pending = 0
        self._idle = threading.Condition()

    def start(self) -> None:
        """Subscribe (on the running loop: the overrun timer lives there)."""
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = self.bus.subscribe(self._on, m.StepUpdate, m.PlanReady, m.DecisionMade, m.Downtime,
                                               m.RunFinished, m.LiveRun)

    async def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Stop listening; give what still waits up to `wait_s` to go out (a target still stuck then
        is left to its daemon thread: the process does not wait for it)."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        if self._timer is not None:
            self._timer.cancel()
        for target in self.targets:
            target.close()
        await asyncio.to_thread(self.wait_sent, wait_s)

    def wait_sent(self, timeout: float) -> bool:
        """Until every notification posted has been sent or has failed (True), or `timeout`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    # --- from the bus ---------------------------------------------------------------------------

    def _run_of(self, run_id: str) -> Run | None:
        try:
            return self.store.open(run_id)
        except RunStoreError:
            return None

    def _driven_here(self, run_id: str) -> bool:
        """The store says this process drives the run (its owner)."""
        if run_id in self._known:
            return True
        run = self._run_of(run_id)
        owner = run.state.owner if run is not None else None
        if owner is not None and owner.pid == os.getpid() and owner.host == socket.gethostname():
            self._known.add(run_id)
            return True
        return False

    def _on(self, message: Any) -> None:
        if isinstance(message, m.LiveRun):  # another console's run, followed here
            for notification in self.watcher.gone(message):
                if self._first_to_tell(message.run_id):
                    self.send(notification)
            return
        run_id = getattr(message, "run_id", None) or self.watcher.run_id  # (a question of no run: the last step's)
        if run_id is None or not self._ours(run_id):
            return
        for notification in self.watcher.on(message):
            self.send(notification)
        self._arm()

    def _first_to_tell(self, run_id: str) -> bool:
        """This console is the first watcher to tell that the run's console (its owner now) is gone:
        the marker names that owner, so a console that resumes the run and dies too is told again."""
        run = self._run_of(run_id)
        owner = run.state.owner if run is not None else None
        if run is None or owner is None or "console-gone" not in self.events:
            return False
        marker = run.dir / f"console-gone-told.{owner.host}.{owner.pid}"
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False  # another watching console told it
        except OSError:
            return True  # a store this console cannot write: better told twice than never
        return True

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        due = self.watcher.overrun_due()
        if due is not None and self._loop is not None:
            self._timer = self._loop.call_later(max(0.0, due - time.time()) + 0.05, self._overrun)

    def _overrun(self) -> None:
        self._timer = None
        for notification in self.watcher.overrun(time.time()):
            self.send(notification)
        self._arm()

    def send(self, notification: Notification) -> None:
        """To every target, unless its event is not one `[notify] events` names."""
        if notification.event not in self.events:
            return
        with self._idle:
            self._pending += len(self.targets)
        for target in self.targets:
            target.post(notification)

    # --- from the targets' threads ----------------------------------------------------------------

    def _report(self, notification: Notification, target: str, error: str | None) -> None:
        if error is None:
            line, level = f"notified {target} ({notification.event}): {notification.title}", "info"
        else:
            line, level = f"notification not sent to {target} ({notification.event}): {error}", "warning"
        entry = None
        with contextlib.suppress(RunStoreError, OSError):  # the journal is the run's: a run gone says nothing
            entry = self.store.open(notification.run_id).journal(None, line, level=level)
        loop = self._loop
        if entry is not None and loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self.bus.publish, entry)
        with self._idle:
            self._pending -= 1
            self._idle.notify_all()
