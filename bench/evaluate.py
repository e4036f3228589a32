"""Benchmark: batched anchors over precomputed context K/V vs the naive one-anchor-at-a-time loop.

A drafter of realistic shape (5 layers, hidden 4096, 32 heads / 8 kv heads of 128, MLP 12288,
block 16, fc over 5 target layers) with random weights, the target heads of a 151,936-token
vocabulary, and 10 prompts of 1,500 tokens (prompt 200) of random hidden states: the work is the
evaluator's own (`remote.evaluate.draft_topk`, top-64 per slot), only the numbers are random.

The naive loop (`draft_topk_naive`: each anchor alone, from scratch) is timed on a sample of anchors
spread over the first prompt and extrapolated per anchor; its top-1 drafts are checked against the
batched ones on the same anchors.

    python bench/evaluate.py --device cuda            # the GPU machine (targets: >= 10x, < 30 s)
    python bench/evaluate.py --device cpu --small     # a smaller slice for a CPU

The last line is the headline.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from remote.drafter import Drafter, drafter_config, random_weights, read_spec_from_config  # noqa: E402
from remote.evaluate import compute_dtype, draft_topk, draft_topk_naive  # noqa: E402

FULL = {"hidden": 4096, "heads": 32, "kv": 8, "head_dim": 128, "inter": 12288, "layers": 5, "vocab": 151936,
        "prompts": 10, "tokens": 1500, "prompt_len": 200, "naive_anchors": 100}
SMALL = {"hidden": 1024, "heads": 8, "kv": 2, "head_dim": 128, "inter": 2816, "layers": 5, "vocab": 8192,
         "prompts": 1, "tokens": 300, "prompt_len": 50, "naive_anchors": 12}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a CPU-sized slice (hidden 1024, 1 prompt of 300)")
    parser.add_argument("--chunk", type=int, default=None, help="anchors per batch (default 64 cuda, 16 cpu)")
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--prompts", type=int, default=None)
    args = parser.parse_args()
    shape = dict(SMALL if args.small else FULL)
    if args.prompts:
        shape["prompts"] = args.prompts
    device = torch.device(args.device)
    dtype = compute_dtype(device)
    chunk = args.chunk or (64 if device.type == "cuda" else 16)
    h, n_fc, topk = shape["hidden"], 5, 64

    config = drafter_config(h, [1, 13, 25, 37, 49], 52, args.block, shape["layers"], mask_token_id=0,
                            vocab_size=shape["vocab"], num_heads=shape["heads"], num_kv_heads=shape["kv"],
                            head_dim=shape["head_dim"], intermediate_size=shape["inter"])
    spec = read_spec_from_config(config)
    weights = random_weights(config, seed=0, dtype=dtype, device=str(device))
    drafter = Drafter(spec, weights, device, dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    embed = (torch.randn(shape["vocab"], h, generator=gen, device=device) * 0.02).to(dtype)
    lm_head = (torch.randn(shape["vocab"], h, generator=gen, device=device) * 0.02).to(dtype)
    prompts = [((torch.randn(shape["tokens"], n_fc * h, generator=gen, device=device)).to(torch.bfloat16),
                torch.randint(0, shape["vocab"], (shape["tokens"],), generator=gen, device=device))
               for _ in range(shape["prompts"])]
    params = sum(w.numel() for w in weights.values()) / 1e6
    print(f"device {device} ({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), {dtype}, "
          f"torch {torch.__version__}")
    print(f"drafter: {spec.num_layers} layers, hidden {h}, heads {spec.num_heads}/{spec.num_kv_heads}x{spec.head_dim}, "
          f"mlp {spec.intermediate_size}, block {spec.block_size}, {params:.0f} M params; vocab {shape['vocab']}; "
          f"{shape['prompts']} prompts x {shape['tokens']} tokens (prompt {shape['prompt_len']}); chunk {chunk}")

    # Warm-up (CUDA context, kernels) on a short slice, not timed.
    feats, tokens = prompts[0]
    draft_topk(drafter, embed, lm_head, feats[:200], tokens[:200], 150, topk, chunk)
    draft_topk_naive(drafter, embed, lm_head, feats, tokens, [shape["prompt_len"]], topk)
    sync(device)

    started = time.perf_counter()
    total_anchors = 0
    first_ids = None
    for i, (feats, tokens) in enumerate(prompts):
        anchors, ids, _ = draft_topk(drafter, embed, lm_head, feats, tokens, shape["prompt_len"], topk, chunk)
        total_anchors += anchors.shape[0]
        if i == 0:
            first_ids = ids
    sync(device)
    batched_s = time.perf_counter() - started
    batched_ms = 1000 * batched_s / total_anchors
    print(f"batched: {total_anchors} anchors in {batched_s:.2f} s ({batched_ms:.3f} ms/anchor)")

    feats, tokens = prompts[0]
    first, last = shape["prompt_len"], shape["tokens"] - 2
    sample = torch.linspace(first, last, shape["naive_anchors"]).round().long().unique().tolist()
    started = time.perf_counter()
    naive_ids, _ = draft_topk_naive(drafter, embed, lm_head, feats, tokens, sample, topk)
    sync(device)
    naive_s = time.perf_counter() - started
    naive_ms = 1000 * naive_s / len(sample)
    agree = (naive_ids[..., 0] == first_ids[[a - first for a in sample]][..., 0]).float().mean().item()
    print(f"naive: {len(sample)} sampled anchors in {naive_s:.2f} s ({naive_ms:.3f} ms/anchor), "
          f"extrapolated to all {total_anchors}: {naive_ms * total_anchors / 1000:.1f} s; "
          f"top-1 agreement with batched {100 * agree:.1f}%")
    speedup = naive_ms / batched_ms
    label = "small slice" if args.small else f"{shape['prompts']} prompts"
    print(f"batched vs naive: {speedup:.1f}x faster (target >= 10x); {device.type} {label}: {batched_s:.1f} s"
          + ("" if args.small else " (target < 30 s)"))


if __name__ == "__main__":
    main()
