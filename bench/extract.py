"""Benchmark of the extraction worker on a random Qwen3.5 of about 2 B parameters (GPU machine).

    source .dev/setup-device.sh && python3 bench/extract.py            # GPU, ~3-4 min
    .venv/bin/python bench/extract.py --small                           # CPU smoke run, tiny model

Measures, side by side with a baseline each time:
  1. load: raw read of the safetensors files vs the worker's load (from_pretrained + placement);
  2. forward with hooks + top-k + saving vs a plain `model(ids)` forward (target: under 5% cost);
  3. fast kernels (fla + causal-conv1d) vs the forced torch path: steady tokens/s and parity;
  4. in-window time: staged (weights in pinned RAM, kernels warmed before the go) vs cold (process
     start, load, Triton compile, forward inside the window), each with its own empty Triton cache;
     and the two runs' hidden states compared: the fast path's run-to-run spread where fla's
     autotuners chose other configs (manifest `kernel_configs`).
Writes the figures as JSON (default docs/gpu-results/bench-extract.json) and prints the headline last.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BIG = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
           num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
           linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
           linear_conv_kernel_dim=4, tie_word_embeddings=True)
SMALL = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=True)


def build_random_target(out: Path, dims: dict[str, Any], device: str, seed: int = 0) -> Path:
    """A random-init Qwen3_5ForCausalLM with `dims`, saved as bf16 safetensors (cached by config)."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    marker = out / "bench-dims.json"
    if marker.is_file() and json.loads(marker.read_text()) == dims:
        return out
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(max_position_embeddings=8192, pad_token_id=0, eos_token_id=1, **dims)
    with torch.device(device):
        model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    marker.write_text(json.dumps(dims))
    return out


def random_completions(target: Path, out: Path, n: int, prompt_len: int, completion_len: int, vocab: int,
                       seed: int = 0) -> Path:
    """completions.json (the real format) of random token ids: timing and parity do not need text."""
    rng = random.Random(seed)
    prompts = [{"id": f"p{i:02d}", "prompt_ids": [rng.randrange(vocab) for _ in range(prompt_len)],
                "completion_ids": [rng.randrange(vocab) for _ in range(completion_len)], "text": "",
                "finish_reason": "length", "endpoint": "generate"} for i in range(n)]
    out.write_text(json.dumps({"format": "dflash-ops.completions/1", "prompt_set_sha256": "random",
                               "prompt_file": "random", "model_path": str(target), "server_url": "none",
                               "sampling": {"temperature": 0, "max_new_tokens": completion_len}, "prompts": prompts}))
    return out


def run_extract(args: list[str], work: Path, name: str, triton_dir: Path | None, go_file: Path | None = None,
                timeout: float = 590) -> dict[str, Any]:
    """Run `remote.extract` as its own process; touch `go_file` when it reports `staged`.
    Returns {"events": [...], "wall_s", "go_at", "start_unix"}; raises with the worker's error on failure."""
    events_file = work / f"{name}.events.jsonl"
    events_file.unlink(missing_ok=True)
    env = {**os.environ, "DFLASH_EVENTS": str(events_file),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if triton_dir is not None:
        env["TRITON_CACHE_DIR"] = str(triton_dir)
    start, start_unix = time.perf_counter(), time.time()
    go_at = None
    events: list[dict[str, Any]] = []
    with open(work / f"{name}.stderr.txt", "wb") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "remote.extract", *args], env=env, cwd=ROOT,
                                stdout=subprocess.DEVNULL, stderr=stderr)
        while True:
            done = proc.poll() is not None
            if events_file.exists():
                events = [json.loads(x) for x in events_file.read_text().splitlines() if x.endswith("}")]
            if go_file is not None and go_at is None and any(e["type"] == "staged" for e in events):
                go_at = time.perf_counter() - start
                go_file.touch()
            if done:
                break
            if time.perf_counter() - start > timeout:
                proc.kill()
                raise RuntimeError(f"{name}: timed out")
            time.sleep(0.05)
    if proc.returncode != 0:
        errors = [e["msg"] for e in events if e["type"] == "error"]
        tail = (work / f"{name}.stderr.txt").read_text(errors="replace")[-1500:]
        raise RuntimeError(f"{name} failed: {errors or tail}")
    return {"events": events, "wall_s": time.perf_counter() - start, "go_at": go_at, "start_unix": start_unix}


