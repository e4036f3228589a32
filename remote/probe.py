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

With `--cache-dir DIR` (the preflight of every window passes one) the *environment* facts (python,
torch and its CUDA devices, the packages, the kernel binding, the host-to-GPU copy speed: ~10 CPU
seconds, importing torch and transformers) are kept in DIR under a fingerprint of what they depend
on (`environment_fingerprint`) and reused while it is unchanged; the *now* facts (host name, Triton
cache, disk, RAM, the model, the disk read speed) are measured every time. `environment` in the
document says which it was: {"fingerprint", "cached", "probed_at", "cache_file", and "not_kept": why
when facts probed now were not kept (a failure that may pass is looked at again next time)}.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import hashlib
import importlib.machinery
import importlib.metadata
import importlib.util
import json
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

# What the environment facts depend on, read without importing torch or transformers (the point of
# the cache: the fingerprint costs milliseconds, the probe it saves ~10 CPU seconds).
# - The distributions whose version or install the facts report or the binding depends on: a new
#   version, or a reinstall of the same one (its dist-info directory is made anew: a new mtime).
FINGERPRINT_DISTRIBUTIONS = ("torch", "transformers", "triton", "flash-linear-attention", "fla-core",
                             "causal-conv1d", "safetensors", "tokenizers", "nvidia-ml-py", "kernels", "numpy")
# - The top-level modules the probe imports, found as the import system would (no import): a package
#   put on PYTHONPATH without any dist-info (the test hosts' FAKE fla) is covered by its file's mtime.
FINGERPRINT_MODULES = (*kernels.FAST_PACKAGES, "torch", "transformers", "triton")
# - The variables that change which GPUs torch sees and in what order, which libraries load, and
#   whether transformers takes kernels from the hub (kernels.py itself reads none).
FINGERPRINT_VARIABLES = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "LD_LIBRARY_PATH",
                         "PYTHONPATH", "USE_HUB_KERNELS", "HF_HUB_OFFLINE")
# - The driver and the GPUs: the driver's version text, each GPU's information (its model and UUID:
#   a swapped card is another one) and the device nodes (one more or fewer GPU).
NVIDIA_PROC = Path("/proc/driver/nvidia")
DEVICE_NODES = "/dev/nvidia[0-9]*"
CACHE_FORMAT = "dflash-ops.probe-environment/1"
CACHE_KEEP = 8  # fingerprints kept per directory: two pythons probing one host do not evict each other
# The document's keys that are environment facts (the rest are measured at every probe).
ENVIRONMENT_KEYS = ("python", "torch", "packages", "kernels")


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


def _distribution(name: str) -> dict[str, Any] | None:
    """A distribution's version, dist-info path and that path's mtime (None when not installed).
    The seam the fingerprint reads installs through."""
    try:
        dist = importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = getattr(dist, "_path", None)  # the dist-info directory (PathDistribution; no public name)
    try:
        mtime = os.stat(path).st_mtime_ns if path is not None else None
    except OSError:
        mtime = None
    return {"version": dist.version, "path": str(path), "mtime_ns": mtime}


