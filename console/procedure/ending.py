"""How a run ends: its compensation, its record and the finished run's recovery (the engine's
`_end`, kept apart from its loop).

Whatever ends a run (done, failed, refused, cancelled, a signal, a crash found on resume), `end`
brings the hosts back to serving before the run is closed: our own jobs ended (never another
console's, never an extractor flushing after it released the GPUs), the restart offered or the
server given back (pause route), the drained replica put back (fleet), the host lock released
once nothing of ours is left out. A second interruption during the compensation is journalled and
waited through. A finished run that left the service down, paused or drained is only ever
recovered (`restart_only`), never run again.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

from console.messages import RunFinished
from console.procedure import kept
from console.procedure.outcomes import Refused, ResumeRefused, StepFailed
from console.procedure.steps import fleet, pause, preflight, route_steps, stop
from console.procedure.store import what_next
from console.service.control import ReadyTimeout, ServiceError
from console.service.sglang_api import ServerAnswerError, ServerUnreachable
from console.ssh.hosts import HostError
from console.ssh.jobs import JobHandle

if TYPE_CHECKING:
    from console.procedure.engine import Engine

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3
EXIT_PAUSED = 4  # paused with the service up (cut short at its budget, or one step done): `run --resume` goes on
AS_IT_WAS = "as-it-was"  # a resume's preflight failed: the run is left as it was (`kept.left_as_it_was`)
GIVE_BACK_ERRORS = (Refused, StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError, ServerAnswerError,
                    ServerUnreachable, ValueError)


def held_line(run_id: str, service: Any) -> str:
    """"THE SERVER IS STILL PAUSED: memory released by run X (kv_cache, cuda_graph) since 09:31:02"."""
    since = time.strftime("%H:%M:%S", time.localtime(service.paused_at or service.released_at or time.time()))
    released = service.released or service.releasing
    what = f"memory released by run {run_id} ({', '.join(released)})" if released else f"paused by run {run_id}"
    return f"THE SERVER IS STILL PAUSED: {what} since {since}"


async def end(engine: Engine, status: str, message: str) -> RunFinished:
    # From here a full disk never stops the run's end: our jobs ended, the service back, the
    # lock released (what cannot be written is kept in memory and said once).
    engine.run.keep_going_on_write_errors = True
    if engine._unsubscribe_telemetry:
        engine._unsubscribe_telemetry()
    if status == AS_IT_WAS:
        return kept.left_as_it_was(engine, message)
    if engine.lock_refused:  # another live console's run holds the host: nothing there is ours to undo
        return finish(engine, status, message)
    if status not in ("done", "paused"):
        if status not in ("failed",):  # a failed step journalled its own error
            engine.journal(None, message, level="warning")
        await compensate_to_the_end(engine, status, declined_while_down(engine, message) if status == "refused" else None)
        if engine._left_flushing is not None:  # the extraction is not thrown away: the run stays resumable
            status, message = "paused", f"{message}; {engine._left_flushing}"
    if not engine.service_down_by_us and not engine.server_held_by_us and not engine.plan_only:
        await release_lock(engine)
    return finish(engine, status, message)

async def _through_interruptions(engine: Engine, work: Any, interrupted: str, failed: str, level: str) -> None:
    """`work` in a task of its own: a signal or second Ctrl-C that lands meanwhile is journalled
    (`interrupted`) and waited through, never escaping the run's end half-way; its error is said
    (`failed`: the error follows) and the run's end goes on."""
    task = asyncio.ensure_future(work)
    while True:
        try:
            await asyncio.shield(task)
            return
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None:
                current.uncancel()
            if task.done():
                return
            engine.journal(None, interrupted, level="warning")
        except Exception as exc:  # noqa: BLE001 - said; the finish below still runs
            engine.journal(None, f"{failed}: {type(exc).__name__}: {exc}", level=level)
            return


async def release_lock(engine: Engine) -> None:
    """The host lock released, never leaving the run "running" on a signal; one it cannot release
    then names a finished run, taken over next time."""
    await _through_interruptions(engine, preflight.release_host_lock(engine),
                                 "interrupted while releasing the host lock: it is released first",
                                 "the host lock could not be released", "warning")


