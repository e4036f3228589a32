"""Why two fast extractions of the same prompts can differ: fla's autotuned configs (GPU machine).

    source .dev/setup-device.sh && python3 bench/autotune_spread.py --json OUT.json      # ~4 min

Runs `remote.extract` on the 4-layer slice of the GPU tests (hidden 2048, vocabulary 32,000; 4 prompts
of 1,000 tokens), each in its own process, under controlled Triton caches, and compares each run's
hidden states with the first one's (float64, per layer) next to the kernel configs each run's
autotuners chose (manifest `kernel_configs`):

  A  cold, cache X empty          (the reference)
  B  cold, cache X as A left it   (fla caches its autotune results there: same configs expected)
  C  cold, cache Y empty          (a second independent tuning: the run-to-run spread)
  S1 staged, cache Z empty        (what test_staged_window_holds_no_compile compares)
  S2 staged, cache X as A left it (staging itself, with the configs held fixed)
  G  --device-map auto, 0=300MiB,cpu=50GiB, cache X (the GPU+CPU split of the GPU tests)

If B and S2 equal A exactly while C and S1 differ only where their configs differ, the spread is the
autotuner's choice, not staging (pinned buffers, side-stream copies, the warm-up).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.extract import BIG, build_random_target, random_completions, released, run_extract  # noqa: E402

DIMS = {**BIG, "num_hidden_layers": 4, "vocab_size": 32000}


def config_diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Kernels whose chosen configs differ between two manifests: {kernel: {"a": .., "b": ..}}."""
    ca, cb = a.get("kernel_configs") or {}, b.get("kernel_configs") or {}
    return {k: {"a": ca.get(k), "b": cb.get(k)} for k in sorted(set(ca) | set(cb)) if ca.get(k) != cb.get(k)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    p.add_argument("--workdir", default=None)
    args = p.parse_args()
    from remote.parity import compare_dirs

    work = Path(args.workdir or tempfile.mkdtemp(prefix="autotune-spread-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_random_target(work / "model", DIMS, "cuda")
    completions = random_completions(model, work / "completions.json", n=4, prompt_len=200, completion_len=800,
                                     vocab=DIMS["vocab_size"])
    base = ["--model", str(model), "--completions", str(completions), "--layers", "0,1,2", "--kernels", "fast"]
    plan = [("A", work / "cache-x", []), ("B", work / "cache-x", []), ("C", work / "cache-y", []),
            ("S1", work / "cache-z", ["--staged"]), ("S2", work / "cache-x", ["--staged"]),
            ("G", work / "cache-x", ["--device-map", "auto", "--max-memory", "0=300MiB,cpu=50GiB"])]
    runs: dict[str, Any] = {}
    for name, cache, extra in plan:
        go = work / f"go-{name}"
        go.unlink(missing_ok=True)
        if "--staged" in extra:
            extra = [*extra, "--go-file", str(go)]
        t0 = time.perf_counter()
        try:
            run = run_extract([*base, "--out", str(work / name), *extra], work, name, cache,
                              go_file=go if "--staged" in extra else None)
        except RuntimeError as exc:
            runs[name] = {"error": str(exc)[-1500:]}
            print(f"{name}: FAILED {exc}", flush=True)
            continue
        window = released(run)
        manifest = json.loads((work / name / "manifest.json").read_text())
        runs[name] = {"wall_s": round(time.perf_counter() - t0, 1), "first_forward_s": window.get("first_forward_s"),
                      "forward_s": window.get("forward_s"), "warmup_s": window.get("warmup_s"),
                      "window_s": window.get("window_s"), "devices": manifest.get("devices"),
                      "kernel_configs": manifest.get("kernel_configs")}
        print(f"{name}: {runs[name]['wall_s']} s, first forward {window.get('first_forward_s')} s, "
              f"{len(manifest.get('kernel_configs') or {})} autotuned kernels", flush=True)
    reference = json.loads((work / "A" / "manifest.json").read_text()) if "error" not in runs.get("A", {"error": 1}) else None
    for name in ("B", "C", "S1", "S2", "G"):
        if reference is None or "error" in runs.get(name, {"error": 1}):
            continue
        other = json.loads((work / name / "manifest.json").read_text())
        report = compare_dirs(work / "A", work / name)
        runs[name]["vs_A"] = [{k: r[k] for k in ("layer", "cosine", "max_abs")} for r in report["layers"]]
        runs[name]["configs_differ_from_A"] = config_diff(reference, other)
        worst = min(r["cosine"] for r in report["layers"])
        print(f"{name} vs A: max |d| {max(r['max_abs'] for r in report['layers']):g}, min cosine {worst:.10f}, "
              f"kernels with other configs: {sorted(runs[name]['configs_differ_from_A']) or 'none'}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