def _module_origin(name: str) -> dict[str, Any] | None:
    """Where the top-level module `name` would be imported from, and that file's mtime; not imported.
    Searched on sys.path as a fresh process would, never taken from sys.modules (a module imported, or
    blocked with None as the rehearsal server does on a CPU, would hide where it now comes from)."""
    try:
        spec = importlib.machinery.PathFinder.find_spec(name, sys.path)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    origin = spec.origin if spec.origin not in (None, "namespace") else None
    locations = [origin] if origin else list(spec.submodule_search_locations or [])
    found = []
    for location in locations:
        try:
            found.append([location, os.stat(location).st_mtime_ns])
        except OSError:
            found.append([location, None])
    return {"locations": found}


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def _probe_code_identity() -> str:
    """This file and kernels.py: a console shipping other probe code probes anew."""
    digest = hashlib.sha256()
    for path in (Path(__file__), Path(kernels.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def environment_fingerprint(model_type: str) -> tuple[str, dict[str, Any]]:
    """(sha256, what it covers) of everything the environment facts depend on; imports nothing heavy.

    Enough because the environment facts are a function of: the interpreter (its realpath and full
    version), where imports come from (sys.path, PYTHONPATH), what is installed there (the
    distributions' versions and dist-info mtimes, the modules' files), the driver and GPUs, the
    variables that steer device visibility and binding, the model type the binding is checked for,
    and the probe's own code. Anything else that changes them (a GPU taken by another process) is
    not an environment fact: memory in use is read from telemetry, not from here.
    """
    covers = {
        "executable": [sys.executable, os.path.realpath(sys.executable)],
        "python": sys.version,
        "sys_path": [_path_entry(entry) for entry in sys.path],
        "variables": {name: os.environ.get(name) for name in FINGERPRINT_VARIABLES},
        "distributions": {name: _distribution(name) for name in FINGERPRINT_DISTRIBUTIONS},
        "modules": {name: _module_origin(name) for name in FINGERPRINT_MODULES},
        "driver": _read(NVIDIA_PROC / "version"),
        "gpus": {p: _read(Path(p)) for p in sorted(glob.glob(str(NVIDIA_PROC / "gpus" / "*" / "information")))},
        "device_nodes": _device_nodes(),
        "model_type": model_type,
        "probe_code": _probe_code_identity(),
    }
    text = json.dumps(covers, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest(), covers


SHIPPED_CODE = str(Path(__file__).resolve().parents[1])  # the console's code on this host: <workdir>/code/<its hash>


def _path_entry(entry: str) -> str:
    """A sys.path entry as the fingerprint covers it: the console's shipped code directory (named by
    its hash, so each console version has its own) by a fixed name. Its probe code is covered by
    `probe_code`; the rest of it imports nothing the environment facts are about, so a new console
    version (or another drill on this machine) reuses what the last one probed."""
    try:
        return "<the console's shipped code>" if str(Path(entry or ".").resolve()) == SHIPPED_CODE else entry  # "": the cwd
    except OSError:
        return entry


def _device_nodes() -> list[list[Any]]:
    """Each GPU device node and its device number; not its times (which a device's use may touch:
    the cache would never be reused). A new card, a new driver: the gpus' information and the
    driver's version text above say it."""
    nodes = []
    for path in sorted(glob.glob(DEVICE_NODES)):
        try:
            nodes.append([path, os.stat(path).st_rdev])
        except OSError:
            nodes.append([path, None])
    return nodes


def cache_file(cache_dir: str | os.PathLike, fingerprint: str) -> Path:
    return Path(cache_dir) / f"environment-{fingerprint[:20]}.json"


def read_cached_environment(cache_dir: str | os.PathLike, fingerprint: str) -> dict[str, Any] | None:
    """The cached environment facts for `fingerprint`, or None: a missing, damaged, half-written,
    other-format or other-fingerprint file is never trusted (the probe runs and rewrites it)."""
    try:
        document = json.loads(cache_file(cache_dir, fingerprint).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(document, dict) or document.get("format") != CACHE_FORMAT \
            or document.get("fingerprint") != fingerprint or not isinstance(document.get("probed_at"), (int, float)):
        return None
    facts = document.get("facts")
    if not isinstance(facts, dict) or not all(isinstance(facts.get(k), dict) for k in (*ENVIRONMENT_KEYS, "h2d")):
        return None
    return document


def write_cached_environment(cache_dir: str | os.PathLike, fingerprint: str, covers: dict[str, Any],
                             probed_at: float, facts: dict[str, Any]) -> Path:
    path = write_json_atomic(cache_file(cache_dir, fingerprint), {
        "format": CACHE_FORMAT, "fingerprint": fingerprint, "probed_at": probed_at, "covers": covers, "facts": facts})
    kept = []
    for other in Path(cache_dir).glob("environment-*.json"):
        with contextlib.suppress(OSError):  # another probe of this host pruned it first
            kept.append((other.stat().st_mtime_ns, other))
    for _, stale in sorted(kept, reverse=True)[CACHE_KEEP:]:
        with contextlib.suppress(OSError):
            stale.unlink()
    return path


def passing_state(facts: dict[str, Any], covers: dict[str, Any]) -> str | None:
    """Why these environment facts may say something passing rather than lasting (None: keep them).

    Failures are not kept, so the next probe looks again: torch that did not import (an install
    half-done, a full /tmp), GPU device nodes present but none seen by torch (a driver in a bad
    state), a copy to GPU 0 that failed beside a busy server."""
    torch = facts["torch"]
    if not torch.get("importable"):
        return f"torch did not import ({torch.get('error')})"
    if covers.get("device_nodes") and not torch.get("cuda_available"):
        return f"{len(covers['device_nodes'])} NVIDIA device nodes but torch sees no CUDA device"
    h2d = facts["h2d"]
    if torch.get("cuda_available") and not h2d.get("measured"):
        return f"the host-to-GPU copy was not measured ({h2d.get('why')})"
    return None


def environment_facts(model_type: str) -> dict[str, Any]:
    """The facts that change only with software, driver or GPUs (imports torch and transformers)."""
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
    return {"python": {"version": platform.python_version(), "executable": sys.executable},
            "torch": torch, "packages": packages, "kernels": binding, "h2d": h2d_speed()}


def probe(model_dir: str | None = None, workdir: str | None = None, model_type: str | None = None,
          cache_dir: str | None = None) -> dict[str, Any]:
    """Collect every fact; never raises for a missing piece (it is reported instead).

    With `cache_dir`, the environment facts come from there when its file for this fingerprint is
    sound, else they are probed and written there."""
    model = model_facts(model_dir)
    model_type = model_type or model.get("model_type") or "qwen3_5"
    fingerprint, covers = environment_fingerprint(model_type)
    cached = read_cached_environment(cache_dir, fingerprint) if cache_dir else None
    environment: dict[str, Any] = {"fingerprint": fingerprint, "cached": cached is not None}
    if cached is not None:
        facts, environment["probed_at"] = cached["facts"], cached["probed_at"]
    else:
        facts, environment["probed_at"] = environment_facts(model_type), time.time()
        passing = passing_state(facts, covers)
        if cache_dir and passing:
            environment["not_kept"] = passing
        elif cache_dir:
            try:
                write_cached_environment(cache_dir, fingerprint, covers, environment["probed_at"], facts)
            except OSError as exc:  # a full or read-only disk: the facts stand, only the reuse is lost
                environment["not_kept"] = f"could not write the cache: {type(exc).__name__}: {exc}"
    if cache_dir:
        environment["cache_file"] = str(cache_file(cache_dir, fingerprint))
    return {
        "format": FORMAT,
        "host": socket.gethostname(),
        **{key: facts[key] for key in ENVIRONMENT_KEYS},
        "triton_cache": triton_cache(),
        "disk": disk(workdir or model_dir or os.getcwd()),
        "ram": memory(),
        "model": model,
        "speeds": {"disk_read": disk_read_speed(model_dir if model.get("exists") else None), "h2d": facts["h2d"]},
        "environment": environment,
    }


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m remote.probe", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="target model directory")
    p.add_argument("--workdir", default=None, help="where outputs go (for disk free)")
    p.add_argument("--model-type", default=None, help="modeling module to inspect (default: the model's)")
    p.add_argument("--out", default=None, help="also write the JSON here (atomically)")
    p.add_argument("--cache-dir", default=None,
                   help="keep the environment facts here and reuse them while the environment's fingerprint "
                        "is unchanged (default: probe everything)")
    args = p.parse_args(argv)
    events.phase("probe")
    facts = probe(args.model, args.workdir, args.model_type, args.cache_dir)
    environment = facts["environment"]
    if environment["cached"]:
        events.log(f"environment unchanged since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(environment['probed_at']))} "
                   f"(fingerprint {environment['fingerprint'][:12]}): torch, packages and kernel binding from that probe")
    if args.out:
        write_json_atomic(args.out, facts)
        events.artifact(args.out, "probe")
    return facts


if __name__ == "__main__":
    run_worker(main)
