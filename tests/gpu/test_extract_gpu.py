"""On the GPU machine: the extractor with fla + causal-conv1d (from ../shared/device) on a random
Qwen3.5 with the real head dims of the ~2 B benchmark model (4 layers, small vocabulary).

    source .dev/setup-device.sh && python3 -m pytest tests/gpu/test_extract_gpu.py -v

Figures go to docs/gpu-results/extract.json (parity per layer, windows) for docs/benchmarks.md.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from bench.extract import BIG, build_random_target, random_completions, released, run_extract  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "gpu-results" / "extract.json"
DIMS = {**BIG, "num_hidden_layers": 4, "vocab_size": 32000}
LAYERS = "0,1,2"
# Two fast runs whose fla autotuners chose other configs (an empty vs a warm Triton cache) can differ
# by bf16 rounding that grows with depth: cosine 1 - 2e-8 at layer 0 to 1 - 6e-6 at layer 3 (max |d|
# 0.0625) was seen; run 6 traced it to l2norm_fwd_kernel at BT 8 with 8 or 16 warps (a row's sum of
# squares split across warps). The bound, per layer of this 4-layer slice, is ~9x that and ~5x tighter
# than the fast-vs-torch gap (1 - 2.4e-4 at layer 3). With the same configs the runs are identical.
AUTOTUNE_COSINE_BOUND = 5e-5


def record(key: str, value) -> None:
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    data[key] = value
    RESULTS.write_text(json.dumps(data, indent=2) + "\n")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("gpu-extract")


@pytest.fixture(scope="module")
def triton_cache(work) -> Path:
    """Shared across this module's runs (TRITON_CACHE_DIR from the environment when set)."""
    return Path(os.environ.get("TRITON_CACHE_DIR") or work / "triton")


@pytest.fixture(scope="module")
def target(work) -> tuple[Path, Path]:
    model = build_random_target(work / "model", DIMS, "cuda")
    completions = random_completions(model, work / "completions.json", n=4, prompt_len=200, completion_len=800,
                                     vocab=DIMS["vocab_size"])
    return model, completions


@pytest.fixture(scope="module")
def fast_run(target, work, triton_cache) -> dict:
    model, completions = target
    return run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "fast"),
                        "--layers", LAYERS, "--kernels", "fast"], work, "fast", triton_cache)


def test_fast_path_bound_and_used(fast_run, work):
    manifest = json.loads((work / "fast" / "manifest.json").read_text())
    roots = {fn: module.split(".")[0] for fn, module in manifest["kernels"].items()}
    assert roots == {"causal_conv1d_fn": "causal_conv1d", "causal_conv1d_update": "causal_conv1d",
                     "torch_chunk_gated_delta_rule": "fla", "torch_recurrent_gated_delta_rule": "fla"}
    assert manifest["kernels_fast"] is True and manifest["kernel_decision"]["effective"] == "fast"
    assert manifest["topk_pass"] == "triton"
    # Used, not only bound: the prefill path ran once per linear layer per prompt.
    assert manifest["kernel_calls"] == {"causal_conv1d_fn": 3 * 4, "torch_chunk_gated_delta_rule": 3 * 4}
    assert manifest["versions"]["fla"] and manifest["versions"]["causal_conv1d"]
    # The configs fla's autotuners chose are recorded (runs that differ there round differently).
    assert any(k.startswith("fla.") for k in manifest["kernel_configs"]), manifest["kernel_configs"]
    # The model really left the GPU before `gpu_released` was sent.
    assert released(fast_run)["gpu_bytes_still_allocated"] < 64 << 20


def test_parity_fast_vs_torch(fast_run, target, work):
    from remote.parity import compare_dirs

    model, completions = target
    run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "torch"),
                 "--layers", LAYERS, "--kernels", "torch"], work, "torch", None)
    report = compare_dirs(work / "fast", work / "torch")
    torch_manifest = json.loads((work / "torch" / "manifest.json").read_text())
    assert not torch_manifest["kernels_fast"] and torch_manifest["topk_pass"] == "torch"
    record("parity_fast_vs_torch", {
        "layers": [{k: row[k] for k in ("layer", "cosine", "max_abs", "mean_abs", "rel_err")} for row in report["layers"]],
        "argmax_agreement": report["argmax_agreement"], "tokens": report["tokens"],
        "fast_tok_s": released(fast_run).get("steady_tokens_per_s")})
    for row in report["layers"]:
        assert 0.99 < row["cosine"] < 1.0, row  # close, and really two different code paths
    # A random-init target has small top-1 margins, so kernel rounding flips some argmaxes; a real
    # checkpoint agrees far more. The figure is recorded; the bound only catches a broken path.
    assert report["argmax_agreement"] > 0.5


