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
from console.procedure import kept
from console.procedure.outcomes import StepFailed
from console.procedure.state import JobRecord
from console.ssh.hosts import HostError
from console.ssh.jobs import JobDead, JobExists, JobHandle, JobStalledError, job_message

if TYPE_CHECKING:
    from console.procedure.window import Window

START_SETTLE_S = 90.0  # a start cut off by a crash settles on the host within about a minute
QUIET_EVENTS = ("progress", "heartbeat")  # not worth a state write each (replaying them is harmless)


def saved_handle(window: Window, key: str) -> JobHandle | None:
    record = window.state.jobs.get(key)
    return JobHandle.from_json(record.handle) if record is not None and record.handle else None


async def job_state(window: Window, key: str) -> str | None:
    """"running", "exited" or "dead" for job `key` as its host says now; None when never started."""
    record = window.state.jobs.get(key)
    if record is None:
        return None
    handle = saved_handle(window, key) or await window.hosts.find_job(record.host, record.job_id)
    if handle is None:
        return None
    record.handle = json.loads(handle.to_json())
    return (await window.hosts.job_status(handle)).state


def new_attempt(window: Window, key: str) -> None:
    """The worker of `key` is gone: the next start is a new attempt under a new id."""
    record = window.state.jobs.get(key)
    if record is None:
        return
    attempt = record.attempt + 1
    window.state.jobs[key] = JobRecord(f"{window.run.run_id}-{key}-a{attempt}", record.host, record.worker,
                                     record.args, attempt=attempt)
    window.run.save()


