"""SGLang's memory saver as `/server_info` reports it, and the names its control routes take.

A server started with `--enable-memory-saver` can give its GPU memory back without stopping
(`POST /release_memory_occupation`) and take it again (`/resume_memory_occupation`), by tag; with
`--enable-weights-cpu-backup` its weights are copied to CPU memory first and come back bit for bit.
Without the memory saver those routes still answer 200 but free nothing (SGLang's no-op adapter,
utils/torch_memory_saver_adapter.py). Facts and their SGLang 0.5.23 sources: docs/sglang.md.

`/server_info` (http_server.py, server_info) carries the launch's resolved arguments at its top
(`enable_memory_saver`, `enable_weights_cpu_backup`: arg_groups/fields/exec_.py) and one
`internal_states` entry per DP rank, each with `memory_usage`
(managers/scheduler_components/memory_usage.py, build_memory_usage): `weight`, `kvcache` (GiB:
memory_pool.py's GB is 1 << 30), `startup_available`, `token_capacity`, `token_capacity_swa`, and
`graph`, the CUDA graphs' GiB per capture phase. They are one rank's own GPU's figures (a TP rank's
share), not the server's total. Its `version` is SGLang's own (`__version__`), which tells whether
its pause can hold requests at all: `/pause_generation` takes a `mode` from 0.5.6 (io_struct.py,
PauseGenerationReqInput); 0.5.5 and earlier take no body and abort every request in flight
(tokenizer_manager.py, pause_generation: `abort_request(abort_all=True)`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

# managers/io_struct.py, PauseGenerationReqInput.mode: "abort" (SGLang's default) fails every
# request in flight; "retract" puts running requests back in the waiting queue (held, answered after
# /continue_generation); "in_place" holds them where they are (their KV cache stays: no release).
PAUSE_MODES = ("abort", "retract", "in_place")
# constants.py, GPU_MEMORY_TYPE_*: the tags release and resume take.
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)
# The first SGLang whose /pause_generation takes a mode (retract holds the requests): 0.5.6. Before
# it the route reads no body and aborts every request in flight (docs/sglang.md, "Pause and release").
PAUSE_HOLDS_SINCE = (0, 5, 6)


def release_of(version: str | None) -> tuple[int, int, int] | None:
    """SGLang's `version` as (major, minor, patch): "0.5.6.post2" and "0.5.23-standin" read as their
    release; None when it does not begin with one."""
    match = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?", version.strip()) if isinstance(version, str) else None
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


@dataclass(frozen=True)
class MemorySaver:
    """Whether the server can release its GPU memory, and how much each tag holds per GPU.

    `memory_gib` is keyed by release tag (`kv_cache`, `weights`, `cuda_graph`): SGLang's
    `memory_usage` `kvcache`, `weight` and the sum of `graph`'s phases, in GiB on one GPU (the
    largest over DP ranks); None when the server reports no memory usage (older releases, the
    rehearsal server without a simulated or real GPU). `version`: SGLang's, as /server_info says."""

    enabled: bool
    weights_cpu_backup: bool
    memory_gib: dict[str, float] | None = None
    version: str | None = None

    def why_no_pause(self) -> str | None:
        """Why this server's /pause_generation cannot hold the requests in flight (the pause route's
        promise: none fails), or None when it can (SGLang 0.5.6 and later)."""
        release = release_of(self.version)
        if release is None:
            return (f"the server reports no SGLang version that can be read ({self.version!r} in /server_info): "
                    f"whether its /pause_generation holds requests (SGLang 0.5.6 and later) or aborts every one "
                    f"of them (0.5.5 and earlier) cannot be told")
        if release < PAUSE_HOLDS_SINCE:
            return (f"the server runs SGLang {self.version}, whose /pause_generation takes no mode and aborts every "
                    f"request in flight (the retract mode that holds them came in SGLang 0.5.6): the pause route "
                    f"would fail users' requests; upgrading the server to SGLang 0.5.6 or later makes it possible")
        return None

    def why_not(self, tags: list[str] | tuple[str, ...]) -> str | None:
        """Why releasing `tags` would not work as the route needs, or None when it would."""
        if not self.enabled:
            return "the server runs without --enable-memory-saver: a release frees nothing"
        if WEIGHTS in tags and not self.weights_cpu_backup:
            return ("the server keeps no CPU backup of its weights (--enable-weights-cpu-backup): releasing "
                    "them loses them until they are loaded again")
        return None


def _gib(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _usage_gib(usage: Any) -> dict[str, float] | None:
    """One rank's `memory_usage` as {tag: GiB}, or None when it is not in SGLang's shape."""
    if not isinstance(usage, dict):
        return None
    weights, kv_cache = _gib(usage.get("weight")), _gib(usage.get("kvcache"))
    graph = usage.get("graph")
    phases = [_gib(v) for v in graph.values()] if isinstance(graph, dict) else [_gib(graph)]
    if weights is None or kv_cache is None or any(p is None for p in phases):
        return None
    return {WEIGHTS: weights, KV_CACHE: kv_cache, CUDA_GRAPH: round(sum(p for p in phases if p is not None), 3)}


def memory_saver_of(server_info: dict) -> MemorySaver:
    """The memory saver as `/server_info` (SGLang 0.5.23's shape, or the rehearsal server's) says.

    A key the server does not report counts as off (releases before the memory saver existed, other
    servers). `memory_gib` is the largest figure per tag over the `internal_states` (DP ranks)."""
    if not isinstance(server_info, dict):
        raise ValueError(f"/server_info: expected a JSON object, got {type(server_info).__name__}")
    per_rank = [_usage_gib(state.get("memory_usage")) for state in server_info.get("internal_states") or []
                if isinstance(state, dict)]
    known = [usage for usage in per_rank if usage is not None]
    memory = {tag: max(usage[tag] for usage in known) for tag in MEMORY_TAGS} if known else None
    version = server_info.get("version")
    return MemorySaver(enabled=server_info.get("enable_memory_saver") is True,
                       weights_cpu_backup=server_info.get("enable_weights_cpu_backup") is True,
                       memory_gib=memory, version=version if isinstance(version, str) else None)


def check_tags(tags: list[str] | tuple[str, ...], endpoint: str) -> list[str]:
    """`tags` as a list, each one SGLang knows; an empty list is refused: SGLang takes it (and None)
    for every tag, weights included (weight_updater.py, release_memory_occupation)."""
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
        raise ValueError(f"{endpoint}: tags must be a list of {', '.join(MEMORY_TAGS)}; got {tags!r}")
    if not tags:
        raise ValueError(f"{endpoint}: no tags given; SGLang takes an empty list for every tag, the weights "
                         f"included: name them ({', '.join(MEMORY_TAGS)})")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"{endpoint}: unknown tag(s) {', '.join(map(repr, unknown))}; SGLang's are "
                         f"{', '.join(MEMORY_TAGS)}")
    return list(dict.fromkeys(tags))