def declined_while_down(engine: Engine, message: str) -> tuple[str, str] | None:
    """A no to a step that must run while the service is down (free-vram: the holders left running):
    the window cannot go on without it, and the service is down because of this run. The restart
    offered then says so (its reason), and what a no to it leaves (`Confirmation.leaves`): the
    service down, named by this run, which `run --resume` restarts later (exit 3). None otherwise (a
    no to the stop changed nothing; a no to the restart is not asked again)."""
    if not engine.service_down_by_us:
        return None
    step = next((s.name for s in route_steps(engine.route) if s.while_down and s.name != "restart"
                 and engine.state.status_of(s.name) == "refused"), None)
    if step is None:
        return None
    run_id, since = engine.run.run_id, engine.state.service.stopped_at or time.time()
    reason = f"{message}; {step} must run while the service is down, so this window cannot go on"
    leaves = (f"the service stays DOWN, stopped by run {run_id} at {time.strftime('%H:%M:%S', time.localtime(since))}; "
              f"`dflash-ops run --resume {run_id}` restarts it later (exit 3)")
    return reason, leaves


async def compensate_to_the_end(engine: Engine, why: str, declined: tuple[str, str] | None = None) -> None:
    """The compensation, never abandoning a restart half-way. `declined`: the restart's reason and
    what a no to it leaves, after a no to a step that must run while the service is down."""
    await _through_interruptions(engine, compensate_and_rejoin(engine, why, declined),
                                 "interrupted again during the compensation: it goes on (the restart is "
                                 "not abandoned half-way)", "the compensation failed", "error")


def finish(engine: Engine, status: str, message: str) -> RunFinished:
    down = engine.service_down_by_us
    held = engine.server_held_by_us and not down
    drained = engine.state.service.left_as() == "drained"  # the fleet window: a replica out of the router
    code = EXIT_DOWN if down or held or drained else EXIT_DONE if status == "done" else \
        EXIT_PAUSED if status == "paused" else EXIT_FAILED
    if not engine.plan_only:
        engine.state.status = status
        engine.state.exit_code = code
    engine.state.message = message
    engine.run.save()
    if down:
        since = engine.state.service.stopped_at or time.time()
        message += f"; THE SERVICE IS STILL DOWN (since {time.strftime('%H:%M:%S', time.localtime(since))})"
        if status != "paused":  # (a pause names its resume already: it goes on with the run)
            message += f": `dflash-ops run --resume {engine.run.run_id}` restarts it"
    if held:
        message += "; " + held_line(engine.run.run_id, engine.state.service)
    if engine.route == "pause":  # a window whose memory came back by a restart outside the run: said
        whys = [*(w.get("restarted_outside") for w in engine.state.windows), engine.state.service.restarted_outside]
        message += "".join(f"; {pause.restart_words(why)}" for why in whys if why)
    if drained:
        message += "; " + fleet.drained_line(engine.run.run_id, engine.state.service)
    finished = RunFinished(engine.run.run_id, status, code, not down and not held, message, str(engine.run.dir))
    engine.journal(None, f"run {status} (exit {code}): {message}", exit=code)
    for line in engine.run.write_errors:
        engine.journal(None, f"not recorded on disk: {line}", level="error")
    engine.bus.publish(finished)
    engine.run.close()
    return finished

async def restart_only(engine: Engine) -> RunFinished:
    """A finished run is never run again; one that left the service down may still restart it."""
    state = engine.state
    if state.service.left_as() == "drained":
        return await rejoin_only(engine)
    if state.service.held and not state.service.down:
        return await give_back_only(engine)
    if not state.service.down:
        raise ResumeRefused(what_next(engine.run))  # one wording everywhere: run, status, the console
    engine.journal(None, f"run {engine.run.run_id} had finished {state.status} with the service down: only its "
                       f"restart is done")
    message = f"run {state.status} earlier; the restart was asked for"
    try:
        await stop.restart_service(engine, reason=f"run {engine.run.run_id} ended {state.status} with the service down")
    except (Refused, StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError) as exc:
        engine.journal("restart", f"the restart failed: {exc}", level="error")
        message = f"run {state.status} earlier; the restart failed: {exc}"
    except asyncio.CancelledError:
        message = f"run {state.status} earlier; {cancelled(engine, 'restart')}"
    down = state.service.down
    if not down and state.service.drained:  # the fleet window: back up, then back in the router
        return await rejoin_only(engine)
    if not down:  # held until the run's service is back (its console gone): released now
        await release_lock(engine)
    code = EXIT_DOWN if down else EXIT_FAILED if state.status != "done" else EXIT_DONE
    return closed(engine, code, message)

