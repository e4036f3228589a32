"""Service control over real SSH (the embedded server): the command manager driving the rehearsal
server, readiness through a forwarded port, telemetry from the agent with the simulated GPU, the
VRAM waiter, and ending exactly the process that kept the memory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from console.config import dump_toml, parse_config
from console.messages import ServiceHealth, StartupProgress, VramHolder
from console.service.control import (
    CommandManager,
    ServiceFailed,
    ServiceMonitor,
    manager_from_config,
    service_identity,
    start_and_wait,
    wait_ready,
)
from console.service.sglang_api import SglangClient
from console.service.vram import end_holders, wait_vram_free
from console.ssh.embedded_server import EmbeddedSSHServer
from console.ssh.hosts import Host
from console.ssh.jobs import JobRunner
from console.ssh.supervisor import HostSupervisor
from console.telemetry import ServiceIdentity, TelemetryStream
from remote.drill import simgpu
from remote.gpu_source import describe_process
from tests.standin_helpers import free_port

PY = sys.executable


@dataclass
class Rig:
    """One drill-like host over SSH: its supervisor, code dir, simulated GPUs, telemetry stream."""

    server: EmbeddedSSHServer
    supervisor: HostSupervisor
    host: Host
    code: str
    sim: Path
    stream: TelemetryStream
    tmp: Path
    model: Path

    def manager(self, port: int, *standin_args: str) -> CommandManager:
        """The command manager for a standin on `port`, from a `[service]` table as an operator
        would write it (its `log` command tails the log the start command writes)."""
        pidfile, log = self.tmp / f"standin-{port}.pid", self.tmp / f"standin-{port}.log"
        argv = [PY, "-m", "remote.drill.standin", "--model", str(self.model), "--port", str(port),
                "--gpu-file", str(self.sim), *standin_args]
        start = (f"cd {shlex.quote(self.code)} && PYTHONPATH={shlex.quote(self.code)} setsid nohup "
                 f"{shlex.join(argv)} > {log} 2>&1 < /dev/null & echo $! > {pidfile}")
        service = {
            "host": "ct129", "manager": "command", "start": start, "stop": f"kill -TERM $(cat {pidfile})",
            # Running = the pid exists and is not a zombie (this sandbox's init never reaps orphans).
            "status": f"pid=$(cat {pidfile}) && ps -o stat= -p $pid | grep -q '^[^Z]' && echo $pid",
            "log": ["tail", "-n", "+1", "-F", str(log)],
        }
        config = parse_config(dump_toml({"hosts": {"ct129": {"address": "127.0.0.1"}}, "service": service,
                                         "target": {"model_path": str(self.model), "layers": [0]}}))
        manager = manager_from_config(config.service, self.host)
        assert isinstance(manager, CommandManager)
        return manager


def _end_leftovers(tmp: Path, sim: Path) -> None:
    """Kill whatever the test's servers left (by their recorded pids only)."""
    pids = [int(p.read_text()) for p in tmp.glob("standin-*.pid") if p.read_text().strip().isdigit()]
    if sim.exists():
        pids += [p["pid"] for p in simgpu.read(sim)["processes"]]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
async def rig(tmp_path: Path, tiny_target: Path) -> AsyncIterator[Rig]:
    server = EmbeddedSSHServer(tmp_path / "home", tmp_path / "ssh", python=PY)
    await server.start()
    supervisor = HostSupervisor(server.spec("ct129", workdir=str(tmp_path / "work")), backoff=(0.2, 1.0))
    supervisor.start()
    host = await supervisor.wait_connected(20)
    code = await JobRunner(host).ensure_code()
    sim = tmp_path / "sim-gpu.json"
    simgpu.update(sim, lambda data: None)  # two idle simulated GPUs
    stream = TelemetryStream(supervisor, lambda h: JobRunner(h).ensure_code(), python=PY, interval=0.2,
                             simulate=str(sim), retry_s=0.2)
    stream.start()
    rig = Rig(server, supervisor, host, code, sim, stream, tmp_path, tiny_target)
    try:
        yield rig
    finally:
        await stream.stop()
        _end_leftovers(tmp_path, sim)
        await supervisor.stop()
        await server.stop()


