"""The telemetry agent: no GPU, the simulated source, nvidia-smi parsing on recorded output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote import agent, gpu_source
from remote.drill import simgpu

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "recorded_h200"


def run_agent(*args: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "remote.agent", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def lines(done: subprocess.CompletedProcess) -> list[dict]:
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_agent_without_gpu_streams_samples_with_the_reason():
    env = {**os.environ, "PATH": "/usr/bin:/bin"}  # no nvidia-smi here, and no NVML library
    done = run_agent("--interval", "0.2", "--count", "3", env=env)
    assert done.returncode == 0, done.stderr
    samples = lines(done)
    assert [s["seq"] for s in samples] == [0, 1, 2]
    assert all(s["source"] == "none" and s["gpus"] == [] and not s["simulated"] for s in samples)
    assert "NVML" in samples[0]["reason"] and "nvidia-smi" in samples[0]["reason"]
    assert samples[0]["ram"]["total_mib"] > 0
    # One line per interval, on the interval's grid.
    assert 0.3 <= samples[2]["t"] - samples[0]["t"] <= 1.0


def test_interval_outside_the_allowed_range_is_refused():
    done = run_agent("--interval", "0.05", "--count", "1")
    assert done.returncode == 2
    assert "--interval 0.05: expected 0.2 to 10 seconds" in done.stderr


def test_agent_ends_when_its_reader_goes_away():
    proc = subprocess.Popen([sys.executable, "-m", "remote.agent", "--interval", "0.2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert json.loads(proc.stdout.readline())["seq"] == 0
        proc.stdout.close()
        assert proc.wait(timeout=5) == 0
        assert b"Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_simulated_source_counts_only_live_holders_and_enriches_them(tmp_path: Path):
    sim = tmp_path / "gpu.json"
    live = subprocess.Popen(["sleep", "60"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        simgpu.hold(sim, live.pid, 30000, gpus=[1])
        simgpu.hold(sim, dead.pid, 12000)  # died without releasing: the driver would have freed it
        done = run_agent("--simulate", str(sim), "--interval", "0.2", "--count", "2")
        samples = lines(done)
        assert len(samples) == 2 and all(s["simulated"] and s["source"] == "simulated" for s in samples)
        gpus = {g["index"]: g for g in samples[-1]["gpus"]}
        assert gpus[0]["mem_used_mib"] == 0 and gpus[1]["mem_used_mib"] == 30000
        assert gpus[1]["mem_total_mib"] == simgpu.DEFAULT_TOTAL_MIB
        (proc,) = samples[-1]["processes"]
        assert proc["pid"] == live.pid and proc["gpu"] == 1 and proc["mib"] == 30000
        assert proc["command"] == "sleep 60"
        assert os.getpid() in proc["ancestors"]  # the test started it: its process tree is known
        assert proc["start_time"] > 0 and proc["user"]
    finally:
        live.kill()
        live.wait()


def test_concurrent_writers_do_not_clobber_each_other(tmp_path: Path):
    sim = tmp_path / "gpu.json"
    holders = [subprocess.Popen(["sleep", "60"]) for _ in range(6)]
    writers = [subprocess.Popen([sys.executable, "-c",
                                 f"from remote.drill import simgpu; simgpu.hold({str(sim)!r}, {h.pid}, 1000)"], cwd=ROOT)
               for h in holders]
    try:
        assert all(w.wait(timeout=30) == 0 for w in writers)
        view = simgpu.live_view(simgpu.read(sim))
        assert sorted({p["pid"] for p in view["processes"]}) == sorted(h.pid for h in holders)
        assert [g["used_mib"] for g in view["gpus"]] == [6000, 6000]
    finally:
        for h in holders:
            h.kill()
            h.wait()


def test_recorded_h200_query_gpu_parses_with_and_without_header():
    expected = {"index": 0, "name": "NVIDIA H200", "uuid": "GPU-cb4d5805-695f-2497-bbc3-b86b49c0e68d",
                "mem_used_mib": 0, "mem_total_mib": 143771, "util_pct": 7, "temp_c": 38}
    bare = gpu_source.parse_smi_gpus((RECORDED / "query_gpu.csv").read_text())
    headed = gpu_source.parse_smi_gpus((RECORDED / "query_gpu_header.csv").read_text())
    assert bare == [{**expected, "power_w": 113.62}]
    assert headed == [{**expected, "power_w": 114.55}]


def test_recorded_compute_apps_map_to_gpu_indices():
    gpus = gpu_source.parse_smi_gpus((RECORDED / "query_gpu.csv").read_text())
    fields = "pid,used_memory,process_name,gpu_uuid"  # the query used for the recording (README)
    apps = gpu_source.parse_smi_apps((RECORDED / "apps_while_alloc.csv").read_text(), gpus, fields)
    assert apps == [{"pid": 528, "gpu": 0, "mib": 5288}]
    assert gpu_source.parse_smi_apps((RECORDED / "apps_idle.csv").read_text(), gpus, fields) == []


def test_unsupported_fields_become_null():
    text = ("index, name, uuid, memory.used [MiB], memory.total [MiB], utilization.gpu [%], temperature.gpu, power.draw [W]\n"
            "0, NVIDIA H200, GPU-x, 47179 MiB, 143771 MiB, [N/A], 38, [Not Supported]\n")
    (gpu,) = gpu_source.parse_smi_gpus(text)
    assert gpu["mem_used_mib"] == 47179 and gpu["util_pct"] is None and gpu["power_w"] is None


cell = st.one_of(st.integers(0, 10**6).map(str), st.sampled_from(["[N/A]", "[Not Supported]", "", "N/A", "12.5 W"]))


@given(st.lists(st.tuples(st.integers(0, 15), cell, cell, cell, cell), max_size=8))
def test_smi_parsing_never_raises_and_keeps_indices(rows):
    text = "".join(f"{i}, GPU name, GPU-{i}, {a}, {b}, {c}, 40, {d}\n" for i, a, b, c, d in rows)
    parsed = gpu_source.parse_smi_gpus(text)
    assert [g["index"] for g in parsed] == [r[0] for r in rows]
    for g in parsed:
        assert all(g[k] is None or isinstance(g[k], int | float) for k in ("mem_used_mib", "util_pct", "power_w"))


def test_nvidia_smi_source_end_to_end_with_a_stand_in_binary(tmp_path: Path):
    """The nvidia-smi source runs the binary it finds on PATH; here a script replaying recorded output."""
    binary = tmp_path / "nvidia-smi"
    binary.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *query-compute-apps*) echo "pid, gpu_uuid, used_gpu_memory [MiB]"; '
        f'echo "{os.getpid()}, GPU-cb4d5805-695f-2497-bbc3-b86b49c0e68d, 5288 MiB" ;;\n'
        f'  *memory.used*) cat {RECORDED / "query_gpu_header.csv"} ;;\n'
        '  *) echo 0 ;;\n'
        "esac\n")
    binary.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}
    done = run_agent("--source", "nvidia-smi", "--count", "1", env=env)
    (sample,) = lines(done)
    assert sample["source"] == "nvidia-smi" and sample["reason"] is None
    assert sample["gpus"][0]["mem_total_mib"] == 143771
    (proc,) = sample["processes"]
    assert proc["pid"] == os.getpid() and proc["mib"] == 5288 and proc["gpu"] == 0
    # Enriched from /proc, like an NVML reading: the command line this process shows there (under
    # pytest-xdist, with setproctitle installed, that is the worker's title, not "python ...").
    shown = Path(f"/proc/{os.getpid()}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    assert proc["command"] and proc["command"].split()[0] in shown


class _BrokenSource:
    """A source whose reads fail mid-stream (a driver that went away): a named stand-in."""

    name = "nvml"
    simulated = False
    reason = None

    def read(self):
        raise RuntimeError("GPU is lost")


def test_a_failing_source_gives_a_sample_with_the_reason_not_a_crash():
    sample = agent.take_sample(_BrokenSource(), 7, 1.0, "h")
    assert sample["seq"] == 7 and sample["gpus"] == [] and sample["reason"] == "nvml: GPU is lost"


def test_process_details_of_a_vanished_pid_are_null():
    gone = subprocess.Popen(["true"])
    gone.wait()
    time.sleep(0.05)
    info = gpu_source.describe_process(gone.pid)
    assert info["command"] is None and info["user"] is None and info["ancestors"] == []


def test_source_none_says_it_was_turned_off():
    source = gpu_source.open_source("none")
    assert source.name == "none" and "turned off" in source.reason


def test_a_malformed_simulated_file_is_reported_in_the_sample(tmp_path: Path):
    sim = tmp_path / "gpu.json"
    sim.write_text('{"gpus": "two"}')
    (sample,) = lines(run_agent("--simulate", str(sim), "--count", "1"))
    assert sample["simulated"] and sample["gpus"] == []
    assert sample["reason"] == f"simulated: {sim}: not a simulated GPU file (no 'gpus' list)"


def test_holders_not_visible_from_this_namespace_are_marked(monkeypatch, tmp_path: Path):
    """NVML gives host pids; in a container /proc/<pid> may be another process or none. A holder is
    `visible` only when the pid holds a /dev/nvidia* file here; otherwise `visible: false` with the
    reason, in the sample the console reads (and `remote.endpids` refuses such a pid)."""
    device = tmp_path / "nvidia0"
    device.write_bytes(b"")
    monkeypatch.setattr(gpu_source, "NVIDIA_DEVICES", str(tmp_path / "nvidia"))
    holder = subprocess.Popen([sys.executable, "-c", f"import time; fh = open({str(device)!r}); print('up', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE)
    other = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        assert holder.stdout.readline().strip() == other.stdout.readline().strip() == b"up"

        class Source:
            name, simulated, reason = "nvml", False, None

            def read(self):
                return [], [{"pid": p, "gpu": 0, "mib": 100} for p in (holder.pid, other.pid, gone.pid)]

        procs = {p["pid"]: p for p in agent.take_sample(Source(), 0, 1.0, "h")["processes"]}
        assert procs[holder.pid]["visible"] is True and procs[holder.pid]["visible_reason"] is None
        assert procs[other.pid]["visible"] is False
        assert "holds no /dev/nvidia* file: not the process NVML reported" in procs[other.pid]["visible_reason"]
        assert procs[other.pid]["command"]  # /proc still describes what the pid names here
        assert procs[gone.pid]["visible"] is False and "does not exist in this pid namespace" in procs[gone.pid]["visible_reason"]
        # A host without NVIDIA device files (a drill host's simulated GPUs): local pids, nothing to check.
        monkeypatch.setattr(gpu_source, "NVIDIA_DEVICES", str(tmp_path / "none-here"))
        assert gpu_source.describe_process(other.pid)["visible"] is True
    finally:
        for proc in (holder, other):
            proc.kill()
            proc.wait()
            proc.stdout.close()


def test_unreadable_descriptors_count_as_visible_only_in_the_hosts_pid_namespace(monkeypatch, tmp_path: Path):
    (tmp_path / "nvidia0").write_bytes(b"")
    monkeypatch.setattr(gpu_source, "NVIDIA_DEVICES", str(tmp_path / "nvidia"))
    monkeypatch.setattr(gpu_source, "holds_nvidia_device", lambda pid: None)  # another user's process
    monkeypatch.setattr(gpu_source, "in_host_pid_namespace", lambda: True)
    assert gpu_source.gpu_visibility(os.getpid())[0] is True
    monkeypatch.setattr(gpu_source, "in_host_pid_namespace", lambda: False)
    visible, reason = gpu_source.gpu_visibility(os.getpid())
    assert visible is False and reason.startswith(f"cannot confirm pid {os.getpid()}")


@given(st.lists(st.integers(min_value=0, max_value=7), min_size=1, max_size=4))
@settings(max_examples=30, deadline=None)
def test_a_servers_gpu_indices_round_trip_and_bad_ones_are_refused(indices: list[int]):
    """`--gpu-indices` (a fleet's replicas sharing one host's simulated file): what the drill writes
    reads back as written; anything else is refused, never taken as every GPU."""
    assert simgpu.parse_indices(",".join(map(str, indices))) == indices
    assert simgpu.parse_indices(None) is None and simgpu.parse_indices("") is None
    for bad in ("1,,2", "a", "-1", "1;2"):
        with pytest.raises(ValueError):
            simgpu.parse_indices(bad)


def test_a_hold_on_a_gpu_the_file_lacks_names_the_file(tmp_path: Path):
    sim = tmp_path / "gpus.json"
    simgpu.update(sim, lambda d: None, simgpu.default_layout(2))
    simgpu.hold(sim, 4242, 1000, gpus=[1])
    with pytest.raises(ValueError, match=r"gpus.json: no GPU \[2, 3\] \(it has \[0, 1\]\)"):
        simgpu.hold(sim, 4243, 1000, gpus=[1, 2, 3])
    assert [p["gpu"] for p in simgpu.read(sim)["processes"]] == [1]  # the refused hold changed nothing
