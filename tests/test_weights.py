"""Weight placement plans (remote.weights): `--device-map auto` never offloads to the CPU unasked."""

from __future__ import annotations

import pytest
import torch

from remote import weights
from remote.events import WorkerError


@pytest.fixture(scope="module")
def model():
    from transformers import Qwen3_5ForCausalLM

    from remote.drill.tinymodel import tiny_config

    return Qwen3_5ForCausalLM(tiny_config()).to(torch.bfloat16)


def test_auto_map_planned_from_free_memory_refuses_a_silent_cpu_offload(model, monkeypatch):
    """A leftover holder leaves GPU0 with 300 KiB free: accelerate would move layers to the CPU and
    the window would crawl. Refused, naming the free memory the plan saw."""
    monkeypatch.setattr(weights, "free_memory", lambda: {0: 300 << 10, "cpu": 64 << 30})
    with pytest.raises(WorkerError) as info:
        weights.plan_device_map(model, "cuda", "auto", None)
    msg = str(info.value)
    assert "would offload 4 module(s) from the GPUs to cpu (" in msg and "model.layers" in msg
    assert "free memory now: GPU0 0 MiB, cpu 64.0 GiB" in msg and "--allow-offload" in msg
    assert info.value.where == "--device-map"


def test_offload_when_asked_for(model, monkeypatch):
    monkeypatch.setattr(weights, "free_memory", lambda: {0: 300 << 10, "cpu": 64 << 30})
    planned = weights.plan_device_map(model, "cuda", "auto", None, allow_offload=True)
    assert "cpu" in planned.values() and 0 in planned.values()
    # An explicit cpu entry in --max-memory is asking for it too (the GPU test's 0=300MiB,cpu=50GiB).
    explicit = weights.plan_device_map(model, "cuda", "auto", weights.parse_max_memory("0=300KiB,cpu=50GiB"))
    assert "cpu" in explicit.values()


def test_caps_without_cpu_that_force_offload_are_refused(model):
    with pytest.raises(WorkerError, match=r"offload 4 module\(s\) from the GPUs to disk .* Planned from --max-memory: GPU0 300KiB\."):
        weights.plan_device_map(model, "cuda", "auto", weights.parse_max_memory("0=300KiB"))


def test_a_plan_that_fits_the_gpus_is_kept(model, monkeypatch):
    monkeypatch.setattr(weights, "free_memory", lambda: {0: 40 << 30, "cpu": 64 << 30})
    planned = weights.plan_device_map(model, "cuda", "auto", None)
    assert set(planned.values()) == {0}
    assert weights.plan_device_map(model, "cuda", None, None) == {"": 0}
    assert weights.plan_device_map(model, "cpu", "auto", None) == {"": "cpu"}
