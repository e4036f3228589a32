"""Telemetry cost: the agent's CPU time per sample by source, and the console's CPU share watching hosts.

    python bench/telemetry.py                  # both parts (the console part needs asyncssh)
    python bench/telemetry.py --skip-console   # on the GPU machine: NVML vs nvidia-smi
    python bench/telemetry.py --skip-agent     # the console part only

Agent: each available source (NVML, nvidia-smi, simulated, none) is sampled the way the agent
samples (readings + /proc details of every holder); CPU time counts this process and, for
nvidia-smi, the child processes it runs (getrusage). Share of a core = CPU per sample / interval.
Console: two hosts over real SSH (OpenSSH's sshd on loopback when installed, else the embedded
server, whose own CPU then counts against the console), each streaming a simulated agent at 1 s;
the console's CPU time over the run / wall time. Targets: agent < 1 %, console < 3 % of a core.
The last line printed is the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from remote import agent, gpu_source  # noqa: E402
from remote.drill import simgpu  # noqa: E402

AGENT_TARGET_PCT = 1.0
CONSOLE_TARGET_PCT = 3.0


def cpu_now() -> float:
    """CPU seconds of this process (ns clock: an NVML sample is ~40 us, below rusage's tick) and of
    its reaped children (nvidia-smi runs as children)."""
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + kids.ru_utime + kids.ru_stime


def per_sample_cpu_ms(source, count: int) -> tuple[float, float]:
    """(median, mean) CPU milliseconds of one agent sample from `source`."""
    agent.take_sample(source, 0, 1.0, "bench")  # warm caches (pwd, /proc) outside the measurement
    times = []
    for i in range(count):
        before = cpu_now()
        agent.take_sample(source, i, 1.0, "bench")
        times.append((cpu_now() - before) * 1000.0)
    return statistics.median(times), statistics.fmean(times)


def bench_agent(samples: int, sim_file: Path) -> dict[str, tuple[float, float] | str]:
    results: dict[str, tuple[float, float] | str] = {}
    for kind in ("nvml", "nvidia-smi"):
        source = gpu_source.open_source(kind)
        if source.name == kind:
            n = samples if kind == "nvml" else max(10, samples // 20)
            results[kind] = per_sample_cpu_ms(source, n)
        else:
            results[kind] = source.reason or "unavailable"
    holder = subprocess.Popen(["sleep", "600"])
    try:
        simgpu.hold(sim_file, holder.pid, 40000)
        results["simulated"] = per_sample_cpu_ms(gpu_source.open_source(simulate=str(sim_file)), samples)
    finally:
        holder.kill()
        holder.wait()
    results["none"] = per_sample_cpu_ms(gpu_source.NoGpuSource("bench"), samples)
    return results


async def bench_console(seconds: float, sim_file: Path) -> tuple[float, str]:
    """CPU share of this process while two supervised hosts stream telemetry at 1 s."""
    from console.ssh.jobs import JobRunner
    from console.ssh.supervisor import HostSupervisor
    from console.telemetry import TelemetryStream

    tmp = Path(tempfile.mkdtemp(prefix="bench-telemetry-"))
    server = None
    sshd = Path("/usr/sbin/sshd")
    if sshd.exists():
        from tests.ssh_fixtures import OpenSSHServer

        server = OpenSSHServer(tmp)
        server.start()
        kind = "OpenSSH sshd"
        specs = [server.spec(name, python=sys.executable, workdir=str(tmp / "work")) for name in ("ct129", "ct200")]
    else:
        from console.ssh.embedded_server import EmbeddedSSHServer

        server = EmbeddedSSHServer(tmp / "home", tmp / "ssh", python=sys.executable)
        await server.start()
        kind = "embedded SSH server (its CPU counts too)"
        specs = [server.spec(name, workdir=str(tmp / "work")) for name in ("ct129", "ct200")]
    supervisors = [HostSupervisor(spec) for spec in specs]
    streams = []
    received = {spec.name: 0 for spec in specs}
    drawn: list[str] = []

    def on_update(update) -> None:
        # What a panel does per tick: read the last sample, the age and a sparkline's worth of history.
        if update.sample is not None:
            received[update.host] += 1
            drawn.append(f"{update.host} {update.age_s:.1f}s {[g.mem_used_mib for g in update.sample.gpus]}")
            del drawn[:-10]

    try:
        for supervisor in supervisors:
            supervisor.start()
            await supervisor.wait_connected(30)
            stream = TelemetryStream(supervisor, lambda h: JobRunner(h).ensure_code(), python=sys.executable,
                                     interval=1.0, simulate=str(sim_file))
            stream.subscribe(on_update)
            stream.start()
            streams.append(stream)
        for stream in streams:  # measure the steady state, not the connection and agent start-up
            await stream.wait_for(lambda s: True, timeout=60)
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        for stream in streams:
            stream.telemetry.history(0, seconds=60)
    finally:
        for stream in streams:
            await stream.stop()
        for supervisor in supervisors:
            await supervisor.stop()
        if hasattr(server, "stop"):
            result = server.stop()
            if asyncio.iscoroutine(result):
                await result
    print(f"console: {sum(received.values())} samples from {len(specs)} hosts over {kind} in {wall:.1f} s; "
          f"CPU {cpu * 1000:.0f} ms")
    return 100.0 * cpu / wall, kind


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=400, help="agent samples per source (nvidia-smi: 1/20)")
    parser.add_argument("--seconds", type=float, default=30.0, help="console measurement window")
    parser.add_argument("--skip-agent", action="store_true")
    parser.add_argument("--skip-console", action="store_true")
    parser.add_argument("--json", metavar="FILE", help="also write the figures as JSON")
    args = parser.parse_args()
    sim_file = Path(tempfile.mkdtemp(prefix="bench-sim-")) / "gpu.json"
    figures: dict = {}
    headline = []

    if not args.skip_agent:
        results = bench_agent(args.samples, sim_file)
        print(f"{'source':<12} {'CPU/sample median':>18} {'mean':>10} {'share of a core at 1 s':>24}")
        for name, value in results.items():
            if isinstance(value, str):
                print(f"{name:<12} {'unavailable':>18}   ({value})")
                continue
            median, mean = value
            print(f"{name:<12} {median:>15.3f} ms {mean:>7.3f} ms {median / 10.0:>22.4f} %")
        figures["agent_ms"] = {k: v for k, v in results.items() if not isinstance(v, str)}
        if isinstance(results.get("nvml"), tuple) and isinstance(results.get("nvidia-smi"), tuple):
            nvml, smi = results["nvml"][0], results["nvidia-smi"][0]
            print(f"nvidia-smi / NVML CPU per sample: {smi / nvml:.0f}x (NVML {nvml:.3f} ms, nvidia-smi {smi:.1f} ms)")
            headline.append(f"agent {nvml / 10.0:.3f}% of a core via NVML ({smi / 10.0:.2f}% via nvidia-smi)")
        else:
            used = next((k for k in ("nvml", "nvidia-smi", "simulated") if isinstance(results.get(k), tuple)), "none")
            headline.append(f"agent {results[used][0] / 10.0:.3f}% of a core ({used} source; no GPU here)")

    if not args.skip_console:
        try:
            share, kind = asyncio.run(bench_console(args.seconds, sim_file))
        except ImportError as exc:
            print(f"console part skipped: {exc} (run it where the console's packages are installed)")
        else:
            figures["console_pct"] = share
            headline.append(f"console {share:.2f}% of a core watching 2 hosts at 1 s")

    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    targets = f"targets: agent < {AGENT_TARGET_PCT:g}%, console < {CONSOLE_TARGET_PCT:g}%"
    print(f"telemetry: {'; '.join(headline) or 'nothing measured'} ({targets})")


if __name__ == "__main__":
    main()
