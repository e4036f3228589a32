"""The window route's stop, free-vram and restart: the service goes down once, its GPUs are seen free
(the leftover holders ended only with the operator's yes), and it is started once per down period."""

from __future__ import annotations

import asyncio
import dataclasses
import shlex
import time
from typing import TYPE_CHECKING

from console.messages import Confirmation, HoldersFound, ServiceStatus
from console.procedure import forecast as fc
from console.procedure.outcomes import Found, Refused, Skip, StepFailed
from console.procedure.state import ServiceState
from console.procedure.steps import fleet_guard, serving
from console.procedure.steps.extraction import extraction_complete
from console.service.control import ReadyTimeout, ServiceError
from console.service.vram import describe_outcomes, wait_vram_free
from console.session import service_name
from console.ssh.hosts import HostError
from console.views.units import duration

if TYPE_CHECKING:
    from console.procedure.window import Window


async def check_stop(window: Window) -> Skip | None:
    """Satisfied once this run stopped the service; the host is asked, never the saved flag alone."""
    service = window.state.service
    if not service.stops:
        return None
    since = time.strftime('%H:%M:%S', time.localtime(service.stopped_at or time.time()))
    if not service.down:
        return Found(f"stopped by this run at {since}; back since "
                     f"{time.strftime('%H:%M:%S', time.localtime(service.ready_at or time.time()))}")
    manager = await window.hosts.service_manager(window.connect_s)
    status = await manager.status()
    if not status.active:
        service.stop_confirmed = True
        window.run.save()
        return Found(f"stopped by this run at {since}; {manager.name} is {status.state} on "
                     f"{window.config.service.host} (asked now)")
    if service.start_issued_at is not None:  # our own restart is under way: the restart step waits for it
        return Found(f"stopped by this run at {since}; our start is under way ({status.state})")
    outside = restarted_outside(service, status)
    if outside is None:  # the process the run meant to stop: the stop never took effect
        window.journal("stop", f"the stop began at {since} but {manager.name} still runs ({status.state}, the same "
                             f"process as before the stop): the console died before the stop took effect; "
                             f"stopping it now", level="warning")
        service.stopped_at = None  # the downtime begins with the stop that takes effect
        window.run.save()
        return None
    return await _started_outside(window, manager.name, status, outside, since)


def restarted_outside(service: ServiceState, status: ServiceStatus) -> str | None:
    """Why the service found active after this run's stop was started again outside the run (its
    manager's start time after the stop, or another main pid than before it), or None when it is
    the same process (a stop that never took effect). Cannot tell: said so (never taken as ours)."""
    stopped_at = service.stopped_at
    if status.since is not None and stopped_at is not None and status.since >= stopped_at:
        return f"active since {time.strftime('%H:%M:%S', time.localtime(status.since))}"
    before = service.main_pid_before_stop
    if status.main_pid is not None and before is not None and status.main_pid != before:
        return f"main pid {status.main_pid}, {before} before the stop"
    if service.stop_returned_at is not None:  # the stop returned and the manager said down: certainly restarted
        return "its stop had returned"
    if status.since is not None or (status.main_pid is not None and before is not None):
        return None  # the same start time, the same pid: the process the stop was meant for
    return "cannot tell whether it is the process the stop was meant for"


async def _started_outside(window: Window, name: str, status: ServiceStatus, why: str, since: str) -> Skip | None:
    """The service runs again, started outside this run after its stop: the time it was up is not
    downtime (its down period ends at the manager's start time, else is not counted). With the GPU
    work done (the extraction released them) nothing more is needed from it; otherwise the window
    needs it down again: a second stop, which is asked (`run_stop`), never taken for granted."""
    svc = window.state.service
    up_at = status.since if status.since is not None and status.since >= (svc.stopped_at or 0) else None
    window.journal("stop", f"{name} on {window.config.service.host} is running again ({status.state}, {why}): "
                           f"started outside this run after its stop at {since}; the time it was up is not downtime",
                   level="warning")
    svc.down, svc.restarted_outside_at, svc.ready_at = False, up_at or time.time(), up_at
    if window.state.extraction.complete or window.state.extraction.gpu_released_at is not None:
        window.run.save()
        window.publish_downtime()
        return Found(f"stopped by this run at {since}; started outside it since ({why}): the extraction had "
                     f"released the GPUs, so it is not stopped again")
    window.state.windows.append({"service": dataclasses.asdict(svc), "extraction": {}, "steps": {},
                                 "forecast": window.state.forecast, "restarted_outside": why})
    window.state.service = ServiceState(main_pid_before_stop=status.main_pid, active_since_before_stop=status.since)
    window.run.save()
    window.publish_downtime()
    return None  # run_stop asks before this second stop (a new down period)