async def test_start_ready_stop_then_vram_free(rig: Rig):
    port = free_port()
    manager = rig.manager(port, "--load-delay", "1", "--gpu-mib", "40000", "--release-after", "1.5")
    assert not (await manager.status()).active
    client = SglangClient(f"http://127.0.0.1:{await rig.host.forward_local_port('127.0.0.1', port)}")
    progress: list[StartupProgress] = []
    health = await start_and_wait(manager, client, timeout=60, host=rig.host, on_progress=progress.append)
    assert health.ready and health.health_status == 200 and health.error is None
    # The configured `log` command's lines became progress: the shards counted, then ready.
    assert any(p.stage == "loading" and p.total == 4 for p in progress), progress
    order = ["loading", "weights_loaded", "ready"]
    stages = [p.stage for p in progress]
    assert stages == sorted(stages, key=order.index), stages

    status = await manager.status()
    assert status.active and status.main_pid == int((rig.tmp / f"standin-{port}.pid").read_text())
    info = await client.model_info()
    assert info["model_path"] == str(rig.model)
    monitor = ServiceMonitor(manager, client)
    view = await monitor.check()  # what the service panel shows
    assert view.status.active and view.health.ready and view.health.model == str(rig.model)
    assert view.health.running_requests is None  # started without --metrics: shown as unknown

    # Telemetry attributes the memory to the service: the GPU worker is a child of its main pid.
    rig.stream.set_service(service_identity(status))
    running = await rig.stream.wait_for(lambda s: any(g.mem_used_mib == 40000 for g in s.gpus), timeout=10)
    assert running.simulated and running.source == "simulated"
    await rig.stream.wait_for(lambda s: bool(s.processes), timeout=5, after=time.monotonic())
    assert rig.stream.telemetry.update(True).service_pids, "the GPU worker was not attributed to the service"

    stopped_at = time.monotonic()
    await manager.stop()
    result = await wait_vram_free(rig.stream, gpus=(0, 1), threshold_mib=1024, timeout=20, stopped_at=stopped_at)
    assert result.free and result.used == "GPU0 0 MiB, GPU1 0 MiB"
    assert result.waited_s >= 1.0  # it really waited for the release, not for systemctl-like return
    stopped = await monitor.check()
    assert not stopped.status.active and stopped.health is None


async def test_stuck_vram_reaches_the_kill_offer_and_ends_only_the_holder(rig: Rig):
    bystander = subprocess.Popen(["sleep", "120"])  # someone else's job on the other GPU
    try:
        simgpu.hold(rig.sim, bystander.pid, 3000, gpus=[1])
        port = free_port()
        manager = rig.manager(port, "--gpu-mib", "47179", "--hold-until-killed", "--stubborn-holder")
        client = SglangClient(f"http://127.0.0.1:{await rig.host.forward_local_port('127.0.0.1', port)}")
        await manager.start()
        await wait_ready(client, timeout=60)
        status = await manager.status()
        rig.stream.set_service(service_identity(status))
        await rig.stream.wait_for(lambda s: any(g.mem_used_mib == 47179 for g in s.gpus), timeout=10,
                                  after=time.monotonic())
        rig.stream.set_service(ServiceIdentity())  # stopped services have no main pid

        stopped_at = time.monotonic()
        await manager.stop()
        stuck = await wait_vram_free(rig.stream, gpus=(0,), threshold_mib=1024, timeout=3, stopped_at=stopped_at)
        assert not stuck.free and stuck.used == "GPU0 47179 MiB"
        (holder,) = stuck.holders  # the bystander is on GPU 1: not offered
        assert holder.mib == 47179 and holder.was_service and "--gpu-worker" in holder.command

        outcomes = await end_holders(rig.host, PY, rig.code, stuck.holders, grace_s=1.0)
        assert [(o.pid, o.outcome) for o in outcomes] == [(holder.pid, "killed")]  # it ignored SIGTERM
        assert bystander.poll() is None
        freed = await wait_vram_free(rig.stream, gpus=(0,), threshold_mib=1024, timeout=10)
        assert freed.free
    finally:
        bystander.kill()
        bystander.wait()


async def test_waiter_watches_every_gpu_of_a_two_gpu_service(rig: Rig):
    """The story's inference host: the target spans both GPUs, so the service holds memory on both,
    and after the stop a leftover holds both. The waiter must wait on every GPU the service used,
    offer the one holder (with both GPUs named), and only call the GPUs free once both are."""
    port = free_port()
    manager = rig.manager(port, "--gpu-mib", "46000", "--hold-until-killed")
    client = SglangClient(f"http://127.0.0.1:{await rig.host.forward_local_port('127.0.0.1', port)}")
    await manager.start()
    await wait_ready(client, timeout=60)
    await rig.stream.wait_for(lambda s: [g.mem_used_mib for g in s.gpus] == [46000, 46000], timeout=10,
                              after=time.monotonic())

    await manager.stop()
    stuck = await wait_vram_free(rig.stream, gpus=(0, 1), threshold_mib=1024, timeout=3)
    assert not stuck.free and stuck.used == "GPU0 46000 MiB, GPU1 46000 MiB"
    (holder,) = stuck.holders
    assert holder.gpus == (0, 1) and holder.mib == 92000 and "--gpu-worker" in holder.command

    outcomes = await end_holders(rig.host, PY, rig.code, stuck.holders, grace_s=2.0)
    assert [(o.pid, o.outcome) for o in outcomes] == [(holder.pid, "terminated")]
    freed = await wait_vram_free(rig.stream, gpus=(0, 1), threshold_mib=1024, timeout=10)
    assert freed.free and freed.used == "GPU0 0 MiB, GPU1 0 MiB"


