"""What notifications cost the window: the time the bus takes to publish a window's messages with the
notifier subscribed, against no notifier, for a live target, a dead one (a closed port) and one that
never answers (held until the end), all apprise `json://` on loopback.

    .venv/bin/python bench/notify.py [--windows 20]

Each window publishes its step updates, the stop's decision, the downtime and its end, and the run's
end (the five notifications) on one bus; the figure is the publish time per window (median), then how
long the sends themselves took to end (sent, failed or given up) on the targets' threads. The window
must not wait on a target: the publish time with a dead or silent target stays the live target's. (The
notifier's own cost, against no notifier, is reading the run's state on the few messages that notify.)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from console import messages as m  # noqa: E402
from console.config import parse_config  # noqa: E402
from console.notify import Notifier  # noqa: E402
from console.procedure import forecast as fc  # noqa: E402
from console.procedure.state import Owner  # noqa: E402
from console.procedure.store import RunStore  # noqa: E402
from console.session.bus import MessageBus  # noqa: E402
from tests.http_recorder import Recorder, closed_port  # noqa: E402

BASE = """[hosts.ct129]\naddress = "10.0.0.129"\n[service]\nhost = "ct129"\nunit = "sglang.service"
[target]\nmodel_path = "/m"\nlayers = [1]\n"""
STEPS = ("preflight", "stage", "cache", "stop", "free-vram", "extract", "restart", "evaluate", "report")


def window(bus: MessageBus, run_id: str, run_dir: str) -> float:
    """One window's messages on `bus`; the seconds publishing them took."""
    asked = m.Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang.service"), "down", True,
                           estimate_s=60, estimate_basis="forecast")
    start = time.perf_counter()
    now = time.time()
    for step in STEPS:
        bus.publish(m.StepUpdate(run_id, step, "running", started_at=now))
        if step == "stop":
            bus.publish(m.DecisionMade(asked, True, "--yes"))
            bus.publish(m.Downtime(run_id, now))
        if step == "restart":
            bus.publish(m.Downtime(run_id, None, now + 50))
        bus.publish(m.StepUpdate(run_id, step, "done", started_at=now, ended_at=now))
    bus.publish(m.RunFinished(run_id, "done", 0, True, "the procedure finished", run_dir))
    return time.perf_counter() - start


async def measure(target: str | None, windows: int, root: Path) -> tuple[float, float]:
    """(median publish seconds per window, seconds until every send ended) for `target` (None: no notifier)."""
    store = RunStore(root / (target or "none").split(":")[0])
    run = store.create(None, None)
    run.state.owner = Owner.this_process()
    run.state.forecast = fc.to_state(m.Forecast(run.run_id, 60.0, (m.ForecastPhase("stop", 60.0, "estimate"),)))
    run.save()
    bus = MessageBus()
    notifier = None
    if target is not None:
        notifier = Notifier(parse_config(BASE + f'[notify]\nurls = ["{target}"]\n'), store, bus)
        notifier.start()
    times = [window(bus, run.run_id, str(run.dir)) for _ in range(windows)]
    began = time.perf_counter()
    if notifier is not None:
        await notifier.close(wait_s=600)
    return statistics.median(times), time.perf_counter() - began


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=20)
    args = parser.parse_args()
    live, hanging = Recorder(), Recorder()
    hanging.hold.clear()
    rows = [("no notifier (baseline)", None), ("live target", live.url),
            ("dead target (closed port)", f"json://127.0.0.1:{closed_port()}/hook"), ("target never answering", hanging.url)]
    with tempfile.TemporaryDirectory() as tmp:
        results = []
        for label, target in rows:
            if target == hanging.url:  # answered only after the window's publishing: apprise's read timeout ends each
                asyncio.get_running_loop().call_later(1.0, hanging.hold.set)
            results.append((label, *await measure(target, args.windows, Path(tmp))))
    live.close()
    hanging.close()
    live_publish = results[1][1]
    print(f"{'':28} {'publish / window':>17} {'x live target':>14} {'sends ended after':>18}")
    for label, publish, drained in results:
        print(f"{label:28} {publish * 1e3:14.2f} ms {publish / live_publish:13.2f}x {drained:16.2f} s")
    dead, hanging_row = results[2], results[3]
    print(f"a window's publishing with a dead target: {dead[1] / live_publish:.2f}x a live one's, with one never "
          f"answering: {hanging_row[1] / live_publish:.2f}x ({live_publish * 1e3:.1f} ms a window with a live target)")

if __name__ == "__main__":
    asyncio.run(main())
