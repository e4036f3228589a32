"""Issue 40, item 4, through the real commands on the drill: the rehearsal server loses its drafter to
a `weights` release as SGLang 0.5.23 does (PR #31674). The run measures the served acceptance length
before the window and after the continue; the fall ends it degraded (exit 5), both figures said in
its output, its journal, `runs` and the report, and the restart that loads the drafter again is said
as the remedy, never taken by `--yes` (an operator's yes restarts it: tests/test_pause_weights.py). (A fixed SGLang, `--draft-weights-survive-release`: tests/test_specdecode.py and
the pause sweep's drafter cases.)"""

from __future__ import annotations

import subprocess

import pytest

from console.procedure.engine import EXIT_DEGRADED, EXIT_FAILED
from tests.standin_helpers import wait_status
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env

pytestmark = pytest.mark.timeout(600)

# The server fills its simulated GPUs with weights (49000 of 49140 MiB, a sliver of KV cache and graphs):
# the extraction then fits only once the weights are released too (to their CPU backup).
SQUEEZED = {'"--gpu-mib", "40000"': '"--gpu-mib", "49000"', '"--kv-cache-mib", "14000"': '"--kv-cache-mib", "100"',
            '"--cuda-graph-mib", "1200"': '"--cuda-graph-mib", "50"'}


def squeeze(drill: Drill, changes: dict[str, str] = SQUEEZED) -> None:
    """The server started again with `changes` to its start command (in the middle of it: `rearm` then
    starts the drill's own again for the next test)."""
    service = drill.config.service
    text = drill.config_path.read_text()
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new)
    drill.config_path.write_text(text)  # the drill's next test gets its own config back (rearm)
    drill.service_command(service.stop)
    drill.service_command(drill.config.service.start)
    wait_status(service.url + "/health", 200, timeout=60)


def test_a_drafter_lost_to_the_weights_release_ends_the_pause_route_degraded(drill: Drill) -> None:
    squeeze(drill)
    done = drill.run_cli("run", "--headless", "--yes", "--route", "pause")
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == EXIT_DEGRADED, out
    run_id, state = drill.only_run()
    assert state["status"] == "degraded" and "weights" in state["service"]["released_tags"]
    # Issue 40, item 5: the target's weights were checked by /weights_checker's checksum, the same before the
    # release and after the resume (the drafter's own weights, lost, are the drafter check's: left out).
    svc = state["service"]
    assert svc["weights_check"] == "checksum" and svc["probe_tokens"] is None
    assert svc["weights_checksum_before"] == svc["weights_checksum_after"] and len(svc["weights_checksum_after"]) == 64
    record = state["facts"]["drafter"]
    before, after = record["before"], record["after"]
    assert before > 2.0 and after < 1.2, record  # the reference drafter, then nearly nothing accepted
    figures = f"acceptance length {before:.2f} before the window, {after:.2f} after"
    assert figures in out, out
    assert "not asked under --yes" in out and "a restart of the server loads the drafter again" in out, out
    assert "restarted" not in record and not any(e.get("step") == "drafter" and e.get("kind") == "question"
                                                 for e in drill.journal())
    journal = drill.journal()
    release = next(e for e in journal if e.get("kind") == "question" and e.get("step") == "release")
    assert "DRAFTER MAY COME BACK WRONG" in release["data"]["impact"]
    runs = subprocess.run([ENTRY_POINT, "runs", "--runs", str(drill.runs)], capture_output=True, text=True,
                          timeout=60, env=cli_env())
    assert "degraded" in runs.stdout and f"{before:.2f} -> {after:.2f}" in " ".join(runs.stdout.split()), runs.stdout
    assert figures in (drill.runs / run_id / "report.md").read_text()


def test_target_weights_that_come_back_wrong_fail_the_window_naming_both_checksums(drill: Drill) -> None:
    """Issue 40, item 5: `--weights-come-back-wrong` changes the target's lm_head at the resume, every logit
    alike, so the greedy tokens stay the same; /weights_checker's checksum after the resume is not the one
    before the release, and the run fails naming both and the remedy (a restart), which --yes never takes.
    The server serves on (given back all the same)."""
    squeeze(drill, {**SQUEEZED, '"--enable-weights-cpu-backup",': '"--enable-weights-cpu-backup", '
                                                                   '"--weights-come-back-wrong", "0.001",'})
    done = drill.run_cli("run", "--headless", "--yes", "--route", "pause")
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == EXIT_FAILED, out
    _, state = drill.only_run()
    svc = state["service"]
    before, after = svc["weights_checksum_before"], svc["weights_checksum_after"]
    assert state["status"] == "failed" and state["steps"]["continue"]["status"] == "failed", state["steps"]
    assert before and after and before != after and "weights" in svc["released_tags"]
    assert f"checksum {after} after the resume, {before} before the release" in out, out
    # The remedy, a restart that reloads the weights, is said; --yes never takes it on its own.
    assert "--yes never restarts the server on its own" in out and "a restart loads its weights again" in out, out
    assert svc["stops"] == 0 and svc["starts"] == 0 and "weights_restart" in state["facts"], svc
    assert not svc["paused"] and not svc["released"]  # given back: the server takes requests again
    wait_status(drill.config.service.url + "/ready", 200, timeout=30)
