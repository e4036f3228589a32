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

The weights are checked, not guessed (issue 40): before a release of the `weights`, SGLang's
`/weights_checker` checksum of the target's weights is taken (and kept in the run's state), and
after the resume it must be the same: a mismatch fails the window naming both checksums; equal, the
window is verified. Only where the server has no such checksum (SGLang before 0.5.23), and for a
release that leaves the weights resident, a greedy `/generate` sent before the pause must answer
the same tokens after the continue; it is not batch-invariant under load, so a mismatch is asked
once more, alone, before it fails anything. The journal says which check was used.

The give-back begins the moment the extractor says `gpu_released`, as the stop route's restart does
(`begin_give_back`): resume, the memory seen back, continue; the extractor's flush to disk and the
sha256 check of its files run while the server takes requests again. The resume and continue steps
then find that done (the continue step still checks /health and the greedy tokens).

Every failure, refusal, cancel and crash after the pause ends in resume + continue (`give_back`,
called by the engine's compensation as the stop route's restart is): one continue per pause, one
resume per release. Facts on SGLang's routes: docs/sglang.md.

A release or resume whose answer was lost (the link dropped, the console died) is never resent on a
guess (issue 40): it is settled only from a telemetry sample taken after the reconnect and the
request's worst case (`settle_after_s`: 3 x the H200 figures), weighed against /server_info's
`memory_usage` (what the tags hold; SGLang fixes it at start-up, so it never says whether they are
released); where that evidence is missing or disagrees the operator is asked, shown what is known,
and a refusal (or `--yes`, which never answers it) leaves the server paused, the run exiting 3.

Nothing is released, resumed or continued on another process than the one paused (`same_server`):
a restarted SGLang has released nothing, and its scheduler dies on a resume of a tag it never
released. The process is its manager's pid and start time, asked just before the pause is sent and
again before each of those requests; a restart found is named with both, and the window's memory
came back by it. The route needs an SGLang whose pause holds requests (0.5.6 and later).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import weakref
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation, Forecast, ForecastPhase, ServiceStatus, TelemetrySample
from console.procedure import forecast as fc
from console.procedure.fit import SPLIT_FILL, need_mib
from console.procedure.outcomes import Found, Refused, Skip, StepFailed
from console.procedure.state import Owner, ServiceState
from console.procedure.steps.extraction import extraction_complete
from console.service.memory_saver import CUDA_GRAPH, KV_CACHE, WEIGHTS, MemorySaver
from console.service.sglang_api import WEIGHTS_CHECKER, NoWeightsChecksum, ServerAnswerError
from console.session import service_name
from console.views.units import duration, size

if TYPE_CHECKING:
    from console.procedure.window import Window

PROBE_IDS = [1, 2, 3, 4, 5, 6, 7, 8]  # any valid ids: the same greedy request before the pause and after
PROBE_TOKENS = 8
# The greedy probe waits behind the requests ahead of it (after the continue: every request that was
# held), so it gets a deadline of its own, longer than a control request's: it is a check, never
# downtime (before the pause the server serves; after the continue it serves again).
PROBE_WAIT_S = 60.0
PROBE_SETTLE_S = 1.0  # before the probe is asked once more, alone, after a mismatch
MEMORY_BACK_S = 60.0  # the resumed memory is seen on the GPUs within this (the KV cache takes < 1 s)
MEMORY_BACK_SHARE = 0.8  # of what the release freed, seen used again after the resume
# Of what the server reports the released tags hold per GPU, seen leaving before free-vram is done: a
# release may answer before the driver has the memory back (slime PR #579, torch_memory_saver).
RELEASE_SEEN_SHARE = 0.5
# Issue 26's measurements on an H200 (torch_memory_saver 0.0.10): the basis until this host has its own.
MEASURED_H200 = {"release": {KV_CACHE: 0.06, CUDA_GRAPH: 0.06, WEIGHTS: 20.0},
                 "resume": {KV_CACHE: 0.17, CUDA_GRAPH: 0.17, WEIGHTS: 7.0}}
MEASURED_H200_WEIGHTS_BYTES = 48 * 2**30  # the weights those figures released and resumed
CONTROL_S = 0.1  # a pause or continue request's round trip (an estimate)
# A release or resume whose answer was lost is settled only from evidence taken after the request's
# worst case: MEASURED_H200 (the weights scaled to this model's size) times this margin, at least
# SETTLE_FLOOR_S, counted from the moment the console is back in touch with the server (the request
# was sent before that, so the worst case has passed then whatever the moment it was sent).
SETTLE_MARGIN = 3.0
SETTLE_FLOOR_S = 2.0
SETTLE_SAMPLE_S = 10.0  # beyond that moment, the wait for one telemetry sample with GPU readings
SETTLE_LANDED_MIB = 1024  # without /server_info's figures: moved by at least this on every GPU
# The windows (one per console) whose operator refused to settle a lost request: fresh evidence is
# still gathered again (the compensation's give-back), but the same console never asks twice.
_settle_refused: weakref.WeakSet[Any] = weakref.WeakSet()
SAVER_HINT = ("add --enable-memory-saver (and --enable-weights-cpu-backup) to the server's start command: one "
              "restart, at a time you choose, and later windows need no restart at all")