async def rejoin_only(engine: Engine) -> RunFinished:
    """A finished run that left its replica out of the fleet's router: only its rejoin."""
    state = engine.state
    message = f"run {state.status} earlier; the rejoin was asked for"
    try:
        await fleet.rejoin_after(engine, reason=f"run {engine.run.run_id} ended {state.status} with the replica drained")
    except GIVE_BACK_ERRORS + fleet.FLEET_ERRORS as exc:
        engine.journal("rejoin", f"the rejoin failed: {exc}", level="error")
        message = f"run {state.status} earlier; the rejoin failed: {exc}"
    except asyncio.CancelledError:
        message = f"run {state.status} earlier; {cancelled(engine, 'rejoin')}"
    if state.service.drained:
        return closed(engine, EXIT_DOWN, message + "; " + fleet.drained_line(engine.run.run_id, state.service))
    await preflight.release_host_lock(engine)
    return closed(engine, EXIT_FAILED if state.status != "done" else EXIT_DONE, message)

async def give_back_only(engine: Engine) -> RunFinished:
    """A finished run that left the server paused or released: only its resume + continue."""
    state = engine.state
    engine.journal(None, f"run {engine.run.run_id} had finished {state.status} with the server paused: only its "
                       f"resume and continue are done")
    message = f"run {state.status} earlier; the resume and continue were asked for"
    try:
        await pause.give_back(engine, reason=f"run {engine.run.run_id} ended {state.status} with the server paused")
    except GIVE_BACK_ERRORS as exc:
        engine.journal("resume", f"giving the server back failed: {exc}", level="error")
        message = f"run {state.status} earlier; giving the server back failed: {exc}"
    except asyncio.CancelledError:
        message = f"run {state.status} earlier; {cancelled(engine, 'resume')}"
    else:
        if state.service.restarted_outside:  # another process: nothing was sent to it (pause.same_server)
            said = pause.restart_words(state.service.restarted_outside)
            message = f"run {state.status} earlier; nothing was resumed or continued: {said}"
    if state.service.held:
        return closed(engine, EXIT_DOWN, message + "; " + held_line(engine.run.run_id, state.service))
    if state.service.drained:  # the fleet window: given back, then back in the router
        return await rejoin_only(engine)
    await preflight.release_host_lock(engine)
    return closed(engine, EXIT_FAILED if state.status != "done" else EXIT_DONE, message)

def cancelled(engine: Engine, step: str) -> str:
    """Ctrl-C (or a signal) while a finished run only recovers its service: taken, never ignored;
    the run is closed saying where the service stands, and `run --resume` (or r) asks again."""
    task = asyncio.current_task()
    while task is not None and task.cancelling():
        task.uncancel()
    what = {"restart": "the restart", "rejoin": "the rejoin", "resume": "giving the server back"}[step]
    engine.journal(step, f"{what} was cancelled (Ctrl-C or a signal): `dflash-ops run --resume "
                         f"{engine.run.run_id}` or r asks again", level="warning")
    return f"{what} was cancelled"


def closed(engine: Engine, code: int, message: str) -> RunFinished:
    state = engine.state
    state.exit_code = code
    engine.run.save()
    up = not state.service.down and not state.service.held
    finished = RunFinished(engine.run.run_id, state.status, code, up, message, str(engine.run.dir))
    engine.bus.publish(finished)
    engine.run.close()
    return finished