def _outside_note(window: Window) -> str:
    """The stop's question after a restart outside the run says so."""
    windows = window.state.windows
    if window.state.service.stops or not windows or not windows[-1].get("restarted_outside"):
        return ""
    return (f"; it was started outside this run after the run's stop ({windows[-1]['restarted_outside']}): this is "
            f"a second stop")


def _alternative(window: Window) -> str:
    """The route that never stops the server, when one fits: where it would extract, and no figure
    of its own (the question's one figure is the forecast downtime)."""
    alternative = window.state.facts.get("alternative")
    return (f"; the alternative: {alternative}, the server never stopped (dflash-ops run --route zero-downtime)"
            if alternative else "")


async def run_stop(window: Window) -> str:
    service = window.config.service
    if window.state.status_of("cache") not in ("done", "skipped"):
        raise StepFailed("stop", "refused: the completions are not cached and verified")
    if window.acts("stage") and window.state.status_of("stage") not in ("done", "skipped"):
        raise StepFailed("stop", "refused: the staged extractor has not reported `staged`")
    await serving.staged_before_the_stop(window)  # the host is asked: a dead stager is staged again (or cold)
    manager = await window.hosts.service_manager(window.connect_s)
    argv = manager.stop_argv()
    made, inputs = await window.make_forecast(manager)
    refused = fc.refusal(made, inputs)
    if refused and not window.state.service.stops:
        raise StepFailed("stop", refused)
    impact = (f"{service_name(window.config)} on {service.host} goes down; forecast downtime {fc.summary(made)}"
              + (f" (budget {made.budget_s:g} s)" if made.budget_s is not None else "") + _alternative(window)
              + _outside_note(window))
    if not window.state.service.stops and not await window.ask(
            Confirmation("stop", "stop the service", service.host, tuple(argv), impact, True,
                         None if fc.unknown(made) else made.downtime_s, "forecast")):
        raise Refused("stop", "stop the service")
    window.crash_point("stop-asked")
    stream = window.hosts.telemetry(service.host)
    svc = window.state.service
    svc.pids_before_stop = sorted(getattr(stream.telemetry, "seen_service_pids", ()) or ())
    svc.stopped_at = svc.stopped_at or time.time()
    svc.down = True
    svc.stops += 1
    window.stopped_mono = time.monotonic()
    window.run.keep_going_on_write_errors = True  # from here on a full disk must not keep it down
    window.run.save()  # before the command: a crash during the stop still knows the service may be down
    window.publish_downtime()
    started = time.monotonic()
    try:
        try:
            await manager.stop()
        except ServiceError as exc:
            await _stop_did_not_take(window, manager, exc)
            raise
        except asyncio.CancelledError:
            await _stopped_anyway(window, manager, started)
            raise
        svc.stop_returned_at = time.time()
        window.irreversible["stop"] = f"stopped in {time.monotonic() - started:.1f} s"
        window.run.save()
    finally:
        window.journal("stop", "stop command ran", host=service.host, argv=list(argv),
                     duration_s=round(time.monotonic() - started, 3))
        window.hosts.poke_service()
    window.crash_point("stop-ran")
    return window.irreversible["stop"]


async def _stop_did_not_take(window: Window, manager: object, exc: Exception) -> None:
    """The stop command failed (a sudo password, say). If the manager says the service is still
    active, it never went down: no downtime is recorded (none feeds `runs` or later forecasts),
    and nothing is restarted. Unknowable (the host does not answer): it may be down, kept so."""
    try:
        status = await manager.status()  # type: ignore[attr-defined]
    except Exception:  # noqa: BLE001 - the stop's own failure is what is raised
        return
    if not status.active:
        return
    svc = window.state.service
    svc.down = False
    svc.stopped_at = None
    window.stopped_mono = None
    window.run.save()
    window.publish_downtime()
    window.journal("stop", f"the stop failed and {getattr(manager, 'name', 'the service')} stayed "
                           f"{status.state}: no downtime ({exc})", host=window.config.service.host, level="error")


