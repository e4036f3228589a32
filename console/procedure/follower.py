"""Any console follows the live run: from its store (steps, downtime, journal, owner) and its hosts
(the running job's progress), whoever drives it: this console, another one, `run --headless`.

A read-only console and `status --watch` see the run a colleague started: its steps, its jobs' bars,
the DOWN timer and who drives it (run id, user, host, pid, since), or that its console is gone.
On the pause route, the server PAUSED since the pause, the memory tags released and by which run;
meanwhile the session's service watch is told not to probe /health (SGLang answers 503 all along).
The store is read, never written; a job's events are read from the host, never consumed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console.messages import AskedQuestion, Confirmation, Downtime, LiveRun, StepUpdate
from console.procedure import identity
from console.procedure.state import ServiceState
from console.procedure.store import (
    JOURNAL,
    CachedStore,
    Run,
    RunStore,
    for_replay_only,
    journal_entry,
    paused_by,
)
from console.session.bus import MessageBus
from console.ssh.jobs import JobHandle, follow_with_reconnect, job_message

POLL_S = 1.0  # the store is a directory of files: looked at once a second
QUESTION = "question.json"  # the question a console waits on, beside the run's state (screens/decider.py)


class RunFollower:
    """Publishes on `bus` what the live run's store and hosts say, once a second.

    `ours(run_id)`: True for the run this console drives itself (its engine publishes it already)."""

    def __init__(self, store: RunStore, bus: MessageBus, session: Any | None = None,
                 ours: Callable[[str], bool] = lambda run_id: False, interval: float = POLL_S):
        self.store = store
        self.bus = bus
        self.session = session
        self.ours = ours
        self.interval = interval
        self._run_id: str | None = None
        self._steps: dict[str, tuple] = {}
        self._down: Downtime | None = None
        self._live: LiveRun | None = None
        self._journal_at = 0
        self._job: tuple[str, asyncio.Task] | None = None
        self._cached = CachedStore(store)  # each state.json parsed again only when it changed

    def live(self) -> Run | None:
        return self._cached.to_resume()

    def look(self, live: Run | None | bool = False) -> LiveRun | None:
        """One look at the store: publishes what changed, returns the live run's summary. `live`:
        the run to follow, already read (off the loop, by `run`); False: read it now."""
        run = self.live() if live is False else live
        self._hold_paused(run)
        if run is None:
            if self._live is not None:
                self._last_look()
                self._live = None
                self._stop_job()
            return None
        if run.run_id != self._run_id:
            self._run_id, self._steps, self._down = run.run_id, {}, None
            self._journal_at = max(0, _size(run) - 64 * 1024)  # the recent past, not the whole journal
            self._stop_job()
        live = self._publish_live(run)
        if live.ours:
            return live
        self._publish_steps(run)
        self._read_journal(run)
        self._follow_running_job(run)
        return live

    def _hold_paused(self, run: Run | None) -> None:
        """While the run holds this session's server paused, its service watch does not probe /health."""
        if self.session is None:
            return
        ours = run is not None and identity.same_service(run.state.service_identity, self.session.config)
        self.session.held_paused(paused_by(run) if ours else None)

    def _publish_live(self, run: Run) -> LiveRun:
        state, owner = run.state, run.state.owner
        gone = state.status == "running" and owner is not None and owner.alive() is False
        said = downtime_of(run.run_id, state.service)
        live = LiveRun(run.run_id, state.status, owner.describe() if owner else None,
                       console_gone=gone, service_down=state.service.down, ours=self.ours(run.run_id),
                       # a question waits while the run goes, or while `r` restarts a finished run that left
                       # the service down (the same console, still alive): never a dead console's
                       question=None if owner is not None and owner.alive() is False else _question(run),
                       paused_since=said.down_since if said.paused else None,
                       released=tuple(state.service.released or state.service.releasing))
        if live != self._live:
            self._live = live
            self.bus.publish(live)
        return live

    def _last_look(self) -> None:
        """The run followed has ended (it is no longer the one to resume): its last steps, its
        downtime and its final status, once, so that no console shows it running any more."""
        if self._run_id is None or self._live is None or self._live.ours:
            return
        with contextlib.suppress(Exception):
            run = self.store.open(self._run_id)
            self._publish_steps(run)
            self._read_journal(run)
            self._publish_live(run)

    def _publish_steps(self, run: Run) -> None:
        state = run.state
        for name, rec in state.steps.items():
            seen = (rec.status, rec.started_at, rec.ended_at, rec.detail)
            if self._steps.get(name) != seen:
                self._steps[name] = seen
                self.bus.publish(StepUpdate(run.run_id, name, rec.status, rec.started_at, rec.ended_at, rec.detail,
                                            work_s=rec.work_s, decision_s=rec.decision_s,
                                            found_on_resume=rec.found_on_resume))
        down = downtime_of(run.run_id, state.service)
        if down != self._down:
            self._down = down
            self.bus.publish(down)

    def _read_journal(self, run: Run) -> None:
        path = run.dir / JOURNAL
        data = b""  # no journal yet: nothing to read
        with contextlib.suppress(OSError), open(path, "rb") as f:
            f.seek(self._journal_at)
            data = f.read()
        if not data or b"\n" not in data:
            return
        complete = data[:data.rindex(b"\n") + 1]
        self._journal_at += len(complete)
        for line in complete.splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and not for_replay_only(record):
                    entry = journal_entry(record, run.run_id)
                    if entry is not None:
                        self.bus.publish(entry)

    def _follow_running_job(self, run: Run) -> None:
        """The bars of the job the other console is following now (the running step's), relayed to
        the job's exit even once its step has ended (a read-only console showed the staged extractor
        "waiting for the go" after the run was done)."""
        if self.session is None:
            return
        running = {name for name, rec in run.state.steps.items() if rec.status == "running"}
        key = "extract" if running & {"stage", "extract"} else "cache" if "cache" in running else \
            "evaluate" if "evaluate" in running else None
        record = run.state.jobs.get(key) if key else None
        if record is None or record.handle is None:
            if key is None and self._job is not None and not self._job[1].done():
                return  # its step ended: the job's last events (its extraction, its exit) are still relayed
            self._stop_job()
            return
        if self._job is not None and self._job[0] == record.job_id:
            return
        self._stop_job()
        handle = JobHandle.from_json(record.handle)
        self._job = (record.job_id, asyncio.create_task(self._relay(handle, record.offset), name="follow-live-job"))

    async def _relay(self, handle: JobHandle, offset: int) -> None:
        supervisor = self.session.supervisors.get(handle.host)
        if supervisor is None:
            return
        with contextlib.suppress(Exception):
            async for _, event in follow_with_reconnect(supervisor, handle, offset=offset, stall_timeout=None):
                message = job_message(handle, event)
                if message is not None:
                    self.bus.publish(message)

    def _stop_job(self) -> None:
        if self._job is not None:
            self._job[1].cancel()
            self._job = None

    async def run(self) -> None:
        """Look once a second until cancelled."""
        try:
            while True:
                with contextlib.suppress(Exception):  # a store being written can be read half-way: next look
                    # The files are read in a thread: a store of many runs never holds the loop.
                    self.look(await asyncio.to_thread(self.live))
                await asyncio.sleep(self.interval)
        finally:
            self._stop_job()


