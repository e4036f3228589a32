"""What the console costs while it watches: the app headless over two simulated hosts of 8 GPUs each,
real `TelemetryUpdate` messages published on a real bus at 1 Hz per host (and the service view every
5 s), for 60 s.

    .venv/bin/python bench/tui.py [--seconds 60] [--json OUT.json]

Measured: the console process's CPU share (process CPU time over wall time, every thread: target
< 3% of a core) and the delay from a sample's publication to the end of the repaint that shows it
(`ConsoleApp.repaint_probe`, called after the next screen refresh). Then, with the telemetry still
flowing, the key-to-paint latency of every key the operator has (from the key press to the end of
the first refresh after it was handled), each printed, the command palette's opening among them.
The last line printed is the headline.
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
from tests.tui.standin import StandinOperator, gpu, mid_window, sample, service_view  # noqa: E402

GPUS = 8
TARGET_CPU = 0.03


def telemetry(host: str, seq: int, t: float) -> m.TelemetryUpdate:
    """Host `host` at second `seq`: memory, utilisation, temperature and power moving, 8 holders."""
    gpus = [gpu(i, int(60000 + 15000 * math.sin(seq / 7 + i)), 81559, util=50 + 40 * math.sin(seq / 5 + i),
                temp=60 + 5 * math.sin(seq / 11), power=300 + 50 * math.sin(seq / 3 + i), name="NVIDIA H100 80GB HBM3")
            for i in range(GPUS)]
    procs = tuple(m.GpuProcess(7000 + i, i, 60000, "dflash", f"python train.py --rank {i}") for i in range(GPUS))
    return m.TelemetryUpdate(host, sample(host, gpus, procs, seq=seq, t=t, simulated=True), 0.05, False, True)


# Every key, in an order that leaves the console where the next one expects it: (key, what it does).
KEYS = (
    ("tab", "focus to the events"), ("down", "scroll the events"), ("tab", "focus to the hosts"),
    ("pagedown", "scroll the hosts"), ("question_mark", "help"), ("down", "scroll the help"), ("escape", "close help"),
    ("p", "plan screen"), ("escape", "back"), ("slash", "events whole"), ("s", "filter typed"), ("escape", "close"),
    ("h", "runs list"), ("escape", "back"), ("o", "results (none: says so)"), ("r", "r says why not"),
    ("ctrl+p", "command palette opens"), ("escape", "palette closes"),
    ("g", "run: the stop's question"), ("down", "scroll the question"), ("n", "refuse the stop"),
    ("q", "quit while down: asks"), ("q", "second q: stays"),
)


async def key_latencies(app: ConsoleApp, pilot, operator: StandinOperator) -> list[tuple[str, str, float]]:
    """Seconds from each key press to the end of the first refresh after it was handled."""
    measured = []
    for key, what in KEYS:
        if key == "q" and app.state.down_since is None:  # the quit modal needs the service down
            mid_window(operator)
            while app.state.down_since is None:
                await pilot.pause(0.01)
        painted = asyncio.Event()
        t0 = time.perf_counter()
        await pilot.press(key)
        app.call_after_refresh(painted.set)
        await painted.wait()
        measured.append((key, what, time.perf_counter() - t0))
        await pilot.pause(0.05)  # what the key opened settles (mounts, the palette's search) before the next
    return measured


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
        keys = await key_latencies(app, pilot, operator)  # with the telemetry still flowing
        publisher.cancel()
    ms = sorted(d * 1000 for d in delays)
    return {"seconds": round(wall, 1), "hosts": 2, "gpus_per_host": GPUS, "samples": len(ms),
            "cpu_share": cpu / wall, "repaint_ms": {"median": statistics.median(ms) if ms else None,
                                                    "p95": ms[int(0.95 * (len(ms) - 1))] if ms else None,
                                                    "max": ms[-1] if ms else None},
            "key_to_paint_ms": [{"key": k, "does": what, "ms": round(1000 * t, 1)} for k, what, t in keys]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--json", metavar="OUT", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    figures = asyncio.run(measure(args.seconds))
    repaint = figures["repaint_ms"]
    print(f"{figures['samples']} samples over {figures['seconds']} s; repaint delay median {repaint['median']:.1f} ms, "
          f"p95 {repaint['p95']:.1f} ms, max {repaint['max']:.1f} ms")
    keys = figures["key_to_paint_ms"]
    for k in keys:
        print(f"key {k['key']:<13} {k['does']:<28} {k['ms']:7.1f} ms")
    worst = max(keys, key=lambda k: k["ms"])
    palette = next(k["ms"] for k in keys if k["key"] == "ctrl+p")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    share = 100 * figures["cpu_share"]
    print(f"tui: {share:.1f}% of a core, repaint delay max {repaint['max']:.0f} ms, key to paint max "
          f"{worst['ms']:.0f} ms ({worst['key']}), palette {palette:.0f} ms "
          f"(target < {100 * TARGET_CPU:.0f}%{'' if share < 100 * TARGET_CPU else ': MISSED'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