async def _stopped_anyway(window: Window, manager: object, started: float) -> None:
    """A cancel (SIGINT, SIGTERM, the console's quit) landed while the stop command was finishing:
    its work may be done on the host though the command did not return. The manager is asked; a
    service that is down is recorded stopped (the step `done`, the downtime running), so that the
    compensation, a resume and the run's downtime go by what happened, not by the interruption."""
    try:
        status = await manager.status()  # type: ignore[attr-defined]
    except (asyncio.CancelledError, Exception):  # noqa: BLE001 - cannot tell: `down` stays as written before the stop
        return
    if status.active:
        return
    svc = window.state.service
    svc.stop_confirmed = True
    window.irreversible["stop"] = (f"stopped in {time.monotonic() - started:.1f} s (the cancel came as the stop "
                                    f"command finished: {getattr(manager, 'name', 'the service')} is {status.state})")
    window.run.save()


async def verify_stop(window: Window) -> None:
    manager = await window.hosts.service_manager(window.connect_s)
    status = await manager.status()
    if status.active:
        raise StepFailed("stop", f"`{shlex.join(manager.stop_argv())}` returned but {manager.name} is still "
                                 f"{status.state}")
    window.state.service.stop_confirmed = True
    window.run.save()


def staged_exclude(window: Window) -> list[int]:
    pid = window.state.extraction.staged_pid
    return [pid] if pid and window.config.target.host == window.config.service.host else []


async def check_free_vram(window: Window) -> Skip | None:
    if window.state.extraction.begun_at or await extraction_complete(window):
        return Found("the extraction already started")
    svc = window.state.service
    if svc.start_issued_at is not None:  # the compensation restarted it (a refusal, then a crash): no window now
        raise StepFailed("free-vram", f"the service was started again at "
                                      f"{time.strftime('%H:%M:%S', time.localtime(svc.start_issued_at))}, before "
                                      f"the extraction began: this window is over; nothing more is done")
    return None


async def run_free_vram(window: Window) -> str:
    service = window.config.service
    stream = window.hosts.telemetry(service.host)
    exclude = staged_exclude(window)
    after = window.stopped_mono if window.stopped_mono is not None else time.monotonic()  # a new process: fresh samples
    known = window.state.service.pids_before_stop
    # (a fleet's window ended early meanwhile: the wait is cut, the compensation restarts: fleet_guard)
    result = await fleet_guard.unless_ended(window, "free-vram", wait_vram_free(
        stream, service.gpus, service.vram_free_mib, service.vram_wait_s, stopped_at=after, service_pids=known,
        exclude=exclude))
    if result.free:
        _vram_free_now(window)
        return f"free after {result.waited_s:.1f} s ({result.used})"
    holders = result.holders
    window.bus.publish(HoldersFound(service.host, holders, result.used, service.vram_free_mib))
    window.journal("free-vram", f"VRAM still held after {result.waited_s:.0f} s ({result.used}): "
                 + "; ".join(f"pid {h.pid} {h.mib} MiB {h.command or '?'}" for h in holders), level="warning")
    hidden = [h for h in holders if not h.visible]
    holders = tuple(h for h in holders if h.visible)  # a pid that names no GPU process here is never signalled
    for h in hidden:
        window.journal("free-vram", f"pid {h.pid} ({h.mib} MiB) is not visible from this namespace "
                                  f"({h.visible_reason or 'no /dev/nvidia* file open'}): left alone", level="warning")
    if not holders:
        raise StepFailed("free-vram", f"VRAM still held ({result.used}) and no process that holds it can be "
                                      f"ended from here" + (f" ({len(hidden)} not visible from this namespace: "
                                                            f"end them on the host itself)" if hidden else ""))
    argv = await window.hosts.endpids_argv(service.host, holders, service.stop_grace_s, service.sudo)
    action = f"end {len(holders)} process{'es' if len(holders) > 1 else ''} holding VRAM"
    impact = ", ".join(f"pid {h.pid} ({h.mib} MiB, {h.command or '?'}"
                       + (", was the service's" if h.was_service else "") + ")" for h in holders)
    if not await window.ask(Confirmation("free-vram", action, service.host, tuple(argv),
                                        f"SIGTERM, then SIGKILL after {service.stop_grace_s:g} s: {impact}", True)):
        raise Refused("free-vram", action)
    outcomes = await window.hosts.end_holders(service.host, holders, service.stop_grace_s, service.sudo)
    for line in describe_outcomes(outcomes):
        window.journal("free-vram", line, host=service.host)
    window.crash_point("holders")
    result = await fleet_guard.unless_ended(window, "free-vram", wait_vram_free(
        stream, service.gpus, service.vram_free_mib, service.vram_wait_s, stopped_at=time.monotonic(),
        service_pids=known, exclude=exclude))
    if not result.free:
        raise StepFailed("free-vram", f"VRAM still held after ending the holders ({result.used})")
    _vram_free_now(window)
    return f"free after ending {len(outcomes)} holder(s) ({result.used})"


