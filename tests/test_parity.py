"""Hidden-state parity (remote.parity): float64 figures per layer, two extractions in two processes."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from remote import parity
from remote.artifacts import write_manifest
from remote.events import EventWriter, WorkerError
from tests.fixtures_models import result_of, run_module


def fake_extraction(directory: Path, hidden: torch.Tensor, g: torch.Tensor, layers: list[int]) -> Path:
    """An extraction output in the real format, from given tensors (hidden [T, n_layers, H])."""
    directory.mkdir(parents=True, exist_ok=True)
    T = hidden.shape[0]
    save_file({"hidden": hidden.contiguous(), "input_ids": torch.arange(T), "g": g,
               "topk_ids": torch.zeros(T, 8, dtype=torch.int64), "topk_logprobs": torch.zeros(T, 8)},
              str(directory / "p.safetensors"), metadata={"prompt_id": "p", "prompt_len": "1", "layers": json.dumps(layers)})
    write_manifest(directory, {"p.safetensors": {}}, layers=layers,
                   prompts=[{"id": "p", "file": "p.safetensors", "prompt_len": 1, "num_tokens": T}])
    return directory


def test_known_difference_gives_the_figures_by_hand(tmp_path):
    a = torch.tensor([[[3.0, 4.0]], [[0.0, 0.0]]], dtype=torch.float64)   # T=2, one layer, H=2
    b = torch.tensor([[[3.0, 4.0]], [[0.0, 1.0]]], dtype=torch.float64)
    fake_extraction(tmp_path / "a", a, torch.tensor([1, 2]), [5])
    fake_extraction(tmp_path / "b", b, torch.tensor([1, 3]), [5])
    report = parity.compare_dirs(tmp_path / "a", tmp_path / "b")
    row = report["layers"][0]
    assert row["layer"] == 5 and row["elements"] == 4
    assert row["mean_abs"] == 0.25 and row["max_abs"] == 1.0
    assert row["rel_err"] == pytest.approx(1 / 5)
    assert row["cosine"] == pytest.approx(25 / (5 * math.sqrt(26)), abs=1e-15)
    assert report["argmax_agreement"] == 0.5


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.1, 10), T=st.integers(1, 40))
def test_identical_and_scaled_inputs(tmp_path_factory, seed, scale, T):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(T, 2, 16, generator=gen).to(torch.bfloat16)
    tmp = tmp_path_factory.mktemp("par")
    fake_extraction(tmp / "a", hidden, torch.zeros(T, dtype=torch.int64), [0, 3])
    fake_extraction(tmp / "b", hidden.clone(), torch.zeros(T, dtype=torch.int64), [0, 3])
    same = parity.compare_dirs(tmp / "a", tmp / "b")
    for row in same["layers"]:
        assert row["max_abs"] == 0 and row["mean_abs"] == 0 and row["rel_err"] == 0
        assert abs(row["cosine"] - 1.0) < 1e-12
    fake_extraction(tmp / "c", hidden.double() * -scale, torch.zeros(T, dtype=torch.int64), [0, 3])
    flipped = parity.compare_dirs(tmp / "a", tmp / "c")
    for row in flipped["layers"]:
        assert abs(row["cosine"] + 1.0) < 1e-12
        assert row["rel_err"] == pytest.approx(1 + scale, rel=1e-9)


def test_mismatched_or_incomplete_outputs_are_clear_errors(tmp_path):
    h = torch.zeros(3, 1, 4)
    fake_extraction(tmp_path / "a", h, torch.zeros(3, dtype=torch.int64), [1])
    fake_extraction(tmp_path / "b", h, torch.zeros(3, dtype=torch.int64), [2])
    with pytest.raises(WorkerError, match=r"layers differ: \[1\] vs \[2\]"):
        parity.compare_dirs(tmp_path / "a", tmp_path / "b")
    (tmp_path / "b" / "manifest.json").unlink()
    with pytest.raises(WorkerError, match="no manifest.json: the output is incomplete"):
        parity.compare_dirs(tmp_path / "a", tmp_path / "b")


def test_two_processes_same_policy_agree_exactly(tiny_target, tiny_completions, tmp_path):
    """fast vs torch needs a GPU (tests/gpu); here both sides run the torch path in separate processes,
    so the figures must show identity: max |d| 0, cosine 1 within 1e-12, argmax all equal."""
    out = tmp_path / "parity"
    code, events = run_module("remote.parity", ["--model", str(tiny_target), "--completions", str(tiny_completions),
                                                "--out", str(out), "--a", "torch", "--b", "any", "--layers", "1,2"], tmp_path)
    report = result_of(events)
    assert [r["layer"] for r in report["layers"]] == [1, 2, 3]
    for row in report["layers"]:
        assert row["max_abs"] == 0 and abs(row["cosine"] - 1) < 1e-12
    assert report["argmax_agreement"] == 1.0 and report["tokens"] > 100
    assert json.loads((out / "parity.json").read_text())["layers"] == report["layers"]
    assert (out / "a-torch" / "manifest.json").is_file() and (out / "b-any" / "manifest.json").is_file()
    assert {e["key"] for e in events if e["type"] == "progress"} >= {"a:prompts", "b:prompts", "a:weights"}
    # The compare-only mode gives the same figures from the two directories.
    buf = io.StringIO()
    again = parity.main(EventWriter(stream=buf), ["--compare", str(out / "a-torch"), str(out / "b-any")])
    assert again["layers"] == report["layers"]


def test_a_failing_side_reports_its_error(tiny_target, tiny_completions, tmp_path):
    code, events = run_module("remote.parity", ["--model", str(tiny_target), "--completions", str(tiny_completions),
                                                "--out", str(tmp_path / "p"), "--a", "fast", "--b", "torch"], tmp_path)
    errors = [e["msg"] for e in events if e["type"] == "error"]
    assert code == 2 and errors[0].startswith("extraction a (kernels fast) failed: kernel policy 'fast' needs fla")
