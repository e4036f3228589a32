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
from console.procedure import kept, run_jobs
from console.procedure.outcomes import Refused, ResumeRefused, StepFailed
from console.procedure.steps import drafter, fleet, fleet_guard, pause, preflight, remedy_restart, stop
from console.procedure.store import what_next
from console.service.control import ReadyTimeout, ServiceError
from console.service.sglang_api import ServerAnswerError, ServerUnreachable
from console.ssh.hosts import HostError

if TYPE_CHECKING:
    from console.procedure.window import Window

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3
EXIT_PAUSED = 4  # paused with the service up (cut short at its budget, or one step done): `run --resume` goes on
# Its work done, but the window left the served drafter degraded (steps/drafter.py): an outcome of its own,
# so that a script and `runs` tell it from a clean run.
EXIT_DEGRADED = 5
AS_IT_WAS = "as-it-was"  # a resume's preflight failed: the run is left as it was (`kept.left_as_it_was`)
GIVE_BACK_ERRORS = (Refused, StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError, ServerAnswerError,
                    ServerUnreachable, ValueError)


def held_line(run_id: str, service: Any) -> str:
    """"THE SERVER IS STILL PAUSED: memory released by run X (kv_cache, cuda_graph) since 09:31:02"."""
    since = time.strftime("%H:%M:%S", time.localtime(service.paused_at or service.released_at or time.time()))
    released = service.released or service.releasing
    what = f"memory released by run {run_id} ({', '.join(released)})" if released else f"paused by run {run_id}"
    return f"THE SERVER IS STILL PAUSED: {what} since {since}"


async def end(window: Window, status: str, message: str) -> RunFinished:
    # From here a full disk never stops the run's end: our jobs ended, the service back, the
    # lock released (what cannot be written is kept in memory and said once).
    window.run.keep_going_on_write_errors = True
    early = fleet_guard.stop_watch(window)  # the other replicas are no longer watched: nothing more is offered
    if status == AS_IT_WAS:
        return kept.left_as_it_was(window, message)
    if window.lock_refused:  # another live console's run holds the host: nothing there is ours to undo
        return finish(window, status, message)
    degraded = drafter.degraded_end(window.state.facts) if status == "done" else None
    if degraded is not None:
        status, message = "degraded", f"{message}; {degraded}"
    if status not in ("done", "degraded", "paused"):
        if status not in ("failed",):  # a failed step journalled its own error
            window.journal(None, message, level="warning")
        await compensate_to_the_end(window, status, declined_while_down(window, message) if status == "refused" else None)
        if window.left_flushing is not None:  # the extraction is not thrown away: the run stays resumable
            status, message = "paused", f"{message}; {window.left_flushing}"
        if early is not None and message.endswith(early) and window.state.service.left_as() is None:
            status, message = "paused", early  # ended early, back serving and in the router: resumable
    if not window.service_down_by_us and not window.server_held_by_us and not window.plan_only:
        await release_lock(window)
    return finish(window, status, message)

async def _through_interruptions(window: Window, work: Any, interrupted: str, failed: str, level: str) -> None:
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
            window.journal(None, interrupted, level="warning")
        except Exception as exc:  # noqa: BLE001 - said; the finish below still runs
            window.journal(None, f"{failed}: {type(exc).__name__}: {exc}", level=level)
            return


async def release_lock(window: Window) -> None:
    """The host lock released, never leaving the run "running" on a signal; one it cannot release
    then names a finished run, taken over next time."""
    await _through_interruptions(window, preflight.release_host_lock(window),
                                 "interrupted while releasing the host lock: it is released first",
                                 "the host lock could not be released", "warning")


def declined_while_down(window: Window, message: str) -> tuple[str, str] | None:
    """A no to a step that must run while the service is down (free-vram: the holders left running):
    the window cannot go on without it, and the service is down because of this run. The restart
    offered then says so (its reason), and what a no to it leaves (`Confirmation.leaves`): the
    service down, named by this run, which `run --resume` restarts later (exit 3). None otherwise (a
    no to the stop changed nothing; a no to the restart is not asked again)."""
    if not window.service_down_by_us:
        return None
    step = next((s.name for s in window.steps if s.while_down and s.name != "restart"
                 and window.state.status_of(s.name) == "refused"), None)
    if step is None:
        return None
    run_id, since = window.run.run_id, window.state.service.stopped_at or time.time()
    reason = f"{message}; {step} must run while the service is down, so this window cannot go on"
    leaves = (f"the service stays DOWN, stopped by run {run_id} at {time.strftime('%H:%M:%S', time.localtime(since))}; "
              f"`dflash-ops run --resume {run_id}` restarts it later (exit 3)")
    return reason, leaves


