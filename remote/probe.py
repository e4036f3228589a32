"""Environment probe: what this host would run the target with, as one JSON document.

    python -m remote.probe [--model DIR] [--workdir DIR] [--model-type qwen3_5] [--out probe.json]

Python, torch, CUDA devices and capability, transformers, fla, causal-conv1d (versions and whether
they import), the implementation transformers binds for each of the four kernel functions, the
Triton cache, disk and RAM free, and the model's size and tensor count. The console shows two hosts
side by side and flags asymmetry (the story's bug: causal-conv1d missing on the training host only).

Measured speeds, for the downtime forecast (`speeds`): the read speed of the model's largest
safetensors file (its first 256 MiB at most, read as the page cache stands: a file already cached
reads at memory speed, as the window's load would then) and, where CUDA is present, the pinned
host-to-GPU copy bandwidth (a short timed copy to GPU 0). Each says what it measured, or why not.

It imports the modeling module with whatever is installed (policy `any`), so the bindings shown are
what transformers binds on this host; `would_force_torch` says the extractor would override them
because there is no GPU.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

from remote import kernels
from remote.artifacts import write_json_atomic
from remote.events import EventWriter, run_worker

FORMAT = "dflash-ops.probe/1"
DISK_READ_BYTES = 256 << 20  # bounded: a second or so even from a slow disk
H2D_BYTES = 64 << 20  # small enough to fit beside a serving SGLang's memory
H2D_COPIES = 5


def torch_facts() -> dict[str, Any]:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return {"importable": False, "error": f"{type(exc).__name__}: {exc}", "devices": []}
    devices = []
    available = bool(torch.cuda.is_available())
    if available:
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            devices.append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                            "memory_total": int(props.total_memory)})
    return {"importable": True, "version": torch.__version__, "cuda": torch.version.cuda,
            "cuda_available": available, "devices": devices}


def triton_cache() -> dict[str, Any]:
    """Where Triton keeps compiled kernels and how much is there (a warm cache saves ~50 s)."""
    directory = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    size = files = 0
    if directory.is_dir():
        for root, _, names in os.walk(directory):
            for name in names:
                try:
                    size += (Path(root) / name).stat().st_size
                    files += 1
                except OSError:
                    pass
    return {"dir": str(directory), "from_env": "TRITON_CACHE_DIR" in os.environ, "exists": directory.is_dir(),
            "bytes": size, "files": files}


def memory() -> dict[str, Any]:
    facts: dict[str, Any] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("MemTotal", "MemAvailable"):
                facts["total" if key == "MemTotal" else "available"] = int(value.split()[0]) * 1024
    except OSError as exc:
        facts["error"] = str(exc)
    return facts


def disk(path: str) -> dict[str, Any]:
    target = Path(path)
    while not target.exists() and target != target.parent:
        target = target.parent
    usage = shutil.disk_usage(target)
    return {"path": str(target), "free": usage.free, "total": usage.total}


def disk_read_speed(model_dir: str | None, limit: int = DISK_READ_BYTES) -> dict[str, Any]:
    """Read the start of the model's largest safetensors file (at most `limit` bytes) and time it."""
    if not model_dir:
        return {"measured": False, "why": "no model directory given"}
    files = sorted(Path(model_dir).glob("*.safetensors"), key=lambda f: f.stat().st_size, reverse=True)
    if not files:
        return {"measured": False, "why": f"no *.safetensors file in {model_dir}"}
    largest = files[0]
    size = largest.stat().st_size
    done = 0
    start = time.perf_counter()
    with open(largest, "rb", buffering=0) as fh:
        while done < limit and (block := fh.read(min(8 << 20, limit - done))):
            done += len(block)
    seconds = max(time.perf_counter() - start, 1e-9)
    part = "the whole file" if done == size else f"the first {done / 2**20:.1f} MiB of {largest.name}"
    return {"measured": True, "file": str(largest), "bytes": done, "seconds": seconds, "bytes_per_s": done / seconds,
            "what": f"{part} ({size / 2**30:.2f} GiB, the largest of {len(files)} safetensors files), "
                    f"read as the page cache stands"}


