"""The config a drill writes: its two hosts, the rehearsal server as a command-managed service, the
tiny target, the drill's prompts, the two drafters and a CPU evaluation (the GPU drill: the few-GB
target, real GPUs read through NVML, the fast kernels and a CUDA evaluation). It must load with
`console.config.load_config` like any operator's file, and it is checked that way when written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from console.config import Config, dump_toml, load_config
from console.drill.layout import INFERENCE_HOST, TRAINING_HOST, DrillLayout
from remote.artifacts import atomic_path
from remote.drill.drafters import SERVING_DTYPE

SERVICE_GPU_MIB = 40000  # per simulated GPU while the rehearsal server runs
LOAD_DELAY_S = 1.0  # simulated weight loading, so the start-up log shows progress
MAX_NEW_TOKENS = 24
GPU_SERVICE_EXTRA_MIB = 16384  # the GPU drill: what the server's CUDA worker holds beside the model
DRAIN_TIMEOUT_S = 60  # a drained rehearsal server's requests end within seconds
GPU_VRAM_FREE_MIB = 2048  # the GPU drill: an idle H200 reads 0 MiB; below this the GPU counts as free
SERVICE_KV_CACHE_MIB = 14000  # of SERVICE_GPU_MIB: what a KV-cache release gives back per simulated GPU
SERVICE_CUDA_GRAPH_MIB = 1200
GPU_KV_CACHE_MIB = 65536  # the GPU drill's KV pool (torch_memory_saver) on an H200 (140 GiB), when the card cannot be read
# ... and as a share of the card's memory, as SGLang sizes its pool (`--mem-fraction-static`) from the
# card it finds: 64 GiB of an H200's 140, so that an H100's 80 GiB hold the same window (36 GiB of KV
# beside the model, the CUDA worker's 16 GiB and the extraction) instead of failing the server's start.
GPU_KV_CACHE_SHARE = 0.45
GPU_CUDA_GRAPH_MIB = 1024
# The crowded GPU drill (`drill up --gpu --crowded`): a small KV pool and CUDA graphs, and the card
# filled but CROWDED_FREE_MIB once the server is up. The extraction of the 1.7 B target needs ~3.7 GiB
# (fit.need_mib): the 2.9 GiB the KV cache, the graphs and the free room give is too little, and with
# the weights' ~3.1 GiB it fits. So the pause route must release the weights, as on a production card
# whose KV pool and model leave no room for a second copy of the target. The free room is what
# SGLang's `--mem-fraction-static` leaves for activations: the server's own under load (~0.65 GiB
# after the crowding) and the staged extractor's CUDA context (~0.8 GiB, made before the stop) live
# there. With 1500 MiB the H100's warm-up extraction ran out of memory before its go (2026-12-06).
CROWDED_KV_CACHE_MIB = 512
CROWDED_CUDA_GRAPH_MIB = 256
CROWDED_FREE_MIB = 2200
# The fleet's router is seen from ct129 (`router_host`) by a name only ct129 resolves (its SSH
# server's `names`, as its /etc/hosts would; `.invalid` resolves nowhere else, RFC 2606): the console
# reaches it through ct129's connection, never from its own machine (issue 41). Users, and the router
# itself, are on this machine: they reach it, and it the replicas, at 127.0.0.1. The replicas' URLs stay
# 127.0.0.1 as seen from ct129 (reached through its connection too: its log says each forward): a
# replica's URL is also handed to jobs run on its host (the cache's completions), and the drill's
# hosts are this machine, which resolves no name of ct129's.
ROUTER_NAME = f"router.{INFERENCE_HOST}.invalid"
HOST_NAMES = {INFERENCE_HOST: {ROUTER_NAME: "127.0.0.1"}}


def gpu_kv_cache_mib(total_mib: int | None = None) -> int:
    """The GPU drill server's KV pool: GPU_KV_CACHE_SHARE of GPU 0's memory (`total_mib`: read through
    NVML when not given), or GPU_KV_CACHE_MIB where the card cannot be read."""
    if total_mib is None:
        try:
            from remote.gpu_source import NvmlSource

            total_mib = NvmlSource().read()[0][0]["mem_total_mib"]
        except Exception:  # noqa: BLE001 - no NVML, no driver, no GPU: the H200's figure
            return GPU_KV_CACHE_MIB
    return int(total_mib * GPU_KV_CACHE_SHARE) if total_mib else GPU_KV_CACHE_MIB


def service_commands(layout: DrillLayout, python: str, port: int, replica: int = 0) -> dict[str, list[str]]:
    """start / stop / status / log of the rehearsal server (`remote.drill.service`), as argv.

    On the GPU drill the server loads its model on the GPU (its VRAM is real) and a real CUDA process
    holds GPU_SERVICE_EXTRA_MIB beside it, as SGLang's scheduler does: the one the first stop leaves.
    With the memory saver (the default) the server can release its KV cache, graphs and weights (a
    CPU backup kept) without stopping: simulated shares of its memory, or real memory through
    torch_memory_saver on the GPU. `replica`: which of a fleet's rehearsal servers (its own state
    directory, and its own GPUs of ct129's simulated ones)."""
    state = str(layout.replica_state(replica))
    manage = [python, "-m", "remote.drill.service"]
    standin = ["--model", str(layout.target), "--port", str(port), "--metrics", "--dtype", SERVING_DTYPE,
               "--speculative-drafter", str(layout.reference)]  # real DFLASH decoding: the online cross-check
    if layout.gpu:
        standin += ["--device", "cuda"]
        episode = ["--cuda-leave-mib", str(CROWDED_FREE_MIB)] if layout.crowded else \
            ["--cuda-mib", str(GPU_SERVICE_EXTRA_MIB)]
    else:
        standin += ["--gpu-file", str(layout.simulated_gpus(INFERENCE_HOST)), "--gpu-mib", str(SERVICE_GPU_MIB),
                    "--load-delay", str(LOAD_DELAY_S)]
        if layout.replicas > 1:  # the replicas share ct129's GPUs, each on its own
            standin += ["--gpu-indices", ",".join(map(str, layout.replica_gpu_indices(replica)))]
        episode = []
    if layout.memory_saver:
        kv, graph = (CROWDED_KV_CACHE_MIB, CROWDED_CUDA_GRAPH_MIB) if layout.crowded else \
            (gpu_kv_cache_mib(), GPU_CUDA_GRAPH_MIB) if layout.gpu else (SERVICE_KV_CACHE_MIB, SERVICE_CUDA_GRAPH_MIB)
        standin += ["--enable-memory-saver", "--enable-weights-cpu-backup", "--kv-cache-mib", str(kv),
                    "--cuda-graph-mib", str(graph)]
    return {
        "start": [*manage, "start", "--state", state, *episode, "--", *standin],
        "stop": [*manage, "stop", "--state", state],
        "status": [*manage, "status", "--state", state],
        "log": ["tail", "-n", "+1", "-F", f"{state}/standin.log"],
    }


