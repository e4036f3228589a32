"""Kernel policy and binding detection (remote.kernels), on real transformers modeling code.

fla and causal-conv1d cannot run here (no GPU); the FAKE packages of `fake_kernel_paths` export the
same names so transformers binds them exactly as the real ones, which is what detection reads.
"""

from __future__ import annotations

import json
import types

import pytest

from remote import kernels
from remote.events import WorkerError
from tests.fixtures_models import error_of, run_module

MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"


def test_policy_fast_without_gpu_fails_before_loading(tiny_target, tiny_completions, tmp_path):
    code, events = run_module("remote.extract", ["--model", str(tiny_target), "--completions", str(tiny_completions),
                                                 "--out", str(tmp_path / "out"), "--kernels", "fast"], tmp_path)
    assert code == 2
    msg = error_of(events)
    assert msg.startswith("kernel policy 'fast' needs fla and causal_conv1d on a CUDA GPU; this host has:")
    assert "fla: not importable" in msg and "causal_conv1d: not importable" in msg
    phases = [e["name"] for e in events if e["type"] == "phase"]
    assert "load" not in phases and "import" not in phases
    assert not (tmp_path / "out").exists()


def test_policy_fast_with_kernels_but_no_gpu_names_what_is_there(tiny_target, tiny_completions, tmp_path,
                                                                fake_kernel_paths):
    code, events = run_module("remote.extract", ["--model", str(tiny_target), "--completions", str(tiny_completions),
                                                 "--out", str(tmp_path / "out"), "--kernels", "fast", "--device", "cpu"],
                              tmp_path, extra_path=list(fake_kernel_paths.values()))
    msg = error_of(events)
    assert code == 2
    assert "fla: 0.0.0+fake" in msg and "causal_conv1d: 0.0.0+fake" in msg and "CUDA GPU: not used" in msg


def test_installed_kernels_are_detected_as_bound(fake_probes):
    """The probe imports the modeling module as installed: transformers binds the (fake) fast kernels."""
    kern = fake_probes["inference"]["kernels"]
    assert kern["scheme"] == kernels.SCHEME_FUNC_MODULES  # the lock's transformers (5.25) with its kernels package
    assert kern["bound"]["torch_chunk_gated_delta_rule"] == "fla.ops.gated_delta_rule.chunk"
    assert kern["bound"]["torch_recurrent_gated_delta_rule"] == "fla.ops.gated_delta_rule.fused_recurrent"
    assert kern["bound"]["causal_conv1d_fn"] == "causal_conv1d.causal_conv1d_interface"
    assert kern["bound"]["causal_conv1d_update"] == "causal_conv1d.causal_conv1d_interface"
    assert kern["fast"] is True and kern["would_force_torch"] is True


def test_only_fla_installed_binds_torch_conv(fake_probes):
    kern = fake_probes["training"]["kernels"]
    assert kern["bound"]["torch_chunk_gated_delta_rule"].startswith("fla.")
    assert kern["bound"]["causal_conv1d_fn"] == MODELING
    assert kern["fast"] is False


def test_cpu_run_forces_torch_even_with_kernels_installed(tiny_target, tiny_completions, tmp_path,
                                                          fake_kernel_paths):
    """With fla importable but no GPU, policy `any` forces torch itself (the fake fla raises if called)."""
    out = tmp_path / "out"
    code, events = run_module("remote.extract", ["--model", str(tiny_target), "--completions", str(tiny_completions),
                                                 "--out", str(out), "--kernels", "any", "--limit", "1"],
                              tmp_path, extra_path=list(fake_kernel_paths.values()))
    assert code == 0, error_of(events)
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["kernels"].values()) == {MODELING}
    assert manifest["kernels_fast"] is False
    assert manifest["kernel_policy"] == "any" and manifest["kernel_decision"]["effective"] == "torch"
    # Which kernels actually ran: the torch prefill path, once per linear-attention layer.
    assert manifest["kernel_calls"] == {"causal_conv1d_fn": 3, "torch_chunk_gated_delta_rule": 3}
    assert manifest["versions"]["fla"] is None  # hidden from the process, so never imported


