"""The downtime window on the drill, broken down by phase, staged and cold side by side.

    python bench/window.py [--runs N] [--dir DIR] [--json FILE]

Downtime is the stop being issued until the server is ready again. Its phases, each timed by the
part that does the work:
  stop         the stop command (issued -> returned)
  vram free    returned -> the first telemetry sample showing the GPUs free (after a warm-up run,
               so the drill's stuck-VRAM first stop is not counted)
  extract      the extractor's own clock: staged, go seen -> GPUs released (`window_s`); cold,
               process start -> released (`since_start_s`: imports, weights read, forward)
  start->ready the start command issued -> health 200 and a one-token generation
The zero-downtime route (extract on the training host's free GPU) is run once too: its downtime is
0 when the server was never stopped. The console's overhead is the downtime minus those: noticing the free GPUs and writing the go,
noticing `gpu_released` and issuing the start, state and journal writes. Runs alternate staged and
cold; medians are printed. Last line: the headline.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from console.config import load_config  # noqa: E402
from console.drill.hosts import down, up  # noqa: E402
from console.operator import Operator  # noqa: E402
from console.procedure.decider import ApproveAll  # noqa: E402


def phases(state: dict[str, Any]) -> dict[str, float]:
    """The downtime and its phases (seconds) from a finished run's state."""
    service, facts = state["service"], state["facts"]
    if "stopped_at" not in service:  # the zero-downtime route: the server was never stopped
        return {k: 0.0 for k in ("downtime", "stop", "vram_free", "extract", "start_ready", "overhead",
                                 "released_to_start")}
    window = facts.get("window", {})
    downtime = service["ready_at"] - service["stopped_at"]
    stop = service["stop_returned_at"] - service["stopped_at"]
    vram = service["vram_free_at"] - service["stop_returned_at"]
    extract = window["window_s"] if window.get("staged") else window["since_start_s"]
    start_ready = service["ready_at"] - service["start_issued_at"]
    # The restart overlaps the extractor's flush; only what lies inside the downtime counts.
    overhead = downtime - stop - vram - extract - start_ready
    return {"downtime": downtime, "stop": stop, "vram_free": vram, "extract": extract,
            "start_ready": start_ready, "overhead": overhead,
            "go_to_released": facts["gpu_released_at"] - facts["go_sent"] if facts.get("go_sent") else None,
            "released_to_start": service["start_issued_at"] - facts["gpu_released_at"]}


async def one_run(config_path: Path, runs: Path, stage: bool, route: str = "window") -> dict[str, Any]:
    operator = Operator(load_config(config_path), runs_dir=runs)
    operator.start()
    try:
        finished = await operator.run(ApproveAll(), stage=None if stage else False, route=route)
    finally:
        await operator.stop()
    if finished.status != "done":
        raise SystemExit(f"bench: the run failed: {finished.message}")
    return operator.store.open(finished.run_id).state.to_json()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each kind (default 2)")
    parser.add_argument("--dir", default=None, help="the drill directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-window-") as tmp:
        drill_dir = Path(args.dir or Path(tmp) / "drill")
        config = up(drill_dir, fresh=True, say=lambda line: print(line, file=sys.stderr))
        try:
            store = Path(tmp) / "runs"
            print("warm-up run (the drill's first stop leaves VRAM held: not counted)", file=sys.stderr)
            asyncio.run(one_run(config, store, stage=True))
            rows: dict[str, list[dict[str, float]]] = {"staged": [], "cold": []}
            for i in range(args.runs):
                for kind in ("staged", "cold") if i % 2 == 0 else ("cold", "staged"):
                    state = asyncio.run(one_run(config, store, stage=kind == "staged"))
                    rows[kind].append(phases(state))
                    print(f"{kind} run {len(rows[kind])}: " + ", ".join(
                        f"{k} {v:.2f} s" for k, v in rows[kind][-1].items() if v is not None), file=sys.stderr)
            state = asyncio.run(one_run(config, store, stage=False, route="zero-downtime"))
            rows["zero-downtime"] = [phases(state)]
            print(f"zero-downtime run: extracted on {state['facts']['extract_on']['host']}; the server was "
                  f"{'never stopped' if 'stopped_at' not in state['service'] else 'STOPPED'}", file=sys.stderr)
        finally:
            down(drill_dir, say=lambda _: None)
    keys = ("downtime", "stop", "vram_free", "extract", "start_ready", "overhead", "released_to_start")
    medians = {kind: {k: statistics.median(r[k] for r in runs) for k in keys} for kind, runs in rows.items()}
    print(f"{'phase':<20}{'staged':>10}{'cold':>10}{'cold/staged':>14}{'zero-downtime':>16}")
    for key in keys:
        staged, cold = medians["staged"][key], medians["cold"][key]
        ratio = f"{cold / staged:.2f}x" if staged > 0.005 else "-"
        print(f"{key:<20}{staged:>9.2f}s{cold:>9.2f}s{ratio:>14}{medians['zero-downtime'][key]:>15.2f}s")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": rows, "medians": medians}, indent=2))
    worst = max(medians["staged"]["overhead"], medians["cold"]["overhead"])
    print(f"window overhead: {medians['staged']['overhead']:.2f} s staged, {medians['cold']['overhead']:.2f} s cold "
          f"(target < 1 s); downtime {medians['staged']['downtime']:.2f} s staged vs "
          f"{medians['cold']['downtime']:.2f} s cold, {medians['zero-downtime']['downtime']:.2f} s zero-downtime")
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