def downtime_of(run_id: str, service: ServiceState) -> Downtime:
    """The downtime as the run's own console publishes it (`Window.publish_downtime`), read from
    its store: down from the stop until ready; on the pause route paused from the pause until the
    continue (a paused server read from `stopped_at` alone was shown up)."""
    if service.down or service.stopped_at is not None:
        return Downtime(run_id, service.stopped_at if service.down else None, service.ready_at)
    paused = service.held or (service.paused_at is not None and service.continued_at is None)
    since = service.paused_at or service.released_at
    return Downtime(run_id, since if paused else None, service.continued_at, paused=paused)


def write_question(run_dir: Path, confirmation: Confirmation, now: float) -> Path | None:
    """The question a console waits on, written beside its run's state (atomically) so that another
    console can say what it waits on; the asking console removes it once answered. None when the
    run has no directory (a plan, a stand-in)."""
    path = Path(run_dir) / QUESTION
    if not path.parent.is_dir():
        return None
    c = confirmation
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps({"step": c.step, "action": c.action, "host": c.host,
                                   "command": shlex.join(c.argv), "asked_at": now}))
    os.replace(partial, path)
    return path


def _question(run: Run) -> AskedQuestion | None:
    """What the run's console waits on: its action, host and literal command."""
    try:
        asked = json.loads((run.dir / QUESTION).read_text())
        return AskedQuestion(str(asked["action"]), str(asked["host"]), str(asked["command"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _size(run: Run) -> int:
    try:
        return os.path.getsize(run.dir / JOURNAL)
    except OSError:
        return 0