def host_table(layout: DrillLayout, name: str, port: int, user: str, python: str) -> dict[str, Any]:
    """Everything explicit: address, port, user, key, known_hosts (nothing left to ~/.ssh/config),
    and whether its GPUs are simulated (the GPU drill's hosts read the real one through NVML)."""
    ssh = layout.ssh_dir(name)
    table = {"address": "127.0.0.1", "port": port, "user": user, "python": python, "workdir": str(layout.workdir(name)),
             "lock_dir": str(layout.lock_dir(name)),
             "identity_file": str(ssh / "client_key"), "known_hosts": str(ssh / "known_hosts"),
             "connect_timeout": 5, "keepalive_interval": 5, "simulated_gpus": not layout.gpu}
    # The server's own empty ssh_config keeps the user's ~/.ssh/config (a `Host *` ProxyJump, say) out.
    table["ssh_config"] = str(ssh / "ssh_config")
    return table


def service_table(layout: DrillLayout, python: str, port: int, replica: int = 0) -> dict[str, Any]:
    """[service], or one replica of [fleet], for the rehearsal server on `port`."""
    return {"host": INFERENCE_HOST, "manager": "command", **service_commands(layout, python, port, replica),
            "url": f"http://127.0.0.1:{port}", "ready_timeout_s": 180 if layout.gpu else 60,
            "vram_free_mib": GPU_VRAM_FREE_MIB if layout.gpu else 1024, "stop_grace_s": 2, "vram_wait_s": 5,
            # a fleet's replicas share ct129: each watches only its own GPUs
            **({"gpus": layout.replica_gpu_indices(replica)} if layout.replicas > 1 and not layout.gpu else {})}


