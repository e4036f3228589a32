"""`dflash-ops status` against two real SSH hosts (embedded servers), the telemetry agent reading a
simulated GPU file, and the rehearsal server (`remote.drill.standin`) as the service."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from console.cli.main import main
from remote.drill import simgpu
from tests.cli_hosts import ThreadedHosts, write_config
from tests.standin_helpers import free_port, start_standin, stop, wait_status

ENTRY_POINT = Path(sys.executable).parent / "dflash-ops"


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")


def _line(text: str, *fragments: str) -> str:
    return next(line for line in text.splitlines() if all(f in line for f in fragments))


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command_service(tmp_path: Path, pidfile: Path, port: int) -> dict:
    """A command-managed service whose start/stop would leave marker files (they must never run)."""
    return {"host": "ct129", "manager": "command", "start": f"touch {tmp_path / 'STARTED'}",
            "stop": f"touch {tmp_path / 'STOPPED'}", "status": f"kill -0 $(cat {pidfile}) && cat {pidfile}",
            "url": f"http://127.0.0.1:{port}"}


def test_snapshot_shows_links_simulated_gpus_holders_and_health(hosts: ThreadedHosts, tmp_path: Path,
                                                                 tiny_target: Path, capsys: pytest.CaptureFixture[str]):
    # ct129 is a drill host (`simulated_gpus`): its workdir holds the simulated GPU file the standin fills.
    hosts.workdir("ct129").mkdir(parents=True)
    sim = hosts.workdir("ct129") / "simulated-gpu.json"
    simgpu.update(sim, lambda data: None)
    port = free_port()
    server = start_standin(tiny_target, port, tmp_path / "standin.log", "--gpu-file", str(sim),
                           "--gpu-mib", "40000", "--release-after", "0")
    try:
        pidfile = tmp_path / "standin.pid"
        pidfile.write_text(str(server.pid))
        wait_status(f"http://127.0.0.1:{port}/health", 200)
        worker = simgpu.read(sim)["processes"][0]["pid"]  # the standin's GPU worker holds the memory
        config = write_config(tmp_path / "ops.toml", {"ct129": hosts.host_table("ct129", simulated_gpus=True),
                                                       "ct200": hosts.host_table("ct200")},
                              service=command_service(tmp_path, pidfile, port))

        assert main(["status", "--config", str(config)]) == 0
        out = capsys.readouterr().out
        ct129 = _line(out, "ct129")
        assert "connected" in ct129 and " ms" in ct129 and "SIMULATED" in ct129
        gpu0, gpu1 = _line(out, "0 SIMULATED"), _line(out, "1 SIMULATED")
        for gpu in (gpu0, gpu1):
            assert "39.1/45.0 GiB 87%" in gpu  # whole, on the GPU's one row
            assert f"{worker} 39.1 GiB [service] {Path(sys.executable).name} -m remote.drill.standin" in gpu
        assert "[service]" in out  # the worker is a child of the service's main pid
        ct200 = _line(out, "ct200")
        assert "connected" in ct200 and "SIMULATED" not in ct200 and "no GPU readings" in ct200
        assert f"on ct129: running, pid {server.pid}" in out
        assert f"health: /health 200, ready; model {tiny_target}; version 0.5.23-standin" in out
        # Read-only: nothing was started or stopped.
        assert server.poll() is None
        assert not (tmp_path / "STARTED").exists() and not (tmp_path / "STOPPED").exists()
    finally:
        stop(server)


def down_host_config(hosts: ThreadedHosts, tmp_path: Path, closed: int) -> Path:
    """ct129 up, ct200 at the `closed` port, the service stopped (its pid file missing)."""
    return write_config(tmp_path / "ops.toml", {
        "ct129": hosts.host_table("ct129"),
        "ct200": hosts.host_table("ct200", port=closed),
    }, service=command_service(tmp_path, tmp_path / "no-such.pid", free_port()))


def test_down_host_and_stopped_service_exit_1(hosts: ThreadedHosts, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]):
    closed = _closed_port()
    config = down_host_config(hosts, tmp_path, closed)
    assert main(["status", "--config", str(config)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert f"down: ct200: cannot reach {hosts.servers['ct200'].user}@127.0.0.1:{closed}: Connection refused" in captured.out
    assert "on ct129: NOT RUNNING (stopped)" in captured.out
    assert "no GPU readings" in _line(captured.out, "ct129")  # not a drill host: no simulated file
    assert "SIMULATED" not in captured.out


def streaming_for(workdir: Path, seconds: float, timeout: float = 60) -> None:
    """Until the telemetry agent on the host of `workdir` has run `seconds` (a fixed sleep from the
    watch's start was too short on a loaded machine: the link was not up yet when the test cut it)."""
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in psutil.process_iter(["cmdline", "create_time"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if "remote.agent" in cmdline and str(workdir) in cmdline + " " + _cwd(proc) \
                    and time.time() - proc.info["create_time"] >= seconds:
                return
        time.sleep(0.1)
    raise TimeoutError(f"no telemetry agent ran {seconds} s for {workdir}")


def _cwd(proc) -> str:
    try:
        return proc.cwd()
    except Exception:  # noqa: BLE001 - gone, or not ours to read
        return ""


def test_watch_marks_a_lost_host_and_its_stale_telemetry_then_ends_on_ctrl_c(hosts: ThreadedHosts, tmp_path: Path):
    hosts.workdir("ct129").mkdir(parents=True)
    simgpu.update(hosts.workdir("ct129") / "simulated-gpu.json", lambda data: None)
    config = write_config(tmp_path / "ops.toml", {"ct129": hosts.host_table("ct129", simulated_gpus=True),
                                                   "ct200": hosts.host_table("ct200")},
                          service=command_service(tmp_path, tmp_path / "no-such.pid", free_port()))
    watch = subprocess.Popen([str(ENTRY_POINT), "status", "--watch", "--config", str(config)],
                             env={**os.environ, "COLUMNS": "200"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        streaming_for(hosts.workdir("ct129"), seconds=2.5)  # connected, and samples came (one a second)
        hosts.call(hosts.servers["ct129"].stop())  # the link to ct129 drops and stays down
        time.sleep(4.5)  # telemetry is stale after 3 intervals of 1 s
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=20)
    finally:
        if watch.poll() is None:
            watch.kill()
    assert watch.returncode == 0, err
    assert "Traceback" not in err and "raised exception" not in err
    # Not a terminal: the final view is printed when the watch ends.
    ct129 = _line(out, "ct129")
    assert "reconnecting for" in ct129 and "Connection refused" in _line(out, "reconnecting: ct129: ")
    assert "SIMULATED, STALE: last sample" in out, out
    ct200 = _line(out, "ct200")
    assert "connected" in ct200 and "STALE" not in ct200


def test_a_damaged_run_store_is_listed_beside_the_run_that_left_the_service_down(
        hosts: ThreadedHosts, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """Unreadable runs (`[]`, `null`, random bytes) are each named with their path and why; the run
    that stopped the service is still found and shown as usual."""
    from console.procedure.store import STATE, RunStore

    store = RunStore(tmp_path / "runs")
    down = store.create(None, None)
    down.state.service.down, down.state.service.stopped_at, down.state.status = True, time.time() - 30, "failed"
    down.save()
    damaged = {"20261201-000000-aa01": b"[]", "20261201-000000-aa02": b"null",
               "20261201-000000-aa03": bytes(range(250, 256)) * 4}
    for run_id, content in damaged.items():
        (store.root / run_id).mkdir()
        (store.root / run_id / STATE).write_bytes(content)
    config = write_config(tmp_path / "ops.toml", {"ct129": hosts.host_table("ct129"), "ct200": hosts.host_table("ct200")},
                          service=command_service(tmp_path, tmp_path / "no-such.pid", free_port()))
    assert main(["status", "--config", str(config), "--runs", str(store.root)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    assert "SERVICE DOWN since" in captured.out and f"stopped by run {down.run_id}" in captured.out
    for run_id in damaged:
        line = _line(captured.out, f"unreadable run {run_id}:")
        assert str(store.root / run_id / STATE) in line
    assert "a JSON list" in _line(captured.out, "aa01") and "not JSON" in _line(captured.out, "aa03")


def test_piped_at_80_columns_keeps_host_names_and_the_reason_whole(hosts: ThreadedHosts, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]):
    """Issue 43.9: piped (80 columns) `status` cut host names to `c…` and the rest of the row away."""
    monkeypatch.setenv("COLUMNS", "80")
    closed = _closed_port()
    config = down_host_config(hosts, tmp_path, closed)
    assert main(["status", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "…" not in out
    ct129 = _line(out, "ct129  connected, ")
    assert " ms" in ct129 and "ago" in ct129
    assert _line(out, "ct200  down")
    assert "no GPU readings" in out


def test_status_names_who_holds_the_service_host(hosts: ThreadedHosts, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 41 part 3: a second operator refused at the preflight is sent to `status` to learn who
    holds the host: the host lock's run and console (its file's account), or free; one whose console
    is gone says so."""
    import json

    from console.procedure.state import Owner
    from remote import lockfile

    config = down_host_config(hosts, tmp_path, free_port())
    locks = Path(hosts.host_table("ct129")["lock_dir"])
    locks.mkdir(parents=True, exist_ok=True)
    locks.chmod(0o1777)
    main(["status", "--config", str(config)])
    assert f"host lock ct129:{locks}/dflash-ops.lock: free (no run holds ct129)" in capsys.readouterr().out

    owner = Owner("alice", socket.gethostname(), os.getpid(), time.time(), None)
    lockfile.take(str(locks), json.dumps({"run_id": "20261205-090000-ab12", **owner.__dict__}))
    main(["status", "--config", str(config)])
    said = _line(capsys.readouterr().out, "host lock")
    assert f"held by run 20261205-090000-ab12 of {owner.describe()} (file of account" in said, said
    assert "console is gone" not in said

    (locks / "dflash-ops.lock").unlink()
    gone = Owner("alice", socket.gethostname(), 4_000_001, time.time(), 1)  # no such process
    lockfile.take(str(locks), json.dumps({"run_id": "20261205-090000-ab12", **gone.__dict__}))
    main(["status", "--config", str(config)])
    said = _line(capsys.readouterr().out, "host lock")
    assert "its console is gone" in said, said
