"""extract: the target's hidden states, from the staged worker (go) or cold from disk, on the target
host or (zero-downtime) on another host with room; the restart begins at `gpu_released`, and past
the budget the operator is offered to stop the extraction and keep what is done."""

from __future__ import annotations

import asyncio
import contextlib
import shlex
import time
from functools import partial
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation, TelemetrySample
from console.procedure import forecast as fc
from console.procedure import run_jobs
from console.procedure.fit import SPLIT_FILL
from console.procedure.outcomes import Found, Skip, StepFailed
from console.procedure.steps import between_hosts, pause, stop
from console.procedure.steps.extraction import extract_args, extraction_complete
from console.service.vram import others_used
from console.ssh.jobs import JobHandle
from console.tasks import cancel_and_wait
from console.views.units import duration

if TYPE_CHECKING:
    from console.procedure.window import Window


async def check_extract(window: Window) -> Skip | None:
    await _back_before_verifying(window)
    if await extraction_complete(window):
        host_name, _ = window.extract_host()
        window.gpu_released.set()
        return Found(f"already extracted (manifest complete, sha256 verified): "
                     f"{host_name}:{await window.dir_on(host_name)}/states")
    return None


async def _back_before_verifying(window: Window) -> None:
    """A resume that finds `gpu_released` recorded brings the server back first (the restart begun,
    its start sent; on the pause route its memory given back and its requests let through), then
    verifies the states: the sha256 of every file never runs while the server is down."""
    record = window.state.jobs.get("extract")
    if record is None or "gpu_released" not in record.events_seen or window.state.extraction.complete:
        return
    if window.route == "pause" and window.server_held_by_us:
        pause.begin_give_back(window)  # as at gpu_released: the continue step then verifies what it gave back
        await pause.give_back(window, reason="the extraction had released the GPUs")  # joins it
        return
    stop.begin_restart(window)
    task = window.restart_task
    if task is None or task.done():
        return
    issued = asyncio.ensure_future(window.start_issued.wait())
    try:
        with window.answer_waits.joined(task):  # the restart's question holds the extraction's verification up
            await asyncio.wait({task, issued}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        issued.cancel()


async def verify_extract(window: Window) -> None:
    if window.state.extraction.partial:
        return  # a partial extraction is published as such (manifest.partial.json), never as complete
    window.state.extraction.complete = False  # asked of the host, not taken from the run
    if not await extraction_complete(window):
        host_name, _ = window.extract_host()
        raise StepFailed("extract", f"the extractor finished but {host_name}:{await window.dir_on(host_name)}/states "
                                    f"has no complete, sha256-verified manifest")


def _on_extract_event(window: Window, event: dict[str, Any]) -> None:
    if event.get("type") == "progress" and event.get("key") == "tokens":
        _project(window, event)
    if event.get("type") != "gpu_released":
        return
    extraction = window.state.extraction
    extraction.gpu_released_at = extraction.gpu_released_at or worker_time(event)
    extraction.window = {k: v for k, v in event.items() if k not in ("type", "seq")}
    window.run.save()
    window.gpu_released.set()
    window.crash_point("gpu-released")
    stop.begin_restart(window)
    pause.begin_give_back(window)


def worker_time(event: dict[str, Any]) -> float:
    """When the worker says the event happened (its own `t`), not when the console handles it:
    events replayed after a resume arrive in a burst, long after they happened."""
    t = event.get("t")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else time.time()


def _project(window: Window, event: dict[str, Any]) -> None:
    """The window's end re-projected from the extraction's rate, on the worker's clock (the event's
    own `t`); past the budget, the operator is offered to stop the extraction now (keeping every
    prompt extracted) and bring the server back."""
    began = window.began()
    if window.forecast_made is None or began is None:
        return
    made, inputs = window.forecast_made
    at = worker_time(event)
    window.progress.add(at, event.get("done") or 0, event.get("total"))
    projection = fc.project(made, inputs, began, at, window.progress)
    window.bus.publish(projection)
    if fc.passes_budget(projection) and not window.budget_asked and window.progress.left:
        window.budget_asked = True
        window.budget_task = asyncio.create_task(_offer_budget_stop(window, projection), name="budget-stop")


async def _offer_budget_stop(window: Window, projection: Any) -> None:
    await asyncio.sleep(0)  # the rest of a burst of replayed events first: the offer rests on the newest
    latest = _latest_projection(window)
    if latest is not None:
        if not fc.passes_budget(latest) or not window.progress.left:
            window.budget_asked = False  # a stale sample said so; the newest does not
            return
        projection = latest
    target = window.config.target.host
    wdir = await window.dir_on(target)
    stop_file = f"{wdir}/stop"
    argv = ["sh", "-c", f"umask 077; : > {shlex.quote(stop_file)}"]
    late = projection.expected_ready_at - (projection.budget_ends_at or projection.expected_ready_at)
    back = "give the server its memory back" if window.route == "pause" else "restart the service"
    if not await window.ask(Confirmation(
            "extract", f"stop the extraction now and {back}", target, tuple(argv),
            f"the window would end {duration(late)} past its budget ({projection.basis}); every prompt already "
            f"extracted is kept (complete, verified files) and `run --resume` extracts the rest in the next "
            f"window", False, None), holds=False):  # the extraction goes on while it is asked
        return
    window.state.extraction.stop_asked_at = time.time()
    window.run.save()
    await window.hosts.run(target, argv)
    window.journal("extract", "the extraction stops after the prompt in hand (the budget): the rest in the next "
                            "window", host=target, level="warning")


def _latest_projection(window: Window) -> Any:
    """The projection from every progress event handled so far, as of the newest one's `t`."""
    began = window.began()
    samples = window.progress.samples
    if window.forecast_made is None or began is None or not samples:
        return None
    made, inputs = window.forecast_made
    return fc.project(made, inputs, began, samples[-1][0], window.progress)


async def run_extract(window: Window) -> str:
    if window.route == "zero-downtime":
        return await _extract_elsewhere(window)
    made = window.state.facts.get("pause_forecast") if window.route == "pause" else window.state.forecast
    if window.forecast_made is None and made:  # resumed: the stop's (or the pause's) forecast stands
        window.forecast_made = (fc.from_state(window.run.run_id, made), await window.forecast_inputs())
    target = window.config.target.host
    wdir = await window.dir_on(target)
    extraction = window.state.extraction
    record = window.state.jobs.get("extract")
    staged = window.acts("stage") and record is not None
    if record is not None and "gpu_released" in record.events_seen:
        stop.begin_restart(window)  # released before a crash: the restart need not wait for the follow
    if staged:
        state = await run_jobs.job_state(window, "extract")
        if state != "running" and extraction.begun_at is None and "staged" in record.events_seen:
            window.journal("extract", f"the staged extractor (pid {record.pid}) is gone before the go: extracting "
                                    f"from disk instead", host=target, level="warning")
            run_jobs.new_attempt(window, "extract")
            staged = False
        elif state == "running" and extraction.go_sent_at is None:
            extraction.begun_at = extraction.begun_at or time.time()
            window.run.save()
            await window.hosts.run(target, ["sh", "-c", f"umask 077; : > {shlex.quote(wdir + '/go')}"])
            extraction.go_sent_at = time.time()
            window.run.save()
            window.journal("extract", "go: the staged extractor copies the weights to the GPU", host=target)
            window.crash_point("go")
        elif state is None or (state != "running" and "staged" not in record.events_seen):
            staged = False
    if not staged:
        if window.state.jobs.get("extract") is None or window.state.jobs["extract"].handle is None:
            await window.hosts.run(target, ["rm", "-f", "--", f"{wdir}/stop"])  # a new window: no old stop

        def begun(_: JobHandle) -> None:
            extraction.begun_at = extraction.begun_at or time.time()
            window.run.save()
            window.crash_point("go")
        outcome = await run_jobs.job(window, target, "extract", "extract", extract_args(window, wdir, False), step="extract",
                                  on_event=partial(_on_extract_event, window), started=begun)
    else:
        outcome = await run_jobs.job(window, target, "extract", "extract", extract_args(window, wdir, True), step="extract",
                                  on_event=partial(_on_extract_event, window))
    result = outcome.get("result") or {}
    window_facts = result.get("window", {})
    if result.get("complete") is False:  # cut short at the budget: kept, never taken as complete
        missing = [str(x) for x in result.get("prompts_missing", [])]
        done = [str(x) for x in window.state.facts.get("prompt_ids", []) if str(x) not in missing]
        window.state.extraction.partial = {"done": done, "missing": missing}
        window.run.save()
        return (f"partial at the budget: {result.get('prompts', '?')} prompts kept, {len(missing)} missing: "
                f"the rest in the next window (run --resume)")
    return (f"{result.get('prompts', '?')} prompts, {result.get('tokens', '?')} tokens, layers "
            f"{result.get('layers')}; window {window_facts.get('window_s', '?')} s")


async def _extract_elsewhere(window: Window) -> str:
    """The zero-downtime route: extract on the host with room while the server keeps serving."""
    host_name, model_path = window.extract_host()
    chosen = window.state.facts["extract_on"]
    wdir = await window.dir_on(host_name)
    if host_name != window.config.service.host:
        service_window = await window.dir_on(window.config.service.host)
        await between_hosts.relay_file(window, window.config.service.host, f"{service_window}/completions.json", host_name,
                               f"{wdir}/completions.json", "extract")
    args = extract_args(window, wdir, False)
    args[args.index("--model") + 1] = model_path
    gpus = chosen.get("gpus") or [chosen["gpu"]]
    if len(gpus) > 1:  # a device_map split, each GPU capped at what it had free (renumbered from 0)
        caps = ",".join(f"{n}={int(chosen['free_mib'][str(g)] * SPLIT_FILL)}MiB" for n, g in enumerate(gpus))
        args += ["--device-map", "auto", "--max-memory", caps]
    env = {} if window.hosts.simulated(host_name) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
    watching: list[asyncio.Task] = []
    job_started = asyncio.Event()

    def watch(handle: JobHandle) -> None:  # from the moment our job exists, its memory is ours
        window.state.extraction.begun_at = window.state.extraction.begun_at or time.time()
        window.run.save()
        watching.append(asyncio.create_task(_gpu_taken(window, host_name, gpus, chosen["need_mib"])))
        job_started.set()

    job = asyncio.create_task(run_jobs.job(window, host_name, "extract", "extract", args, step="extract", env=env,
                                        started=watch), name="zero-downtime-extract")
    try:
        started = asyncio.create_task(job_started.wait())
        await asyncio.wait({job, started}, return_when=asyncio.FIRST_COMPLETED)
        started.cancel()
        if watching:
            await asyncio.wait({job, watching[0]}, return_when=asyncio.FIRST_COMPLETED)
        if watching and watching[0].done() and not watching[0].cancelled() and watching[0].exception() is None:
            # Taken: stopped now, whatever the job says later (a cancel can be swallowed mid-SSH call).
            with contextlib.suppress(Exception):  # the job's own failure is not the news here
                await cancel_and_wait(job)
            await run_jobs.end_own_jobs(window)  # stopped cleanly, before the other process meets an OOM
            raise StepFailed("extract", f"{watching[0].result()} during the extraction: it was stopped before "
                                        f"an OOM. The window route remains: dflash-ops run --route window")
        outcome = await job
    finally:
        for task in (job, *watching):
            task.cancel()
    result = outcome.get("result") or {}
    return (f"on {host_name} GPU{chosen['gpu']} with the server serving: {result.get('prompts', '?')} prompts, "
            f"{result.get('tokens', '?')} tokens, layers {result.get('layers')}")


async def _gpu_taken(window: Window, host: str, gpus: list[int], need_mib: int) -> str:
    """Returns (says why) once other processes leave the chosen GPUs less room than the extraction
    needs. Our own job's memory is not counted: its pid is read anew for every sample."""
    stream = window.hosts.telemetry(host)
    fill = 1.0 if len(gpus) == 1 else SPLIT_FILL

    def ours() -> list[int]:
        record = window.state.jobs.get("extract")
        return [record.pid] if record is not None and record.pid else []

    def room(sample: TelemetrySample) -> int | None:
        readings = [g for g in sample.gpus if g.index in gpus and g.mem_total_mib is not None]
        if len(readings) != len(gpus):
            return None
        used = others_used(sample, gpus, ours())
        if any(used.get(g.index) is None for g in readings):
            return None
        return sum(int((g.mem_total_mib - used[g.index]) * fill) for g in readings)

    def short(sample: TelemetrySample) -> bool:
        left = room(sample)
        return left is not None and left < need_mib

    latest = stream.telemetry.latest
    sample = latest if latest is not None and short(latest) else await stream.wait_for(short, timeout=1e9)
    names = "+".join(f"GPU{g}" for g in gpus)
    mine = ours()
    others = [f"pid {p.pid} ({p.mib} MiB)" for p in sample.processes if p.gpu in gpus and p.pid not in mine]
    return (f"{names} on {host} was taken by {', '.join(others) or 'another process'}: "
            f"{room(sample)} MiB left, ~{need_mib} MiB needed")