async def compensate_to_the_end(window: Window, why: str, declined: tuple[str, str] | None = None) -> None:
    """The compensation, never abandoning a restart half-way. `declined`: the restart's reason and
    what a no to it leaves, after a no to a step that must run while the service is down."""
    await _through_interruptions(window, compensate_and_rejoin(window, why, declined),
                                 "interrupted again during the compensation: it goes on (the restart is "
                                 "not abandoned half-way)", "the compensation failed", "error")


def finish(window: Window, status: str, message: str) -> RunFinished:
    down = window.service_down_by_us
    held = window.server_held_by_us and not down
    drained = window.state.service.left_as() == "drained"  # the fleet window: a replica out of the router
    code = EXIT_DOWN if down or held or drained else EXIT_DONE if status == "done" else \
        EXIT_DEGRADED if status == "degraded" else EXIT_PAUSED if status == "paused" else EXIT_FAILED
    if not window.plan_only:
        window.state.status = status
        window.state.exit_code = code
    window.state.message = message
    window.run.save()
    if down:
        since = window.state.service.stopped_at or time.time()
        message += f"; THE SERVICE IS STILL DOWN (since {time.strftime('%H:%M:%S', time.localtime(since))})"
        if status != "paused":  # (a pause names its resume already: it goes on with the run)
            message += f": `dflash-ops run --resume {window.run.run_id}` restarts it"
    if held:
        message += "; " + held_line(window.run.run_id, window.state.service)
    if window.route == "pause":  # a window whose memory came back by a restart outside the run: said
        whys = [*(w.get("restarted_outside") for w in window.state.windows), window.state.service.restarted_outside]
        message += "".join(f"; {pause.restart_words(why)}" for why in whys if why)
    if drained:
        message += "; " + fleet.drained_line(window.run.run_id, window.state.service)
    finished = RunFinished(window.run.run_id, status, code, not down and not held, message, str(window.run.dir))
    window.journal(None, f"run {status} (exit {code}): {message}", exit=code)
    for line in window.run.write_errors:
        window.journal(None, f"not recorded on disk: {line}", level="error")
    window.bus.publish(finished)
    window.run.close()
    return finished

async def restart_only(window: Window) -> RunFinished:
    """A finished run is never run again; one that left the service down may still restart it."""
    state = window.state
    if state.service.left_as() == "drained":
        return await rejoin_only(window)
    if state.service.held and not state.service.down:
        return await give_back_only(window)
    if not state.service.down:
        raise ResumeRefused(what_next(window.run))  # one wording everywhere: run, status, the console
    window.journal(None, f"run {window.run.run_id} had finished {state.status} with the service down: only its "
                       f"restart is done")
    message = f"run {state.status} earlier; the restart was asked for"
    try:
        await stop.restart_service(window, reason=f"run {window.run.run_id} ended {state.status} with the service down")
    except (Refused, StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError) as exc:
        window.journal("restart", f"the restart failed: {exc}", level="error")
        message = f"run {state.status} earlier; the restart failed: {exc}"
    except asyncio.CancelledError:
        message = f"run {state.status} earlier; {cancelled(window, 'restart')}"
    down = state.service.down
    if not down:
        remedy_restart.end_parked_down_period(window)
        state = window.state  # the window's own record is the service's again
    if not down and state.service.drained:  # the fleet window: back up, then back in the router
        return await rejoin_only(window)
    if not down:  # held until the run's service is back (its console gone): released now
        await release_lock(window)
    code = EXIT_DOWN if down else ended_code(state.status)
    return closed(window, code, message)

async def rejoin_only(window: Window) -> RunFinished:
    """A finished run that left its replica out of the fleet's router: only its rejoin."""
    state = window.state
    message = f"run {state.status} earlier; the rejoin was asked for"
    try:
        await fleet.rejoin_after(window, reason=f"run {window.run.run_id} ended {state.status} with the replica drained")
    except GIVE_BACK_ERRORS + fleet.FLEET_ERRORS as exc:
        window.journal("rejoin", f"the rejoin failed: {exc}", level="error")
        message = f"run {state.status} earlier; the rejoin failed: {exc}"
    except asyncio.CancelledError:
        message = f"run {state.status} earlier; {cancelled(window, 'rejoin')}"
    if state.service.drained:
        return closed(window, EXIT_DOWN, message + "; " + fleet.drained_line(window.run.run_id, state.service))
    await preflight.release_host_lock(window)
    return closed(window, ended_code(state.status), message)

