"""The evaluator refuses bad input before any work, in one line, leaving nothing that looks complete;
each refusal next to the intact control it differs from. Fixtures are the producers' real output
(remote.drill.synthetic's extraction directories and drafters)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from remote.drill.synthetic import build_copying_setup, copying_states, random_sequences, write_extraction
from remote.evaluate import main as evaluate_main
from remote.events import EventWriter, WorkerError
from tests.fixtures_models import run_in_process


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    return build_copying_setup(tmp_path_factory.mktemp("trust"), prompts=2, num_tokens=50)


def _args(setup: dict[str, Path], out: Path, states: Path | None = None, drafter: Path | None = None,
          *extra: str) -> list[str]:
    return ["--states", str(states or setup["states"]), "--target", str(setup["target"]),
            "--drafter", f"copy={drafter or setup['drafter']}", "--out", str(out), "--device", "cpu",
            "--budgets", "8", "--topk", "8", *extra]


def _ok(setup: dict[str, Path], out: Path, *args: str) -> tuple[dict, list[dict]]:
    result, events = run_in_process(evaluate_main, _args(setup, out, *args))
    return json.loads((out / "results.json").read_text()), events


def _refused(setup: dict[str, Path], tmp: Path, *args, extra: tuple[str, ...] = ()) -> str:
    out = tmp / "out"
    with pytest.raises(WorkerError) as err:
        evaluate_main(EventWriter(path=str(tmp / "events.jsonl")), _args(setup, out, *args, *extra))
    assert "\n" not in err.value.msg
    assert not (out / "manifest.json").exists() and not (out / "copy").exists()
    return err.value.msg


def _states(tmp: Path, layers=(0, 1, 2), **edit) -> Path:
    seqs = copying_states(random_sequences(2, 20, 50, 32), 32, 16, list(layers), 2)
    for seq in seqs:
        if "zero_layer" in edit:
            seq["hidden"][:, list(layers).index(edit["zero_layer"])] = 0.0
        if "token" in edit:
            seq["input_ids"][25] = edit["token"]
    return write_extraction(tmp, seqs, list(layers), 34, soundness=edit.get("soundness", True))


def test_the_intact_setup_is_evaluated_with_its_provenance(setup, tmp_path) -> None:
    results, events = _ok(setup, tmp_path / "out")
    prov = results["drafters"]["copy"]["provenance"]
    assert prov["target_layer_ids"] == [1, 2] and prov["layers_source"] == "config" and prov["weights_checked"]
    assert prov["reads"] == [{"layer": 1, "index": 1}, {"layer": 2, "index": 2}]
    assert results["soundness"]["flagged"] == [] and results["drafters"]["copy"]["tau"]["vanilla"]["macro"] == 16
    assert any(e["type"] == "log" and "sizes and sha256 as in the manifest" in e["msg"] for e in events)


def test_a_states_file_zeroed_after_a_host_crash_is_refused(setup, tmp_path) -> None:
    states = tmp_path / "states"
    shutil.copytree(setup["states"], states)
    victim = states / "prompt01.safetensors"
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size: only the sha256 tells
    assert "prompt01.safetensors does not match its sha256" in _refused(setup, tmp_path, states)


def test_token_ids_the_target_cannot_embed_are_refused_before_the_forward(setup, tmp_path) -> None:
    msg = _refused(setup, tmp_path, _states(tmp_path / "s", token=40))
    assert "input_ids holds token 40, outside the target vocabulary (0..31): it cannot be embedded" in msg


def test_nan_drafter_weights_are_refused_naming_the_tensor(setup, tmp_path) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(setup["drafter"], drafter)
    weights = load_file(str(drafter / "model.safetensors"))
    weights["layers.1.self_attn.k_proj.weight"][0, 0] = float("nan")
    save_file(weights, str(drafter / "model.safetensors"))
    msg = _refused(setup, tmp_path, None, drafter)
    assert "tensor 'layers.1.self_attn.k_proj.weight' holds 1 NaN and 0 Inf" in msg


def test_non_finite_target_heads_are_refused(setup, tmp_path) -> None:
    target = tmp_path / "target"
    shutil.copytree(setup["target"], target)
    shard = next(target.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    name = next(iter(tensors))
    tensors[name] = tensors[name].clone()
    tensors[name][1, 1] = float("inf")
    save_file(tensors, str(shard))
    with pytest.raises(WorkerError, match="holds non-finite values: refused"):
        evaluate_main(EventWriter(path=str(tmp_path / "e.jsonl")),
                      ["--states", str(setup["states"]), "--target", str(target), "--drafter",
                       f"copy={setup['drafter']}", "--out", str(tmp_path / "out"), "--device", "cpu"])
    assert not (tmp_path / "out").exists()


def test_a_flagged_layer_is_refused_unless_allowed(setup, tmp_path) -> None:
    states = _states(tmp_path / "s", zero_layer=2)
    msg = _refused(setup, tmp_path, states)
    assert "reads layer 2" in msg and "flagged unsound" in msg and "all zero" in msg and "--allow-unsound" in msg
    results, events = _ok(setup, tmp_path / "out2", states, None, "--allow-unsound")
    assert results["soundness"]["flagged"] == [2] and results["drafters"]["copy"]["tau"]["vanilla"]["macro"] < 2
    assert any(e["type"] == "log" and e["level"] == "warning" and "--allow-unsound" in e["msg"] for e in events)


def test_an_older_manifest_without_soundness_gets_it_computed(setup, tmp_path) -> None:
    states = _states(tmp_path / "s", soundness=False, zero_layer=2)
    assert "flagged unsound" in _refused(setup, tmp_path, states)
    results, events = _ok(setup, tmp_path / "out2", _states(tmp_path / "s2", soundness=False))
    assert results["soundness"]["flagged"] == [] and any("computed now" in e.get("msg", "") for e in events)


def test_layer_ids_required_and_an_override_is_shown_as_such(setup, tmp_path) -> None:
    drafter = tmp_path / "drafter"
    shutil.copytree(setup["drafter"], drafter)
    config = json.loads((drafter / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (drafter / "config.json").write_text(json.dumps(config))
    msg = _refused(setup, tmp_path, None, drafter)
    assert "target_layer_ids' is missing and required" in msg and "only a guess" in msg
    results, _ = _ok(setup, tmp_path / "out2", None, drafter, "--layers-override", "copy=1,2")
    prov = results["drafters"]["copy"]["provenance"]
    assert prov["layers_source"] == "override" and prov["config_target_layer_ids"] is None
    assert results["drafters"]["copy"]["facts"]["layers_source"] == "override"
    assert "not among the drafters" in _refused(setup, tmp_path, None, drafter, extra=("--layers-override", "zz=1"))


def test_the_extraction_lacking_a_layer_is_named_on_both_sides(setup, tmp_path) -> None:
    msg = _refused(setup, tmp_path, _states(tmp_path / "s", layers=(0, 2)))
    assert "fc takes 2 layers [1, 2] (target_layer_ids)" in msg and "holds layers [0, 2]: missing [1]" in msg


def test_a_state_file_whose_metadata_disagrees_is_named(setup, tmp_path) -> None:
    states = tmp_path / "states"
    shutil.copytree(setup["states"], states)
    manifest = json.loads((states / "manifest.json").read_text())
    manifest["prompts"][0]["prompt_len"] = 21
    (states / "manifest.json").write_text(json.dumps(manifest))
    assert "disagree with the manifest's 'prompt00' / 21" in _refused(setup, tmp_path, states)