def test_staged_window_holds_no_compile(fast_run, target, work, triton_cache):
    """Staged with an EMPTY Triton cache: the compile happens in the warm-up, before the go; inside the
    window the first pass is as fast as the others."""
    model, completions = target
    go = work / "go"
    staged = run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "staged"),
                          "--layers", LAYERS, "--kernels", "fast", "--staged", "--go-file", str(go)],
                         work, "staged", work / "triton-empty", go_file=go)
    ready = next(e for e in staged["events"] if e["type"] == "staged")
    s, c = released(staged), released(fast_run)
    cold_window = c["t"] - fast_run["start_unix"]
    record("window", {"staged": s, "staged_event": ready, "cold": c, "cold_window_s": cold_window})
    assert ready["pinned"] is True and ready["warmup_s"] > 0
    per_prompt = (s["forward_s"] - s["first_forward_s"]) / 3
    assert s["first_forward_s"] < 3 * per_prompt + 0.5, s
    assert s["window_s"] < cold_window
    from remote.parity import compare_dirs

    # The empty cache makes this run's autotuners tune afresh: where they pick other configs than the
    # cold run's, bf16 rounding differs (fla's choice, not staging's: see the next test). That spread
    # is recorded and held to AUTOTUNE_COSINE_BOUND; with the same configs, nothing may differ.
    same = compare_dirs(work / "fast", work / "staged")
    differ = configs_differ(work / "fast", work / "staged")
    record("staged_vs_cold_parity", {"layers": [{k: r[k] for k in ("layer", "cosine", "max_abs")} for r in same["layers"]],
                                     "configs_differ": differ, "bound_cosine": 1 - AUTOTUNE_COSINE_BOUND})
    if differ:
        assert all(r["cosine"] > 1 - AUTOTUNE_COSINE_BOUND for r in same["layers"]), (same["layers"], differ)
    else:
        assert all(r["max_abs"] == 0 for r in same["layers"]), same["layers"]


def configs_differ(dir_a: Path, dir_b: Path) -> dict:
    """Kernels whose autotuned configs differ between two extractions' manifests."""
    a = json.loads((dir_a / "manifest.json").read_text()).get("kernel_configs") or {}
    b = json.loads((dir_b / "manifest.json").read_text()).get("kernel_configs") or {}
    return {k: {"a": a.get(k), "b": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def test_staged_with_the_cold_runs_configs_is_identical(fast_run, target, work, triton_cache):
    """Staging itself (pinned host copies, side-stream copies, reserved buffers, the warm-up) changes
    nothing: with the cold run's Triton cache, fla reads the configs it tuned there, and the hidden
    states are bit-identical."""
    from remote.parity import compare_dirs

    model, completions = target
    go = work / "go-warm"
    run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "staged-warm"),
                 "--layers", LAYERS, "--kernels", "fast", "--staged", "--go-file", str(go)],
                work, "staged-warm", triton_cache, go_file=go)
    assert configs_differ(work / "fast", work / "staged-warm") == {}
    same = compare_dirs(work / "fast", work / "staged-warm")
    record("staged_same_configs_vs_cold", [{k: r[k] for k in ("layer", "cosine", "max_abs")} for r in same["layers"]])
    assert all(r["max_abs"] == 0 for r in same["layers"]), same["layers"]


def test_auto_map_refuses_a_silent_cpu_offload(fast_run, target, work, triton_cache):
    """A holder leaves 800 MiB free on the GPU (the worker's CUDA context takes some of it; the model is
    690 MB): `--device-map auto` without --max-memory would plan layers onto the CPU from what is free;
    the worker refuses, naming the free memory, before anything reaches the GPU."""
    model, completions = target
    free, _ = torch.cuda.mem_get_info()
    holder = torch.empty(max(free - (800 << 20), 0), dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(RuntimeError, match="would offload .* Planned from free memory now: GPU0 .* --allow-offload"):
            run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "offload"),
                         "--layers", LAYERS, "--kernels", "fast", "--device-map", "auto"], work, "offload", triton_cache)
    finally:
        del holder
        torch.cuda.empty_cache()
    assert not (work / "offload" / "manifest.json").exists()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_split_across_two_gpus_matches_one(fast_run, target, work, triton_cache):
    from remote.parity import compare_dirs

    model, completions = target
    run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "split"),
                 "--layers", LAYERS, "--kernels", "fast", "--device-map", "auto",
                 "--max-memory", "0=500MiB,1=20GiB"], work, "split", triton_cache)
    manifest = json.loads((work / "split" / "manifest.json").read_text())
    assert manifest["devices"] == ["cuda:0", "cuda:1"]
    report = compare_dirs(work / "fast", work / "split")
    record("split_two_gpus", {"devices": manifest["devices"], "layers": report["layers"]})
    assert all(r["max_abs"] == 0 for r in report["layers"])


