"""Build the drill's assets into one directory: the tiny target, the two drafters, the prompt set.

    python -m remote.drill.assets OUT_DIR [--gpu]

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
GPU_MAX_NEW_TOKENS = 64  # the GPU drill's completions: a forward inside the window worth timing
MIN_TAU_GAP = 2.0  # reference minus candidate, on the drill's prompts


def write_prompts(path: Path, max_new_tokens: int = MAX_NEW_TOKENS) -> Path:
    """The drill's prompt file: a few of the shipped prompts with short completions (fast on a CPU)."""
    from remote.prompts import DEFAULT_PROMPTS

    chosen = {}
    for line in DEFAULT_PROMPTS.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record["id"] in PROMPT_IDS:
                chosen[record["id"]] = {**record, "max_new_tokens": max_new_tokens}
    path.write_text("".join(json.dumps(chosen[i]) + "\n" for i in PROMPT_IDS))
    return path


def random_drafters(target: Path, out: Path) -> dict[str, Any]:
    """The GPU drill's drafters: random ones shaped for the few-GB target (fitting one to a random
    1.7 B target would say nothing more; the CPU drill's fitted pair shows the tau gap). Both read
    the same layers, so the evaluation on CUDA runs the real kernels on real shapes."""
    from transformers import AutoConfig, AutoTokenizer

    from remote.drafter import save_random_drafter

    config = AutoConfig.from_pretrained(target)
    mask = int(AutoTokenizer.from_pretrained(target).convert_tokens_to_ids("<|mask|>"))
    layers = config.num_hidden_layers
    layer_ids = sorted({1, layers // 2, layers - 2})
    drafters = {}
    for seed, name in enumerate(("reference", "candidate")):
        save_random_drafter(out / name, config.hidden_size, config.vocab_size, layer_ids, layers, block_size=16,
                            num_layers=1, mask_token_id=mask, seed=seed, num_heads=16, num_kv_heads=4, head_dim=128)
        drafters[name] = {"path": str(out / name), "target_layer_ids": layer_ids, "fit_check_tau": None,
                          "random": True}
    return {"block_size": 16, "target_layer_ids": layer_ids, "drafters": drafters}


def _progress_line(done: int, total: int, what: str) -> None:
    """`[done/total] what`: the console's build line reads it as a bar with the time left."""
    print(f"[{done}/{total}] {what}", file=sys.stderr, flush=True)


def build(out: str | os.PathLike, steps: int | None = None, gpu: bool = False) -> dict[str, Any]:
    """Build every asset under `out` (which should be empty); return the content of assets.json.
    `gpu`: the GPU drill's assets (the few-GB target built on the GPU, random drafters)."""
    from remote.drill import drafters
    from remote.drill.tinymodel import build_tiny_target

    drafters.quiet_transformers()
    began = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"building the {'GPU drill' if gpu else 'tiny'} target", file=sys.stderr, flush=True)
    target = build_tiny_target(out / "target", num_layers=4, gpu=gpu)
    prompts = write_prompts(out / "prompts.jsonl", GPU_MAX_NEW_TOKENS if gpu else MAX_NEW_TOKENS)
    if gpu:
        fit = random_drafters(target, out / "drafters")
    else:
        print("fitting the reference and candidate drafters", file=sys.stderr, flush=True)
        fit = drafters.fit_drafters(target, out / "drafters", list(PROMPT_IDS), MAX_NEW_TOKENS,
                                    steps or drafters.STEPS, progress=_progress_line)
        taus = {name: d["fit_check_tau"] for name, d in fit["drafters"].items()}
        if taus["reference"] - taus["candidate"] < MIN_TAU_GAP:
            raise SystemExit(f"drill assets: the drafters' taus do not differ visibly ({taus}); not keeping them")
    facts = {
        "format": FORMAT,
        "built_at": time.time(),
        "build_s": round(time.perf_counter() - began, 2),
        "target": "target",
        "prompts": prompts.name,
        "max_new_tokens": GPU_MAX_NEW_TOKENS if gpu else MAX_NEW_TOKENS,
        "gpu": gpu,
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
    parser.add_argument("--gpu", action="store_true", help="the GPU drill's assets (needs CUDA)")
    args = parser.parse_args()
    facts = build(args.out, args.steps, args.gpu)
    print(json.dumps({name: d["fit_check_tau"] for name, d in facts["drafters"].items()}))


if __name__ == "__main__":
    main()