def _url(window: Window, path: str) -> str:
    return window.config.service.url.rstrip("/") + path


def request_argv(window: Window, path: str, body: dict[str, Any]) -> tuple[str, ...]:
    """The literal request, as the Decider shows it: POST http://…/release_memory_occupation {"tags": [...]}."""
    return ("POST", _url(window, path), json.dumps(body))


def _gpus(window: Window, sample: TelemetrySample) -> list[int]:
    return list(window.config.service.gpus) or [g.index for g in sample.gpus]


def _used(window: Window, sample: TelemetrySample | None) -> dict[str, int]:
    """Used MiB per service GPU in `sample` (keys as strings: the state is JSON)."""
    if sample is None:
        return {}
    gpus = _gpus(window, sample)
    return {str(g.index): int(g.mem_used_mib) for g in sample.gpus if g.index in gpus and g.mem_used_mib is not None}


def _latest(window: Window) -> TelemetrySample | None:
    return window.hosts.telemetry(window.config.service.host).telemetry.latest


def extraction_need_mib(window: Window) -> int | None:
    """What the extraction needs on the service's GPUs (fit.py's estimate), None when unknown."""
    from console.procedure.fit import longest_tokens

    model = window.facts.probes.get(window.config.target.host, {}).get("model", {})
    if not model.get("tensor_bytes"):
        return None
    tokens = window.state.facts.get("prompt_tokens")
    longest = max(tokens) if tokens else longest_tokens(window.prompt_records())
    return need_mib(int(model["tensor_bytes"]), int(longest), int(model.get("hidden_size") or 0),
                    len(window.facts.layers), int(model.get("vocab_size") or 0))


def release_plan(saver: MemorySaver, free_mib: int | None, gpus: int, need: int | None) -> tuple[list[str] | None, str]:
    """The tags to release and why; (None, why) when the route is not possible on this server.

    The KV cache and CUDA graphs when the extraction fits beside the resident weights; the weights
    too only when it must, and only with a CPU backup of them (else they would be lost). An SGLang
    whose pause aborts the requests (0.5.5 and earlier) has no pause route at all."""
    aborts = saver.why_no_pause()
    if aborts is not None:
        return None, aborts
    if not saver.enabled:
        return None, f"the server runs without the memory saver: {SAVER_HINT}"
    light = [KV_CACHE, CUDA_GRAPH]
    if saver.memory_gib is None or free_mib is None or need is None:
        return light, ("the KV cache and CUDA graphs (the server reports no memory usage: free-vram waits for the "
                       "room the extraction needs)")
    per_tag = {tag: int(saver.memory_gib.get(tag, 0.0) * 1024) * gpus for tag in (KV_CACHE, CUDA_GRAPH, WEIGHTS)}
    usable = SPLIT_FILL if gpus > 1 else 1.0
    beside = int((free_mib + per_tag[KV_CACHE] + per_tag[CUDA_GRAPH]) * usable)
    if beside >= need:
        return light, (f"the KV cache and CUDA graphs ({per_tag[KV_CACHE] + per_tag[CUDA_GRAPH]} MiB): the "
                       f"extraction (~{need} MiB) fits beside the resident weights ({beside} MiB then free)")
    with_weights = int((free_mib + sum(per_tag.values())) * usable)
    if with_weights < need:
        return None, (f"the extraction needs ~{need} MiB; even releasing the weights too frees only {with_weights} MiB "
                      f"on the service's GPUs")
    if not saver.weights_cpu_backup:
        return None, (f"the extraction needs ~{need} MiB, the KV cache and CUDA graphs free {beside} MiB: the weights "
                      f"would go too, and the server keeps no CPU backup of them (--enable-weights-cpu-backup)")
    return [*light, WEIGHTS], (f"the KV cache, CUDA graphs and weights ({sum(per_tag.values())} MiB; the weights to "
                               f"their CPU backup): the extraction (~{need} MiB) does not fit beside them")


async def plan_release(window: Window) -> tuple[list[str] | None, str]:
    """The release the plan proposes (kept in the run's facts: a resumed run keeps its plan)."""
    kept = window.state.facts.get("plan_release")
    if kept is not None:
        return kept["tags"], kept["why"]
    server = await window.hosts.server()
    saver = await server.memory_saver()
    sample = _latest(window)
    used = _used(window, sample)
    free = None
    if sample is not None and used:
        totals = {str(g.index): g.mem_total_mib for g in sample.gpus if g.mem_total_mib is not None}
        free = sum(totals[g] - used[g] for g in used if g in totals)
    tags, why = release_plan(saver, free, max(1, len(used)), extraction_need_mib(window))
    window.state.facts["plan_release"] = {"tags": tags, "why": why, "weights_cpu_backup": saver.weights_cpu_backup}
    window.run.save()
    return tags, why


