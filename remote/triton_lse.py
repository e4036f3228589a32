"""One pass over 16-bit logits on the GPU: each row's fp32 log-sum-exp and its block maxima.

Imported only for CUDA tensors (Triton comes with torch's CUDA wheels). In torch the same figures
take three passes and a [T, V] fp32 temporary: `log_softmax(x, dtype=float32)` (or
`logsumexp(x.float())`) writes four bytes per logit and reads them back, and the block maxima for
`remote.topk.block_topk` are another read, slow with a 256-wide inner reduction. fla ships a
`logsumexp_fwd`, but it subtracts in the input's 16-bit dtype and autotunes at each new width (an
autotune inside the downtime window); this kernel upcasts on load and has one config.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

CHUNK = 4096  # entries of a row loaded at once


@triton.jit
def _lse_and_block_max(x_ptr, lse_ptr, bmax_ptr, stride, width, n_blocks,
                       CHUNK: tl.constexpr, GROUP: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * stride
    # Online log-sum-exp per lane: running maximum m and sum s of exp(x - m), merged at the end.
    m = tl.full([CHUNK], float("-inf"), tl.float32)
    s = tl.zeros([CHUNK], tl.float32)
    for start in range(0, width, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        x = tl.load(base + cols, mask=cols < width, other=float("-inf")).to(tl.float32)
        groups = start // GROUP + tl.arange(0, CHUNK // GROUP)
        block_max = tl.max(tl.reshape(x, (CHUNK // GROUP, GROUP)), axis=1)
        tl.store(bmax_ptr + row * n_blocks + groups, block_max, mask=groups < n_blocks)
        new_m = tl.maximum(m, x)
        # A lane that has seen only -inf keeps s = 0 (exp(-inf - -inf) would be NaN).
        safe_m = tl.where(new_m == float("-inf"), 0.0, new_m)
        s = s * tl.exp(m - safe_m) + tl.exp(x - safe_m)
        m = new_m
    top = tl.max(m, axis=0)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.sum(s * tl.exp(m - safe_top), axis=0)
    tl.store(lse_ptr + row, tl.log(total) + safe_top)


def lse_and_block_max(logits: Any, block: int) -> tuple[Any, Any]:
    """For a 2-D CUDA tensor: (fp32 log-sum-exp of each row [T], maxima of each row's `block`-wide
    blocks [T, ceil(V / block)] in fp32, the last one over the ragged tail's real entries)."""
    if CHUNK % block or block & (block - 1):
        raise ValueError(f"block must be a power of two dividing {CHUNK}, got {block}")
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, width = logits.shape
    n_blocks = triton.cdiv(width, block)
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    bmax = torch.empty(rows, n_blocks, dtype=torch.float32, device=logits.device)
    if rows:
        with torch.cuda.device(logits.device):
            _lse_and_block_max[(rows,)](logits, lse, bmax, logits.stride(0), width, n_blocks,
                                        CHUNK=CHUNK, GROUP=block, num_warps=8)
    return lse, bmax
