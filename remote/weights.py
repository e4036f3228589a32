"""Checkpoint facts and weight placement with progress (tensors and bytes).

The model is first built by `from_pretrained(device_map="cpu")`, which maps the safetensors files
lazily (KERNELS.md: 0.15 s for 12.8 GB, nothing read yet). `place_weights` then moves every tensor
to its device one at a time, reporting progress: straight to the GPU for a cold load, or into
pinned host RAM for a staged load (really reading the bytes), from where the copy to the GPU inside
the downtime window runs at tens of GB/s.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

from remote.events import WorkerError

DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_header(path: str | Path) -> dict[str, Any]:
    """The JSON header of one safetensors file (tensor names, dtypes, shapes, offsets)."""
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: too short to be a safetensors file")
        (length,) = struct.unpack("<Q", raw)
        if length > 100 * 1024 * 1024:
            raise ValueError(f"{path}: implausible safetensors header length {length}")
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise ValueError(f"{path}: safetensors header is not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise ValueError(f"{path}: safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    return header


INDEX = "model.safetensors.index.json"


def _index_map(directory: Path, error: type[Exception]) -> dict[str, Path] | None:
    """tensor name -> file from the directory's safetensors index; None when it has none."""
    index = directory / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError) as exc:
        raise error(f"{index}: not a safetensors index ({exc})") from exc
    return {name: directory / file for name, file in weight_map.items()}


def safetensors_files(directory: str | Path, error: type[Exception] = ValueError) -> list[Path]:
    """The weight files of a checkpoint directory: those its index names, else `model.safetensors`,
    else every `*.safetensors`. Raises `error` naming the directory when there are none."""
    directory = Path(directory)
    mapped = _index_map(directory, error)
    if mapped is not None:
        return sorted(set(mapped.values()))
    single = directory / "model.safetensors"
    files = [single] if single.is_file() else sorted(directory.glob("*.safetensors"))
    if not files:
        raise error(f"{directory}: no safetensors weights (model.safetensors or an index)")
    return files


def tensor_files(directory: str | Path, error: type[Exception] = ValueError) -> dict[str, Path]:
    """tensor name -> the file holding it, from the index or else the files' headers (no tensor read)."""
    directory = Path(directory)
    mapped = _index_map(directory, error)
    if mapped is not None:
        return mapped
    names: dict[str, Path] = {}
    for file in safetensors_files(directory, error):
        try:
            header = safetensors_header(file)
        except ValueError as exc:
            raise error(str(exc)) from exc
        names.update(dict.fromkeys(header, file))
    return names


def checkpoint_facts(model_dir: str | Path) -> dict[str, Any]:
    """Files, tensor count and bytes of a safetensors checkpoint, read from headers only."""
    directory = Path(model_dir)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise WorkerError(f"no *.safetensors files in {directory}", str(directory))
    tensors = 0
    tensor_bytes = 0
    for file in files:
        header = safetensors_header(file)
        tensors += len(header)
        for info in header.values():
            start, end = info["data_offsets"]
            tensor_bytes += end - start
    return {"files": len(files), "tensors": tensors, "tensor_bytes": tensor_bytes,
            "file_bytes": sum(f.stat().st_size for f in files)}


def read_model_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json of a model directory, with a clear error for a missing or broken one."""
    directory = Path(model_dir)
    if not directory.is_dir():
        raise WorkerError(f"model path does not exist or is not a directory: {directory}", "--model")
    path = directory / "config.json"
    if not path.is_file():
        raise WorkerError(f"{directory} has no config.json: not a Hugging Face model directory", "--model")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WorkerError(f"{path}: not valid JSON ({exc})", str(path)) from exc


def device_for(name: str, device_map: dict[str, Any]) -> Any:
    """The device of tensor `name` under an accelerate-style `device_map` (longest prefix wins)."""
    best, best_len = None, -1
    for prefix, device in device_map.items():
        if (prefix == "" or name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
            best, best_len = device, len(prefix)
    if best is None:
        raise KeyError(f"{name} is not covered by the device map")
    return best


def _tensors(model: Any) -> list[tuple[Any, str, str, str]]:
    """(module, store, attribute, qualified name) for every parameter and buffer, shared ones once."""
    items = []
    for module_name, module in model.named_modules():
        for store in ("_parameters", "_buffers"):
            for attr, tensor in getattr(module, store).items():
                if tensor is not None:
                    items.append((module, store, attr, f"{module_name}.{attr}" if module_name else attr))
    return items


def model_bytes(model: Any) -> tuple[int, int]:
    """(tensor count, bytes) of the model's distinct parameters and buffers."""
    seen: set[int] = set()
    count = size = 0
    for module, store, attr, _ in _tensors(model):
        tensor = getattr(module, store)[attr]
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        count += 1
        size += tensor.numel() * tensor.element_size()
    return count, size