def _vram_free_now(window: Window) -> None:
    window.state.service.vram_free_at = time.time()
    window.run.save()


def begin_restart(window: Window) -> None:
    """The restart begins the moment the GPUs are released, not after the files are flushed."""
    if window.route == "window" and window.service_down_by_us and window.restart_task is None:
        window.state.service.restart_begun_at = window.state.service.restart_begun_at or time.time()
        window.run.save()
        window.restart_task = asyncio.create_task(restart_service(window, reason="the extraction released the GPUs"),
                                                 name="restart-at-gpu-released")


async def check_restart(window: Window) -> Skip | None:
    service = window.state.service
    if not service.stops:
        return Skip("the service was not stopped by this run")
    if not service.down and window.restart_task is None:
        return Found(f"ready {(service.ready_at or 0) - (service.stopped_at or 0):.1f} s after the stop")
    return None


async def run_restart(window: Window) -> str:
    if window.restart_task is not None:
        task, window.restart_task = window.restart_task, None
        try:
            with window.answer_waits.joined(task):  # its question, still open, holds this step up from now
                await task  # begun at gpu_released
        except Refused:
            raise  # the operator said no to this restart: asked once, never again by the restart step
        except (StepFailed, HostError, ServiceError, ReadyTimeout) as exc:
            window.journal("restart", f"the restart begun at gpu_released failed: {exc}", level="error")
    if window.service_down_by_us:
        await restart_service(window, reason="the extraction finished")
    service = window.state.service
    return f"ready {(service.ready_at or 0) - (service.stopped_at or 0):.1f} s after the stop"


async def restart_service(window: Window, reason: str, leaves: str | None = None) -> None:
    """Start the service (asking first) and wait until it is ready; the downtime ends then.
    `leaves`: what a no to it leaves behind, when the question says so (`Confirmation.leaves`).

    One start per down period: the manager is asked first, and a service already active or
    activating (our start cut off by a crash, a quit modal's restart, another console) is
    waited for, never started again. Calls are serialized."""
    async with window.restart_lock:
        if not window.service_down_by_us:
            return
        service = window.config.service
        svc = window.state.service
        manager = await window.hosts.service_manager(window.connect_s)
        status = await manager.status()
        started = time.monotonic()
        try:
            if status.active or status.state in ("activating", "reloading"):
                window.start_issued.set()
                window.journal("restart", f"{manager.name} is already {status.state}: waiting until it is ready, "
                                        f"not starting it again", host=service.host)
                health = await window.hosts.wait_service_ready(service.ready_timeout_s)
                svc.ready_seen_late = svc.start_issued_at is not None and window.restart_task is None
            else:
                argv = manager.start_argv()
                down = svc.stopped_at
                so_far = f"down {duration(time.time() - down)} so far" if down else "not stopped by this run"
                failed_before = f"; the last start failed: {svc.restart_error}" if svc.restart_error else ""
                if not await window.ask(Confirmation("restart", "start the service", service.host, tuple(argv),
                                                    f"{reason}: brings {service_name(window.config)} back "
                                                    f"({so_far}){failed_before}", False,
                                                    window.earlier.get("restart"), leaves=leaves)):
                    window.restart_refused = True
                    raise Refused("restart", "start the service")
                svc.start_issued_at = time.time()
                svc.starts += 1
                window.run.save()
                window.start_issued.set()  # a resume's verification of the states waits for this (steps/extract.py)
                window.crash_point("start-issued")
                health = await window.hosts.start_service_and_wait(service.ready_timeout_s, window.bus.publish)
        except (ServiceError, ReadyTimeout, HostError, TimeoutError) as exc:
            svc.restart_error = str(exc) or type(exc).__name__
            window.run.save()
            raise
        svc.down = False
        svc.ready_at = time.time()
        svc.restart_error = None
        window.run.save()
        window.journal("restart", f"ready after {time.monotonic() - started:.1f} s ({health.model or 'model ?'})",
                     host=service.host, argv=manager.start_argv(), duration_s=round(time.monotonic() - started, 3))
        window.publish_downtime()
        window.hosts.poke_service()  # the host lock stays until the run ends (its evaluation, its cross-check)
        window.crash_point("ready")
