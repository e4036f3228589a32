"""Issue 40, section 1, through the real commands on the drill: the rehearsal server's release answers
before its memory leaves the GPUs (`--release-frees-after`, as torch_memory_saver can: slime PR #579).
The pause route's free-VRAM wait watches the GPUs rather than trusting the answer: the window
completes, no step failed, the memory it recorded as freed is the release's, the server never
stopped and serves again; the console sent no `/flush_cache` (sglang #19029). (That no console asks a
paused server's /health, which SGLang answers 503 for the whole pause: tests/test_paused_visible.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from console.drill.layout import INFERENCE_HOST, DrillLayout
from console.procedure.engine import EXIT_DONE
from remote.drill import service as drill_service
from remote.drill import simgpu
from tests.standin_helpers import http_status
from tests.test_drafter_check import squeeze
from tests.test_standin_memory_saver import until
from tests.window_fixtures import Drill

pytestmark = pytest.mark.timeout(600)

FREES_AFTER_S = 2.0  # within the drill's vram_wait_s (5 s)
KV_FLAG = '"--kv-cache-mib", "14000"'


def test_a_release_answered_before_its_memory_left_is_waited_for_and_the_window_completes(drill: Drill) -> None:
    layout = DrillLayout.at(drill.dir)
    # the restart below is not the stuck-VRAM episode: the old server's memory leaves as it stops
    (layout.service_state / drill_service.STUCK_MARKER).touch()
    squeeze(drill, {KV_FLAG: f'{KV_FLAG}, "--release-frees-after", "{FREES_AFTER_S:g}"'})
    gpus = layout.simulated_gpus(INFERENCE_HOST)
    until(lambda: max(g["used_mib"] for g in simgpu.live_view(simgpu.read(gpus))["gpus"]) <= 40000, 30)
    pid = drill.service_pid()
    log = Path(drill.config.service.log[-1])
    done = drill.run_cli("run", "--headless", "--yes", "--route", "pause")
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    _, state = drill.only_run()
    steps = state["steps"]
    assert [s for s, step in steps.items() if step["status"] == "failed"] == []
    assert all(steps[s]["status"] == "done" for s in ("pause", "release", "free-vram", "extract", "resume", "continue"))
    svc = state["service"]
    assert svc["released_tags"] == ["kv_cache", "cuda_graph"] and svc["released"] == [] and not svc["paused"]
    before, after = svc["used_before_release_mib"], svc["used_after_release_mib"]
    # the release's memory (14000 + 1200 MiB per GPU) seen gone, not the answer's word for it
    assert all(before[g] - after[g] >= 14000 for g in before), (before, after)
    assert svc["vram_free_at"] - svc["released_at"] >= FREES_AFTER_S - 0.5
    assert drill.service_pid() == pid and http_status(drill.config.service.url + "/health", timeout=30) == 200
    text = log.read_text()
    assert "POST /release_memory_occupation" in text and "/flush_cache" not in text
