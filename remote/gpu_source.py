"""Where the telemetry agent reads GPUs from: NVML, `nvidia-smi` CSV, a simulated file, or none.

Every source answers `read() -> (gpus, processes)`:
  gpus       [{"index", "name", "uuid", "mem_used_mib", "mem_total_mib", "util_pct", "temp_c", "power_w"}]
  processes  [{"pid", "gpu", "mib"}]   (the processes holding GPU memory; `gpu` is the GPU index)
A field the source cannot read is None, never an exception (as nvitop's API does): one broken query
must not take the whole sample down. `describe_process` adds what /proc knows about a pid.
"""

from __future__ import annotations

import csv
import glob
import io
import os
import pwd
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from remote.procstat import PPID, START_TIME, read_stat

T = TypeVar("T")

SMI_GPU_FIELDS = "index,name,uuid,memory.used,memory.total,utilization.gpu,temperature.gpu,power.draw"
SMI_APP_FIELDS = "pid,gpu_uuid,used_gpu_memory"
SMI_TIMEOUT_S = 10.0


def _safe(fn: Callable[[], T]) -> T | None:
    try:
        return fn()
    except Exception:  # noqa: BLE001 - a failing field becomes null, by contract
        return None


class NoGpuSource:
    """No GPU readings, with the reason (e.g. "NVML: Driver Not Loaded; nvidia-smi: not found")."""

    name = "none"
    simulated = False

    def __init__(self, reason: str):
        self.reason = reason

    def read(self) -> tuple[list[dict], list[dict]]:
        return [], []