async def give_back_only(window: Window) -> RunFinished:
    """A finished run that left the server paused or released: only its resume + continue."""
    state = window.state
    window.journal(None, f"run {window.run.run_id} had finished {state.status} with the server paused: only its "
                       f"resume and continue are done")
    message = f"run {state.status} earlier; the resume and continue were asked for"
    try:
        await pause.give_back(window, reason=f"run {window.run.run_id} ended {state.status} with the server paused")
    except GIVE_BACK_ERRORS as exc:
        window.journal("resume", f"giving the server back failed: {exc}", level="error")
        message = f"run {state.status} earlier; giving the server back failed: {exc}"
    except asyncio.CancelledError:
        message = f"run {state.status} earlier; {cancelled(window, 'resume')}"
    else:
        if state.service.restarted_outside:  # another process: nothing was sent to it (pause.same_server)
            said = pause.restart_words(state.service.restarted_outside)
            message = f"run {state.status} earlier; nothing was resumed or continued: {said}"
    if state.service.held:
        return closed(window, EXIT_DOWN, message + "; " + held_line(window.run.run_id, state.service))
    if state.service.drained:  # the fleet window: given back, then back in the router
        return await rejoin_only(window)
    await preflight.release_host_lock(window)
    return closed(window, ended_code(state.status), message)

def ended_code(status: str) -> int:
    """A finished run's exit status once its service is back (its recovery after the run ended)."""
    return EXIT_DONE if status == "done" else EXIT_DEGRADED if status == "degraded" else EXIT_FAILED


def cancelled(window: Window, step: str) -> str:
    """Ctrl-C (or a signal) while a finished run only recovers its service: taken, never ignored;
    the run is closed saying where the service stands, and `run --resume` (or r) asks again."""
    task = asyncio.current_task()
    while task is not None and task.cancelling():
        task.uncancel()
    what = {"restart": "the restart", "rejoin": "the rejoin", "resume": "giving the server back"}[step]
    window.journal(step, f"{what} was cancelled (Ctrl-C or a signal): `dflash-ops run --resume "
                         f"{window.run.run_id}` or r asks again", level="warning")
    return f"{what} was cancelled"


def closed(window: Window, code: int, message: str) -> RunFinished:
    state = window.state
    state.exit_code = code
    window.run.save()
    up = not state.service.down and not state.service.held
    finished = RunFinished(window.run.run_id, state.status, code, up, message, str(window.run.dir))
    window.bus.publish(finished)
    window.run.close()
    return finished

async def compensate_and_rejoin(window: Window, why: str, declined: tuple[str, str] | None = None) -> None:
    """The route's compensation, then (the fleet window) the drained replica back in the router:
    never while it is still down or paused."""
    await compensate(window, why, declined)
    if not window.restart_on_failure:
        return
    try:
        await fleet.rejoin_after(window, reason=f"the run {why} after the drain")
    except GIVE_BACK_ERRORS + fleet.FLEET_ERRORS as exc:
        window.journal("rejoin", f"putting the replica back in the router failed: {exc}", level="error")

async def compensate(window: Window, why: str, declined: tuple[str, str] | None = None) -> None:
    """After a failure, refusal or cancel: end our jobs, and with the service down because of us,
    offer the restart (`declined`: its reason and what a no leaves, `declined_while_down`)."""
    await run_jobs.end_own_jobs(window)
    if window.restart_task is not None:
        task, window.restart_task = window.restart_task, None
        try:
            await task
        except Exception as exc:
            what = "giving the server back" if window.route == "pause" else "the restart"
            window.journal("resume" if window.route == "pause" else "restart",
                           f"{what} begun at gpu_released failed: {exc}", level="error")
    if window.server_held_by_us and not window.service_down_by_us:
        if not window.restart_on_failure:
            window.journal("resume", "the server is left paused (--no-restart)", level="warning")
            return
        try:
            await pause.give_back(window, reason=f"the run {why} after the pause")
        except GIVE_BACK_ERRORS as exc:
            window.journal("resume", f"giving the server back failed: {exc}", level="error")
        return
    if not window.service_down_by_us:
        return
    if not window.restart_on_failure:
        window.journal("restart", "the service is left down (--no-restart)", level="warning")
        return
    if window.restart_refused:  # the operator's no stands: never asked again by the same run
        window.journal("restart", "the restart was refused: the service stays down (r in the console, or "
                                f"`dflash-ops run --resume {window.run.run_id}`, restarts it)", level="warning")
        return
    reason, leaves = declined or (f"the run {why} after the stop", None)
    try:
        await stop.restart_service(window, reason=reason, leaves=leaves)
    except Refused:
        window.journal("restart", "the restart was refused: the service stays down (r in the console, or "
                                  f"`dflash-ops run --resume {window.run.run_id}`, restarts it)", level="warning")
    except (StepFailed, HostError, ServiceError, ReadyTimeout, TimeoutError) as exc:
        window.journal("restart", f"the restart failed: {exc}", level="error")
