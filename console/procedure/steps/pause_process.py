"""The pause route's process, proven before anything more is sent to it (issue 40): the server's
manager's pid and start time, asked just before the pause and again before each release, resume and
continue. A restarted SGLang has released nothing, and its scheduler dies on a resume of a tag it
never released: a restart found is named with both identities, and nothing meant for the process
paused is sent to it (`same_server`). Used by console/procedure/steps/pause.py and pause_settle.py.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from console.messages import ServiceStatus
from console.procedure.outcomes import StepFailed
from console.procedure.state import ServiceState
from console.session import service_name

if TYPE_CHECKING:
    from console.procedure.window import Window


def process_words(pid: int | None, since: float | None) -> str:
    """"pid 4242 up since 09:31:02", or whichever of the two its manager reports."""
    words = ([f"pid {pid}"] if pid is not None else []) + (
        [f"up since {time.strftime('%H:%M:%S', time.localtime(since))}"] if since is not None else [])
    return " ".join(words) or "no pid or start time"


def other_process(service: ServiceState, status: ServiceStatus) -> bool | None:
    """Whether the server's manager now names another process than the one this run paused: its pid
    or its start time differs from those recorded just before the pause (systemd's MainPID and
    ActiveEnterTimestamp, a status command's pid), or none runs. None: nothing to compare."""
    if not status.active:
        return True
    compared = False
    pids = (service.main_pid_before_stop, status.main_pid)
    for then, now in (pids, (service.active_since_before_stop, status.since)):
        if then is not None and now is not None:
            if then != now:
                return True
            compared = True
    return False if compared else None


def restart_words(why: str | None) -> str:
    """How a run says it: "the server this run paused was restarted outside it (pid 5151 now, pid 4242
    when paused): the window's memory came back by that restart"."""
    return (f"the server this run paused was restarted outside it ({why}): the window's memory came back by "
            f"that restart")


async def same_server(window: Window, step: str) -> bool:
    """Whether the server is still the process this run paused, asked before a release, a resume or a
    continue is sent: a restarted SGLang released nothing, and its scheduler dies on a resume of a
    tag it never released (weight_updater.py, `offload_tags.remove`). Its manager's pid and start
    time against those recorded before the pause, as the stop route's `restarted_outside`; where
    neither tells, /ready: 503 is a paused server, 200 one that is not paused (nothing is sent to it).
    Another process: the window's memory came back by its restart (`restarted`, both named), False.
    None running: the same, then StepFailed (nothing of the run holds it; it needs a start)."""
    svc = window.state.service
    status = await (await window.hosts.service_manager(window.connect_s)).status()
    other = other_process(svc, status)
    then = process_words(svc.main_pid_before_stop, svc.active_since_before_stop)
    if other is None:
        paused = await paused_now(window)
        if paused is None:
            raise StepFailed(step, f"cannot tell whether the server is the process this run paused ({then} then, "
                                   f"{process_words(status.main_pid, status.since)} now) and it has no /ready: look "
                                   f"at it before giving its memory back by hand")
        if paused:
            return True
        restarted(window, status, f"it answers /ready 200, so it is not paused, and its manager names nothing to "
                                   f"compare with the process paused ({then})")
        return False
    if not other:
        return True
    if not status.active:
        restarted(window, status, f"it is {status.state} now; {then} when paused")
        raise StepFailed(step, f"the server this run paused is {status.state}: its process is gone, with the memory "
                               f"it held, and nothing is sent; it was not stopped by this run: start it")
    restarted(window, status, f"{process_words(status.main_pid, status.since)} now, {then} when paused")
    return False


def restarted(window: Window, status: ServiceStatus, why: str) -> None:
    """The process this run paused is not the server now: the memory it released went with it, and
    nothing of this run holds the server any more. The pause's downtime ends at the new process's
    start (its manager's, when it says), else now."""
    svc = window.state.service
    paused_at = time.strftime("%H:%M:%S", time.localtime(svc.paused_at or time.time()))
    since = status.since if status.active and status.since is not None else None
    up_at = since if since is not None and since >= (svc.paused_at or 0) else time.time()
    svc.restarted_outside, svc.restarted_outside_at = why, up_at
    svc.paused, svc.released, svc.releasing, svc.resuming = False, [], [], []
    svc.continued_at = svc.continued_at or up_at
    window.run.save()
    window.publish_downtime()
    window.journal(None, f"{service_name(window.config)} on {window.config.service.host} is not the process this run "
                         f"paused at {paused_at} ({why}): restarted outside this run, the window's memory came back "
                         f"by that restart; nothing is released, resumed or continued on it", level="warning")


def pause_again(window: Window) -> None:
    """Restarted before the extraction began: the window is over (kept in `windows`, the restart named)
    and the next begins with a new pause of the process running now, asked as the first was."""
    svc = window.state.service
    window.state.windows.append({"service": dataclasses.asdict(svc), "extraction": {}, "steps": {},
                                 "forecast": window.state.forecast, "restarted_outside": svc.restarted_outside})
    window.state.service = ServiceState()
    window.run.save()
    window.publish_downtime()


async def paused_now(window: Window) -> bool | None:
    """Whether the server is paused, by SGLang's /ready (503 while paused, 200 serving); None when it
    cannot tell (a release without /ready answers 404)."""
    status = await (await window.hosts.server()).ready()
    return True if status == 503 else False if status == 200 else None