class NvmlSource:
    """NVML through nvidia-ml-py (`pynvml`): ~37 us a sample on an H200 (KERNELS.md)."""

    name = "nvml"
    simulated = False
    reason = None

    def __init__(self) -> None:
        import pynvml  # raises ImportError when nvidia-ml-py is missing

        self._nv = pynvml
        pynvml.nvmlInit()  # raises NVMLError ("Driver Not Loaded", "NVML Shared Library Not Found", ...)
        count = pynvml.nvmlDeviceGetCount()
        self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        # Name and uuid do not change while the driver is loaded: read them once.
        self._static = [
            {"name": _safe(lambda h=h: _text(pynvml.nvmlDeviceGetName(h))),
             "uuid": _safe(lambda h=h: _text(pynvml.nvmlDeviceGetUUID(h)))}
            for h in self._handles
        ]

    def read(self) -> tuple[list[dict], list[dict]]:
        nv = self._nv
        gpus: list[dict] = []
        processes: list[dict] = []
        for index, (handle, static) in enumerate(zip(self._handles, self._static, strict=True)):
            memory = _safe(lambda h=handle: nv.nvmlDeviceGetMemoryInfo(h))
            power_mw = _safe(lambda h=handle: nv.nvmlDeviceGetPowerUsage(h))
            gpus.append({
                "index": index,
                **static,
                "mem_used_mib": None if memory is None else memory.used // (1 << 20),
                "mem_total_mib": None if memory is None else memory.total // (1 << 20),
                "util_pct": _safe(lambda h=handle: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                "temp_c": _safe(lambda h=handle: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                "power_w": None if power_mw is None else round(power_mw / 1000.0, 1),
            })
            seen: set[int] = set()
            for getter in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
                for proc in _safe(lambda g=getter, h=handle: g(h)) or []:
                    if proc.pid in seen:
                        continue
                    seen.add(proc.pid)
                    used = getattr(proc, "usedGpuMemory", None)  # None when the driver will not say
                    processes.append({"pid": proc.pid, "gpu": index, "mib": None if used is None else used // (1 << 20)})
        return gpus, processes


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


_NUMBER = re.compile(r"^\s*(-?\d+(?:\.\d+)?)")


def smi_number(text: str | None) -> float | None:
    """'29089 MiB' -> 29089.0, '154.88 W' -> 154.88, '[N/A]' / '[Not Supported]' / '' -> None."""
    if text is None:
        return None
    match = _NUMBER.match(text)
    return float(match.group(1)) if match else None


def _smi_rows(text: str, fields: str) -> list[dict[str, str]]:
    """Rows of `nvidia-smi --format=csv[,noheader][,nounits]` output keyed by field name.

    With a header line its names are used (units dropped, any column order); without one, the
    comma-separated `fields` of the query are.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    rows = list(csv.reader(io.StringIO("\n".join(lines)), skipinitialspace=True))
    first = [re.sub(r"\s*\[.*\]$", "", h.strip()) for h in rows[0]]
    if first and first[0] in fields.split(","):
        header, rows = first, rows[1:]
    else:
        header = fields.split(",")
    return [dict(zip(header, (c.strip() for c in row), strict=False)) for row in rows if row]


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def parse_smi_gpus(text: str, fields: str = SMI_GPU_FIELDS) -> list[dict]:
    """Parse `nvidia-smi --query-gpu=FIELDS --format=csv` (header optional, units optional)."""
    gpus = []
    for row in _smi_rows(text, fields):
        index = _int_or_none(smi_number(row.get("index")))
        if index is None:
            continue
        name = row.get("name")
        uuid = row.get("uuid")
        gpus.append({
            "index": index,
            "name": name if name and not name.startswith("[") else None,
            "uuid": uuid if uuid and not uuid.startswith("[") else None,
            "mem_used_mib": _int_or_none(smi_number(row.get("memory.used"))),
            "mem_total_mib": _int_or_none(smi_number(row.get("memory.total"))),
            "util_pct": _int_or_none(smi_number(row.get("utilization.gpu"))),
            "temp_c": _int_or_none(smi_number(row.get("temperature.gpu"))),
            "power_w": smi_number(row.get("power.draw")),
        })
    return gpus


def parse_smi_apps(text: str, gpus: list[dict], fields: str = SMI_APP_FIELDS) -> list[dict]:
    """Parse `nvidia-smi --query-compute-apps=FIELDS --format=csv`; `gpus` maps uuids to indices."""
    by_uuid = {g["uuid"]: g["index"] for g in gpus if g.get("uuid")}
    processes = []
    for row in _smi_rows(text, fields):
        pid = _int_or_none(smi_number(row.get("pid")))
        if pid is None:
            continue
        processes.append({
            "pid": pid,
            "gpu": by_uuid.get(row.get("gpu_uuid")),
            # `used_memory` is the older name of `used_gpu_memory`; nvidia-smi accepts both.
            "mib": _int_or_none(smi_number(row.get("used_gpu_memory", row.get("used_memory")))),
        })
    return processes


class SmiSource:
    """`nvidia-smi` CSV: two processes a sample (~25 ms each), for hosts without nvidia-ml-py."""

    name = "nvidia-smi"
    simulated = False
    reason = None

    def __init__(self, binary: str | None = None) -> None:
        found = binary or shutil.which("nvidia-smi")
        if not found:
            raise FileNotFoundError("not found on PATH")
        self._binary = found
        self._query("--query-gpu=index", "--format=csv,noheader")  # fails now if the driver is unusable

    def _query(self, *args: str) -> str:
        done = subprocess.run([self._binary, *args], capture_output=True, text=True, timeout=SMI_TIMEOUT_S)
        if done.returncode != 0:
            first = (done.stdout + done.stderr).strip().splitlines()
            raise RuntimeError(first[0] if first else f"exit {done.returncode}")
        return done.stdout

    def read(self) -> tuple[list[dict], list[dict]]:
        gpus = parse_smi_gpus(self._query(f"--query-gpu={SMI_GPU_FIELDS}", "--format=csv"))
        apps = _safe(lambda: self._query(f"--query-compute-apps={SMI_APP_FIELDS}", "--format=csv"))
        return gpus, parse_smi_apps(apps or "", gpus)


class SimulatedSource:
    """A drill host's simulated GPUs (see `remote.drill.simgpu`); every sample is marked simulated."""

    name = "simulated"
    simulated = True
    reason = None

    def __init__(self, path: str | os.PathLike) -> None:
        self._path = Path(path)

    def read(self) -> tuple[list[dict], list[dict]]:
        from remote.drill import simgpu  # only drill hosts have it: a real host gets no remote/drill/

        try:
            view = simgpu.live_view(simgpu.read(self._path))
        except FileNotFoundError:
            # Not written yet: the drill host has its GPUs but nothing has run on them.
            view = simgpu.live_view(simgpu.default_layout())
        gpus = [
            {
                "index": g["index"],
                "name": g.get("name"),
                "uuid": g.get("uuid"),
                "mem_used_mib": g["used_mib"],
                "mem_total_mib": g.get("total_mib"),
                "util_pct": g.get("util_pct"),
                "temp_c": g.get("temp_c"),
                "power_w": g.get("power_w"),
            }
            for g in view["gpus"]
        ]
        return gpus, [{"pid": p["pid"], "gpu": p.get("gpu"), "mib": p.get("mib")} for p in view["processes"]]


def open_source(kind: str = "auto", simulate: str | None = None) -> NvmlSource | SmiSource | SimulatedSource | NoGpuSource:
    """The first source that works, in order NVML, nvidia-smi; else `NoGpuSource` with every reason."""
    if simulate:
        return SimulatedSource(simulate)
    reasons = []
    if kind in ("auto", "nvml"):
        try:
            return NvmlSource()
        except ImportError:
            reasons.append("NVML: nvidia-ml-py is not installed")
        except Exception as exc:  # noqa: BLE001 - NVMLError and friends: keep the driver's words
            reasons.append(f"NVML: {_text(exc) or type(exc).__name__}")
    if kind in ("auto", "nvidia-smi"):
        try:
            return SmiSource()
        except Exception as exc:  # noqa: BLE001
            reasons.append(f"nvidia-smi: {exc}")
    if kind == "none":
        reasons.append("GPU readings turned off (--source none)")
    return NoGpuSource("; ".join(reasons))


def _proc_text(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


NVIDIA_DEVICES = "/dev/nvidia"  # the driver's device files: /dev/nvidia0.., nvidiactl, nvidia-uvm


def nvidia_devices_present() -> bool:
    """True when this host (this mount namespace) has NVIDIA device files: only then can NVML report
    processes, and only then is a holder's descriptor check meaningful (a drill host's simulated
    GPUs have none, and their holders are local pids)."""
    return bool(glob.glob(glob.escape(NVIDIA_DEVICES) + "*"))


def holds_nvidia_device(pid: int) -> bool | None:
    """True when `pid` has a /dev/nvidia* file open, False when it has none (or does not exist), None
    when its descriptors cannot be read (another user's process, and this is not root)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except PermissionError:
        return None
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"/proc/{pid}/fd/{name}").startswith(NVIDIA_DEVICES):
                return True
        except OSError:
            continue
    return False


def in_host_pid_namespace() -> bool | None:
    """True when this process sees the host's pids (its NSpid has one entry), False inside a child
    pid namespace (a container), None when the kernel does not say (before Linux 4.1)."""
    text = _proc_text(os.getpid(), "status") or ""
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            return len(line.split()) == 2
    return None


_CONFIRMED: dict[tuple[int, int], bool] = {}  # (pid, start time) seen holding a /dev/nvidia* file


def gpu_visibility(pid: int, fields: list[str] | None = None) -> tuple[bool, str | None]:
    """(visible, reason): whether `pid`, a pid NVML reported, names the GPU process here.

    NVML reports host pids; inside a container /proc/<pid> can be another process or none. So a pid
    counts as visible when it holds a /dev/nvidia* file open. When its descriptors cannot be read
    (another user's process), it counts as visible only in the host's pid namespace, where NVML's
    pid is this pid. Without NVIDIA device files (simulated GPUs) there is nothing to check against.
    """
    if not nvidia_devices_present():
        return True, None
    fields = read_stat(pid) if fields is None else fields
    if fields is None:
        return False, f"pid {pid} does not exist in this pid namespace (NVML reports host pids)"
    key = (pid, _safe(lambda: int(fields[START_TIME])) or 0)
    if key in _CONFIRMED:
        return True, None
    holds = holds_nvidia_device(pid)
    if holds:
        if len(_CONFIRMED) > 4096:
            _CONFIRMED.clear()
        _CONFIRMED[key] = True
        return True, None
    if holds is False:
        return False, (f"pid {pid} here holds no /dev/nvidia* file: not the process NVML reported "
                       "(another pid namespace, or the pid was reused)")
    if in_host_pid_namespace():
        return True, "its file descriptors are not readable as this user; the host's pid namespace, so NVML's pid is this one"
    return False, (f"cannot confirm pid {pid}: its file descriptors are not readable as this user, and this "
                   "is not the host's pid namespace")


def describe_process(pid: int) -> dict:
    """What /proc says about `pid`: user, command line, ppid, ancestors, start time, cgroup, and
    whether it is visible from here (`visible`, `visible_reason`: see `gpu_visibility`).

    `start_time` (clock ticks since boot) identifies the process: a pid reused later has another, so
    the console can end exactly the process it listed. Fields /proc will not give are None (a process
    in another pid namespace, as seen from a container, has none at all). A process with
    `visible: false` must not be offered for ending: the pid NVML gave names another process here, or
    none (`remote.endpids` refuses it too).
    """
    info: dict[str, Any] = {"user": None, "command": None, "ppid": None, "ancestors": [], "start_time": None,
                            "cgroup": None, "visible": False, "visible_reason": None}
    fields = read_stat(pid)
    info["visible"], info["visible_reason"] = gpu_visibility(pid, fields)
    if fields is None:
        return info
    info["ppid"] = _safe(lambda: int(fields[PPID]))
    info["start_time"] = _safe(lambda: int(fields[START_TIME]))
    cmdline = _proc_text(pid, "cmdline")
    if cmdline:
        info["command"] = cmdline.rstrip("\0").replace("\0", " ")
    else:
        info["command"] = _proc_text(pid, "comm")
        info["command"] = info["command"].strip() if info["command"] else None
    info["user"] = _safe(lambda: pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name)
    cgroup = _proc_text(pid, "cgroup")
    if cgroup:
        # cgroup v2 is one line "0::/system.slice/sglang.service"; with v1, prefer the systemd line.
        lines = [line.split(":", 2) for line in cgroup.splitlines() if line.count(":") >= 2]
        chosen = next((p for h, c, p in lines if h == "0"), None) or next((p for h, c, p in lines if "name=systemd" in c), None)
        info["cgroup"] = chosen
    ancestors = []
    parent = info["ppid"]
    while parent and parent > 1 and len(ancestors) < 64:
        ancestors.append(parent)
        parent_fields = read_stat(parent)
        parent = _safe(lambda f=parent_fields: int(f[PPID])) if parent_fields else None
    info["ancestors"] = ancestors
    return info


def host_memory() -> dict[str, int | None]:
    """Host RAM in MiB from /proc/meminfo: total and available."""
    values: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            text = fh.read()
    except OSError:
        return {"total_mib": None, "available_mib": None}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        number = smi_number(rest)
        if number is not None:
            values[key] = int(number) // 1024
    return {"total_mib": values.get("MemTotal"), "available_mib": values.get("MemAvailable")}