def released(run: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in run["events"] if e["type"] == "gpu_released")


def raw_read(model_dir: Path) -> tuple[float, int]:
    """Seconds and bytes to read every safetensors file once (64 MiB reads, page cache as it is)."""
    total = 0
    start = time.perf_counter()
    for file in sorted(model_dir.glob("*.safetensors")):
        with open(file, "rb", buffering=0) as fh:
            while chunk := fh.read(64 << 20):
                total += len(chunk)
    return time.perf_counter() - start, total


def hooks_overhead(model_dir: Path, completions: Path, layers: list[int], device: str, work: Path,
                   rounds: int = 15, profile: Path | None = None) -> dict[str, Any]:
    """In this process: plain `model(ids)` forwards vs the worker's forward loop, measured two ways.

    Paired (the headline): prompt by prompt, a plain forward and an extraction of the same prompt
    back to back, in alternating order, each followed by a full device sync (so the extraction is
    charged its whole host copy, with no credit for overlapping it with the next prompt); the
    writer saves in the background as in the worker. Pairs 50 ms apart share the machine's state,
    which on the GPU host swings by +-20 % from one second to the next; whole-set timings alone
    cannot resolve a 5 % difference there.

    Whole set, as the window sees it:

    Plain: `model(ids)` per prompt (logits for every position, as Hugging Face computes them), one
    sync at the end. Extraction: `forward_one` per prompt (hooks, final norm, top-8, pinned host
    copies on a side stream), either waiting only for the copies ("hooks") or handing each prompt to
    the worker's `Writer` ("with saving": the loop until the GPU is done, which is when the worker
    frees it; the writer's drain and fsync come after `gpu_released` and are reported apart).
    The variants alternate round by round and medians are compared: a launch-bound forward of a
    2 B model varies by tens of percent between runs, and alternating cancels slow drifts.
    """
    import statistics

    import torch
    from transformers import AutoModelForCausalLM

    from remote.events import EventWriter
    from remote.extract import Writer, forward_one
    from remote.layers import find_decoder_layers

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map=device).eval()
    _, decoder_layers = find_decoder_layers(model)
    fast = device == "cuda"  # as the worker: the Triton top-8 pass where the fast kernels run
    prompts = json.loads(completions.read_text())["prompts"]
    seqs = [p["prompt_ids"] + p["completion_ids"] for p in prompts]
    tokens = sum(len(s) for s in seqs)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def plain() -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for ids in seqs:
                model(torch.tensor([ids], device=device), use_cache=False)
        sync()
        return time.perf_counter() - start

    def hooks() -> float:
        start = time.perf_counter()
        outputs = [forward_one(model, decoder_layers, layers, ids, triton_topk=fast) for ids in seqs]
        for out in outputs:
            out.wait()
        sync()
        return time.perf_counter() - start

    def with_saving(i: int) -> tuple[float, float]:
        out = work / f"overhead-{i % 2}"
        out.mkdir(exist_ok=True)
        writer = Writer(out, layers, EventWriter(stream=io.StringIO()), len(seqs))
        start = time.perf_counter()
        for p, ids in zip(prompts, seqs, strict=True):
            writer.put(p["id"], len(p["prompt_ids"]), forward_one(model, decoder_layers, layers, ids, triton_topk=fast))
        sync()
        loop_s = time.perf_counter() - start
        writer.finish()
        return loop_s, time.perf_counter() - start - loop_s

    def paired() -> tuple[list[float], list[float]]:
        writer = Writer(work / "overhead-paired", layers, EventWriter(stream=io.StringIO()), len(seqs))
        plain_s, extract_s = [], []
        for n in range(rounds):
            for j, (p, ids) in enumerate(zip(prompts, seqs, strict=True)):
                for which in ((0, 1) if (n + j) % 2 == 0 else (1, 0)):
                    start = time.perf_counter()
                    if which == 0:
                        with torch.inference_mode():
                            model(torch.tensor([ids], device=device), use_cache=False)
                    else:
                        writer.put(p["id"], len(p["prompt_ids"]), forward_one(model, decoder_layers, layers, ids, triton_topk=fast))
                    sync()
                    (plain_s if which == 0 else extract_s).append(time.perf_counter() - start)
        writer.finish()
        return plain_s, extract_s

    (work / "overhead-paired").mkdir(exist_ok=True)
    plain()  # warm-up (kernels from the cache, allocator, pinned buffers)
    hooks()
    with_saving(-1)
    pair_plain, pair_extract = paired()
    plain_runs, hooks_runs, save_runs = [], [], []
    for i in range(rounds):
        plain_runs.append(plain())
        hooks_runs.append(hooks())
        save_runs.append(with_saving(i))
    if profile is not None:  # where the extra time goes, kernel by kernel, for one round of each
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        tables = []
        for name, fn in (("plain", plain), ("extraction with saving", lambda: with_saving(-2))):
            with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
            tables.append(f"== {name}\n" + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25))
        profile.write_text("\n".join(tables))
    median = statistics.median
    plain_s, hooks_s = median(plain_runs), median(hooks_runs)
    save_s, drain_s = median(r[0] for r in save_runs), median(r[1] for r in save_runs)
    ratios = [e / q for q, e in zip(pair_plain, pair_extract, strict=True)]
    return {"tokens": tokens, "rounds": rounds, "pairs": len(ratios),
            "paired_cost": sum(pair_extract) / sum(pair_plain) - 1,
            "paired_median_cost": median(ratios) - 1,
            "paired_quartiles": [q - 1 for q in statistics.quantiles(ratios, n=4)],
            "paired_plain_s": pair_plain, "paired_extract_s": pair_extract,
            "plain_runs_s": plain_runs, "hooks_runs_s": hooks_runs,
            "save_runs_s": [r[0] for r in save_runs], "drain_runs_s": [r[1] for r in save_runs],
            "plain_s": plain_s, "hooks_s": hooks_s, "hooks_and_save_s": save_s, "drain_s": drain_s,
            "plain_tok_s": tokens / plain_s, "hooks_tok_s": tokens / hooks_s, "save_tok_s": tokens / save_s,
            "hooks_cost": hooks_s / plain_s - 1, "hooks_and_save_cost": save_s / plain_s - 1,
            "hooks_cost_min": min(hooks_runs) / min(plain_runs) - 1,
            "hooks_and_save_cost_min": min(r[0] for r in save_runs) / min(plain_runs) - 1}


