"""The run's jobs on the hosts: started under ids recorded before the start (found again by id after
a crash, never started twice), and followed from a persisted offset (an event handled once is
never handled again; an event seen before stands for a live process only once the host says the
job still runs)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from console.messages import JobProgress
from console.procedure.outcomes import StepFailed
from console.procedure.state import JobRecord
from console.ssh.jobs import JobDead, JobExists, JobHandle, JobStalledError, job_message

if TYPE_CHECKING:
    from console.procedure.engine import Engine

START_SETTLE_S = 90.0  # a start cut off by a crash settles on the host within about a minute
QUIET_EVENTS = ("progress", "heartbeat")  # not worth a state write each (replaying them is harmless)


def saved_handle(engine: Engine, key: str) -> JobHandle | None:
    record = engine.state.jobs.get(key)
    return JobHandle.from_json(record.handle) if record is not None and record.handle else None


async def job_state(engine: Engine, key: str) -> str | None:
    """"running", "exited" or "dead" for job `key` as its host says now; None when never started."""
    record = engine.state.jobs.get(key)
    if record is None:
        return None
    handle = saved_handle(engine, key) or await engine.hosts.find_job(record.host, record.job_id)
    if handle is None:
        return None
    record.handle = json.loads(handle.to_json())
    return (await engine.hosts.job_status(handle)).state


def new_attempt(engine: Engine, key: str) -> None:
    """The worker of `key` is gone: the next start is a new attempt under a new id."""
    record = engine.state.jobs.get(key)
    if record is None:
        return
    attempt = record.attempt + 1
    engine.state.jobs[key] = JobRecord(f"{engine.run.run_id}-{key}-a{attempt}", record.host, record.worker,
                                     record.args, attempt=attempt)
    engine.run.save()


async def job(engine: Engine, host_name: str, worker: str, key: str, args: list[str], step: str,
               fresh: bool = False, until: str | None = None,
               on_event: Callable[[dict[str, Any]], Any] | None = None,
               env: dict[str, str] | None = None, started: Callable[[JobHandle], Any] | None = None
               ) -> dict[str, Any]:
    """Start (or find again) job `key` on `host_name` and follow it from its persisted offset
    until it exits (or until an event of type `until`; then the job keeps running).

    The job's id is recorded in the state before it starts, so a console killed in between
    finds it by id on resume instead of starting a second one. `fresh`: a read-only job
    (probes) is simply run again on resume. `started(handle)` is called once the job exists.
    """
    jobs = engine.state.jobs
    record = jobs.get(key)
    handle: JobHandle | None = None
    if record is not None and not fresh:
        handle = saved_handle(engine, key) or await engine.hosts.find_job(host_name, record.job_id)
    if handle is None:
        if record is None or fresh:
            job_id = f"{engine.run.run_id}-{key}" + ("" if not fresh else f"-{int(time.time() * 1000) % 100000}")
            record = jobs[key] = JobRecord(job_id, host_name, worker, list(args))
            engine.run.save()  # before the start: found again by id after a crash
        handle = await start_once(engine, host_name, worker, args, env, record.job_id)
        engine.journal(step, f"started {worker} on {host_name} (pid {handle.pid})", host=host_name,
                     argv=["python", "-m", f"remote.{worker}", *args], kind="job-start", job_id=record.job_id)
    else:
        engine.journal(step, f"found {worker} job {handle.job_id} on {host_name} again (pid {handle.pid}); "
                           f"following it from byte {record.offset}", host=host_name, kind="job-start",
                       job_id=record.job_id)
    record.handle = json.loads(handle.to_json())
    engine.run.save()
    if started is not None:
        started(handle)
    return await follow(engine, handle, record, step, until=until, on_event=on_event)


async def start_once(engine: Engine, host: str, worker: str, args: list[str], env: dict[str, str] | None,
                      job_id: str) -> JobHandle:
    """Start job `job_id`, or find it: a console killed during a start leaves the start half done
    on the host; the job then either appears under its id or is given up there (JobRunner's
    start protocol), and is found or started again, never twice."""
    deadline = time.monotonic() + START_SETTLE_S
    while True:
        try:
            return await engine.hosts.start_job(host, worker, args, env, job_id)
        except JobExists:
            found = await engine.hosts.find_job(host, job_id)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def follow(engine: Engine, handle: JobHandle, record: JobRecord, step: str, until: str | None = None,
                  on_event: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """Follow from the record's offset: every event handled is handled once, across crashes. An
    event already seen (`until` among `events_seen`) stands for a live process only once the
    host says the job still runs."""
    outcome: dict[str, Any] = {"handle": handle, "artifacts": [], "result": record.result}
    if record.error:
        outcome["error"] = record.error
    if until is not None and until in record.events_seen:
        status = await engine.hosts.job_status(handle)
        if status.state == "running":
            outcome["until"] = {"type": until, **(record.result if isinstance(record.result, dict) else {})}
            return outcome
        raise StepFailed(step, f"{handle.worker} on {handle.host} (pid {handle.pid}) said `{until}` but is "
                               f"{status.state} now" + (f": {status.stderr_tail[-300:]}" if status.stderr_tail else ""))
    if record.exit_code is not None:  # its `exit` was handled before a crash: nothing follows it
        outcome["exit"] = record.exit_code
    events = engine.hosts.follow_job(handle, record.offset, engine.connect_s) if record.exit_code is None else _none()
    try:
        async for offset, event in events:
            kind = event.get("type")
            publish_event(engine, handle, event)
            record.offset = offset
            if kind == "result":
                outcome["result"] = record.result = event.get("data")
            elif kind == "error":
                outcome["error"] = record.error = event.get("msg")
            elif kind == "artifact":
                outcome["artifacts"].append(event)
            elif kind == "exit":
                outcome["exit"] = record.exit_code = event.get("code")
            if kind == until:  # what the step waited for, kept for a resume that finds the job again
                record.result = {k: v for k, v in event.items() if k not in ("type", "seq")}
            if kind not in QUIET_EVENTS:
                if kind not in record.events_seen:
                    record.events_seen.append(kind)
                engine.run.save()
            if on_event is not None:
                result = on_event(event)
                if asyncio.iscoroutine(result):
                    await result
            if until is not None and kind == until:
                outcome["until"] = event
                return outcome
    except (JobDead, JobStalledError) as exc:
        raise StepFailed(step, str(exc)) from None
    except TimeoutError:
        raise StepFailed(step, f"{handle.host} did not reconnect within {engine.connect_s:.0f} s while "
                               f"following {handle.worker}") from None
    if until is not None:
        raise StepFailed(step, f"{handle.worker} on {handle.host} exited ({outcome.get('exit')}) before "
                               f"`{until}`: {outcome.get('error') or 'no error reported'}")
    if outcome.get("exit") not in (0, None) or outcome.get("error"):
        tail = "" if outcome.get("error") else await engine.hosts.stderr_tail(handle)
        raise StepFailed(step, f"{handle.worker} on {handle.host} failed (exit {outcome.get('exit')}): "
                               f"{outcome.get('error') or 'no error event'}" + (f"; stderr: {tail[-300:]}" if tail else ""))
    return outcome


PROGRESS_EVERY_S = 0.5  # a job's progress is journalled at most this often per counter (phases and milestones always)
NOT_MILESTONES = ("progress", "heartbeat", "log", "phase", "exit", "artifact", "invalid")  # any other event is one


def publish_event(engine: Engine, handle: JobHandle, event: dict[str, Any]) -> None:
    message = job_message(handle, event)
    if message is not None:
        engine.bus.publish(message)
    kind = event.get("type")
    if kind == "log":
        engine.journal(None, f"{handle.host} {handle.worker}: {event.get('msg')}", host=handle.host,
                     level=event.get("level", "info") if event.get("level") in ("warning", "error") else "info",
                     kind="job-log", job_id=handle.job_id)
    _record_progress(engine, handle, kind, message)


def _record_progress(engine: Engine, handle: JobHandle, kind: Any, message: Any) -> None:
    """The job's progress as it came (the time received is the entry's), for the replay: each counter
    at most every PROGRESS_EVERY_S, its last value kept until a phase change, a milestone or the exit
    writes it, so that no bar is replayed short of where it got."""
    pending = engine.progress_said
    where = {"host": handle.host, "job_id": handle.job_id}

    def write(progress: JobProgress) -> None:
        data = {k: v for k, v in (("done", progress.done), ("total", progress.total), ("unit", progress.unit),
                                  ("rate", progress.rate), ("phase", progress.phase), ("key", progress.key),
                                  ("label", progress.message), ("worker_t", progress.t)) if v is not None}
        engine.record(None, f"{handle.worker} {progress.key or progress.unit}: {progress.done:g}"
                            + (f" of {progress.total:g}" if progress.total else ""),
                      kind="job-progress", data={"worker": handle.worker, **data}, **where)

    def flush() -> None:
        for key, (said_at, unsaid) in list(pending.items()):
            if key[0] == handle.job_id and unsaid is not None:
                write(unsaid)
                pending[key] = (said_at, None)

    if isinstance(message, JobProgress):
        key, now = (handle.job_id, message.key or message.unit), time.monotonic()
        said_at, _ = pending.get(key, (float("-inf"), None))
        if now - said_at >= PROGRESS_EVERY_S:
            write(message)
            pending[key] = (now, None)
        else:
            pending[key] = (said_at, message)
    elif kind == "phase" or (isinstance(kind, str) and kind not in NOT_MILESTONES):
        flush()
        name = getattr(message, "message", None) if kind == "phase" else kind
        engine.record(None, f"{handle.worker}: {kind} {name if kind == 'phase' else ''}".rstrip(), kind="job-progress",
                      data={"worker": handle.worker, "event": kind, **({"phase": name} if kind == "phase" else {})},
                      **where)
    elif kind == "exit":
        flush()
        engine.record(None, f"{handle.worker} on {handle.host} exited ({event_code(message)})", kind="job-exit",
                      exit=event_code(message), data={"worker": handle.worker}, **where)


def event_code(message: Any) -> int | None:
    return getattr(message, "code", None)


async def _none() -> Any:
    """No events (an async iterator that ends at once)."""
    return
    yield
