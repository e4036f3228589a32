"""The target's per-position top-k over a full vocabulary, cheaper than `torch.topk` on wide rows.

`torch.topk` over 150 k entries runs a multi-pass radix select per row; it was the largest extra
cost of extraction over a plain forward (bench/extract.py). The exact shortcut used here: cut each
row into blocks, take every block's maximum (one streaming reduction), keep the k blocks with the
largest maxima, and run `topk` over only their entries. Every one of the row's k largest values
lies in one of those blocks (a block holding none of them has a maximum no larger than the k-th
value), so the values are exactly `torch.topk`'s; only the order of ids among equal values may
differ, which `torch.topk` does not define either.
"""

from __future__ import annotations

from typing import Any

BLOCK = 256


def block_topk(x: Any, k: int, block: int = BLOCK, block_max: Any = None) -> tuple[Any, Any]:
    """(values, indices) of the k largest entries of each row of a 2-D tensor, best first.

    `block_max`, when given, holds each row's block maxima already (at least its full blocks,
    e.g. from `remote.triton_lse`), in any dtype that orders the values as `x` does.
    """
    import torch

    rows, width = x.shape
    blocks = width // block
    if blocks < 4 * k:  # narrow rows: the plain top-k is as cheap
        return x.topk(k, dim=-1)
    body = blocks * block
    if block_max is None:
        block_max = x[:, :body].reshape(rows, blocks, block).amax(dim=-1)
    best_blocks = block_max[:, :blocks].topk(k, dim=-1).indices
    offsets = torch.arange(block, device=x.device)
    candidates = (best_blocks[..., None] * block + offsets).reshape(rows, k * block)
    if body < width:  # the ragged tail is always a candidate
        tail = torch.arange(body, width, device=x.device).expand(rows, width - body)
        candidates = torch.cat([candidates, tail], dim=-1)
    values, where = x.gather(-1, candidates).topk(k, dim=-1)
    return values, candidates.gather(-1, where)


def topk_logprobs(logits: Any, k: int, triton: bool = False) -> tuple[Any, Any, Any]:
    """For logits [T, V] in the model's dtype: top-k ids, their fp32 log-probs, and the argmax.

    The ranking runs on the logits themselves (upcasting is exact, so it is the fp32 ranking); a
    log-prob is the upcast logit minus the row's fp32 log-sum-exp. With `triton` (CUDA logits, and
    only where the fast kernels run: the torch policy must not depend on Triton compiling on the
    host) one pass gives the log-sum-exp and the block maxima without a [T, V] fp32 tensor;
    otherwise torch's reductions give the same values (within fp32 rounding).
    """
    import torch

    block_max = None
    if triton and logits.is_cuda:
        from remote.triton_lse import lse_and_block_max

        lse, block_max = lse_and_block_max(logits, BLOCK)
    else:
        lse = torch.logsumexp(logits.float(), dim=-1)
    values, ids = block_topk(logits, k, block_max=block_max)
    return ids, values.float() - lse[:, None], logits.argmax(dim=-1)
