"""What a run keeps when it cannot go on as planned (issue 27): a resume whose preflight failed
leaves the run as it was, and an extractor that released the GPUs is left to finish its files.

Both are the engine's (`Engine._end`, `Engine._end_own_jobs`), kept here so that the engine's loop
stays readable; they take the engine as their first argument, as the steps' functions do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from console.messages import RunFinished
from console.ssh.jobs import JobHandle

if TYPE_CHECKING:
    from console.procedure.window import Window

EXIT_FAILED, EXIT_DOWN = 1, 3  # as console/procedure/window.py says them


def left_as_it_was(window: Window, why: str) -> RunFinished:
    """A resume whose preflight failed (a host briefly unreachable, the server not ready yet, the
    host's lock held): nothing of the resume has acted, so nothing is undone. The run's state is
    restored whole (paused or running, its window and kept prompts as they were), no job is ended,
    nothing is compensated; a later resume tries again."""
    assert window.before_resume is not None
    run = window.run
    run.state = state = window.before_resume
    left = state.service.left_as()
    code = EXIT_DOWN if left else EXIT_FAILED
    message = (f"the resume's preflight failed: {why}; run {run.run_id} is left as it was ({state.status}"
               + (f", the service {left} by it" if left else "") + "): no job was ended and nothing was "
               f"changed; `dflash-ops run --resume {run.run_id}` tries again")
    state.message = message
    run.save()
    finished = RunFinished(run.run_id, "failed", code, left is None, message, str(run.dir))
    window.journal(None, message, level="error", exit=code)
    window.bus.publish(finished)
    run.close()
    return finished


def flushing(window: Window, handle: JobHandle, state: str | None, exit_code: int | None) -> bool:
    """The extractor after `gpu_released`, running (writing its files), exited 0 before the engine
    handled its exit, or on a host that cannot be asked (`state` None): left alone, and the run ends
    paused for its resume to verify the states and evaluate (`Engine._end`), never killed while it
    flushes. Said once (`window.left_flushing`)."""
    record = window.state.jobs.get("extract")
    if (record is None or record.job_id != handle.job_id or "gpu_released" not in record.events_seen
            or record.exit_code is not None):  # its exit handled: the step saw it end (and verified it)
        return False
    if window.state.step("extract").status == "done":  # its files already verified (a resume found them
        return False                                     # complete): nothing is left to flush or to verify
    if state not in (None, "running") and not (state == "exited" and exit_code == 0):
        return False
    if window.left_flushing is None:
        window.left_flushing = (f"the extractor (pid {handle.pid} on {handle.host}) had released the GPUs and "
                                 f"was writing its files: it is left to finish, and `dflash-ops run --resume "
                                 f"{window.run.run_id}` verifies them and evaluates")
        window.journal("extract", window.left_flushing, host=handle.host, level="warning")
    return True