async def test_health_flapping_during_start_is_not_taken_for_ready(rig: Rig):
    port = free_port()
    manager = rig.manager(port, "--load-delay", "2", "--flap-health", "--gpu-mib", "1000", "--release-after", "0")
    client = SglangClient(f"http://127.0.0.1:{await rig.host.forward_local_port('127.0.0.1', port)}")
    seen: list[ServiceHealth] = []
    health = await start_and_wait(manager, client, timeout=60, on_health=seen.append)
    assert health.ready
    flaps = [h for h in seen if h.health_status == 200 and not h.ready]
    assert flaps, [h.health_status for h in seen]  # /health said 200 while the model was still loading
    assert any(h.health_status == 503 for h in seen)
    server = await client.server_info()
    assert server["ready_at"] is not None and server["ready_at"] - server["started_at"] >= 2.0
    await manager.stop()


async def test_telemetry_restarts_after_a_reconnect(rig: Rig):
    await rig.stream.wait_for(lambda s: True, timeout=10)
    assert rig.stream.starts == 1
    await rig.server.stop()  # the link drops; the agent's stdout closes with it
    await asyncio.sleep(0.5)
    await rig.server.start()
    dropped_at = time.monotonic()
    sample = await rig.stream.wait_for(lambda s: True, timeout=30, after=dropped_at)
    assert rig.stream.starts >= 2 and sample.seq < 20  # a new agent counts from 0 again
    assert not rig.stream.telemetry.is_stale()


async def test_a_stale_start_up_log_is_not_taken_for_the_new_start(rig: Rig):
    """`tail -n +1 -F log` first replays the last start's log, "ready" included: only what the new
    start writes may become progress."""
    port = free_port()
    manager = rig.manager(port, "--load-delay", "1", "--gpu-mib", "1000", "--release-after", "0")
    (rig.tmp / f"standin-{port}.log").write_text(
        "Load weight begin. avail mem=139.00 GB\n"
        "Loading safetensors checkpoint shards: 100% Completed | 7/7 [00:09<00:00]\n"
        "Load weight end. elapsed=9.20 s, type=Qwen3_5ForCausalLM\n"
        "The server is fired up and ready to roll!\n")
    client = SglangClient(f"http://127.0.0.1:{await rig.host.forward_local_port('127.0.0.1', port)}")
    progress: list[StartupProgress] = []
    health = await start_and_wait(manager, client, timeout=60, host=rig.host, on_progress=progress.append)
    assert health.ready
    assert not any(p.total == 7 for p in progress), progress  # the old start's shards
    assert any(p.stage == "loading" and p.total == 4 for p in progress), progress
    stages = [p.stage for p in progress]
    assert stages[0] == "loading" and stages.count("ready") == 1 and stages[-1] == "ready", stages
    await manager.stop()


async def test_a_server_that_dies_at_start_fails_the_wait_at_once_with_its_log(rig: Rig):
    blocker = socket.socket()  # bound, not listening: the server cannot bind, connecting is refused
    blocker.bind(("127.0.0.1", 0))
    port = blocker.getsockname()[1]
    try:
        manager = rig.manager(port)
        client = SglangClient(f"http://127.0.0.1:{await rig.host.forward_local_port('127.0.0.1', port)}")
        began = time.monotonic()
        with pytest.raises(ServiceFailed) as info:
            await start_and_wait(manager, client, timeout=60, host=rig.host)
        assert time.monotonic() - began < 20  # not the ready timeout
        message = str(info.value)
        assert "is stopped after its start" in message
        assert f"cannot listen on 127.0.0.1:{port}" in message  # the log command's tail
        assert info.value.status.state == "stopped"
    finally:
        blocker.close()


def _home_python(rig: Rig) -> str:
    """A `~/venv/bin/python` on the host, as operators configure it."""
    venv = rig.server.home / "venv" / "bin"
    venv.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        (venv / "python").symlink_to(PY)
    return "~/venv/bin/python"


async def test_telemetry_runs_a_home_relative_python(rig: Rig):
    stream = TelemetryStream(rig.supervisor, lambda h: JobRunner(h).ensure_code(), python=_home_python(rig),
                             interval=0.2, simulate=str(rig.sim), retry_s=0.2)
    stream.start()
    try:
        sample = await stream.wait_for(lambda s: True, timeout=15)
        assert sample.simulated and stream.error is None
    finally:
        await stream.stop()
    assert await rig.host.resolve_python("~/venv/bin/python") == f"{rig.server.home}/venv/bin/python"
    assert await rig.host.resolve_python("/usr/bin/python3") == "/usr/bin/python3"


async def test_endpids_runs_a_home_relative_python(rig: Rig):
    victim = subprocess.Popen(["sleep", "60"])
    try:
        holder = VramHolder(victim.pid, 100, (0,), "sleep 60", None, describe_process(victim.pid)["start_time"], False)
        outcomes = await end_holders(rig.host, _home_python(rig), rig.code, [holder], grace_s=1.0)
        assert [(o.pid, o.outcome) for o in outcomes] == [(victim.pid, "terminated")]
        assert victim.wait(5) == -signal.SIGTERM
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