def fleet_table(layout: DrillLayout, python: str, service_ports: list[int], router_port: int) -> dict[str, Any]:
    """[fleet]: the real router on loopback, seen from ct129 by a name of its own (`ROUTER_NAME`), each
    rehearsal server a replica (r1, r2, ...)."""
    return {"router": f"http://{ROUTER_NAME}:{router_port}", "router_host": INFERENCE_HOST,
            "drain_timeout_s": DRAIN_TIMEOUT_S,
            "replicas": [{"name": f"r{i + 1}", **service_table(layout, python, port, i)}
                         for i, port in enumerate(service_ports)]}


def drill_config_data(layout: DrillLayout, ports: dict[str, int], service_port: int, user: str,
                      python: str, replica_ports: list[int] | None = None, router_port: int | None = None) -> dict[str, Any]:
    """The config's tables; with `replica_ports` (every replica's, the first being `service_port`) and
    `router_port`, a fleet instead of [service]."""
    if replica_ports and len(replica_ports) > 1:
        assert router_port is not None and replica_ports[0] == service_port
        served = {"fleet": fleet_table(layout, python, replica_ports, router_port)}
    else:
        served = {"service": service_table(layout, python, service_port)}
    return {
        "hosts": {name: host_table(layout, name, ports[name], user, python) for name in (INFERENCE_HOST, TRAINING_HOST)},
        **served,
        # The GPU drill extracts with the fast kernels, as production must; the CPU drill has none.
        "target": {"host": INFERENCE_HOST, "model_path": str(layout.target), "kernels": "fast" if layout.gpu else "any",
                   "layers": "auto", "paths": {TRAINING_HOST: str(layout.target_copy)}},
        "prompts": {"file": str(layout.prompts), "max_new_tokens": MAX_NEW_TOKENS},
        "drafters": [
            {"name": "reference", "host": TRAINING_HOST, "path": str(layout.reference), "reference": True},
            {"name": "candidate", "host": TRAINING_HOST, "path": str(layout.candidate)},
        ],
        "eval": {"host": INFERENCE_HOST, "device": "cuda" if layout.gpu else "cpu", "budgets": [8, 16], "topk": 8},
    }


HEADER = """\
# Written by `dflash-ops drill up`: two rehearsal hosts on this machine (embedded SSH servers on
# loopback with their own keys), the rehearsal server as a command-managed service on ct129, a tiny
# hybrid Qwen3.5 target, two drafters on ct200 (the reference and a candidate with the story's
# off-by-one layer bug). GPUs are simulated; the first stop leaves VRAM held by a leftover process.
# The server runs with SGLang's memory saver unless `drill up --no-memory-saver`.
# `dflash-ops drill down` ends it all.

"""
FLEET_HEADER = """\
# --replicas: several rehearsal servers on ct129 behind SGLang's real router (smg, or sglang-router with
# --router sglang-router; the fleet extra) on loopback: [fleet] instead of [service]. The first replica's simulated GPUs are ct129's; the
# others' are in their own service directories.

"""
GPU_HEADER = """\
# Written by `dflash-ops drill up --gpu`: two rehearsal hosts on this machine (embedded SSH servers on
# loopback with their own keys) sharing its CUDA GPU (REAL GPU: NVML telemetry, real VRAM), the
# rehearsal server serving a random 1.7 B hybrid Qwen3.5 from the GPU as a command-managed service on
# ct129, two random drafters on ct200. The first stop leaves a real CUDA process holding VRAM.
# The server runs with SGLang's memory saver (torch_memory_saver) unless `drill up --no-memory-saver`.
# `dflash-ops drill down` ends it all.

"""


def write_drill_config(layout: DrillLayout, ports: dict[str, int], service_port: int, user: str,
                       python: str, replica_ports: list[int] | None = None, router_port: int | None = None) -> Config:
    """Write the drill's config atomically and return it as `load_config` reads it back."""
    data = drill_config_data(layout, ports, service_port, user, python, replica_ports, router_port)
    header = (GPU_HEADER if layout.gpu else HEADER) + (FLEET_HEADER if "fleet" in data else "")
    text = header + dump_toml(data)
    path: Path = layout.config
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return load_config(path)
