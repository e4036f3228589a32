"""remote.endpids: a signal goes only to the process that was listed, checked before every signal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from remote import endpids, gpu_source, procstat


def _spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"up"  # its signal handlers are installed
    return proc


STUBBORN = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"


@pytest.fixture
def no_gpu_devices(monkeypatch, tmp_path):
    monkeypatch.setattr(gpu_source, "NVIDIA_DEVICES", str(tmp_path / "no-such-device"), raising=False)


@pytest.fixture
def signals(monkeypatch) -> list[int]:
    """Every signal endpids sends, however it sends it (kill or a pidfd)."""
    sent: list[int] = []
    real_kill, real_pidfd = os.kill, getattr(signal, "pidfd_send_signal", None)

    def kill(pid, sig):
        sent.append(sig)
        return real_kill(pid, sig)

    def pidfd_send(fd, sig, *args):
        sent.append(sig)
        return real_pidfd(fd, sig, *args)

    monkeypatch.setattr(os, "kill", kill)
    if real_pidfd is not None:
        monkeypatch.setattr(signal, "pidfd_send_signal", pidfd_send)
    return sent


def test_no_kill_for_a_pid_reused_during_the_grace_period(monkeypatch, signals, no_gpu_devices):
    """The listed process exits after TERM and its pid is taken by another before the grace ends
    (simulated: from the TERM on, /proc reports another start time for the pid). That other process
    must not get the KILL; the listed one is reported terminated."""
    proc = _spawn(STUBBORN)
    try:
        start = procstat.start_time(proc.pid)
        real_read = procstat.read_stat

        def read_stat(pid):
            fields = real_read(pid)
            if pid == proc.pid and fields and signal.SIGTERM in signals:
                fields = list(fields)
                fields[procstat.START_TIME] = str(start + 1234)  # another process now has this pid
            return fields

        monkeypatch.setattr(procstat, "read_stat", read_stat)
        (result,) = endpids.end_processes([(proc.pid, start)], 0.5)
        assert signal.SIGKILL not in signals and signals == [signal.SIGTERM]
        assert result["outcome"] == "terminated", result
        assert proc.poll() is None  # "the other process" is untouched
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_identity_is_checked_again_right_before_the_kill(monkeypatch, signals, no_gpu_devices):
    """The pid is reused in the instant between the end of the grace wait and the KILL."""
    proc = _spawn(STUBBORN)
    try:
        start = procstat.start_time(proc.pid)
        real_wait = endpids._wait_gone
        reused = []

        def wait_then_reuse(idents, deadline):
            left = real_wait(idents, deadline)
            reused.append(True)
            return left

        real_read = procstat.read_stat

        def read_stat(pid):
            fields = real_read(pid)
            if pid == proc.pid and fields and reused:
                fields = list(fields)
                fields[procstat.START_TIME] = str(start + 1)
            return fields

        monkeypatch.setattr(endpids, "_wait_gone", wait_then_reuse)
        monkeypatch.setattr(procstat, "read_stat", read_stat)
        (result,) = endpids.end_processes([(proc.pid, start)], 0.2)
        assert signals == [signal.SIGTERM] and proc.poll() is None
        assert result["outcome"] == "terminated" and "another process" in result["detail"]
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_pid_listed_without_start_time_is_pinned_when_first_seen(monkeypatch, signals, no_gpu_devices):
    proc = _spawn(STUBBORN)
    try:
        start = procstat.start_time(proc.pid)
        real_read = procstat.read_stat

        def read_stat(pid):
            fields = real_read(pid)
            if pid == proc.pid and fields and signal.SIGTERM in signals:
                fields = list(fields)
                fields[procstat.START_TIME] = str(start + 7)
            return fields

        monkeypatch.setattr(procstat, "read_stat", read_stat)
        (result,) = endpids.end_processes([(proc.pid, None)], 0.3)
        assert signals == [signal.SIGTERM] and result["outcome"] == "terminated"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_a_target_holding_no_nvidia_device_is_never_signalled(monkeypatch, tmp_path: Path, signals):
    """On a host with NVIDIA device files, NVML's pid must hold one open here, else it is another
    process (a container's pid namespace) and is refused; one that holds it is ended as usual."""
    device = tmp_path / "nvidia0"
    device.write_bytes(b"")
    monkeypatch.setattr(gpu_source, "NVIDIA_DEVICES", str(tmp_path / "nvidia"))
    bystander = _spawn("import time; print('up', flush=True); time.sleep(60)")
    holder = _spawn(f"import time; fh = open({str(device)!r}); print('up', flush=True); time.sleep(60)")
    try:
        targets = [(p.pid, procstat.start_time(p.pid)) for p in (bystander, holder)]
        outcomes = {r["pid"]: r for r in endpids.end_processes(targets, 2.0)}
        assert outcomes[bystander.pid]["outcome"] == "not_visible"
        assert "holds no /dev/nvidia* file" in outcomes[bystander.pid]["detail"]
        assert outcomes[holder.pid]["outcome"] == "terminated"
        assert bystander.poll() is None and signals == [signal.SIGTERM]
        # Asked to skip the check (--gpu-check off), it would be signalled.
        assert endpids.end_processes([targets[0]], 2.0, gpu_check="off")[0]["outcome"] == "terminated"
    finally:
        for proc in (bystander, holder):
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            proc.stdout.close()