async def pause_forecast(window: Window, tags: list[str], inputs: fc.ForecastInputs | None = None) -> Forecast:
    """The pause route's downtime (pause → continue) by phase, each with its basis. The release, the
    free-VRAM wait and the resume come from earlier pause runs that released the same tags (a
    weights release is never projected from KV-only windows: 20 s out against 0.06 s on the H200),
    else from issue 26's measurements on an H200, the weights' share scaled to this model's size
    (said so); the pause and the continue from every earlier pause run; the extraction as the
    window's forecast has it. Over budget above `[window] max_downtime_s`."""
    from console.procedure.steps import estimates

    pause_runs = [r.state.to_json() for r in window.earlier_runs() if r.state.route == "pause"]
    same = [s for s in pause_runs if sorted(s.get("service", {}).get("released_tags") or []) == sorted(tags)]
    inputs = inputs or await window.forecast_inputs()
    whole = fc.forecast(inputs)
    model_bytes = inputs.model_bytes if WEIGHTS in tags else None

    def phase(step: str, fallback: tuple[float, str], runs: list[dict[str, Any]], which: str) -> ForecastPhase:
        earlier = estimates(runs)
        if step in earlier:
            return ForecastPhase(step, earlier[step], f"median of {len(runs)} earlier pause runs{which}")
        return ForecastPhase(step, fallback[0], fallback[1], estimated=True)

    def h200(kind: str) -> tuple[float, str]:
        said, seconds = [], 0.0
        for tag in tags:
            measured = MEASURED_H200[kind][tag]
            if tag == WEIGHTS and model_bytes:  # the weights' time grows with their size
                measured *= model_bytes / MEASURED_H200_WEIGHTS_BYTES
                said.append(f"{tag} {MEASURED_H200[kind][tag]:g} s for {size(MEASURED_H200_WEIGHTS_BYTES)}, "
                            f"{measured:.2f} s for this model's {size(model_bytes)}")
            else:
                said.append(f"{tag} {measured:g} s")
            seconds += measured
        return seconds, "measured on an H200 (issue 26, torch_memory_saver 0.0.10): " + ", ".join(said)

    which = f" that released {', '.join(tags)}"
    extract = fc.phase(whole, "extract")
    phases = (phase("pause", (CONTROL_S, "estimate: one control request"), pause_runs, ""),
              phase("release", h200("release"), same, which),
              phase("free-vram", (1.0, "estimate: one telemetry sample sees the memory free"), same, which),
              ForecastPhase("extract", extract.seconds, extract.basis, extract.spread_s, extract.estimated),
              phase("resume", h200("resume"), same, which),
              phase("continue", (CONTROL_S, "estimate: one control request"), pause_runs, ""))
    total = sum(p.seconds for p in phases if p.seconds is not None)  # a floor while the extraction is unknown
    budget = window.config.window.max_downtime_s
    return Forecast(window.run.run_id, total, phases, budget, budget is not None and total > budget)


# --- pause ----------------------------------------------------------------------------------------


async def _paused_now(window: Window) -> bool | None:
    """Whether the server is paused, by SGLang's /ready (503 while paused, 200 serving); None when it
    cannot tell (a release without /ready answers 404)."""
    status = await (await window.hosts.server()).ready()
    return True if status == 503 else False if status == 200 else None


