"""The simulated GPU memory of a drill host: one JSON file, shared by its writers and the agent.

Drill hosts have no GPU, so the rehearsal server (`remote.drill.standin`) "allocates" memory by writing
an entry under its holder's pid into this file, and the telemetry agent (`remote.agent --simulate`)
reads it as if it were NVML. File shape:

    {"gpus": [{"index": 0, "name": "SIMULATED ...", "uuid": "SIM-...", "total_mib": 49140}],
     "processes": [{"pid": 1234, "gpu": 0, "mib": 46000}]}

The server's GPU worker holds its `--gpu-mib` per GPU under its own pid; with the memory saver the
server rewrites that entry as it releases and resumes its KV cache, graphs and weights
(`remote.drill.memory_saver`), so readers see the memory leave and come back.

Like a real driver, a reader counts only entries whose process is alive: when a holder dies (even by
SIGKILL, with no chance to clean up) its memory is free. Writers take an exclusive `flock` on
`FILE.lock`, read, modify and replace the file atomically (temp + rename), so concurrent writers never
clobber each other and a reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from remote.artifacts import write_json_atomic
from remote.drill.locks import locked
from remote.procstat import pid_alive

DEFAULT_GPU_NAME = "SIMULATED NVIDIA L40S"
DEFAULT_TOTAL_MIB = 46068


def default_layout(count: int = 2, total_mib: int = DEFAULT_TOTAL_MIB, name: str = DEFAULT_GPU_NAME) -> dict:
    """An empty simulated host with `count` GPUs (the story's inference host had 2 x 48 GB)."""
    gpus = [
        {"index": i, "name": name, "uuid": f"SIM-GPU-{i:08d}", "total_mib": total_mib} for i in range(count)
    ]
    return {"gpus": gpus, "processes": []}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with locked(f"{path}.lock"):
        yield


def read(path: str | os.PathLike) -> dict:
    """Read the file as written (dead holders included); raise ValueError naming a bad file."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a simulated GPU file ({exc})") from exc
    if not isinstance(data, dict) or not isinstance(data.get("gpus"), list):
        raise ValueError(f"{path}: not a simulated GPU file (no 'gpus' list)")
    data.setdefault("processes", [])
    return data


def update(path: str | os.PathLike, change: Callable[[dict], None], layout: dict | None = None) -> dict:
    """Apply `change` to the file's content under the lock and replace it atomically.

    A missing file starts from `layout` (default: `default_layout()`). Returns the new content.
    """
    path = Path(path)
    with _locked(path):
        try:
            data = read(path)
        except FileNotFoundError:
            data = json.loads(json.dumps(layout or default_layout()))
        change(data)
        write_json_atomic(path, data)
    return data


def parse_indices(text: str | None) -> list[int] | None:
    """"2,3" -> [2, 3] (a server's own GPUs of a shared file); None or "" -> None (every GPU).
    Raises ValueError for anything but comma-separated indices >= 0."""
    if not text:
        return None
    indices = [int(part) for part in text.split(",")]
    if any(i < 0 for i in indices):
        raise ValueError(f"negative GPU index in {text!r}")
    return indices


def hold(path: str | os.PathLike, pid: int, mib_per_gpu: int, gpus: list[int] | None = None) -> dict:
    """Record `pid` as holding `mib_per_gpu` on each of `gpus` (default: every GPU of the file)."""

    def change(data: dict) -> None:
        present = [g["index"] for g in data["gpus"]]
        indices = gpus if gpus is not None else present
        if set(indices) - set(present):
            raise ValueError(f"{path}: no GPU {sorted(set(indices) - set(present))} (it has {present})")
        data["processes"] = [p for p in data["processes"] if p.get("pid") != pid]
        data["processes"] += [{"pid": pid, "gpu": i, "mib": int(mib_per_gpu)} for i in indices]

    return update(path, change)


def release(path: str | os.PathLike, pid: int) -> dict:
    """Remove every entry held by `pid`."""

    def change(data: dict) -> None:
        data["processes"] = [p for p in data["processes"] if p.get("pid") != pid]

    return update(path, change)


def live_view(data: dict[str, Any]) -> dict[str, Any]:
    """The file as a driver would report it: dead holders dropped, used memory summed per GPU."""
    processes = [p for p in data.get("processes", []) if isinstance(p.get("pid"), int) and pid_alive(p["pid"])]
    gpus = []
    for gpu in data.get("gpus", []):
        used = int(gpu.get("base_used_mib", 0)) + sum(int(p.get("mib", 0)) for p in processes if p.get("gpu") == gpu["index"])
        gpus.append({**gpu, "used_mib": used})
    return {"gpus": gpus, "processes": processes}
