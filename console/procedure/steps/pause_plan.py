"""The pause route's plan: what the extraction needs on the service's GPUs, which memory tags to
release for it (the KV cache and CUDA graphs when it fits beside the resident weights; the weights
too only when it must, and only with their CPU backup), and the pause's forecast by phase. Used by
console/procedure/steps/pause.py (which re-exports them) and preflight.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from console.messages import Forecast, ForecastPhase
from console.procedure import forecast as fc
from console.procedure.fit import SPLIT_FILL, need_mib
from console.procedure.steps.pause_settle import (
    MEASURED_H200,
    MEASURED_H200_WEIGHTS_BYTES,
    latest_sample,
    used_mib,
)
from console.service.memory_saver import CUDA_GRAPH, KV_CACHE, WEIGHTS, MemorySaver
from console.views.units import size

if TYPE_CHECKING:
    from console.procedure.window import Window

CONTROL_S = 0.1  # a pause or continue request's round trip (an estimate)
SAVER_HINT = ("add --enable-memory-saver (and --enable-weights-cpu-backup) to the server's start command: one "
              "restart, at a time you choose, and later windows need no restart at all")


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
    sample = latest_sample(window)
    used = used_mib(window, sample)
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