# --- the process paused: proven before anything more is sent to it ---------------------------------


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
    Another process: the window's memory came back by its restart (`_restarted`, both named), False.
    None running: the same, then StepFailed (nothing of the run holds it; it needs a start)."""
    svc = window.state.service
    status = await (await window.hosts.service_manager(window.connect_s)).status()
    other = other_process(svc, status)
    then = process_words(svc.main_pid_before_stop, svc.active_since_before_stop)
    if other is None:
        paused = await _paused_now(window)
        if paused is None:
            raise StepFailed(step, f"cannot tell whether the server is the process this run paused ({then} then, "
                                   f"{process_words(status.main_pid, status.since)} now) and it has no /ready: look "
                                   f"at it before giving its memory back by hand")
        if paused:
            return True
        _restarted(window, status, f"it answers /ready 200, so it is not paused, and its manager names nothing to "
                                   f"compare with the process paused ({then})")
        return False
    if not other:
        return True
    if not status.active:
        _restarted(window, status, f"it is {status.state} now; {then} when paused")
        raise StepFailed(step, f"the server this run paused is {status.state}: its process is gone, with the memory "
                               f"it held, and nothing is sent; it was not stopped by this run: start it")
    _restarted(window, status, f"{process_words(status.main_pid, status.since)} now, {then} when paused")
    return False


def _restarted(window: Window, status: ServiceStatus, why: str) -> None:
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


def _pause_again(window: Window) -> None:
    """Restarted before the extraction began: the window is over (kept in `windows`, the restart named)
    and the next begins with a new pause of the process running now, asked as the first was."""
    svc = window.state.service
    window.state.windows.append({"service": dataclasses.asdict(svc), "extraction": {}, "steps": {},
                                 "forecast": window.state.forecast, "restarted_outside": svc.restarted_outside})
    window.state.service = ServiceState()
    window.run.save()
    window.publish_downtime()


async def check_pause(window: Window) -> Skip | None:
    svc = window.state.service
    if svc.pauses == 0:
        return None
    since = time.strftime("%H:%M:%S", time.localtime(svc.paused_at or time.time()))
    if svc.held and not await same_server(window, "pause"):
        extraction = window.state.extraction
        if extraction.begun_at is None and not extraction.complete:  # the window needs the memory again
            _pause_again(window)
            return None
        return Found(f"paused by this run at {since}; {restart_words(svc.restarted_outside)}")
    if svc.paused and not svc.pause_confirmed:  # sent, its answer never seen: asked of the server
        now = await _paused_now(window)
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
        await _settle_releasing(window)
    if svc.released_tags:
        return Found(f"released {', '.join(svc.released_tags)} at "
                     f"{time.strftime('%H:%M:%S', time.localtime(svc.released_at or time.time()))}")
    return None


async def _settle_releasing(window: Window, step: str = "release") -> None:
    """A release whose answer was never seen (the link dropped, the console died): whether the memory
    left is settled from evidence, never guessed (a tag resumed that was not released, or released
    twice, ends SGLang's scheduler; a continue over released memory fails the requests it lets run).
    The evidence is `_settle_evidence`'s: a telemetry sample taken after the reconnect and after the
    request's worst case, weighed against what /server_info says the tags hold. Decisive, it is
    settled; else the operator is asked (`_ask_settle`)."""
    svc = window.state.service
    tags = list(svc.releasing)
    evidence = await _settle_evidence(window, "release", tags)
    window.crash_point("settle-evidence")
    landed = evidence.verdict
    if landed is None:
        landed = await _ask_settle(window, step, "release", tags, evidence)
    how = "seen" if evidence.verdict is not None else "the operator's word"
    if landed:
        svc.released, svc.released_tags = list(tags), list(tags)
        svc.released_at = svc.released_at or time.time()
        if evidence.now:
            svc.used_after_release_mib = evidence.now
        window.journal("release", f"the release of {', '.join(tags)} had landed ({how}: {evidence.words()})",
                       level="warning", host=window.config.service.host)
    else:
        window.journal("release", f"the release of {', '.join(tags)} had not landed ({how}: {evidence.words()})",
                       level="warning", host=window.config.service.host)
    svc.releasing = []
    window.run.save()
    window.crash_point("settled")


@dataclasses.dataclass
class SettleEvidence:
    """What is known of a release or resume whose answer was lost: the GPUs' used MiB before the
    release, after it (when measured), and now (a sample taken after `after_s` past the reconnect,
    or nothing: `stale` says what the latest sample was), and what /server_info says the tags hold
    per GPU (SGLang's `memory_usage`, fixed at start-up: it says how much a release moves, never
    whether one happened). `verdict`: True landed, False not landed, None not decisive."""

    kind: str
    tags: list[str]
    before: dict[str, int]
    after: dict[str, int]
    now: dict[str, int]
    after_s: float
    basis: str
    sampled_at: float | None = None
    stale: str | None = None
    server_mib: int | None = None
    server_said: str = ""
    verdict: bool | None = None
    why: str = ""

    def words(self) -> str:
        used = f"GPU memory used before the release {_mib_words(self.before)}"
        if self.after and self.kind == "resume":
            used += f", after it {_mib_words(self.after)}"
        if self.now:
            at = time.strftime("%H:%M:%S", time.localtime(self.sampled_at or time.time()))
            used += (f", now {_mib_words(self.now)} (sampled at {at}, over {self.after_s:.1f} s after the reconnect: "
                     f"{self.basis})")
        else:
            used += f"; no GPU sample taken {self.after_s:.1f} s after the reconnect ({self.basis}): {self.stale}"
        return f"{used}; {self.server_said}; {self.why}"


def _mib_words(used: dict[str, int]) -> str:
    return ", ".join(f"GPU{g} {mib} MiB" for g, mib in sorted(used.items())) if used else "unknown"


def settle_after_s(window: Window, kind: str, tags: list[str]) -> tuple[float, str]:
    """How long after the reconnect a lost release or resume of `tags` has surely ended, and the
    basis: issue 26's H200 figures (MEASURED_H200, the weights scaled to this model's size) times
    SETTLE_MARGIN, at least SETTLE_FLOOR_S."""
    model = window.facts.probes.get(window.config.target.host, {}).get("model", {})
    scale = max(1.0, int(model.get("tensor_bytes") or 0) / MEASURED_H200_WEIGHTS_BYTES)
    measured = sum(MEASURED_H200[kind][t] * (scale if t == WEIGHTS else 1.0) for t in tags)
    seconds = max(SETTLE_FLOOR_S, SETTLE_MARGIN * measured)
    return seconds, (f"its worst case: {SETTLE_MARGIN:g} x the {measured:.2f} s measured on an H200 (issue 26), "
                     f"at least {SETTLE_FLOOR_S:g} s")


async def _settle_evidence(window: Window, kind: str, tags: list[str]) -> SettleEvidence:
    """The evidence on a lost `kind` ("release" or "resume") of `tags`: one telemetry sample with GPU
    readings taken after the reconnect plus the request's worst case (the reconnect is now: the
    console talks to the host again; the request was sent before it, so its worst case has passed
    by then whenever it was sent), waited for on the telemetry stream: never an older sample (one
    taken before the link dropped, or while a weights release still ran, says nothing); and
    /server_info's per-tag figures, where it answers them. The verdict compares what moved on every service GPU
    with what the tags hold (with the measured release itself for a resume, else SETTLE_LANDED_MIB)."""
    svc = window.state.service
    wait_s, basis = settle_after_s(window, kind, tags)
    stream = window.hosts.telemetry(window.config.service.host)
    moment = time.monotonic() + wait_s
    evidence = SettleEvidence(kind, tags, dict(svc.used_before_release_mib), dict(svc.used_after_release_mib), {},
                              wait_s, basis)
    try:
        sample = await stream.wait_for(lambda s: bool(_used(window, s)), wait_s + SETTLE_SAMPLE_S, after=moment)
    except TimeoutError:
        latest = stream.telemetry.latest
        if latest is None:
            evidence.stale = "the host's agent sent no sample"
        elif not _used(window, latest):
            evidence.stale = "the host's agent reports no GPU memory readings"
        else:
            evidence.stale = (f"the latest, at {time.strftime('%H:%M:%S', time.localtime(latest.t))}, was taken "
                              f"before that: it says nothing of the request")
    else:
        evidence.now, evidence.sampled_at = _used(window, sample), sample.t
    try:
        saver = await (await window.hosts.server()).memory_saver()
        gib = saver.memory_gib
    except Exception as exc:  # its answer is evidence where it has one; nothing is sent on its account
        gib, evidence.server_said = None, f"/server_info did not answer ({str(exc) or type(exc).__name__})"
    if gib is not None:
        evidence.server_mib = int(sum(gib.get(t, 0.0) for t in tags) * 1024)
        evidence.server_said = (f"/server_info says {', '.join(tags)} hold {evidence.server_mib} MiB per GPU "
                                f"(its start-up figures: they say how much moves, not whether it did)")
    elif not evidence.server_said:
        evidence.server_said = "/server_info reports no memory usage"
    evidence.verdict, evidence.why = _verdict(evidence)
    return evidence


def _verdict(e: SettleEvidence) -> tuple[bool | None, str]:
    """Landed, not landed, or None (asked), from what moved on every service GPU."""
    if not e.now:
        return None, "no fresh GPU reading: whether it landed cannot be seen"
    if e.kind == "release":
        if not e.before:
            return None, "no GPU reading from before the release to compare with"
        moved = {g: e.before.get(g, used) - used for g, used in e.now.items()}
    else:
        after = e.after or ({g: b - e.server_mib for g, b in e.before.items()} if e.server_mib else {})
        if not after:
            return None, "no GPU reading from after the release to compare with"
        moved = {g: used - after.get(g, used) for g, used in e.now.items()}
    expected = e.server_mib
    if expected is None and e.kind == "resume" and e.before and e.after:
        expected = max(e.before[g] - e.after.get(g, e.before[g]) for g in e.before)  # what the release freed
    if expected:
        if all(m >= MEMORY_BACK_SHARE * expected for m in moved.values()):
            return True, f"{_mib_words(moved)} moved, as the tags hold"
        if all(m <= (1 - MEMORY_BACK_SHARE) * expected for m in moved.values()):
            return False, f"{_mib_words(moved)} moved: nothing like the {expected} MiB the tags hold"
        return None, (f"{_mib_words(moved)} moved, which disagrees with the {expected} MiB per GPU the tags hold: "
                      f"neither landed nor not landed can be read from it")
    if all(m >= SETTLE_LANDED_MIB for m in moved.values()):
        return True, f"{_mib_words(moved)} moved"
    if all(m < SETTLE_LANDED_MIB for m in moved.values()):
        return False, f"{_mib_words(moved)} moved: the GPUs hold what they held"
    return None, f"{_mib_words(moved)} moved: the GPUs disagree"


async def _ask_settle(window: Window, step: str, kind: str, tags: list[str], evidence: SettleEvidence) -> bool:
    """The operator settles a lost `kind` the evidence does not: shown what is known, asked first
    whether it landed, then whether it did not; each answer leads to the one request (or none) that
    is right for it, never a resend on a guess. Both refused: Refused, the server left paused (the
    run exits 3, THE SERVER IS STILL PAUSED); not asked again by the same console (the next one, `run
    --resume`, gathers its own evidence and asks). `--yes` settles nothing on its own: StepFailed, paused."""
    svc = window.state.service
    known = evidence.words()
    body = {"tags": tags}
    if window.decider.name == "--yes":
        raise StepFailed(step, f"the {kind} of {', '.join(tags)} was sent but its answer never came, and the evidence "
                               f"does not settle it ({known}); --yes never settles it on a guess: the server stays "
                               f"paused for an operator (run --resume, and answer whether it landed)")
    if window in _settle_refused:
        raise Refused(step, f"settle the lost {kind} of {', '.join(tags)} (refused earlier by this console's "
                            f"operator; {known})")
    resume = request_argv(window, "/resume_memory_occupation", body)
    cont = request_argv(window, "/continue_generation", {})
    if kind == "release":
        # Asked by the release step (the window goes on) or by the give-back (the resume and continue follow).
        going_on = step == "release"
        yes = Confirmation(step, f"settle the lost release: {', '.join(tags)} WERE released ("
                           + ("the window goes on: the extraction, then their resume)" if going_on
                              else "the resume follows)"), window.config.service.host, resume,
                           f"{known}. Yes: they are recorded released and resumed once"
                           + (" after the extraction" if going_on else ", then the requests run again")
                           + ". A resume of memory not released ends SGLang's scheduler", True,
                           leaves="asked next whether they were NOT released")
        no = Confirmation(step, f"settle the lost release: {', '.join(tags)} were NOT released ("
                          + ("the release is asked again)" if going_on else "no resume: the continue follows)"),
                          window.config.service.host,
                          request_argv(window, "/release_memory_occupation", body) if going_on else cont,
                          f"{known}. Yes: nothing is resumed. "
                          + ("A second release of released memory ends SGLang's scheduler" if going_on
                             else "A continue over released memory fails the requests it lets run"), True,
                          leaves="the server stays PAUSED for a human to look at it")
    else:
        yes = Confirmation(step, f"settle the lost resume: {', '.join(tags)} ARE back (no second resume)",
                           window.config.service.host, cont,
                           f"{known}. Yes: nothing is resumed again; the requests run again. A continue over "
                           f"released memory fails the requests it lets run", True,
                           leaves="asked next whether they are NOT back")
        no = Confirmation(step, f"settle the lost resume: {', '.join(tags)} are NOT back (resumed again)",
                          window.config.service.host, resume,
                          f"{known}. Yes: the resume is sent again. A second resume of memory already back ends "
                          f"SGLang's scheduler", True, leaves="the server stays PAUSED for a human to look at it")
    if await window.ask(yes):
        return True
    if await window.ask(no):
        return False
    svc.give_back_error = f"the lost {kind} of {', '.join(tags)} left unsettled by the operator"
    window.run.save()
    _settle_refused.add(window)
    raise Refused(step, f"settle the lost {kind} of {', '.join(tags)}")


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
    svc.used_before_release_mib = _used(window, _latest(window))
    window.state.facts["release_expected_mib"] = _expected_mib(saver, tags)
    svc.releasing = list(tags)
    svc.releases += 1
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
    now = _used(window, sample)
    want = int(RELEASE_SEEN_SHARE * expected)
    return bool(now) and all(before[g] - now.get(g, before[g]) >= want for g in before)


def _drafter_warning(window: Window, tags: list[str]) -> str:
    """A `weights` release on a speculating server: SGLang 0.5.23 brings the drafter back wrong (PR #31674)."""
    if WEIGHTS not in tags or not (window.state.facts.get("drafter") or {}).get("speculative"):
        return ""
    before = window.state.facts["drafter"]["before"]
    return (f"; the server decodes speculatively: its DRAFTER MAY COME BACK WRONG after a weights release (SGLang "
            f"PR #31674: outputs stay correct, acceptance falls to ~1); the drafter check after the continue "
            f"measures it against {before:.2f} now and tells")


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
        gpus = _gpus(window, sample)
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
                f"({window.state.service.used_before_release_mib} MiB used before it, {_used(window, latest)} now)")
            raise StepFailed("free-vram", f"the service's GPUs have {room(latest) if latest else '?'} MiB free after "
                                          f"{service.vram_wait_s:g} s, the extraction needs ~{need} MiB{not_gone}; "
                                          f"the server's memory is given back now") from None
        sample = latest  # the room is there, though the release's memory was not seen leaving (a restart?)
        window.journal("free-vram", f"the release was answered but its memory was not seen leaving the GPUs within "
                                    f"{service.vram_wait_s:g} s ({window.state.service.used_before_release_mib} MiB "
                                    f"used before it, {_used(window, latest)} now); the extraction's ~{need} MiB fit "
                                    f"beside it", level="warning")
    svc = window.state.service
    svc.used_after_release_mib = _used(window, sample)
    svc.vram_free_at = time.time()
    window.run.save()
    return (f"{room(sample)} MiB free on the service's GPUs after {time.monotonic() - started:.1f} s"
            + (f" (the extraction needs ~{need} MiB)" if need else ""))


