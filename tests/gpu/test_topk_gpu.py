"""On the GPU machine: the Triton pass (fp32 log-sum-exp + block maxima) equals torch's reductions,
and the extractor's top-8 on the GPU equals the CPU path.

    source .dev/setup-device.sh && python3 -m pytest --noconftest tests/gpu/test_topk_gpu.py -v
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("width", [151936, 32000, 4097, 300, 7])
def test_one_pass_equals_torch(width):
    from remote.topk import BLOCK
    from remote.triton_lse import lse_and_block_max

    gen = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(37, width, device="cuda", generator=gen) * 5).to(torch.bfloat16)
    x[0] = float("-inf")  # a row of -inf: log-sum-exp -inf, not NaN
    x[1, : width // 2] = float("-inf")
    lse, bmax = lse_and_block_max(x, BLOCK)
    reference = torch.logsumexp(x.double(), dim=-1)
    assert lse[0].item() == float("-inf")
    assert torch.allclose(lse[1:].double(), reference[1:], rtol=0, atol=2e-6)
    blocks = -(-width // BLOCK)
    padded = torch.nn.functional.pad(x.float(), (0, blocks * BLOCK - width), value=float("-inf"))
    assert torch.equal(bmax, padded.reshape(37, blocks, BLOCK).amax(-1))


def test_topk_logprobs_on_gpu_equal_the_cpu_path():
    from remote.topk import topk_logprobs

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(300, 151936, generator=gen) * 4).to(torch.bfloat16)
    ids_cpu, lp_cpu, g_cpu = topk_logprobs(logits, 8)
    ids_gpu, lp_gpu, g_gpu = topk_logprobs(logits.cuda(), 8, triton=True)
    gathered = logits.gather(-1, ids_gpu.cpu())
    assert torch.equal(gathered, logits.gather(-1, ids_cpu))  # the same values (ids may differ on ties)
    assert torch.allclose(lp_gpu.cpu(), lp_cpu, rtol=0, atol=2e-6)
    assert torch.equal(g_gpu.cpu(), g_cpu)
