"""Build the drill's assets into one directory: the tiny target, the two drafters, the prompt set.

    python -m remote.drill.assets OUT_DIR

OUT_DIR/target (`remote.drill.tinymodel`), OUT_DIR/drafters/{reference,candidate}
(`remote.drill.drafters`), OUT_DIR/prompts.jsonl (the drill's few prompts, short completions) and,
written last, OUT_DIR/assets.json saying what was built. The console builds into a temporary
directory and renames it when this has exited 0 (`console.drill.assets`), so a killed build is
never taken as complete. The build refuses to finish when the drafters' taus do not differ visibly.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from remote.artifacts import write_json_atomic

FORMAT = "dflash-ops.drill-assets/1"
PROMPT_IDS = ("fizzbuzz", "binary_search", "linked_list_reverse", "json_parser")
MAX_NEW_TOKENS = 24
MIN_TAU_GAP = 2.0  # reference minus candidate, on the drill's prompts


def write_prompts(path: Path) -> Path:
    """The drill's prompt file: a few of the shipped prompts with short completions (fast on a CPU)."""
    from remote.prompts import DEFAULT_PROMPTS

    chosen = {}
    for line in DEFAULT_PROMPTS.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record["id"] in PROMPT_IDS:
                chosen[record["id"]] = {**record, "max_new_tokens": MAX_NEW_TOKENS}
    path.write_text("".join(json.dumps(chosen[i]) + "\n" for i in PROMPT_IDS))
    return path


def build(out: str | os.PathLike, steps: int | None = None) -> dict[str, Any]:
    """Build every asset under `out` (which should be empty); return the content of assets.json."""
    from remote.drill import drafters
    from remote.drill.tinymodel import build_tiny_target

    drafters.quiet_transformers()
    began = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    print("building the tiny target", file=sys.stderr, flush=True)
    target = build_tiny_target(out / "target", num_layers=4)
    prompts = write_prompts(out / "prompts.jsonl")
    print("fitting the reference and candidate drafters", file=sys.stderr, flush=True)
    fit = drafters.fit_drafters(target, out / "drafters", list(PROMPT_IDS), MAX_NEW_TOKENS,
                                steps or drafters.STEPS)
    taus = {name: d["fit_check_tau"] for name, d in fit["drafters"].items()}
    if taus["reference"] - taus["candidate"] < MIN_TAU_GAP:
        raise SystemExit(f"drill assets: the drafters' taus do not differ visibly ({taus}); not keeping them")
    facts = {
        "format": FORMAT,
        "built_at": time.time(),
        "build_s": round(time.perf_counter() - began, 2),
        "target": "target",
        "prompts": prompts.name,
        "max_new_tokens": MAX_NEW_TOKENS,
        "drafters": {name: {**d, "path": f"drafters/{name}"} for name, d in fit["drafters"].items()},
        "block_size": fit["block_size"],
        "target_layer_ids": fit["target_layer_ids"],
    }
    write_json_atomic(out / "assets.json", facts)
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=None, help="Adam steps per drafter")
    args = parser.parse_args()
    facts = build(args.out, args.steps)
    print(json.dumps({name: d["fit_check_tau"] for name, d in facts["drafters"].items()}))


if __name__ == "__main__":
    main()
