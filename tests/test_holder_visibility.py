"""A holder NVML names by a host pid that is no GPU process in this namespace (a container) is shown
but never offered to end: the agent's real sample, through the console's parser and the waiter."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from console.service.vram import find_holders
from console.telemetry import parse_sample
from remote import agent, gpu_source


class OneHolder:
    """A source naming one process on GPU 0 (what NVML reports), as the real sources' read() do."""

    name, simulated, reason = "nvml", False, None

    def __init__(self, pid: int):
        self.pid = pid

    def read(self):
        gpus = [{"index": 0, "name": "GPU", "uuid": None, "mem_used_mib": 47000, "mem_total_mib": 49140,
                 "util_pct": 0.0, "temp_c": 30.0, "power_w": 50.0}]
        return gpus, [{"pid": self.pid, "gpu": 0, "mib": 47000}]


@pytest.mark.parametrize("visible", [True, False])
def test_an_invisible_holder_is_listed_but_marked(monkeypatch: pytest.MonkeyPatch, visible: bool) -> None:
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        # In a container the agent finds no /dev/nvidia* file held by NVML's pid: gpu_visibility says so.
        monkeypatch.setattr(gpu_source, "gpu_visibility", lambda pid, fields=None: (
            (True, None) if visible else (False, f"pid {pid} here holds no /dev/nvidia* file")))
        line = json.dumps(agent.take_sample(OneHolder(sleeper.pid), 1, 1.0, "ct129"))
        (holder,) = find_holders(parse_sample(line), [0])
        assert holder.pid == sleeper.pid and holder.mib == 47000
        assert holder.visible is visible
        assert (holder.visible_reason is None) is visible
    finally:
        sleeper.kill()
        sleeper.wait()