# --- resume and continue ----------------------------------------------------------------------------


def _memory_back(window: Window, sample: TelemetrySample | None) -> bool | None:
    """Whether the released memory is seen used again on the GPUs; None when nothing tells."""
    svc = window.state.service
    before, after = svc.used_before_release_mib, svc.used_after_release_mib
    now = _used(window, sample)
    freed = {g: before[g] - after.get(g, before[g]) for g in before}
    if not before or not after or not now or sum(freed.values()) <= 0:
        return None
    return all(now.get(g, 0) >= after.get(g, 0) + int(MEMORY_BACK_SHARE * max(0, f)) for g, f in freed.items())


async def _settle_resuming(window: Window, step: str = "resume") -> None:
    """A resume whose answer was never seen: whether it landed is settled from evidence taken after
    the reconnect and the resume's worst case (`_settle_evidence`), else by the operator
    (`_ask_settle`): a tag resumed twice ends SGLang's scheduler (KeyError in `offload_tags.remove`),
    a continue over released memory fails the requests it lets run."""
    svc = window.state.service
    tags = list(svc.resuming)
    evidence = await _settle_evidence(window, "resume", tags)
    window.crash_point("settle-evidence")
    landed = evidence.verdict
    if landed is None:
        landed = await _ask_settle(window, step, "resume", tags, evidence)
    how = "seen" if evidence.verdict is not None else "the operator's word"
    if landed:
        svc.released = []
        svc.resumed_at = svc.resumed_at or time.time()
        window.journal("resume", f"the resume of {', '.join(tags)} had landed ({how}: {evidence.words()})",
                       level="warning", host=window.config.service.host)
    else:
        window.journal("resume", f"the resume of {', '.join(tags)} had not landed ({how}: {evidence.words()}): "
                                 f"sent again", level="warning", host=window.config.service.host)
    svc.resuming = []
    window.run.save()
    window.crash_point("settled")


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


