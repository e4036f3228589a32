"""Where the target fits without the serving GPUs: the zero-downtime route's preflight.

For every host with GPU readings, compare what is free now (telemetry, per GPU; the service's own
GPUs on its host, and a fleet's replicas' GPUs on theirs, are never counted) with what the
extraction needs (the weights, from the probe, plus an estimate of the activations of the longest
prompt + completion, stated as an estimate),
whether the host holds a copy of the target's weights (`[target] paths`, checked by the probe), and
whether it binds the same kernels as the host the drafters were trained on: a host with
causal-conv1d missing computes other states (the story's lesson), so it is never proposed.

A fleet's replicas (`replica_fits`): which of them can take the window, by the same measures.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from console.config import Config
from console.messages import HostFit, TelemetrySample

MIB = 1 << 20
CUDA_CONTEXT_MIB = 600  # the CUDA context, cuBLAS workspace and allocator slack of one process
SPLIT_FILL = 0.9  # of each GPU's free memory, when the target is split over several
CHARS_PER_TOKEN = 3  # a prompt's tokens before it is tokenised: an over-estimate for code and English


def longest_tokens(prompts: list[dict[str, Any]]) -> int:
    """An estimate of the longest prompt + completion in tokens, before anything is tokenised."""
    def chars(record: dict[str, Any]) -> int:
        if record.get("text"):
            return len(record["text"])
        return sum(len(msg.get("content", "")) for msg in record.get("messages", [])) + 64  # the chat template
    return max(chars(r) // CHARS_PER_TOKEN + int(r["max_new_tokens"]) for r in prompts)


def need_mib(weights_bytes: int, tokens: int, hidden: int, layers_saved: int, vocab: int) -> int:
    """GPU memory the extraction needs: weights, the forward's activations (bf16 hidden states of
    a few live layers plus those saved), the logits (bf16) for the top-k, and the CUDA context."""
    activations = tokens * hidden * 2 * (layers_saved + 4) + tokens * vocab * 2
    return int((weights_bytes + activations) / MIB) + CUDA_CONTEXT_MIB


def _kernels(probe: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(v) for k, v in (probe.get("kernels") or {}).get("bound", {}).items()}


def serving_gpus(config: Config, host: str, sample: TelemetrySample) -> set[int]:
    """`host`'s GPUs that serve the model: the service's, and every replica's of a fleet on that host
    (issue 41: with r1 drained, r2's GPU was offered while r2 carried every request). A service or
    replica that names no GPUs (`gpus`) uses all of its host's."""
    services = [config.service, *(r.service for r in config.fleet.replicas)] if config.fleet else [config.service]
    serving: set[int] = set()
    for service in services:
        if service.host == host:
            serving |= set(service.gpus) if service.gpus else {g.index for g in sample.gpus}
    return serving


def where_it_fits(config: Config, probes: Mapping[str, Mapping[str, Any]],
                  samples: Mapping[str, TelemetrySample | None], tokens: int, layers_saved: int) -> list[HostFit]:
    """Every host's fit, in config order. A host is proposed only when all four checks pass."""
    trained_on = sorted({d.host for d in config.drafters})
    reference_kernels = {h: _kernels(probes.get(h, {})) for h in trained_on if probes.get(h)}
    fits = []
    for host in config.hosts:
        sample = samples.get(host)
        path = config.target.path_on(host)
        if sample is None or not sample.gpus:
            fits.append(HostFit(host, False, sample.reason if sample is not None and sample.reason else "no GPU readings"))
            continue
        if path is None:
            fits.append(HostFit(host, False, f"the target's weights are not on {host} (no [target] paths.{host})"))
            continue
        model = probes.get(host, {}).get("model", {})
        if not model.get("exists") or not model.get("tensor_bytes"):
            fits.append(HostFit(host, False, f"{host}:{path} is not a readable checkpoint "
                                             f"({model.get('error') or 'missing'})", model_path=path))
            continue
        kernels = _kernels(probes.get(host, {}))
        differs = [h for h, k in reference_kernels.items() if h != host and k and k != kernels]
        if differs:
            changed = sorted(f for f in kernels if kernels.get(f) != reference_kernels[differs[0]].get(f))
            fits.append(HostFit(host, False, f"binds other kernels than {differs[0]}, where the drafters were "
                                             f"trained ({', '.join(changed)}): its states would differ",
                                model_path=path))
            continue
        hidden, vocab = int(model.get("hidden_size") or 0), int(model.get("vocab_size") or 0)
        need = need_mib(int(model["tensor_bytes"]), tokens, hidden, layers_saved, vocab)
        serving = serving_gpus(config, host, sample)
        free = {g.index: (g.mem_total_mib or 0) - (g.mem_used_mib or 0) for g in sample.gpus
                if g.index not in serving and g.mem_used_mib is not None and g.mem_total_mib}
        if not free:
            fits.append(HostFit(host, False, "every GPU there serves the model", need_mib=need, model_path=path))
            continue
        gpu = max(free, key=lambda i: free[i])
        others = [h for h in reference_kernels if h != host]  # never compared with itself
        if others:
            kernels_note = f"weights at {path}; same kernels as {', '.join(others)}, where the drafters were trained"
        elif host in reference_kernels:
            kernels_note = f"weights at {path}; the drafters were trained here: its kernels are theirs"
        else:
            kernels_note = f"weights at {path}; no drafter host's kernels to compare with"
        estimate = f"~{need} MiB (weights + activations of ~{tokens} tokens, estimated)"
        if free[gpu] >= need:
            fits.append(HostFit(host, True, f"GPU{gpu} has {free[gpu]} MiB free for {estimate}; {kernels_note}",
                                gpu, free[gpu], need, path, (gpu,)))
            continue
        # No one GPU has the room: a device_map split over the freest GPUs, each filled to SPLIT_FILL
        # of its free memory (every split adds a copy of the activations crossing it).
        chosen, room = [], 0
        for index in sorted(free, key=lambda i: -free[i]):
            chosen.append(index)
            room += int(free[index] * SPLIT_FILL)
            if room >= need:
                break
        if room >= need and len(chosen) > 1:
            names = "+".join(f"GPU{i}" for i in sorted(chosen))
            fits.append(HostFit(host, True, f"split across {names} ({room} MiB usable of "
                                            f"{sum(free[i] for i in chosen)} MiB free) for {estimate}; {kernels_note}",
                                chosen[0], room, need, path, tuple(sorted(chosen))))
            continue
        fits.append(HostFit(host, False, f"the freest GPU (GPU{gpu}) has {free[gpu]} MiB free and all of them together "
                                         f"{room} MiB usable, the extraction needs {estimate}",
                            gpu, free[gpu], need, path))
    return fits


@dataclass(frozen=True)
class ReplicaFit:
    """Whether a fleet's replica can take the window: the extraction runs where it serves, on the
    GPUs its drain and stop free, with the drafters' kernels."""

    name: str
    fits: bool
    why: str
    need_mib: int | None = None
    room_mib: int | None = None


def replica_fits(config: Config, probes: Mapping[str, Mapping[str, Any]],
                 samples: Mapping[str, TelemetrySample | None], tokens: int, layers_saved: int,
                 simulated: Callable[[str], bool] = lambda host: False) -> list[ReplicaFit]:
    """Every replica of `config.fleet`, in config order: it fits when it serves on the target's host
    (the extraction runs there, on the GPUs the window frees), that host binds the kernels the
    policy asks for and the same kernels as the drafters' hosts, and its GPUs (`[service] gpus`,
    else all of the host's) hold the extraction: their memory once the replica is stopped (one
    GPU whole, several filled to SPLIT_FILL each) against the weights and the activations' estimate.
    No GPU readings: the memory is not checked, and said so."""
    fleet = config.fleet
    assert fleet is not None
    target = config.target
    trained_on = sorted({d.host for d in config.drafters})
    reference_kernels = {h: _kernels(probes.get(h, {})) for h in trained_on if probes.get(h)}
    out = []
    for replica in fleet.replicas:
        host = replica.service.host
        if host != target.host:
            out.append(ReplicaFit(replica.name, False, f"it serves on {host}; the extraction runs on the target's host "
                                                       f"{target.host} ([target] host)"))
            continue
        probe = probes.get(host, {})
        model = probe.get("model", {})
        if not model.get("exists") or not model.get("tensor_bytes"):
            out.append(ReplicaFit(replica.name, False, f"{host}:{target.model_path} is not a readable checkpoint "
                                                       f"({model.get('error') or 'missing'})"))
            continue
        kernels = _kernels(probe)
        if target.kernels == "fast" and not (probe.get("kernels") or {}).get("fast") and not simulated(host):
            bound = ", ".join(f"{k}={v}" for k, v in kernels.items()) or "nothing"
            out.append(ReplicaFit(replica.name, False, f"{host} binds {bound}, not the fast kernels ([target] "
                                                       f"kernels = \"fast\")"))
            continue
        differs = [h for h, k in reference_kernels.items() if h != host and k and k != kernels]
        if differs:
            changed = sorted(f for f in kernels if kernels.get(f) != reference_kernels[differs[0]].get(f))
            out.append(ReplicaFit(replica.name, False, f"{host} binds other kernels than {differs[0]}, where the "
                                                       f"drafters were trained ({', '.join(changed)})"))
            continue
        need = need_mib(int(model["tensor_bytes"]), tokens, int(model.get("hidden_size") or 0), layers_saved,
                        int(model.get("vocab_size") or 0))
        sample = samples.get(host)
        readings = {g.index: g.mem_total_mib for g in (sample.gpus if sample is not None else ()) if g.mem_total_mib}
        if not readings:
            out.append(ReplicaFit(replica.name, True, f"its GPUs' memory is not checked (no GPU readings from {host}); "
                                                      f"the extraction needs ~{need} MiB", need))
            continue
        wanted = list(replica.service.gpus) or sorted(readings)
        missing = [i for i in wanted if i not in readings]
        if missing:
            out.append(ReplicaFit(replica.name, False, f"its GPUs {', '.join(map(str, missing))} are not among "
                                                       f"{host}'s ({', '.join(map(str, sorted(readings)))})", need))
            continue
        room = readings[wanted[0]] if len(wanted) == 1 else sum(int(readings[i] * SPLIT_FILL) for i in wanted)
        gpus = "+".join(f"GPU{i}" for i in wanted)
        if room < need:
            out.append(ReplicaFit(replica.name, False, f"its GPUs ({gpus} on {host}) hold {room} MiB, the extraction "
                                                       f"needs ~{need} MiB (weights + activations of ~{tokens} tokens, "
                                                       f"estimated)", need, room))
            continue
        out.append(ReplicaFit(replica.name, True, f"its GPUs ({gpus} on {host}) hold {room} MiB for ~{need} MiB; "
                                                  f"the drafters' kernels", need, room))
    return out
