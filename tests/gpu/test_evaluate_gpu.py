"""The evaluator on a CUDA GPU (bf16): the copying drafter still reaches tau = B, the batched path agrees
with the naive loop, and the GPU's drafts agree with the CPU's float32 ones.

    python -m pytest -q tests/gpu/test_evaluate_gpu.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remote.drafter import load_drafter, save_random_drafter
from remote.drill.synthetic import build_copying_setup
from remote.evaluate import draft_topk, draft_topk_naive, evaluate
from remote.events import EventWriter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_copying_drafter_on_cuda(tmp_path: Path) -> None:
    paths = build_copying_setup(tmp_path / "setup", block_size=16, prompts=3, num_tokens=300)
    events = EventWriter(path=str(tmp_path / "events.jsonl"))
    results = evaluate(paths["states"], paths["target"], {"copy": paths["drafter"]}, tmp_path / "out",
                       torch.device("cuda"), [8, 16, 64], 8, None, None, events)
    m = results["drafters"]["copy"]
    assert results["device"].startswith("cuda") and results["dtype"] == "bfloat16"
    assert m["tau"]["vanilla"]["macro"] == 16.0 and m["pos1_acc"] == 1.0
    assert (tmp_path / "out" / "manifest.json").is_file()
    assert json.loads((tmp_path / "out" / "results.json").read_text())["drafters"]["copy"]["streak"] == 15.0


def _random_setup(tmp_path: Path):
    path = save_random_drafter(tmp_path / "d", 256, 1000, [1, 5, 9], 12, block_size=16, num_layers=2,
                               mask_token_id=999, seed=4, num_heads=8, num_kv_heads=2, head_dim=32)
    gen = torch.Generator().manual_seed(0)
    feats = torch.randn(400, 3 * 256, generator=gen)
    embed, lm_head = torch.randn(1000, 256, generator=gen), torch.randn(1000, 256, generator=gen)
    tokens = torch.randint(0, 1000, (400,), generator=gen)
    return path, feats, embed, lm_head, tokens


def _scaled(drafter):
    for name, w in drafter.w.items():
        if w.dim() == 2:
            drafter.w[name] = w * 10
    return drafter


def test_batched_equals_naive_on_cuda(tmp_path: Path) -> None:
    path, feats, embed, lm_head, tokens = _random_setup(tmp_path)
    d = _scaled(load_drafter(path, "cuda", torch.float32))
    args = (embed.cuda(), lm_head.cuda(), feats.cuda(), tokens.cuda())
    anchors, ids, lp = draft_topk(d, *args, 100, 16, chunk=64)
    sample = anchors[::37].tolist()
    naive_ids, naive_lp = draft_topk_naive(d, *args, sample, 16)
    rows = [a - 100 for a in sample]
    assert (ids[rows][..., 0] == naive_ids[..., 0]).float().mean() > 0.99
    torch.testing.assert_close(lp[rows][..., 0], naive_lp[..., 0], atol=2e-3, rtol=2e-3)


def test_cuda_bf16_agrees_with_cpu_fp32(tmp_path: Path) -> None:
    path, feats, embed, lm_head, tokens = _random_setup(tmp_path)
    cpu = _scaled(load_drafter(path, "cpu", torch.float32))
    gpu = _scaled(load_drafter(path, "cuda", torch.bfloat16))
    _, ids_cpu, _ = draft_topk(cpu, embed, lm_head, feats, tokens, 300, 8, chunk=16)
    _, ids_gpu, _ = draft_topk(gpu, embed.cuda(), lm_head.cuda(), feats.cuda(), tokens.cuda(), 300, 8, chunk=64)
    # bf16 moves near-ties; the top-1 must still agree almost everywhere.
    assert (ids_cpu[..., 0] == ids_gpu[..., 0]).float().mean() > 0.9
