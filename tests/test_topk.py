"""The block top-k equals torch.topk in values, with ids that hold those values."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote.topk import block_topk, topk_logprobs


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), width=st.integers(1, 9000), k=st.integers(1, 8), block=st.sampled_from([4, 16, 256]),
       levels=st.sampled_from([3, 50, 0]), seed=st.integers(0, 2**31 - 1))
def test_block_topk_values_equal_torch_topk(rows, width, k, block, levels, seed):
    k = min(k, width)
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen)
    if levels:  # few distinct values: many ties, the hard case for a shortcut
        x = torch.randint(0, levels, (rows, width), generator=gen).float()
    x = x.to(torch.bfloat16)
    values, ids = block_topk(x, k, block=block)
    expected = x.topk(k, dim=-1).values
    assert torch.equal(values, expected)
    assert torch.equal(x.gather(-1, ids), values)  # each id holds its value
    assert all(len(set(row.tolist())) == k for row in ids)  # no id twice
    # The same with block maxima computed elsewhere (the GPU kernel's fp32 maxima, one per block
    # including the ragged tail's, which block_topk must not rely on).
    blocks = -(-width // block)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block - width), value=float("-inf"))
    maxima = padded.reshape(rows, blocks, block).amax(-1)
    values2, ids2 = block_topk(x, k, block=block, block_max=maxima)
    assert torch.equal(values2, expected) and torch.equal(x.gather(-1, ids2), values2)
    assert all(len(set(row.tolist())) == k for row in ids2)


def test_topk_logprobs_match_a_float64_log_softmax():
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(7, 40_000, generator=gen) * 4).to(torch.bfloat16)
    ids, logprobs, argmax = topk_logprobs(logits, 8)
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert logprobs.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.allclose(logprobs.double(), reference.gather(-1, ids), atol=1e-5)
    assert torch.allclose(logprobs.double(), reference.topk(8, dim=-1).values, atol=1e-5)  # the 8 best, best first
    assert torch.equal(argmax, logits.float().argmax(-1))