async def end_own_jobs(engine: Engine) -> None:
    """A run that ends without finishing leaves no worker of its own behind: the staged extractor
    would wait for its go forever holding the weights in RAM, and an extraction still on the
    GPUs would fight the restarting server for them. Ended before the restart, every host at
    once; a host that cannot be reached is said once, its other jobs not tried (each would wait
    out the same timeout while the service stays down)."""
    by_host: dict[str, list[JobHandle]] = {}
    for key, record in engine.state.jobs.items():
        if record.handle is None or key.startswith(("probe-", "provenance-", "check")) or not engine.holds_lock:
            continue  # only while this engine holds the run's host (its lock): never another console's jobs
        handle = JobHandle.from_json(record.handle)
        by_host.setdefault(handle.host, []).append(handle)

    async def end_on(host: str, handles: list[JobHandle]) -> None:
        for handle in handles:
            try:
                status = await engine.hosts.job_status(handle)
                if kept.flushing(engine, handle, status.state, status.exit_code):
                    continue  # it released the GPUs: its files are all but written, never thrown away
                if status.state == "running":
                    status = await engine.hosts.cancel_job(handle, grace=5.0)
                    engine.journal(None, f"ended our {handle.worker} job on {host} (pid {handle.pid}): "
                                       f"{status.state}" + (f", {status.note}" if status.note else ""),
                                 host=host, level="warning")
            except (HostError, TimeoutError) as exc:
                for unreached in handles[handles.index(handle):]:  # an extractor flushing is left to the resume
                    kept.flushing(engine, unreached, None, None)
                left = ", ".join(f"{h.worker} (pid {h.pid})" for h in handles[handles.index(handle):])
                engine.journal(None, f"could not end our jobs on {host}: {left}: {exc or 'no answer'}",
                             host=host, level="error")
                return

    await asyncio.gather(*(end_on(host, handles) for host, handles in by_host.items()))

async def compensate_and_rejoin(engine: Engine, why: str, declined: tuple[str, str] | None = None) -> None:
    """The route's compensation, then (the fleet window) the drained replica back in the router:
    never while it is still down or paused."""
    await compensate(engine, why, declined)
    if not engine.restart_on_failure:
        return
    try:
        await fleet.rejoin_after(engine, reason=f"the run {why} after the drain")
    except GIVE_BACK_ERRORS + fleet.FLEET_ERRORS as exc:
        engine.journal("rejoin", f"putting the replica back in the router failed: {exc}", level="error")

async def compensate(engine: Engine, why: str, declined: tuple[str, str] | None = None) -> None:
    """After a failure, refusal or cancel: end our jobs, and with the service down because of us,
    offer the restart (`declined`: its reason and what a no leaves, `declined_while_down`)."""
    await end_own_jobs(engine)
    if engine._restart_task is not None:
        task, engine._restart_task = engine._restart_task, None
        try:
            await task
        except Exception as exc:
            what = "giving the server back" if engine.route == "pause" else "the restart"
            engine.journal("resume" if engine.route == "pause" else "restart",
                           f"{what} begun at gpu_released failed: {exc}", level="error")
    if engine.server_held_by_us and not engine.service_down_by_us:
        if not engine.restart_on_failure:
            engine.journal("resume", "the server is left paused (--no-restart)", level="warning")
            return
        try:
            await pause.give_back(engine, reason=f"the run {why} after the pause")
        except GIVE_BACK_ERRORS as exc:
            engine.journal("resume", f"giving the server back failed: {exc}", level="error")
        return
    if not engine.service_down_by_us:
        return
    if not engine.restart_on_failure:
        engine.journal("restart", "the service is left down (--no-restart)", level="warning")
        return
    if engine.restart_refused:  # the operator's no stands: never asked again by the same run
        engine.journal("restart", "the restart was refused: the service stays down (r in the console, or "
                                f"`dflash-ops run --resume {engine.run.run_id}`, restarts it)", level="warning")
        return
    reason, leaves = declined or (f"the run {why} after the stop", None)
    try:
        await stop.restart_service(engine, reason=reason, leaves=leaves)
    except Refused:
        engine.journal("restart", "the restart was refused: the service stays down (r in the console, or "
                                  f"`dflash-ops run --resume {engine.run.run_id}`, restarts it)", level="warning")
    except (StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError) as exc:
        engine.journal("restart", f"the restart failed: {exc}", level="error")
