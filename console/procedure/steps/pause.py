"""The pause route's own steps: the server process is never stopped.

    pause → release → free-vram → extract → resume → continue

`pause` sends `POST /pause_generation {"mode": "retract"}` (running requests go back to the queue and
wait; none fails), `release` gives back only the GPU memory the extraction needs (`kv_cache` and
`cuda_graph` when the extraction fits beside the resident weights; `weights` too only when it must,
and only when the server keeps a CPU backup of them), free-vram waits for that room (the server's
own processes are never offered for ending), the extraction runs, `resume` takes back exactly the
tags released and sees the memory back on the GPUs, and `continue` lets the held requests run, then
checks that `/health` passes and that the weights came back whole. Each change asks the Decider with
the literal request.

What to release, and the pause's forecast: `pause_plan.py`. The weights are checked, not guessed:
`pause_weights.py` (/weights_checker's checksum, else the greedy probe, asked once more alone before
it fails anything; a checksum that differs offers the restart that reloads them).

The give-back begins the moment the extractor says `gpu_released`, as the stop route's restart does
(`begin_give_back`): resume, the memory seen back, continue; the extractor's flush to disk and the
sha256 check of its files run while the server takes requests again. The resume and continue steps
then find that done (the continue step still checks /health and the greedy tokens).

Every failure, refusal, cancel and crash after the pause ends in resume + continue (`give_back`,
called by the engine's compensation as the stop route's restart is): one continue per pause, one
resume per release. Facts on SGLang's routes: docs/sglang.md.

A release or resume whose answer was lost is never resent on a guess: `pause_settle.py` settles it
from evidence taken after the request's worst case, else asks the operator.

Nothing is released, resumed or continued on another process than the one paused (`same_server`):
a restarted SGLang has released nothing, and its scheduler dies on a resume of a tag it never
released (`pause_process.py`: the manager's pid and start time, asked before each request). The
route needs an SGLang whose pause holds requests (0.5.6 and later).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING

from console.messages import Confirmation, TelemetrySample
from console.procedure import forecast as fc
from console.procedure.fit import SPLIT_FILL
from console.procedure.outcomes import Found, Refused, Skip, StepFailed
from console.procedure.state import Owner
from console.procedure.steps import drafter
from console.procedure.steps.extraction import extraction_complete
from console.procedure.steps.pause_plan import (  # noqa: F401  (re-exported: preflight.py reads them here)
    CONTROL_S,
    SAVER_HINT,
    extraction_need_mib,
    pause_forecast,
    plan_release,
    release_plan,
)
from console.procedure.steps.pause_process import (
    pause_again,
    paused_now,
    restart_words,
    same_server,
)
from console.procedure.steps.pause_settle import (
    latest_sample,
    memory_back,
    request_argv,
    service_gpus,
    settle,
    settle_releasing,
    used_mib,
)
from console.procedure.steps.pause_weights import (
    check_restart,
    compare_checksums,
    probe_again,
    take_weights_reference,
)
from console.service.memory_saver import WEIGHTS, MemorySaver
from console.service.sglang_api import ServerAnswerError
from console.session import service_name
from console.views.units import duration

if TYPE_CHECKING:
    from console.procedure.window import Window

MEMORY_BACK_S = 60.0  # the resumed memory is seen on the GPUs within this (the KV cache takes < 1 s)
# Of what the server reports the released tags hold per GPU, seen leaving before free-vram is done: a
# release may answer before the driver has the memory back (slime PR #579, torch_memory_saver).
RELEASE_SEEN_SHARE = 0.5
# --- pause ----------------------------------------------------------------------------------------


# --- the process paused: proven before anything more is sent to it ---------------------------------


async def check_pause(window: Window) -> Skip | None:
    svc = window.state.service
    if svc.pauses == 0:
        return None
    since = time.strftime("%H:%M:%S", time.localtime(svc.paused_at or time.time()))
    if svc.held and not await same_server(window, "pause"):
        extraction = window.state.extraction
        if extraction.begun_at is None and not extraction.complete:  # the window needs the memory again
            pause_again(window)
            return None
        return Found(f"paused by this run at {since}; {restart_words(svc.restarted_outside)}")
    if svc.paused and not svc.pause_confirmed:  # sent, its answer never seen: asked of the server
        now = await paused_now(window)
        if now is False:
            window.journal("pause", "the pause sent earlier had not landed (/ready answers 200): sent again",
                           level="warning")
            return None
        svc.pause_confirmed = True
        window.run.save()
    if svc.paused:
        return Found(f"paused by this run at {since}")
    if svc.restarted_outside:
        return Found(f"paused by this run at {since}; {restart_words(svc.restarted_outside)}")
    return Found(f"paused by this run at {since}; taking requests again since "
                 f"{time.strftime('%H:%M:%S', time.localtime(svc.continued_at or time.time()))}")


async def run_pause(window: Window) -> str:
    if window.state.status_of("cache") not in ("done", "skipped"):
        raise StepFailed("pause", "refused: the completions are not cached and verified")
    if window.acts("stage") and window.state.status_of("stage") not in ("done", "skipped"):
        raise StepFailed("pause", "refused: the staged extractor has not reported `staged`")
    tags, why = await plan_release(window)
    if tags is None:
        raise StepFailed("pause", f"the pause route is not possible: {why}")
    inputs = await window.forecast_inputs()
    made = await pause_forecast(window, tags, inputs)
    window.state.facts["pause_forecast"] = fc.to_state(made)
    window.run.save()
    window.forecast_made = (made, inputs)  # re-projected from the extraction's rate (steps/extract.py)
    if made.over_budget and window.state.service.pauses == 0:
        raise StepFailed("pause", f"refused before the pause, the server untouched: the forecast pause "
                                  f"{fc.summary(made)} exceeds the budget [window] max_downtime_s = {made.budget_s:g} s")
    if made.budget_s is not None and fc.unknown(made) and window.state.service.pauses == 0:
        raise StepFailed("pause", f"refused before the pause, the server untouched: the budget [window] "
                                  f"max_downtime_s = {made.budget_s:g} s cannot be checked, the forecast pause "
                                  f"{fc.summary(made)} has {', '.join(fc.unknown(made))} unknown")
    server = await window.hosts.server()
    svc = window.state.service
    await take_weights_reference(window, server, tags)
    body = {"mode": "retract"}
    impact = (f"{service_name(window.config)} on {window.config.service.host} holds its requests (running ones go "
              f"back to its queue, new ones wait; none fails) until /continue_generation; the process is never "
              f"stopped; forecast pause {fc.summary(made)}"
              + (f" (budget {made.budget_s:g} s)" if made.budget_s is not None else ""))
    if not await window.ask(Confirmation("pause", "pause the server's generation", window.config.service.host,
                                          request_argv(window, "/pause_generation", body), impact, False,
                                          made.downtime_s, "forecast")):
        raise Refused("pause", "pause the server's generation")
    manager = await window.hosts.service_manager(window.connect_s)
    status = await manager.status()  # the process paused: nothing is sent later to another one
    if not status.active:
        raise StepFailed("pause", f"{manager.name} is {status.state}: there is no server to pause")
    if status.main_pid is None and status.since is None:
        raise StepFailed("pause", f"refused before the pause, the server untouched: {manager.name} reports neither "
                                  f"a pid nor a start time, so a server restarted during the window could not be "
                                  f"told from the one paused (SGLang dies on a resume of memory it never released): "
                                  f"make its status command print the server's pid first")
    svc.main_pid_before_stop, svc.active_since_before_stop = status.main_pid, status.since
    svc.paused_at = svc.paused_at or time.time()
    svc.paused, svc.pause_confirmed = True, False
    svc.pauses += 1
    window.run.keep_going_on_write_errors = True  # from here on a full disk must not keep it paused
    window.run.save()  # before the request: a crash during it still knows the server may be paused
    window.publish_downtime()
    await server.pause_generation("retract")
    svc.pause_confirmed = True
    window.run.save()
    window.irreversible["pause"] = "paused (retract): requests held, none failed"
    window.journal("pause", "POST /pause_generation {\"mode\": \"retract\"}: paused", host=window.config.service.host)
    window.crash_point("paused")
    return window.irreversible["pause"]


# --- release --------------------------------------------------------------------------------------


async def check_release(window: Window) -> Skip | None:
    svc = window.state.service
    if svc.releasing:
        await settle_releasing(window)
    if svc.released_tags:
        return Found(f"released {', '.join(svc.released_tags)} at "
                     f"{time.strftime('%H:%M:%S', time.localtime(svc.released_at or time.time()))}")
    return None


async def run_release(window: Window) -> str:
    tags, why = await plan_release(window)
    if tags is None:
        raise StepFailed("release", f"not possible: {why}")
    server = await window.hosts.server()
    saver = await server.memory_saver()
    refused = saver.why_not(tags)
    if refused:
        raise StepFailed("release", f"{refused}; {SAVER_HINT}")
    svc = window.state.service
    body = {"tags": tags}
    impact = (f"{service_name(window.config)} on {window.config.service.host} gives back {why}; it stays paused, "
              f"its process and " + ("its weights (copied to CPU memory)" if WEIGHTS in tags else "its weights")
              + " stay; /resume_memory_occupation takes exactly these back" + _drafter_warning(window, tags))
    if not await window.ask(Confirmation("release", f"release the server's {' and '.join(tags)}",
                                          window.config.service.host,
                                          request_argv(window, "/release_memory_occupation", body), impact,
                                          WEIGHTS in tags)):
        raise Refused("release", f"release the server's {' and '.join(tags)}")
    if not await same_server(window, "release"):
        raise StepFailed("release", f"nothing was released: {restart_words(svc.restarted_outside)}; a new run "
                                    f"pauses the server that runs now")
    svc.used_before_release_mib = used_mib(window, latest_sample(window))
    window.state.facts["release_expected_mib"] = _expected_mib(saver, tags)
    svc.releasing = list(tags)
    svc.releases += 1
    svc.memory_request_sent_at = time.time()
    window.run.save()  # before the request: a crash during it knows a release may have landed
    started = time.monotonic()
    await server.release_memory_occupation(tags)
    svc.released, svc.released_tags, svc.releasing = list(tags), list(tags), []
    svc.released_at = time.time()
    window.run.save()
    took = time.monotonic() - started
    window.journal("release", f"POST /release_memory_occupation {json.dumps(body)}: released in {took:.2f} s",
                   host=window.config.service.host, duration_s=round(took, 3))
    window.crash_point("released")
    return f"released {', '.join(tags)} in {took:.2f} s"


def _expected_mib(saver: MemorySaver, tags: list[str]) -> int | None:
    """MiB per GPU the server reports `tags` hold (None: it reports no memory usage)."""
    if not saver.memory_gib:
        return None
    return int(sum(saver.memory_gib.get(t) or 0.0 for t in tags) * 1024)


def released_seen(window: Window, sample: TelemetrySample) -> bool:
    """Whether the release's memory is seen gone from every service GPU in `sample`: at least
    RELEASE_SEEN_SHARE of what the server reports the released tags hold per GPU below the use read
    before the release. True when nothing tells (no reading from before, no memory report)."""
    before = window.state.service.used_before_release_mib
    expected = window.state.facts.get("release_expected_mib")
    if not before or not expected:
        return True
    now = used_mib(window, sample)
    want = int(RELEASE_SEEN_SHARE * expected)
    return bool(now) and all(before[g] - now.get(g, before[g]) >= want for g in before)


def _drafter_warning(window: Window, tags: list[str]) -> str:
    """A `weights` release on a speculating server: SGLang 0.5.23 brings the drafter back wrong (PR #31674)."""
    if WEIGHTS not in tags or not (window.state.facts.get("drafter") or {}).get("speculative"):
        return ""
    before = window.state.facts["drafter"]["before"]
    check = (f"the drafter check after the continue measures it against {before:.2f} now and tells"
             if drafter.telling(before) else
             f"the drafter check after the continue CANNOT TELL: {before:.2f} now, and {drafter.why_blind(before)}")
    return (f"; the server decodes speculatively: its DRAFTER MAY COME BACK WRONG after a weights release (SGLang "
            f"PR #31674: outputs stay correct, acceptance falls to ~1); {check}")


# --- free-vram (the pause route's: wait for the room, end nothing) ----------------------------------


async def check_room(window: Window) -> Skip | None:
    if window.state.extraction.begun_at is not None:
        return Found("the extraction already started")

    if await extraction_complete(window):
        return Found("the extraction already finished")
    return None


async def run_room(window: Window) -> str:
    """Waits until the service's GPUs have the room the extraction needs. The server's own processes
    hold the resident weights on purpose: they are never offered for ending."""
    need = extraction_need_mib(window)
    service = window.config.service
    stream = window.hosts.telemetry(service.host)

    def room(sample: TelemetrySample) -> int | None:
        gpus = service_gpus(window, sample)
        readings = [g for g in sample.gpus if g.index in gpus and g.mem_total_mib and g.mem_used_mib is not None]
        if not readings:
            return None
        fill = SPLIT_FILL if len(readings) > 1 else 1.0
        return sum(int((g.mem_total_mib - g.mem_used_mib) * fill) for g in readings)

    def fits(sample: TelemetrySample) -> bool:
        left = room(sample)
        if left is None:
            return False
        if need is None:  # nothing to measure the room against: the release's memory must be seen gone
            return released_seen(window, sample)
        return left >= need

    started = time.monotonic()
    try:  # a sample taken after the release: what it freed is measured (the resume is verified against it).
        # The answer is not trusted: a release can answer before the driver has the memory back (slime
        # PR #579), so the wait is for the memory seen gone, not only for the room.
        sample = await stream.wait_for(lambda s: fits(s) and released_seen(window, s), service.vram_wait_s,
                                       after=started, eager=True)
    except TimeoutError:
        latest = stream.telemetry.latest
        gone = latest is not None and released_seen(window, latest)
        if latest is None or not fits(latest):
            not_gone = "" if latest is None or gone else (
                f"; the release was answered but its memory has not left them "
                f"({window.state.service.used_before_release_mib} MiB used before it, {used_mib(window, latest)} now)")
            raise StepFailed("free-vram", f"the service's GPUs have {room(latest) if latest else '?'} MiB free after "
                                          f"{service.vram_wait_s:g} s, the extraction needs ~{need} MiB{not_gone}; "
                                          f"the server's memory is given back now") from None
        sample = latest  # the room is there, though the release's memory was not seen leaving (a restart?)
        window.journal("free-vram", f"the release was answered but its memory was not seen leaving the GPUs within "
                                    f"{service.vram_wait_s:g} s ({window.state.service.used_before_release_mib} MiB "
                                    f"used before it, {used_mib(window, latest)} now); the extraction's ~{need} MiB fit "
                                    f"beside it", level="warning")
    svc = window.state.service
    svc.used_after_release_mib = used_mib(window, sample)
    svc.vram_free_at = time.time()
    window.run.save()
    return (f"{room(sample)} MiB free on the service's GPUs after {time.monotonic() - started:.1f} s"
            + (f" (the extraction needs ~{need} MiB)" if need else ""))


# --- resume and continue ----------------------------------------------------------------------------


def begin_give_back(window: Window) -> None:
    """At `gpu_released`: the server's memory goes back and its requests run again now, not after the
    extractor's files are flushed and verified (the pause route's twin of `stop.begin_restart`)."""
    if window.route == "pause" and window.server_held_by_us and window.restart_task is None:
        window.restart_task = asyncio.create_task(
            _give_back(window, reason="the extraction released the GPUs", early=True), name="give-back-at-gpu-released")


async def join_give_back(window: Window, step: str | None = None) -> None:
    """Wait for the give-back begun at `gpu_released`, if any. A failure is journalled, and whatever it
    left undone is done by the steps (each request in doubt settled first). The operator's refusal
    stands: raised by its own step (`step`; None: by whichever caller comes first)."""
    task, window.restart_task = window.restart_task, None
    if task is not None:
        try:
            with window.answer_waits.joined(task):  # its questions, still open, hold the caller up from now
                await task
        except Refused as exc:
            window.give_back_refused = exc
        except Exception as exc:
            window.journal("resume", f"giving the server back at gpu_released failed: {exc}", level="error")
    refused = window.give_back_refused
    if refused is not None and (step is None or refused.step == step):
        window.give_back_refused = None
        raise refused


async def check_resume(window: Window) -> Skip | None:
    await join_give_back(window, "resume")
    svc = window.state.service
    await settle(window, "resume")
    if svc.restarted_outside:
        return Found(f"nothing resumed: {restart_words(svc.restarted_outside)}")
    if svc.released:
        return None
    if svc.releases == 0:
        return Skip("nothing was released by this run")
    return Found(f"{', '.join(svc.released_tags)} resumed at "
                 f"{time.strftime('%H:%M:%S', time.localtime(svc.resumed_at or time.time()))}")


async def run_resume(window: Window, reason: str = "the extraction finished") -> str:
    svc = window.state.service
    tags = list(svc.released)
    server = await window.hosts.server()
    body = {"tags": tags}
    failed_before = f"; the last attempt failed: {svc.give_back_error}" if svc.give_back_error else ""
    if not await window.ask(Confirmation("resume", "give the server its memory back", window.config.service.host,
                                          request_argv(window, "/resume_memory_occupation", body),
                                          f"{reason}: {service_name(window.config)} takes back {', '.join(tags)}"
                                          f"{failed_before}", False, window.earlier.get("resume"))):
        raise Refused("resume", "give the server its memory back")
    if not await same_server(window, "resume"):
        return f"nothing resumed: {restart_words(svc.restarted_outside)}"
    svc.resumes += 1
    svc.resuming = list(tags)
    svc.memory_request_sent_at = time.time()
    window.run.save()  # before the request: a crash during it knows a resume may have landed
    started = time.monotonic()
    try:
        await server.resume_memory_occupation(tags)
    except (ServerAnswerError, ValueError) as exc:  # answered, and not a 200: it did not resume
        svc.resuming = []
        svc.give_back_error = str(exc) or type(exc).__name__
        window.run.save()
        raise
    except Exception as exc:  # no answer seen: settled from the GPUs before anything is sent again
        svc.give_back_error = str(exc) or type(exc).__name__
        window.run.save()
        raise
    svc.released, svc.resuming = [], []
    svc.resumed_at = time.time()
    svc.give_back_error = None
    window.run.save()
    took = time.monotonic() - started
    window.journal("resume", f"POST /resume_memory_occupation {json.dumps(body)}: resumed in {took:.2f} s",
                   host=window.config.service.host, duration_s=round(took, 3))
    window.crash_point("resumed")
    return f"resumed {', '.join(tags)} in {took:.2f} s"


async def verify_resume(window: Window) -> None:
    """The memory is seen back on the GPUs (telemetry), not assumed from the answer."""
    if window.state.service.restarted_outside:
        return  # it came back by the restart: nothing was resumed
    stream = window.hosts.telemetry(window.config.service.host)
    latest = stream.telemetry.latest
    if memory_back(window, latest) is None or memory_back(window, latest):
        return  # back, or nothing measured to compare with (the continue's checks still run)
    try:
        await stream.wait_for(lambda sample: memory_back(window, sample) is True, MEMORY_BACK_S, eager=True)
    except TimeoutError:
        svc = window.state.service
        raise StepFailed("resume", f"the server answered the resume, but its GPUs show {used_mib(window, latest_sample(window))} "
                                   f"MiB used after {MEMORY_BACK_S:g} s ({svc.used_before_release_mib} before the "
                                   f"release)") from None


async def check_continue(window: Window) -> Skip | None:
    await join_give_back(window, "continue")
    svc = window.state.service
    if svc.pauses == 0:
        return Skip("the server was not paused by this run")
    if svc.restarted_outside:
        return Found(f"nothing continued: {restart_words(svc.restarted_outside)}")
    if not svc.paused and not window.continued_early:  # continued by this console at gpu_released: verified below
        if await check_restart(window):  # a console killed in the weights' restart: finished now
            window.state.service.weights_verified = True
            window.run.save()
        elif svc.weights_check is not None and not svc.weights_verified:  # a console killed before the check
            await verify_continue(window)
        svc = window.state.service
        return Found(f"taking requests again since "
                     f"{time.strftime('%H:%M:%S', time.localtime(svc.continued_at or time.time()))}")
    return None


async def run_continue(window: Window, reason: str = "its memory is back") -> str:
    svc = window.state.service
    if svc.released:
        raise StepFailed("continue", f"{', '.join(svc.released)} still released: the server is resumed first")
    if window.continued_early and not svc.paused:
        window.continued_early = False
        return (f"taking requests again since {time.strftime('%H:%M:%S', time.localtime(svc.continued_at or 0))} "
                f"(continued at gpu_released)")
    server = await window.hosts.server()
    if svc.continues > 0:  # sent before, its answer lost
        if await paused_now(window) is False:  # it landed
            window.journal("continue", "the continue sent earlier had landed (/ready answers 200)", level="warning")
            return _continued(window)
        # /ready 503 is a paused server, or one a /health marked unhealthy during the pause (another
        # client's: SGLang keeps /ready 503 until a /health passes), and only a /health, which holds a
        # paused server's check 20 s and marks it unhealthy, could tell them apart. The continue is sent
        # again: on a server no longer paused SGLang's continue changes nothing. Said, never silent.
        window.journal("continue", "the continue sent earlier got no answer and /ready does not say it landed "
                                   "(503: paused, or marked unhealthy by a /health during the pause): it is sent "
                                   "again, which changes nothing on a server no longer paused", level="warning")
    if not await window.ask(Confirmation("continue", "let the server take requests again", window.config.service.host,
                                          request_argv(window, "/continue_generation", {}),
                                          f"{reason}: the held requests run again", False)):
        raise Refused("continue", "let the server take requests again")
    if not await same_server(window, "continue"):
        return f"nothing continued: {restart_words(svc.restarted_outside)}"
    if await paused_now(window) is False:  # not paused (continued outside the run): nothing is sent
        window.journal("continue", "the server answers /ready 200: it is not paused, no continue is sent",
                       level="warning")
        return _continued(window)
    svc.continues += 1
    window.run.save()
    try:
        await server.continue_generation()
    except Exception as exc:
        svc.give_back_error = str(exc) or type(exc).__name__
        window.run.save()
        raise
    return _continued(window)


def _continued(window: Window) -> str:
    svc = window.state.service
    svc.paused = False
    svc.continued_at = time.time()
    svc.given_back_by = Owner.this_process().who()  # named to a console that lost the run's claim to this one
    svc.give_back_error = None
    window.run.save()
    window.publish_downtime()
    window.hosts.poke_service()
    held = svc.continued_at - (svc.paused_at or svc.continued_at)
    window.journal("continue", f"POST /continue_generation: taking requests again after {duration(held)} paused",
                   host=window.config.service.host)
    window.crash_point("continued")
    return f"taking requests again: paused {duration(held)}"


async def verify_continue(window: Window) -> None:
    """Serving again, verified: /health passes, and the weights came back whole: with a `weights`
    release, /weights_checker's checksum after the resume equals the one before the release (a
    mismatch fails the window naming both; equal, the window is verified and no probe is sent);
    else (no such checker, or the weights stayed resident) the greedy probe answers the tokens it
    answered before the pause, asked once more alone before a mismatch fails anything."""
    server = await window.hosts.server()
    status = await server.health()
    if status != 200:
        raise StepFailed("continue", f"GET /health answers {status} after the continue")
    svc = window.state.service
    if svc.weights_check == "checksum":
        await compare_checksums(window, server)
    elif svc.probe_tokens is not None:
        await probe_again(window, server, svc.probe_tokens)
    if svc.weights_check is not None:  # (the service's record again: a restart that reloaded the weights puts it back)
        window.state.service.weights_verified = True
        window.run.save()


async def give_back(window: Window, reason: str) -> None:
    """The pause route's compensation: resume exactly what this run released, then continue, each
    once. Called after any failure, refusal or cancel after the pause, and by `run --resume` of a
    run that left the server paused. A give-back begun at `gpu_released` is waited for first. The
    process paused found serving again (/ready 200) while the run says its memory is out: nothing is
    sent (`_found_serving`). Two consoles never both give one run back: the engine's claim
    (console/procedure/claim.py) lets one in, the other names it."""
    await join_give_back(window)
    await _give_back(window, reason)


def _found_serving(window: Window) -> None:
    """The process this run paused answers /ready 200 while the run says its memory is out: it was
    given back outside this run (another console, by hand). Nothing is sent: a resume of a tag no
    longer released ends SGLang's scheduler (KeyError in `offload_tags.remove`)."""
    svc = window.state.service
    out = svc.released or svc.resuming or svc.releasing
    window.journal("resume", f"the server this run paused answers /ready 200 (it takes requests): its memory "
                             f"({', '.join(out)}) was given back outside this run; nothing is resumed or continued",
                   host=window.config.service.host, level="warning")
    svc.released, svc.resuming, svc.releasing = [], [], []
    svc.paused = False
    svc.continued_at = svc.continued_at or time.time()
    window.run.save()
    window.publish_downtime()
    window.hosts.poke_service()


async def _give_back(window: Window, reason: str, early: bool = False) -> None:
    svc = window.state.service
    # The process is proven before anything is asked (the resume and the continue prove it again once
    # their questions are answered); at gpu_released, where each moment is downtime, only then.
    if not early and svc.held and not await same_server(window, "resume"):
        return  # restarted outside the run (named): nothing of this run holds the server
    unconfirmed = svc.paused and not svc.pause_confirmed and not svc.released and not svc.releasing
    if unconfirmed and await paused_now(window) is False:  # the pause never landed: nothing to continue
        svc.paused = False
        window.run.save()
        window.journal("pause", "the pause had not landed (/ready answers 200): nothing to give back",
                       level="warning")
        return
    memory_out = svc.released or svc.resuming or svc.releasing
    if not early and memory_out and await paused_now(window) is False:
        _found_serving(window)  # the process paused serves again: nothing is sent to it
        return
    await settle(window, "resume")
    if svc.released:
        await run_resume(window, reason)
        await verify_resume(window)
    if svc.paused:
        await run_continue(window, reason)
        window.continued_early = early  # the continue step still checks /health and the weights