async def job(window: Window, host_name: str, worker: str, key: str, args: list[str], step: str,
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
    jobs = window.state.jobs
    record = jobs.get(key)
    handle: JobHandle | None = None
    if record is not None and not fresh:
        handle = saved_handle(window, key) or await window.hosts.find_job(host_name, record.job_id)
    if handle is None:
        if record is None or fresh:
            job_id = f"{window.run.run_id}-{key}" + ("" if not fresh else f"-{int(time.time() * 1000) % 100000}")
            record = jobs[key] = JobRecord(job_id, host_name, worker, list(args))
            window.run.save()  # before the start: found again by id after a crash
        handle = await start_once(window, host_name, worker, args, env, record.job_id)
        window.jobs_started_here.add(record.job_id)
        window.journal(step, f"started {worker} on {host_name} (pid {handle.pid})", host=host_name,
                     argv=["python", "-m", f"remote.{worker}", *args], kind="job-start", job_id=record.job_id)
    elif record.job_id in window.jobs_started_here:  # started by an earlier step of this console: it goes on
        window.journal(step, f"{worker} on {host_name} (pid {handle.pid}, started by this console) goes on",
                       host=host_name, kind="job-start", job_id=record.job_id)
    else:  # started before this console (a resume): found by its id, never started twice
        window.journal(step, f"found {worker} job {handle.job_id} on {host_name} again (pid {handle.pid}); "
                           f"following it from byte {record.offset}", host=host_name, kind="job-start",
                       job_id=record.job_id)
    record.handle = json.loads(handle.to_json())
    window.run.save()
    if started is not None:
        started(handle)
    return await follow(window, handle, record, step, until=until, on_event=on_event)


async def start_once(window: Window, host: str, worker: str, args: list[str], env: dict[str, str] | None,
                      job_id: str) -> JobHandle:
    """Start job `job_id`, or find it: a console killed during a start leaves the start half done
    on the host; the job then either appears under its id or is given up there (JobRunner's
    start protocol), and is found or started again, never twice."""
    deadline = time.monotonic() + START_SETTLE_S
    while True:
        try:
            return await window.hosts.start_job(host, worker, args, env, job_id)
        except JobExists:
            found = await window.hosts.find_job(host, job_id)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


async def follow(window: Window, handle: JobHandle, record: JobRecord, step: str, until: str | None = None,
                  on_event: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
    """Follow from the record's offset: every event handled is handled once, across crashes. An
    event already seen (`until` among `events_seen`) stands for a live process only once the
    host says the job still runs."""
    outcome: dict[str, Any] = {"handle": handle, "artifacts": [], "result": record.result}
    if record.error:
        outcome["error"] = record.error
    if until is not None and until in record.events_seen:
        status = await window.hosts.job_status(handle)
        if status.state == "running":
            outcome["until"] = {"type": until, **(record.result if isinstance(record.result, dict) else {})}
            return outcome
        raise StepFailed(step, f"{handle.worker} on {handle.host} (pid {handle.pid}) said `{until}` but is "
                               f"{status.state} now" + (f": {status.stderr_tail[-300:]}" if status.stderr_tail else ""))
    if record.exit_code is not None:  # its `exit` was handled before a crash: nothing follows it
        outcome["exit"] = record.exit_code
    events = window.hosts.follow_job(handle, record.offset, window.connect_s) if record.exit_code is None else _none()
    try:
        async for offset, event in events:
            kind = event.get("type")
            publish_event(window, handle, event)
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
                window.run.save()
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
        raise StepFailed(step, f"{handle.host} did not reconnect within {window.connect_s:.0f} s while "
                               f"following {handle.worker}") from None
    if until is not None:
        raise StepFailed(step, f"{handle.worker} on {handle.host} exited ({outcome.get('exit')}) before "
                               f"`{until}`: {outcome.get('error') or 'no error reported'}")
    if outcome.get("exit") not in (0, None) or outcome.get("error"):
        tail = "" if outcome.get("error") else await window.hosts.stderr_tail(handle)
        raise StepFailed(step, f"{handle.worker} on {handle.host} failed (exit {outcome.get('exit')}): "
                               f"{outcome.get('error') or 'no error event'}" + (f"; stderr: {tail[-300:]}" if tail else ""))
    return outcome


PROGRESS_EVERY_S = 0.5  # a job's progress is journalled at most this often per counter (phases and milestones always)
NOT_MILESTONES = ("progress", "heartbeat", "log", "phase", "exit", "artifact", "invalid")  # any other event is one


def publish_event(window: Window, handle: JobHandle, event: dict[str, Any]) -> None:
    message = job_message(handle, event)
    if message is not None:
        window.bus.publish(message)
    kind = event.get("type")
    if kind == "log":
        window.journal(None, f"{handle.host} {handle.worker}: {event.get('msg')}", host=handle.host,
                     level=event.get("level", "info") if event.get("level") in ("warning", "error") else "info",
                     kind="job-log", job_id=handle.job_id)
    record_progress(window, handle, kind, message)


def record_progress(window: Window, handle: JobHandle, kind: Any, message: Any) -> None:
    """The job's progress as it came (the time received is the entry's), for the replay: each counter
    at most every PROGRESS_EVERY_S, its last value kept until a phase change, a milestone or the exit
    writes it, so that no bar is replayed short of where it got."""
    pending = window.progress_said
    where = {"host": handle.host, "job_id": handle.job_id}

    def write(progress: JobProgress) -> None:
        data = {k: v for k, v in (("done", progress.done), ("total", progress.total), ("unit", progress.unit),
                                  ("rate", progress.rate), ("phase", progress.phase), ("key", progress.key),
                                  ("label", progress.message), ("worker_t", progress.t)) if v is not None}
        window.record(None, f"{handle.worker} {progress.key or progress.unit}: {progress.done:g}"
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
        window.record(None, f"{handle.worker}: {kind} {name if kind == 'phase' else ''}".rstrip(), kind="job-progress",
                      data={"worker": handle.worker, "event": kind, **({"phase": name} if kind == "phase" else {})},
                      **where)
    elif kind == "exit":
        flush()
        window.record(None, f"{handle.worker} on {handle.host} exited ({event_code(message)})", kind="job-exit",
                      exit=event_code(message), data={"worker": handle.worker}, **where)


def event_code(message: Any) -> int | None:
    return getattr(message, "code", None)


async def _none() -> Any:
    """No events (an async iterator that ends at once)."""
    return
    yield


async def end_own_jobs(window: Window) -> None:
    """A run that ends without finishing leaves no worker of its own behind: the staged extractor
    would wait for its go forever holding the weights in RAM, and an extraction still on the
    GPUs would fight the restarting server for them. Ended before the restart, every host at
    once; a host that cannot be reached is said once, its other jobs not tried (each would wait
    out the same timeout while the service stays down)."""
    by_host: dict[str, list[JobHandle]] = {}
    for key, record in window.state.jobs.items():
        if record.handle is None or key.startswith(("probe-", "provenance-", "check")) or not window.holds_lock:
            continue  # only while this engine holds the run's host (its lock): never another console's jobs
        handle = JobHandle.from_json(record.handle)
        by_host.setdefault(handle.host, []).append(handle)

    async def end_on(host: str, handles: list[JobHandle]) -> None:
        for handle in handles:
            try:
                status = await window.hosts.job_status(handle)
                if kept.flushing(window, handle, status.state, status.exit_code):
                    continue  # it released the GPUs: its files are all but written, never thrown away
                if status.state == "running":
                    status = await window.hosts.cancel_job(handle, grace=5.0)
                    window.journal(None, f"ended our {handle.worker} job on {host} (pid {handle.pid}): "
                                       f"{status.state}" + (f", {status.note}" if status.note else ""),
                                 host=host, level="warning")
            except (HostError, TimeoutError) as exc:
                for unreached in handles[handles.index(handle):]:  # an extractor flushing is left to the resume
                    kept.flushing(window, unreached, None, None)
                left = ", ".join(f"{h.worker} (pid {h.pid})" for h in handles[handles.index(handle):])
                window.journal(None, f"could not end our jobs on {host}: {left}: {exc or 'no answer'}",
                             host=host, level="error")
                return

    await asyncio.gather(*(end_on(host, handles) for host, handles in by_host.items()))
