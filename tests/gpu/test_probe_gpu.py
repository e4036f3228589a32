"""On the GPU machine: the probe's environment cache with a real driver and GPUs.

The fingerprint reads the driver's version, each GPU's information and the device nodes; on CPU
machines all three are empty, so only here is it seen that they are read, that a GPU's use does not
move them (or no window would ever reuse the facts), and that the facts kept say CUDA.

    python -m pytest tests/gpu/test_probe_gpu.py -v
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from remote import probe  # noqa: E402

FINGERPRINT = "from remote.probe import environment_fingerprint; print(environment_fingerprint('qwen3_5')[0])"
USE_THE_GPU = ("import torch; x = torch.empty(2**30, dtype=torch.uint8, device='cuda:0'); x.fill_(1); "
               "torch.cuda.synchronize(); print(int(x.sum() > 0))")


def fingerprint_in_a_fresh_process() -> str:
    done = subprocess.run([sys.executable, "-c", FINGERPRINT], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, check=True)
    return done.stdout.strip()


def test_the_fingerprint_reads_the_driver_and_gpus_and_a_gpus_use_does_not_move_it() -> None:
    _, covers = probe.environment_fingerprint("qwen3_5")
    assert covers["driver"] and "NVRM" in covers["driver"], covers["driver"]
    assert covers["gpus"] and all(text and "GPU UUID" in text for text in covers["gpus"].values()), covers["gpus"]
    assert covers["device_nodes"] and all(rdev is not None for _, rdev in covers["device_nodes"])

    before = fingerprint_in_a_fresh_process()
    used = subprocess.run([sys.executable, "-c", USE_THE_GPU], capture_output=True, text=True, timeout=120, check=True)
    assert used.stdout.strip() == "1"
    assert fingerprint_in_a_fresh_process() == before


def test_the_facts_kept_say_cuda_and_are_reused_while_nothing_changed(tmp_path: Path) -> None:
    first = probe.probe(cache_dir=str(tmp_path))
    assert first["environment"]["cached"] is False
    assert "not_kept" not in first["environment"], first["environment"]
    assert first["torch"]["cuda_available"] is True
    assert first["speeds"]["h2d"]["measured"] is True

    second = probe.probe(cache_dir=str(tmp_path))
    assert second["environment"]["cached"] is True
    assert second["environment"]["fingerprint"] == first["environment"]["fingerprint"]
    for key in probe.ENVIRONMENT_KEYS:
        assert second[key] == first[key], key


def test_the_real_kernels_are_read_as_bound_under_a_known_scheme() -> None:
    """With the real fla and causal-conv1d on a GPU, under this machine's own transformers: the binding
    is read under a scheme the workers know and all four functions are fla's or causal-conv1d's."""
    from remote import kernels

    facts = probe.probe()
    binding = facts["kernels"]
    print(f"transformers {binding.get('transformers')}: {binding.get('scheme')}: {binding.get('bound')}")
    assert binding["scheme"] in (kernels.SCHEME_LEGACY, kernels.SCHEME_CLOSURE, kernels.SCHEME_FUNC_MODULES), binding
    assert binding["fast"] is True, binding
    assert binding["bound"]["causal_conv1d_fn"].startswith("causal_conv1d"), binding
    assert binding["bound"]["torch_chunk_gated_delta_rule"].startswith("fla.ops."), binding
