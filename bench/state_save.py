"""What saving a run's state costs: the engine writes state.json at every step and event that a resume
depends on (about a hundred times in a drill window), so its serialisation is on the window's path.

    .venv/bin/python bench/state_save.py [--saves 200] [--state tests/data/replay/.../state.json]

The baseline is the way it was written before (`dataclasses.asdict`, which deep-copies every value,
then the standard library's `json.dumps(indent=2, sort_keys=True)`, its pure-Python encoder since an
indent is asked); the figure is `RunState.dumps` (pydantic-core). Both are timed on the same state,
alternating, in CPU time; the atomic write (temp file, fsync, rename) is the same for both and left
out. Each output is checked to decode to the same JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from console.procedure.state import RunState  # noqa: E402

DEFAULT = ROOT / "tests/data/replay/20261202-042648-ad7a/state.json"  # a whole drill window's state


def baseline(state: RunState) -> bytes:
    return (json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True, default=str) + "\n").encode()


def timed(fns, state: RunState, saves: int) -> list[float]:
    """CPU milliseconds per save of each of `fns`: the median of five batches, the functions' batches
    alternating (a machine whose speed drifts slows both alike)."""
    batches: list[list[float]] = [[] for _ in fns]
    for _ in range(5):
        for fn, times in zip(fns, batches, strict=True):
            start = time.process_time()
            for _ in range(saves):
                fn(state)
            times.append((time.process_time() - start) * 1000 / saves)
    return [statistics.median(times) for times in batches]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=200)
    parser.add_argument("--state", type=Path, default=DEFAULT)
    args = parser.parse_args()
    state = RunState.from_json(json.loads(args.state.read_text()), str(args.state))
    if json.loads(baseline(state)) != json.loads(state.dumps()):
        print("the two serialisations differ: the figure would compare different files", file=sys.stderr)
        return 1
    old, new = timed([baseline, RunState.dumps], state, args.saves)
    print(f"state: {args.state} ({len(state.dumps())} bytes)")
    print(f"asdict + json.dumps (baseline): {old:.2f} ms CPU per save")
    print(f"RunState.dumps (pydantic-core): {new:.2f} ms CPU per save ({old / new:.0f}x less)")
    print(f"state save: {new:.2f} ms per save (baseline {old:.2f} ms; target < 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