async def _settle(window: Window, step: str) -> None:
    """A release or resume whose answer was never seen, settled from evidence taken after the
    reconnect and the request's worst case, else by the operator (`_settle_releasing`,
    `_settle_resuming`): only on the process paused (a restarted one's GPUs say nothing of this run's
    requests)."""
    svc = window.state.service
    if (svc.releasing or svc.resuming) and not await same_server(window, step):
        return
    if svc.releasing:
        await _settle_releasing(window, step)
    if svc.resuming:
        await _settle_resuming(window, step)


async def check_resume(window: Window) -> Skip | None:
    await join_give_back(window, "resume")
    svc = window.state.service
    await _settle(window, "resume")
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
    if _memory_back(window, latest) is None or _memory_back(window, latest):
        return  # back, or nothing measured to compare with (the continue's checks still run)
    try:
        await stream.wait_for(lambda sample: _memory_back(window, sample) is True, MEMORY_BACK_S, eager=True)
    except TimeoutError:
        svc = window.state.service
        raise StepFailed("resume", f"the server answered the resume, but its GPUs show {_used(window, _latest(window))} "
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
        if svc.weights_check is not None and not svc.weights_verified:  # a console killed before the check
            await verify_continue(window)
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
    if svc.continues > 0 and await _paused_now(window) is False:  # sent before, its answer lost: it landed
        window.journal("continue", "the continue sent earlier had landed (/ready answers 200)", level="warning")
        return _continued(window)
    if not await window.ask(Confirmation("continue", "let the server take requests again", window.config.service.host,
                                          request_argv(window, "/continue_generation", {}),
                                          f"{reason}: the held requests run again", False)):
        raise Refused("continue", "let the server take requests again")
    if not await same_server(window, "continue"):
        return f"nothing continued: {restart_words(svc.restarted_outside)}"
    if await _paused_now(window) is False:  # not paused (continued outside the run): nothing is sent
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
        await _compare_checksums(window, server)
    elif svc.probe_tokens is not None:
        await _probe_again(window, server, svc.probe_tokens)
    if svc.weights_check is not None:
        svc.weights_verified = True
        window.run.save()


async def take_weights_reference(window: Window, server: Any, tags: list[str]) -> None:
    """Before the pause, what the resumed server must answer again, chosen once per window (kept in
    the run's state: a resumed run or a console killed meanwhile still has it). A release of the
    `weights`: SGLang's /weights_checker checksum of the target's weights (0.5.23:
    `SglangClient.weights_checksum`); a server without one (404, 405, or 0.5.6's checker, which has
    no checksum) falls back to the greedy probe, said in the journal. A release that leaves the
    weights resident (the KV cache and CUDA graphs) needs no weights check: the greedy probe, as a
    check that the server answers as before."""
    svc = window.state.service
    if svc.weights_check is None:
        if WEIGHTS in tags:
            try:
                svc.weights_checksum_before = await server.weights_checksum()
            except NoWeightsChecksum as exc:
                svc.weights_check = "probe"
                window.journal("pause", f"{exc}: the weights are checked after the resume by the greedy probe "
                                        f"instead", level="warning", host=window.config.service.host)
            else:
                svc.weights_check = "checksum"
                window.journal("pause", f"{WEIGHTS_CHECKER} checksum of the target's weights before the release: "
                                        f"{svc.weights_checksum_before}", host=window.config.service.host)
        else:
            svc.weights_check = "probe"
        window.run.save()
    if svc.weights_check == "probe" and svc.probe_tokens is None:  # the greedy answer to give again
        svc.probe_tokens = list((await server.generate(PROBE_IDS, PROBE_TOKENS, PROBE_WAIT_S))["output_ids"])
        window.run.save()


async def _compare_checksums(window: Window, server: Any) -> None:
    svc = window.state.service
    before = svc.weights_checksum_before
    try:
        after = await server.weights_checksum()
    except NoWeightsChecksum as exc:
        raise StepFailed("continue", f"the weights cannot be checked: {exc}, though the server gave their checksum "
                                     f"before the release ({before}); look at it before trusting its answers") from None
    svc.weights_checksum_after = after
    window.run.save()
    if after != before:
        window.journal("continue", f"weights checksum {after} after the resume, {before} before the release: "
                                   f"the weights did not come back whole", level="error",
                       host=window.config.service.host)
        raise StepFailed("continue", f"the server's weights did not come back whole: {WEIGHTS_CHECKER} checksum "
                                     f"{after} after the resume, {before} before the release (the target's "
                                     f"weights); its answers cannot be trusted: restart it to load them again")
    window.journal("continue", f"weights checked: the {WEIGHTS_CHECKER} checksum after the resume is the one "
                               f"before the release ({after})", host=window.config.service.host)


async def _probe_again(window: Window, server: Any, expected: list[int]) -> None:
    """The greedy probe after the continue. Greedy decoding is not batch-invariant under load (the
    held requests run again beside it): a near-tie can turn one token, so a mismatch is asked once
    more, alone (nothing else sent meanwhile), after `PROBE_SETTLE_S`, before it fails the window."""
    got = list((await server.generate(PROBE_IDS, PROBE_TOKENS, PROBE_WAIT_S))["output_ids"])
    if got == expected:
        window.journal("continue", f"weights checked by the greedy probe: the same {len(got)} tokens as before "
                                   f"the pause", host=window.config.service.host)
        return
    window.journal("continue", f"the greedy probe answered {got} after the continue, {expected} before the pause: "
                               f"asked once more, alone, in {PROBE_SETTLE_S:g} s (a near-tie under load can turn "
                               f"a greedy token)", level="warning", host=window.config.service.host)
    await asyncio.sleep(PROBE_SETTLE_S)
    again = list((await server.generate(PROBE_IDS, PROBE_TOKENS, PROBE_WAIT_S))["output_ids"])
    if again == expected:
        window.journal("continue", f"weights checked by the greedy probe: asked again alone, the same "
                                   f"{len(again)} tokens as before the pause", host=window.config.service.host)
        return
    raise StepFailed("continue", f"the server answers other greedy tokens than before the pause, twice ({got}, "
                                 f"then alone {again}; {expected} before): its weights may not have come back whole")


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
    if unconfirmed and await _paused_now(window) is False:  # the pause never landed: nothing to continue
        svc.paused = False
        window.run.save()
        window.journal("pause", "the pause had not landed (/ready answers 200): nothing to give back",
                       level="warning")
        return
    memory_out = svc.released or svc.resuming or svc.releasing
    if not early and memory_out and await _paused_now(window) is False:
        _found_serving(window)  # the process paused serves again: nothing is sent to it
        return
    await _settle(window, "resume")
    if svc.released:
        await run_resume(window, reason)
        await verify_resume(window)
    if svc.paused:
        await run_continue(window, reason)
        window.continued_early = early  # the continue step still checks /health and the weights
