"""What the console costs while it watches: the app headless over two simulated hosts of 8 GPUs each,
real `TelemetryUpdate` messages published on a real bus at 1 Hz per host (and the service view every
5 s), for 60 s.

    .venv/bin/python bench/tui.py [--seconds 60] [--json OUT.json]

Measured: the console process's CPU share (process CPU time over wall time, every thread: target
< 3% of a core) and the delay from a sample's publication to the end of the repaint that shows it
(`ConsoleApp.repaint_probe`, called after the next screen refresh). The last line printed is the
headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from console import messages as m  # noqa: E402
from screens.app import ConsoleApp  # noqa: E402
from tests.tui.standin import StandinOperator, gpu, sample, service_view  # noqa: E402

GPUS = 8
TARGET_CPU = 0.03


def telemetry(host: str, seq: int, t: float) -> m.TelemetryUpdate:
    """Host `host` at second `seq`: memory, utilisation, temperature and power moving, 8 holders."""
    gpus = [gpu(i, int(60000 + 15000 * math.sin(seq / 7 + i)), 81559, util=50 + 40 * math.sin(seq / 5 + i),
                temp=60 + 5 * math.sin(seq / 11), power=300 + 50 * math.sin(seq / 3 + i), name="NVIDIA H100 80GB HBM3")
            for i in range(GPUS)]
    procs = tuple(m.GpuProcess(7000 + i, i, 60000, "dflash", f"python train.py --rank {i}") for i in range(GPUS))
    return m.TelemetryUpdate(host, sample(host, gpus, procs, seq=seq, t=t, simulated=True), 0.05, False, True)


async def measure(seconds: float, warmup: float = 3.0) -> dict:
    operator = StandinOperator()
    operator.seed(simulated=True)
    app = ConsoleApp(operator)
    delays: list[float] = []
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()

        async def publish() -> None:
            seq = 0
            while True:
                now = time.time()
                for host in ("ct129", "ct200"):
                    operator.publish(telemetry(host, seq, now))
                if seq % 5 == 0:
                    operator.publish(service_view(True, now))
                seq += 1
                await asyncio.sleep(1.0)

        publisher = asyncio.ensure_future(publish())
        await asyncio.sleep(warmup)  # first mounts and layout out of the figures
        app.repaint_probe = delays.append
        wall0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.sleep(seconds)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        app.repaint_probe = None
        publisher.cancel()
    ms = sorted(d * 1000 for d in delays)
    return {"seconds": round(wall, 1), "hosts": 2, "gpus_per_host": GPUS, "samples": len(ms),
            "cpu_share": cpu / wall, "repaint_ms": {"median": statistics.median(ms) if ms else None,
                                                    "p95": ms[int(0.95 * (len(ms) - 1))] if ms else None,
                                                    "max": ms[-1] if ms else None}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    figures = asyncio.run(measure(args.seconds))
    repaint = figures["repaint_ms"]
    print(f"{figures['samples']} samples over {figures['seconds']} s; repaint delay median {repaint['median']:.1f} ms, "
          f"p95 {repaint['p95']:.1f} ms, max {repaint['max']:.1f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    share = 100 * figures["cpu_share"]
    print(f"tui: {share:.1f}% of a core, repaint delay max {repaint['max']:.0f} ms "
          f"(target < {100 * TARGET_CPU:.0f}%{'' if share < 100 * TARGET_CPU else ': MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
