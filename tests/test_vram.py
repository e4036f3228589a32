"""The VRAM waiter's decisions, and ending exactly the listed holders (real processes)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from console.messages import EndOutcome, GpuProcess, GpuReading, TelemetrySample, VramHolder
from console.service.vram import (
    VramError,
    endpids_argv,
    find_holders,
    parse_end_results,
    used_summary,
    vram_free,
    wait_vram_free,
)
from console.telemetry import TelemetryStream
from remote import endpids
from remote.drill import simgpu
from remote.gpu_source import describe_process

ROOT = Path(__file__).resolve().parents[1]


def sample(used: list[int | None], processes: tuple[GpuProcess, ...] = ()) -> TelemetrySample:
    gpus = tuple(GpuReading(i, "H200", f"GPU-{i}", u, 143771, 0, 30, 100) for i, u in enumerate(used))
    return TelemetrySample("ct129", 0, 0.0, 1.0, "nvml", False, None, gpus, processes)


@pytest.mark.parametrize("used, gpus, free", [
    ([0, 0], (), True),
    ([0, 47179], (), False),
    ([0, 47179], (0,), True),  # only the service's GPUs count
    ([1023, 12], (0, 1), True),
    ([1024, 12], (0, 1), False),  # under the threshold, not at it
    ([None, 0], (0, 1), False),  # an unreadable GPU is not free
    ([], (), False),  # no readings: cannot say free
    ([0, 0], (5,), False),  # the service's GPU is not on this host: never free
])
def test_vram_free(used, gpus, free):
    assert vram_free(sample(used), gpus, 1024) is free


@given(st.lists(st.integers(0, 150_000), min_size=1, max_size=8), st.integers(1, 150_000))
def test_free_iff_every_gpu_is_under_threshold(used, threshold):
    assert vram_free(sample(used), (), threshold) == all(u < threshold for u in used)


def test_holders_are_grouped_per_pid_and_marked_when_they_were_the_service():
    procs = (
        GpuProcess(4242, 0, 46000, "root", "sglang::scheduler_TP0", start_time=11),
        GpuProcess(4242, 1, 45000, "root", "sglang::scheduler_TP0", start_time=11),
        GpuProcess(5000, 1, 500, "alice", "python notebook.py", start_time=22),
        GpuProcess(6000, 3, 9000, "bob", "python other.py", start_time=33),
    )
    holders = find_holders(sample([46500, 45500, 0, 9000], procs), (0, 1), service_pids=[4242])
    assert holders == [
        VramHolder(4242, 91000, (0, 1), "sglang::scheduler_TP0", "root", 11, True),
        VramHolder(5000, 500, (1,), "python notebook.py", "alice", 22, False),
    ]


def test_endpids_command_names_each_process_by_pid_and_start_time():
    holders = [VramHolder(4242, 91000, (0, 1), "x", "root", 11, True), VramHolder(5000, 1, (1,), "y", "a", None, False)]
    assert endpids_argv("python3", "/code", holders, 10, sudo=True) == [
        "sudo", "-n", "env", "PYTHONPATH=/code", "python3", "-m", "remote.endpids", "--grace", "10", "4242:11", "5000"]


def test_endpids_answer_is_checked():
    assert parse_end_results('noise\n{"results": [{"pid": 5, "outcome": "killed", "detail": "d", "after_s": 1.5}]}') == [
        EndOutcome(5, "killed", "d", 1.5)]
    with pytest.raises(VramError, match="gave no result"):
        parse_end_results("Traceback (most recent call last): ...")


def _spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"up"  # its signal handlers are installed
    return proc


def test_endpids_ends_exactly_the_listed_processes_and_reports_each():
    polite = _spawn("import time; print('up', flush=True); time.sleep(60)")
    stubborn = _spawn("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)")
    bystander = _spawn("import time; print('up', flush=True); time.sleep(60)")
    gone = subprocess.Popen(["true"])
    gone.wait()
    try:
        targets = [(polite.pid, describe_process(polite.pid)["start_time"]),
                   (stubborn.pid, describe_process(stubborn.pid)["start_time"]),
                   (bystander.pid, describe_process(bystander.pid)["start_time"] + 1),  # pid reused since listed
                   (gone.pid, None)]
        done = subprocess.run([sys.executable, "-m", "remote.endpids", "--grace", "1",
                               *[f"{p}:{s}" if s is not None else str(p) for p, s in targets]],
                              cwd=ROOT, capture_output=True, text=True, timeout=30)
        outcomes = {r["pid"]: r for r in json.loads(done.stdout)["results"]}
        assert outcomes[polite.pid]["outcome"] == "terminated"
        assert outcomes[stubborn.pid]["outcome"] == "killed" and outcomes[stubborn.pid]["after_s"] >= 1
        assert outcomes[bystander.pid]["outcome"] == "replaced"
        assert outcomes[gone.pid]["outcome"] == "gone"
        assert polite.wait(5) != 0 and stubborn.wait(5) == -9
        time.sleep(0.2)
        assert bystander.poll() is None  # never touched
    finally:
        for proc in (polite, stubborn, bystander):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()


def test_endpids_refuses_pid_one_and_nonsense():
    for bad in ("1", "abc", "12:x"):
        with pytest.raises(SystemExit):
            endpids.main([bad])


class LocalHost:
    """A stand-in for an SSH `Host` that runs the command on this machine (the stream part only)."""

    async def stream(self, argv: list[str], stdin=None):
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE, cwd=ROOT,
                                                    stdin=asyncio.subprocess.PIPE if stdin else asyncio.subprocess.DEVNULL,
                                                    env={"PATH": "/usr/bin:/bin"})
        if stdin:
            stdin(lambda text: proc.stdin.write(text.encode()))
        try:
            async for line in proc.stdout:
                yield line.decode().rstrip("\n")
        finally:
            if stdin:
                stdin(None)
            if proc.returncode is None:
                proc.kill()
            await proc.wait()


class ConnectedSupervisor:
    """A supervisor stand-in that is always connected to `LocalHost`."""

    name = "local"

    async def wait_connected(self, timeout: float | None = None) -> LocalHost:
        return LocalHost()


async def test_a_host_without_gpu_readings_fails_the_wait_at_once_with_the_reason():
    stream = TelemetryStream(ConnectedSupervisor(), lambda host: _code_dir(), python=sys.executable, interval=0.2)
    stream.start()
    try:
        began = time.monotonic()
        with pytest.raises(VramError, match="local has no GPU readings .*NVML"):
            await wait_vram_free(stream, gpus=(0,), threshold_mib=1024, timeout=30)
        assert time.monotonic() - began < 10
    finally:
        await stream.stop()


async def test_an_eager_wait_sees_the_memory_leave_without_waiting_for_the_interval(tmp_path: Path):
    """The window's waits (VRAM free after the stop, room after a release, memory back after a
    resume) ask the agent for samples instead of waiting for its interval: with a 10 s interval the
    released memory is seen within the 5 s wait, where the interval's next sample would come too late."""
    sim = tmp_path / "gpu.json"
    holder = subprocess.Popen(["sleep", "120"])
    simgpu.hold(sim, holder.pid, 30000, gpus=[0])
    stream = TelemetryStream(ConnectedSupervisor(), lambda host: _code_dir(), python=sys.executable, interval=10,
                             simulate=str(sim))
    stream.start()
    try:
        first = await stream.wait_for(lambda s: True, 60)
        assert first.gpus[0].mem_used_mib == 30000
        holder.kill()
        holder.wait()  # the simulated driver frees a dead process's memory
        result = await wait_vram_free(stream, gpus=(0,), threshold_mib=1024, timeout=5, stopped_at=time.monotonic())
        assert result.free, result.used
        # Not eager: the interval's next sample is seconds away.
        with pytest.raises(TimeoutError):
            await stream.wait_for(lambda s: True, 2, after=time.monotonic())
    finally:
        holder.kill()
        await stream.stop()