def test_require_fast_lists_the_torch_bound_functions():
    binding = {"bound": {"causal_conv1d_fn": MODELING, "torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule"}}
    with pytest.raises(WorkerError, match=r"torch path for: causal_conv1d_fn -> " + MODELING.replace(".", r"\.")):
        kernels.require_fast(binding)
    kernels.require_fast({"bound": {"a": "fla.ops.x", "b": "causal_conv1d.cpp_functions"}})


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(WorkerError, match="unknown kernel policy 'quick'"):
        kernels.apply_policy("quick", "cpu")


def _legacy_module(fast: bool) -> types.ModuleType:
    """A stand-in for a transformers <= 5.14 modeling module (the real ones: test_transformers_matrix.py)."""
    module = types.ModuleType("transformers.models.qwen3_next.modeling_qwen3_next")
    fla_fn = types.FunctionType((lambda: None).__code__, {}, "chunk_gated_delta_rule")
    fla_fn.__module__ = "fla.ops.gated_delta_rule.chunk"
    module.is_fast_path_available = fast
    module.chunk_gated_delta_rule = fla_fn if fast else None
    module.fused_recurrent_gated_delta_rule = None
    module.causal_conv1d_fn = None
    module.causal_conv1d_update = None
    return module


def test_legacy_scheme_reads_flag_and_layer_attributes():
    import torch

    class LinearAttn(torch.nn.Module):
        pass

    class Layer(torch.nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.linear_attn = LinearAttn()
            self.linear_attn.chunk_gated_delta_rule = fn

    module = _legacy_module(fast=True)
    model = torch.nn.Sequential(Layer(module.chunk_gated_delta_rule))
    binding = kernels.bound_kernels(module, model)
    assert binding["scheme"] == kernels.SCHEME_LEGACY
    assert binding["bound"]["torch_chunk_gated_delta_rule"] == "fla.ops.gated_delta_rule.chunk"
    assert binding["bound"]["causal_conv1d_fn"] == module.__name__
    assert binding["fast"] is False
    slow = kernels.bound_kernels(_legacy_module(fast=False))
    assert set(slow["bound"].values()) == {"transformers.models.qwen3_next.modeling_qwen3_next"}


def test_modeling_module_name_for_text_and_multimodal_types():
    assert kernels.modeling_module_name("qwen3_5_text") == MODELING
    assert kernels.modeling_module_name("qwen3_5") == MODELING
    with pytest.raises(WorkerError, match="model type 'nonesuch'"):
        kernels.import_modeling("nonesuch")


def test_legacy_scheme_reports_each_function_on_its_own():
    """transformers <= 5.14 with fla installed and causal-conv1d missing (the story's case):
    `is_fast_path_available` is False, yet the delta rules run on fla; only the conv is torch."""
    import torch

    module = _legacy_module(fast=False)
    fla_fn = types.FunctionType((lambda: None).__code__, {}, "chunk_gated_delta_rule")
    fla_fn.__module__ = "fla.ops.gated_delta_rule.chunk"
    fla_rec = types.FunctionType((lambda: None).__code__, {}, "fused_recurrent_gated_delta_rule")
    fla_rec.__module__ = "fla.ops.gated_delta_rule.fused_recurrent"
    torch_update = types.FunctionType((lambda: None).__code__, {}, "torch_causal_conv1d_update")
    torch_update.__module__ = module.__name__
    module.chunk_gated_delta_rule, module.fused_recurrent_gated_delta_rule = fla_fn, fla_rec

    class LinearAttn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            # As Qwen3NextGatedDeltaNet.__init__ of those versions sets them.
            self.causal_conv1d_fn = None  # None -> the forward runs nn.Conv1d
            self.causal_conv1d_update = torch_update
            self.chunk_gated_delta_rule = fla_fn
            self.recurrent_gated_delta_rule = fla_rec

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear_attn = LinearAttn()

    want = {"torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk",
            "torch_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule.fused_recurrent",
            "causal_conv1d_fn": module.__name__, "causal_conv1d_update": module.__name__}
    for binding in (kernels.bound_kernels(module, torch.nn.Sequential(Layer())), kernels.bound_kernels(module)):
        assert binding["scheme"] == kernels.SCHEME_LEGACY
        assert binding["bound"] == want
        assert binding["fast"] is False
    with pytest.raises(WorkerError, match="causal_conv1d_fn -> .*modeling_qwen3_next") as info:
        kernels.require_fast(kernels.bound_kernels(module))
    assert "chunk_gated_delta_rule ->" not in str(info.value)


def test_a_scheme_of_no_known_shape_is_unknown_and_never_guessed():
    """A modeling module with the four names but neither a per-layer flag, a fallback closure nor a
    function module (a transformers to come): every function unknown, and `fast` refuses naming it."""
    module = types.ModuleType("transformers.models.qwen3_5.modeling_qwen3_5")
    for fn in kernels.KERNEL_FUNCTIONS:
        setattr(module, fn, types.FunctionType((lambda: None).__code__, {}, fn))
    binding = kernels.bound_kernels(module)
    assert binding["scheme"] == f"unknown binding scheme (transformers {kernels.transformers_version()})"
    assert binding["bound"] == dict.fromkeys(kernels.KERNEL_FUNCTIONS) and binding["fast"] is False
    with pytest.raises(WorkerError, match=r"kernel policy 'fast' but transformers binds its kernels under an "
                                          r"unknown binding scheme \(transformers "):
        kernels.require_fast(binding)
    del module.causal_conv1d_update  # a name gone is no known scheme either
    assert kernels.is_unknown_scheme(kernels.bound_kernels(module)["scheme"])


def test_a_kernelized_function_module_is_unknown_not_guessed():
    """The real 5.25 modeling module, with one function module given a `forward` of its own (what
    `kernels.kernelize` does with a hub kernel): that shape is not read, so the scheme is unknown."""
    import importlib

    module = importlib.import_module(MODELING)
    assert kernels.bound_kernels(module)["scheme"] == kernels.SCHEME_FUNC_MODULES
    func_module = module.causal_conv1d_fn
    func_module.forward = lambda *args, **kwargs: None
    try:
        assert kernels.is_unknown_scheme(kernels.bound_kernels(module)["scheme"])
    finally:
        del func_module.forward
    assert kernels.bound_kernels(module)["scheme"] == kernels.SCHEME_FUNC_MODULES


def test_autotune_choices_read_every_autotuner_once(monkeypatch):
    """What Triton's autotuners chose (recorded in the manifest), found through heuristics wrappers
    and across the modules that import the same kernel; {} without Triton."""
    monkeypatch.delitem(__import__("sys").modules, "triton.runtime.autotuner", raising=False)
    assert kernels.autotune_choices() == {}

    class Autotuner:
        def __init__(self, fn, cache):
            self.fn, self.cache = fn, cache

    class Heuristics:
        def __init__(self, fn):
            self.fn = fn

    class JITFunction:
        def __init__(self, fn):
            self.fn = fn

    def kernel_h():
        pass

    kernel_h.__module__, kernel_h.__qualname__ = "fla.ops.common.chunk_delta_h", "kernel_h"
    fake = types.ModuleType("triton.runtime.autotuner")
    fake.Autotuner, fake.Heuristics = Autotuner, Heuristics
    tuned = Heuristics(Autotuner(JITFunction(kernel_h), {(32, 128, "torch.bfloat16"): "BV: 64, num_warps: 4"}))
    untouched = Autotuner(JITFunction(kernel_h), {})
    one = types.ModuleType("fla.ops.common.chunk_delta_h")
    one.kernel_h, one.other = tuned, untouched
    two = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    two.kernel_h = tuned  # imported there too
    import sys

    for name, mod in (("triton.runtime.autotuner", fake), (one.__name__, one), (two.__name__, two)):
        monkeypatch.setitem(sys.modules, name, mod)
    assert kernels.autotune_choices() == {
        "fla.ops.common.chunk_delta_h.kernel_h": {"(32, 128, 'torch.bfloat16')": "BV: 64, num_warps: 4"}}