def test_split_gpu_and_cpu_matches_one_gpu(fast_run, target, work, triton_cache):
    """One GPU capped so that accelerate must offload later layers to host RAM (executed on the GPU
    through its hooks): the hidden states equal the all-on-GPU run's."""
    from remote.parity import compare_dirs

    model, completions = target
    run_extract(["--model", str(model), "--completions", str(completions), "--out", str(work / "gpu-cpu"),
                 "--layers", LAYERS, "--kernels", "fast", "--device-map", "auto",
                 "--max-memory", "0=300MiB,cpu=50GiB"], work, "gpu-cpu", triton_cache)
    manifest = json.loads((work / "gpu-cpu" / "manifest.json").read_text())
    assert "cpu" in manifest["devices"] and "cuda:0" in manifest["devices"], manifest["devices"]
    report = compare_dirs(work / "fast", work / "gpu-cpu")
    record("split_gpu_and_cpu", {"devices": manifest["devices"], "device_map": manifest.get("device_map"),
                                 "layers": report["layers"]})
    assert all(r["cosine"] > 1 - 1e-12 for r in report["layers"]), report["layers"]


def test_which_kernel_configs_move_the_rounding(fast_run, target):
    """The cause of staged != cold, isolated in one process: the same prompt through the same weights,
    with each autotuned fla kernel forced in turn to each of its configs (one per distinct num_warps /
    BK: the knobs that can change the MMA instruction or a reduction's split), the others as tuned.
    Which configs change the bf16 states, and by how much, is recorded; every one within the bound."""
    from transformers import AutoModelForCausalLM
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.errors import OutOfResources

    from remote import extract, kernels
    from remote.layers import find_decoder_layers

    modeling = kernels.import_modeling("qwen3_5_text")
    if not kernels.bound_kernels(modeling)["fast"]:
        pytest.skip("fla and causal-conv1d are not bound in this process")
    model_dir, completions = target
    entry = json.loads(Path(completions).read_text())["prompts"][0]
    ids = entry["prompt_ids"] + entry["completion_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, device_map="cuda").eval()
    _, layers = find_decoder_layers(model)

    def forward():
        return extract.forward_one(model, layers, [0, 1, 2, 3], ids).wait()["hidden"].double()

    reference = forward()  # tunes (or reads the tuned configs from the cache)
    tuners = {}
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("fla."):
            continue
        for obj in list(vars(module).values()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn
            if isinstance(obj, Autotuner) and obj.cache and len(obj.configs) > 1:
                inner = obj.fn
                while hasattr(inner, "fn"):
                    inner = inner.fn
                tuners[f"{inner.__module__}.{inner.__name__}"] = obj
    rows = []
    try:
        for kernel, tuner in sorted(tuners.items()):
            configs, cache = list(tuner.configs), dict(tuner.cache)
            chosen = str(next(iter(cache.values())))
            distinct = {}
            for config in configs:
                distinct.setdefault((config.num_warps, config.kwargs.get("BK")), config)
            try:
                for config in distinct.values():
                    tuner.configs, tuner.cache = [config], {}
                    try:
                        hidden = forward()
                    except OutOfResources as exc:  # a config the autotuner would have pruned on this GPU
                        rows.append({"kernel": kernel, "config": str(config), "skipped": str(exc)[:120]})
                        continue
                    per_layer = []
                    for i in range(hidden.shape[1]):
                        a, b = reference[:, i].reshape(-1), hidden[:, i].reshape(-1)
                        per_layer.append({"layer": i, "max_abs": float((a - b).abs().max()),
                                          "cosine": float(a @ b / (a.norm() * b.norm()))})
                    rows.append({"kernel": kernel, "chosen": chosen, "config": str(config), "layers": per_layer})
            finally:
                tuner.configs, tuner.cache = configs, cache
    finally:
        torch.cuda.synchronize()
    moved = [r for r in rows if "layers" in r and any(x["max_abs"] > 0 for x in r["layers"])]
    record("kernel_config_spread", {"kernels": sorted(tuners), "runs": rows,
                                    "configs_that_change_the_states": [(r["kernel"], r["config"]) for r in moved]})
    for r in moved:
        print(f"{r['kernel'].rsplit('.', 1)[-1]} [{r['config']}] (tuned: {r['chosen']}): max |d| "
              f"{max(x['max_abs'] for x in r['layers']):g}, min cosine {min(x['cosine'] for x in r['layers']):.9f}")
    assert tuners and any("layers" in r for r in rows), rows
    for row in rows:
        if "layers" in row:
            assert all(x["cosine"] > 1 - AUTOTUNE_COSINE_BOUND for x in row["layers"]), row