def h2d_speed(nbytes: int = H2D_BYTES, copies: int = H2D_COPIES) -> dict[str, Any]:
    """Pinned host memory to GPU 0: one copy to warm up, then `copies` timed ones."""
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        return {"measured": False, "why": f"torch does not import ({type(exc).__name__}: {exc})"}
    if not torch.cuda.is_available():
        return {"measured": False, "why": "no CUDA device (torch sees none): no host-to-GPU copy to time"}
    try:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
        device.copy_(host, non_blocking=True)
        torch.cuda.synchronize(0)
        start = time.perf_counter()
        for _ in range(copies):
            device.copy_(host, non_blocking=True)
        torch.cuda.synchronize(0)
        seconds = max(time.perf_counter() - start, 1e-9)
    except RuntimeError as exc:  # out of memory beside the server, a driver error: said, not raised
        return {"measured": False, "why": f"the copy failed: {exc}"}
    finally:
        host = device = None
    return {"measured": True, "device": 0, "bytes": nbytes * copies, "seconds": seconds,
            "bytes_per_s": nbytes * copies / seconds,
            "what": f"{copies} copies of {nbytes >> 20} MiB from pinned host memory to GPU 0"}


def model_facts(model_dir: str | None) -> dict[str, Any]:
    if not model_dir:
        return {"path": None}
    from remote.layers import text_config
    from remote.weights import checkpoint_facts, read_model_config

    facts: dict[str, Any] = {"path": model_dir, "exists": Path(model_dir).is_dir()}
    try:
        config = read_model_config(model_dir)
        tcfg = text_config(config)
        facts.update(model_type=config.get("model_type"), architectures=config.get("architectures"),
                     num_layers=tcfg.get("num_hidden_layers"), hidden_size=tcfg.get("hidden_size"),
                     vocab_size=tcfg.get("vocab_size"),
                     layer_types=_layer_type_counts(tcfg.get("layer_types")))
        facts.update(checkpoint_facts(model_dir))
    except Exception as exc:  # noqa: BLE001 - the probe reports, it does not fail
        facts["error"] = getattr(exc, "msg", None) or f"{type(exc).__name__}: {exc}"
    return facts


def _layer_type_counts(layer_types: Any) -> dict[str, int] | None:
    if not isinstance(layer_types, list):
        return None
    counts: dict[str, int] = {}
    for kind in layer_types:
        counts[str(kind)] = counts.get(str(kind), 0) + 1
    return counts


def kernel_binding(model_type: str) -> dict[str, Any]:
    try:
        module = kernels.import_modeling(model_type)
        return kernels.bound_kernels(module)
    except Exception as exc:  # noqa: BLE001
        return {"error": getattr(exc, "msg", None) or f"{type(exc).__name__}: {exc}", "bound": {}, "fast": False}


def probe(model_dir: str | None = None, workdir: str | None = None, model_type: str | None = None) -> dict[str, Any]:
    """Collect every fact; never raises for a missing piece (it is reported instead)."""
    model = model_facts(model_dir)
    model_type = model_type or model.get("model_type") or "qwen3_5"
    torch = torch_facts()
    packages = {name: kernels.package_status(name) for name in (*kernels.FAST_PACKAGES, "triton")}
    try:
        import transformers

        packages["transformers"] = {"importable": True, "version": transformers.__version__, "error": None}
    except Exception as exc:  # noqa: BLE001
        packages["transformers"] = {"importable": False, "version": None, "error": str(exc)}
    binding = kernel_binding(model_type) if packages["transformers"]["importable"] else {"bound": {}, "fast": False}
    binding["model_type"] = model_type
    binding["would_force_torch"] = not torch.get("cuda_available", False)
    return {
        "format": FORMAT,
        "host": socket.gethostname(),
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "torch": torch,
        "packages": packages,
        "kernels": binding,
        "triton_cache": triton_cache(),
        "disk": disk(workdir or model_dir or os.getcwd()),
        "ram": memory(),
        "model": model,
        "speeds": {"disk_read": disk_read_speed(model_dir if model.get("exists") else None), "h2d": h2d_speed()},
    }


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m remote.probe", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target model directory")
    p.add_argument("--workdir", default=None, help="where outputs go (for disk free)")
    p.add_argument("--model-type", default=None, help="modeling module to inspect (default: the model's)")
    p.add_argument("--out", default=None, help="also write the JSON here (atomically)")
    args = p.parse_args(argv)
    events.phase("probe")
    facts = probe(args.model, args.workdir, args.model_type)
    if args.out:
        write_json_atomic(args.out, facts)
        events.artifact(args.out, "probe")
    return facts


if __name__ == "__main__":
    run_worker(main)