async def _code_dir() -> str:
    return str(ROOT)


def test_our_staged_extractor_is_subtracted_and_never_offered():
    """The stager holds 20 GB on GPU 0 while it waits for the go: the service's leftovers must go
    under the threshold on their own, and the stager is never listed for ending."""
    stager = GpuProcess(7000, 0, 20000, "root", "python -m remote.extract --staged", start_time=5)
    leftover = GpuProcess(4242, 0, 900, "root", "sglang::scheduler_TP0", start_time=11)
    reading = sample([20900, 0], (stager, leftover))
    assert not vram_free(reading, (0, 1), 1024)  # counted in, the stager blocks the window forever
    assert vram_free(reading, (0, 1), 1024, exclude=[7000])  # 900 MiB left: under the threshold
    assert not vram_free(reading, (0, 1), 800, exclude=[7000])  # the threshold applies to the rest
    assert [h.pid for h in find_holders(reading, (0, 1), exclude=[7000])] == [4242]
    assert used_summary(reading, (0,), exclude=[7000]) == "GPU0 900 MiB (+ 20000 MiB ours)"


async def test_the_waiter_ends_on_the_rest_and_lists_only_other_holders():
    stager = GpuProcess(7000, 0, 20000, "root", "python -m remote.extract --staged", start_time=5)
    stuck = GpuProcess(4242, 0, 46000, "root", "sglang::scheduler_TP0", start_time=11)
    stream = FixedStream([sample([66000, 0], (stager, stuck))])
    result = await wait_vram_free(stream, (0,), 1024, timeout=0.2, stopped_at=0.0, exclude=[7000])
    assert not result.free and [h.pid for h in result.holders] == [4242]
    assert result.used == "GPU0 46000 MiB (+ 20000 MiB ours)"
    stream = FixedStream([sample([20500, 0], (stager, GpuProcess(4242, 0, 500, "root", "x", start_time=11)))])
    assert (await wait_vram_free(stream, (0,), 1024, timeout=2, stopped_at=0.0, exclude=[7000])).free


class FixedStream:
    """A `TelemetryStream` stand-in that has received `samples` (the last is the latest)."""

    def __init__(self, samples: list[TelemetrySample]):
        self.samples = samples
        self.error = None
        self.telemetry = type("T", (), {"host": "ct129", "latest": samples[-1], "received_at": 1.0,
                                        "seen_service_pids": {}})()

    async def wait_for(self, predicate, timeout: float, after: float | None = None, eager: bool = False) -> TelemetrySample:
        for s in self.samples:
            if predicate(s):
                return s
        await asyncio.sleep(timeout)
        raise TimeoutError