def place_weights(model: Any, device_map: dict[str, Any], pin: bool = False,
                  on_tensor: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Move every parameter and buffer to its device from `device_map`, one tensor at a time.

    `pin=True` copies CPU-mapped tensors into pinned host RAM (staging: the bytes are really read
    now). Tied tensors stay tied. `on_tensor(tensors_done, bytes_done)` is called after each one.
    Returns {"tensors", "bytes"}.
    """
    import torch

    moved: dict[int, Any] = {}
    done = done_bytes = 0
    for module, store, attr, name in _tensors(model):
        table = getattr(module, store)
        tensor = table[attr]
        if id(tensor) in moved:
            table[attr] = moved[id(tensor)]
            continue
        device = device_for(name, device_map)
        data = tensor.data
        if pin:
            new = torch.empty(data.shape, dtype=data.dtype, device="cpu", pin_memory=True)
            new.copy_(data)
        elif str(device) == "disk":
            raise WorkerError("disk offload is not supported: give --max-memory enough cpu memory", "--max-memory")
        else:
            new = data.to(device)
        if store == "_parameters":
            new = torch.nn.Parameter(new, requires_grad=False)
        table[attr] = new
        moved[id(tensor)] = new
        done += 1
        done_bytes += data.numel() * data.element_size()
        if on_tensor is not None:
            on_tensor(done, done_bytes)
    return {"tensors": done, "bytes": done_bytes}


def parse_max_memory(text: str | None) -> dict[Any, str] | None:
    """'0=40GiB,1=40GiB,cpu=200GiB' -> {0: '40GiB', 1: '40GiB', 'cpu': '200GiB'}."""
    if not text:
        return None
    result: dict[Any, str] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not value:
            raise WorkerError(f"--max-memory entries look like 0=40GiB or cpu=200GiB, found {part!r}", "--max-memory")
        key = key.strip()
        result[int(key) if key.isdigit() else key] = value.strip()
    return result


def free_memory() -> dict[Any, int]:
    """What accelerate plans `--device-map auto` from when no --max-memory is given: bytes free on each
    GPU now (`torch.cuda.mem_get_info`) and available host RAM."""
    from accelerate.utils import get_max_memory

    return dict(get_max_memory())


def _size(value: Any) -> str:
    if not isinstance(value, int | float):
        return str(value)  # as given in --max-memory
    return f"{value / (1 << 30):.1f} GiB" if value >= 1 << 30 else f"{value / (1 << 20):.0f} MiB"


def plan_device_map(model: Any, device: str, device_map: str | None, max_memory: dict[Any, str] | None,
                    allow_offload: bool = False) -> dict[str, Any]:
    """Where each module goes: everything on `device`, or accelerate's `auto` split under `max_memory`.

    A split that puts modules on the cpu (or disk) runs them at host speed, through accelerate's
    hooks: it is refused unless asked for, by `allow_offload` or an explicit cpu entry in
    `max_memory`. Without --max-memory accelerate plans from the memory free *now*, so a leftover
    holder of GPU memory would otherwise turn into a slow window that says nothing.
    """
    if device == "cpu":
        return {"": "cpu"}
    if device_map in (None, "", "cuda", "cuda:0", "0"):
        if max_memory is None:
            return {"": 0}
    elif device_map != "auto":
        raise WorkerError(f"--device-map must be 'auto' or 'cuda', found {device_map!r}", "--device-map")
    from accelerate import infer_auto_device_map

    budget = max_memory if max_memory is not None else free_memory()
    no_split = sorted(getattr(model, "_no_split_modules", None) or [])
    planned = dict(infer_auto_device_map(model, max_memory=dict(budget), no_split_module_classes=no_split))
    offloaded = [name for name, where in planned.items() if str(where) in ("cpu", "disk")]
    asked = allow_offload or any(str(key) in ("cpu", "disk") for key in (max_memory or {}))
    if offloaded and not asked:
        seen = ", ".join(f"{'GPU' + str(k) if isinstance(k, int) else k} {_size(v)}" for k, v in budget.items())
        source = "--max-memory" if max_memory is not None else "free memory now"
        raise WorkerError(
            f"--device-map auto would offload {len(offloaded)} module(s) from the GPUs to "
            f"{'/'.join(sorted({str(planned[n]) for n in offloaded}))} ({', '.join(offloaded[:4])}"
            f"{', ...' if len(offloaded) > 4 else ''}): the window would run at host speed. Planned from "
            f"{source}: {seen}. Free the GPUs (a leftover holder?), or pass --allow-offload (or a cpu entry "
            f"in --max-memory) to offload on purpose", "--device-map")
    return planned


def devices_used(device_map: dict[str, Any]) -> list[str]:
    """Distinct devices of a device map, as strings ('cpu', 'cuda:0', ...)."""
    return sorted({f"cuda:{d}" if isinstance(d, int) else str(d) for d in device_map.values()})