def print_overhead(o: dict[str, Any]) -> None:
    q1, _, q3 = o["paired_quartiles"]
    print(f"paired, prompt by prompt ({o['pairs']} pairs, extraction with saving, synced after each): "
          f"total {o['paired_cost'] * 100:+.1f}%, median pair {o['paired_median_cost'] * 100:+.1f}% "
          f"(quartiles {q1 * 100:+.1f}% .. {q3 * 100:+.1f}%)", flush=True)
    print(f"whole set: plain {o['plain_tok_s']:.0f} tok/s; hooks + top-8 + host copies {o['hooks_tok_s']:.0f} tok/s "
          f"({o['hooks_cost'] * 100:+.1f}%); with saving {o['save_tok_s']:.0f} tok/s "
          f"({o['hooks_and_save_cost'] * 100:+.1f}%), then the writer's drain + fsync {o['drain_s'] * 1000:.0f} ms "
          f"after the GPU is free (medians of {o['rounds']} alternating rounds; fastest rounds: "
          f"{o['hooks_cost_min'] * 100:+.1f}% / {o['hooks_and_save_cost_min'] * 100:+.1f}%)", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny model on CPU (a smoke run, not a benchmark)")
    p.add_argument("--workdir", default=None, help="where the model and outputs go (model cached there)")
    p.add_argument("--json", default=None, help="figures JSON (default docs/gpu-results/bench-extract.json)")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--only-overhead", action="store_true", help="only the hooks + saving vs plain forward figure")
    p.add_argument("--only-window", action="store_true", help="only the staged window (weights staged, go, window)")
    p.add_argument("--profile", default=None, help="with --only-overhead: write a torch.profiler table here")
    args = p.parse_args()

    import torch

    gpu = torch.cuda.is_available() and not args.small
    device = "cuda" if gpu else "cpu"
    dims = SMALL if args.small else BIG
    n_prompts, prompt_len, completion_len = (3, 40, 160) if args.small else (args.prompts, 300, 1200)
    work = Path(args.workdir or Path(tempfile.gettempdir()) / ("dflash-bench-small" if args.small else "dflash-bench"))
    work.mkdir(parents=True, exist_ok=True)
    fast_policy = "fast" if gpu else "torch"
    layers = "1,6,12,18,22" if not args.small else "0,1,2"
    layer_ids = sorted({int(x) for x in layers.split(",")} | {dims["num_hidden_layers"] - 1})
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if gpu else "cpu", "dims": dims,
                               "prompts": n_prompts, "tokens_per_prompt": prompt_len + completion_len}

    t = time.perf_counter()
    model_dir = build_random_target(work / "model", dims, device)
    from remote.weights import checkpoint_facts

    facts = checkpoint_facts(model_dir)
    figures["checkpoint"] = facts
    print(f"model: {facts['tensor_bytes'] / 2e9:.2f} B params, {facts['tensors']} tensors, "
          f"{facts['tensor_bytes'] / 1e9:.2f} GB (ready in {time.perf_counter() - t:.1f} s)", flush=True)
    completions = random_completions(model_dir, work / "completions.json", n_prompts, prompt_len, completion_len,
                                     dims["vocab_size"])
    if args.only_overhead:
        o = hooks_overhead(model_dir, completions, layer_ids, device, work,
                           profile=Path(args.profile) if args.profile else None)
        print_overhead(o)
        print(f"extraction overhead: {o['paired_cost'] * 100:+.1f}% vs a plain forward, paired prompt by prompt "
              f"(whole set {o['hooks_and_save_cost'] * 100:+.1f}%; target < 5%)")
        return
    stamp = str(int(time.time()))
    base = ["--model", str(model_dir), "--completions", str(completions), "--layers", layers, "--device", device]

    if args.only_window:  # the staged window alone, with an empty Triton cache (checks the warm-up)
        go = work / f"go-{stamp}"
        s = released(run_extract([*base, "--out", str(work / "out-staged"), "--kernels", fast_policy, "--staged",
                                  "--go-file", str(go)], work, "staged", work / f"triton-staged-{stamp}", go_file=go))
        rest = (s["forward_s"] - s["first_forward_s"]) / max(n_prompts - 1, 1)
        print(f"staged window {s['window_s']:.2f} s = copy {s['copy_s']:.2f} s + forward {s['forward_s']:.2f} s "
              f"(first prompt {s['first_forward_s']:.2f} s, later prompts {rest:.3f} s each) + release "
              f"{s['release_s']:.2f} s; {s.get('gpu_bytes_still_allocated', 0) / 2**20:.0f} MiB still allocated")
        return

    # 4a. cold: everything inside the window, empty Triton cache.
    raw_s, raw_bytes = raw_read(model_dir)
    cold = run_extract([*base, "--out", str(work / "out-fast"), "--kernels", fast_policy], work, "cold",
                       work / f"triton-cold-{stamp}")
    c = released(cold)
    load_s = c["from_pretrained_s"] + c["copy_s"]
    figures["load"] = {"raw_read_s": raw_s, "raw_read_gb_s": raw_bytes / raw_s / 1e9, "load_s": load_s,
                       "load_gb_s": c["bytes"] / load_s / 1e9, "from_pretrained_s": c["from_pretrained_s"],
                       "copy_s": c["copy_s"]}
    print(f"load: worker {load_s:.2f} s ({figures['load']['load_gb_s']:.2f} GB/s) vs raw read {raw_s:.2f} s "
          f"({figures['load']['raw_read_gb_s']:.2f} GB/s, page cache as left by the build): "
          f"ratio {load_s / raw_s:.2f}", flush=True)

    # 4b. staged: host read + warm-up before the go, its own empty Triton cache.
    go = work / f"go-{stamp}"
    staged = run_extract([*base, "--out", str(work / "out-staged"), "--kernels", fast_policy, "--staged",
                          "--go-file", str(go)], work, "staged", work / f"triton-staged-{stamp}", go_file=go)
    s = released(staged)
    staged_ev = next(e for e in staged["events"] if e["type"] == "staged")
    figures["window"] = {
        # Cold: from the process start (the server is already down) to the GPU released.
        "cold_s": c["t"] - cold["start_unix"], "cold_first_forward_s": c["first_forward_s"],
        "staged_s": s["window_s"], "staged_copy_s": s["copy_s"], "staged_forward_s": s["forward_s"],
        "staged_first_forward_s": s["first_forward_s"], "staged_host_read_s": staged_ev["host_read_s"],
        "staged_warmup_s": staged_ev["warmup_s"], "steady_tok_s": c.get("steady_tokens_per_s"),
        "steady_forward_s": s["tokens"] / c["steady_tokens_per_s"] if c.get("steady_tokens_per_s") else None,
    }
    w = figures["window"]
    print(f"window: cold {w['cold_s']:.2f} s (first pass {w['cold_first_forward_s']:.2f} s) vs staged "
          f"{w['staged_s']:.2f} s = copy {w['staged_copy_s']:.2f} s + forward {w['staged_forward_s']:.2f} s "
          f"(first pass {w['staged_first_forward_s']:.2f} s); before the go: host read {w['staged_host_read_s']:.2f} s,"
          f" warm-up {w['staged_warmup_s']:.2f} s", flush=True)

    # Run-to-run spread of the fast path: cold and staged tuned fla's kernels each on its own (two
    # empty Triton caches); where the autotuners chose other configs the bf16 rounding can differ.
    from remote.parity import compare_dirs

    spread = compare_dirs(work / "out-fast", work / "out-staged")
    configs = [json.loads((work / d / "manifest.json").read_text()).get("kernel_configs") or {}
               for d in ("out-fast", "out-staged")]
    figures["run_to_run"] = {
        "layers": [{k: r[k] for k in ("layer", "cosine", "max_abs")} for r in spread["layers"]],
        "configs_differ": sorted(k for k in set(configs[0]) | set(configs[1]) if configs[0].get(k) != configs[1].get(k)),
        "configs_cold": configs[0]}
    rr = figures["run_to_run"]
    print(f"run-to-run (cold vs staged, each autotuned on its own): max |d| "
          f"{max(r['max_abs'] for r in rr['layers']):g}, min cosine {min(r['cosine'] for r in rr['layers']):.9f}; "
          f"kernels with other configs: {', '.join(k.rsplit('.', 1)[-1] for k in rr['configs_differ']) or 'none'}",
          flush=True)

    # 3. fast vs torch, and parity of the two.
    torch_run = run_extract([*base, "--out", str(work / "out-torch"), "--kernels", "torch"], work, "torch", None)
    tr = released(torch_run)

    parity = compare_dirs(work / "out-fast", work / "out-torch")
    figures["kernels"] = {"fast_tok_s": c.get("steady_tokens_per_s"), "torch_tok_s": tr.get("steady_tokens_per_s"),
                          "speedup": (c.get("steady_tokens_per_s") or 0) / max(tr.get("steady_tokens_per_s") or 1, 1e-9),
                          "parity": [{k: r[k] for k in ("layer", "cosine", "max_abs", "mean_abs", "rel_err")}
                                     for r in parity["layers"]],
                          "argmax_agreement": parity["argmax_agreement"]}
    k = figures["kernels"]
    print(f"kernels ({fast_policy} vs torch): {k['fast_tok_s']:.0f} vs {k['torch_tok_s']:.0f} tok/s steady: "
          f"speed-up {k['speedup']:.2f}x; parity cosine "
          + ", ".join(f"L{r['layer']} {r['cosine']:.5f}" for r in k["parity"])
          + f"; argmax agreement {k['argmax_agreement']:.4f}", flush=True)

    # 2. hooks + saving vs plain forward, in this process (kernels from the staged run's cache).
    if gpu:
        os.environ["TRITON_CACHE_DIR"] = str(work / f"triton-staged-{stamp}")
    o = hooks_overhead(model_dir, completions, layer_ids, device, work)
    figures["hooks"] = o
    print_overhead(o)

    target = Path(args.json) if args.json else (work / "bench-extract.json" if args.small
                                                else ROOT / "docs" / "gpu-results" / "bench-extract.json")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"figures: {target}", flush=True)
    compile_note = ("no compile in window" if w["staged_first_forward_s"] < 3 * max(
        w["staged_forward_s"] / max(n_prompts, 1), 0.05) else "first pass slow: check the warm-up")
    print(f"in-window: staged {w['staged_s']:.2f} s vs cold {w['cold_s']:.2f} s "
          f"(copy {w['staged_copy_s']:.2f} s + forward {w['staged_forward_s']:.2f} s; {compile_note})")


if __name__ == "__main__":
    main()
