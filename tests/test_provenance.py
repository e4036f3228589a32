"""Layer provenance (EVAL-SPEC 6) and feature soundness, checked before any GPU time.

Fixtures are the producers' real output: `remote.drill.synthetic` writes extraction directories in
the extractor's format (its manifest's soundness computed by `remote.soundness`, as the extractor
does) and real drafter checkpoints.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from remote.drafter import DrafterError, parse_overrides, provenance, save_random_drafter
from remote.drill.synthetic import build_copying_setup, copying_states, random_sequences, write_extraction
from remote.soundness import Accumulator, SoundnessError, check_layers
from tests.fixtures_models import error_of, result_of, run_module


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict[str, Path]:
    return build_copying_setup(tmp_path_factory.mktemp("prov"), prompts=2, num_tokens=60)


def _states(tmp: Path, layers: list[int], hidden_size: int = 34, zero_layer: int | None = None,
            nan_layer: int | None = None) -> Path:
    seqs = copying_states(random_sequences(2, 20, 60, 32), 32, 16, layers, layers[-1])
    for seq in seqs:
        if zero_layer is not None:
            seq["hidden"][:, layers.index(zero_layer)] = 0.0
        if nan_layer is not None:
            seq["hidden"][3, layers.index(nan_layer), 5] = float("nan")
        seq["hidden"] = seq["hidden"][..., :hidden_size]
    return write_extraction(tmp, seqs, layers, hidden_size)


def test_provenance_of_an_intact_drafter_and_extraction(setup) -> None:
    record = provenance(setup["drafter"], "copy", states=setup["states"], target_vocab=32)
    assert record["target_layer_ids"] == [1, 2] and record["layers_source"] == "config"
    assert record["config_target_layer_ids"] == [1, 2]
    assert (record["fc_width"], record["block_size"], record["mask_token_id"], record["hidden_size"]) == (2, 16, 31, 34)
    assert record["reads"] == [{"layer": 1, "index": 1}, {"layer": 2, "index": 2}]
    assert [r["layer"] for r in record["soundness"]] == [1, 2] and not any(r["flagged"] for r in record["soundness"])
    assert record["weights_checked"] is True and record["states"] == str(setup["states"])
    json.dumps(record)  # a result event's data


def test_extraction_lacking_a_layer_is_named_on_both_sides(setup, tmp_path) -> None:
    states = _states(tmp_path / "s", [0, 2])
    with pytest.raises(DrafterError) as err:
        provenance(setup["drafter"], "copy", states=states)
    msg = str(err.value)
    assert "fc takes 2 layers [1, 2] (target_layer_ids)" in msg and "holds layers [0, 2]: missing [1]" in msg
    assert "\n" not in msg


def test_hidden_size_and_vocabulary_disagreements(setup, tmp_path) -> None:
    with pytest.raises(DrafterError, match=r"hidden_size 34 .* extraction .* holds hidden size 30"):
        provenance(setup["drafter"], "copy", states=_states(tmp_path / "s", [0, 1, 2], hidden_size=30))
    with pytest.raises(DrafterError, match=r"mask_token_id 31 .* outside the target vocabulary of 16 tokens"):
        provenance(setup["drafter"], "copy", target_vocab=16)
    with pytest.raises(DrafterError, match=r"vocab_size 32 .* but the target has 40 tokens"):
        provenance(setup["drafter"], "copy", target_vocab=40)


def test_fc_width_disagreeing_with_the_ids_is_named_from_the_headers_alone(tmp_path) -> None:
    bad = save_random_drafter(tmp_path / "bad", 64, 97, [0, 1, 2, 3, 4], 8, block_size=4, mask_token_id=5, fc_layers=4)
    for weights in (True, False):
        with pytest.raises(DrafterError, match=r"fc.weight takes 4 target layers .* names 5: \[0, 1, 2, 3, 4\]"):
            provenance(bad, "bad", weights=weights)
    ok = save_random_drafter(tmp_path / "ok", 64, 97, [0, 1, 2, 3, 4], 8, block_size=4, mask_token_id=5)
    assert provenance(ok, weights=False)["fc_width"] == 5


def test_override_is_shown_as_such(setup, tmp_path) -> None:
    record = provenance(setup["drafter"], "copy", layers_override=[0, 2], states=setup["states"])
    assert record["layers_source"] == "override" and record["target_layer_ids"] == [0, 2]
    assert record["config_target_layer_ids"] == [1, 2]
    assert parse_overrides(["copy=0,2", "b=5"]) == {"copy": [0, 2], "b": [5]}
    for bad in (["copy"], ["copy=x"], ["=1"], ["a=1", "a=2"], ["a=1,1"]):
        with pytest.raises(DrafterError):
            parse_overrides(bad)


@pytest.mark.parametrize("fault", ["zero", "nan"])
def test_a_flagged_layer_is_refused_unless_allowed(setup, tmp_path, fault) -> None:
    kwargs = {"zero_layer": 1} if fault == "zero" else {"nan_layer": 1}
    states = _states(tmp_path / "s", [0, 1, 2], **kwargs)
    manifest = json.loads((states / "manifest.json").read_text())
    assert manifest["soundness"]["flagged"] == [1]
    with pytest.raises(DrafterError, match=r"drafter copy reads layer 1 .* flagged unsound: .*--allow-unsound"):
        provenance(setup["drafter"], "copy", states=states)
    assert provenance(setup["drafter"], "copy", states=states, allow_unsound=True)["soundness"][0]["flagged"]
    # a flagged layer the drafter does not read is no reason to refuse it
    assert provenance(setup["drafter"], "copy", layers_override=[0, 2], states=states)["reads"][0]["layer"] == 0


def test_soundness_statistics_by_hand() -> None:
    hidden = torch.zeros(4, 2, 3)
    hidden[:, 0] = torch.tensor([[3.0, 4.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 6.0, 8.0]])
    hidden[:, 1] = torch.randn(4, 3) + 5
    hidden[0, 1, 0] = float("inf")
    acc = Accumulator([7, 9])
    acc.add(hidden.to(torch.bfloat16))
    rows = {r["layer"]: r for r in acc.result()["layers"]}
    a = rows[7]
    assert a["zero_share"] == pytest.approx(5 / 12) and a["zero_rows"] == 1 and a["constant_rows"] == 1
    assert a["nan"] == a["inf"] == 0 and a["tokens"] == 4
    assert a["norm_p50"] == pytest.approx(5.0, rel=1e-2) and a["norm_p99"] == pytest.approx(10.0, rel=1e-2)
    assert a["norm_p1"] == 0.0 and a["flagged"] and len(a["reasons"]) == 2
    assert rows[9]["inf"] == 1 and rows[9]["flagged"]
    with pytest.raises(SoundnessError, match="layer 7"):
        check_layers(acc.result(), [7], "drafter d", "here")
    clean = Accumulator([0])
    clean.add(torch.randn(5, 1, 8))
    check_layers(clean.result(), [0], "drafter d", "here")
    assert clean.result()["flagged"] == []


def test_provenance_worker_cli(setup, tmp_path) -> None:
    code, events = run_module("remote.provenance", ["--provenance", f"copy={setup['drafter']}", "--states",
                                                 str(setup["states"]), "--target", str(setup["target"]),
                                                 "--layers-override", "copy=1,2"], tmp_path)
    data = result_of(events)
    assert code == 0 and data["drafters"]["copy"]["layers_source"] == "override"
    assert data["states_layers"] == [0, 1, 2] and events[-1] == {**events[-1], "type": "exit", "code": 0}
    code, events = run_module("remote.provenance", ["--provenance", f"copy={setup['drafter']}", "--states",
                                                 str(_states(tmp_path / "s", [0, 2]))], tmp_path)
    assert code == 2 and "missing [1]" in error_of(events) and "\n" not in error_of(events)
    assert not any(e["type"] == "result" for e in events)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float8_e5m2,
                                   torch.float8_e4m3fn])
def test_the_weights_scan_counts_what_torch_counts_in_each_float_format(tmp_path: Path, dtype: torch.dtype):
    """The provenance reads the files with numpy (no torch on its host): its NaN and Inf counts, shapes
    and dtypes are torch's own for every float format safetensors holds, across its read chunks."""
    from safetensors.torch import save_file

    from remote import provenance as prov

    values = torch.randn(3, 1000)
    values[0, :7], values[1, 5:9], values[2, -1] = float("nan"), float("inf"), float("-inf")
    tensors = {"model.a": values.to(dtype), "model.b": torch.randn(17).to(dtype), "model.ids": torch.arange(4)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    facts = prov.scan_weights(tmp_path)
    assert set(facts) == {"a", "b", "ids"}  # the common prefix removed, as the loader does
    for name, tensor in tensors.items():
        fact = facts[name.removeprefix("model.")]
        assert fact.shape == tuple(tensor.shape) and fact.floating == tensor.is_floating_point()
        if tensor.is_floating_point():  # widened for the count: float8 has no isinf of its own; values stay
            wide = tensor.double()
            assert (fact.nan, fact.inf) == (int(wide.isnan().sum()), int(wide.isinf().sum())), name
    assert (facts["a"].nan, facts["a"].inf) != (0, 0)


def test_a_truncated_weights_file_is_named(tmp_path: Path):
    from safetensors.torch import save_file

    from remote import provenance as prov

    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "model.safetensors"))
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(DrafterError, match=r"model.safetensors: unreadable safetensors \(tensor 'w' lies outside"):
        prov.scan_weights(tmp_path)


def test_the_provenance_worker_imports_no_torch(setup: dict[str, Path]):
    """The preflight runs it on every drafter host: a second of start, not the seconds torch takes."""
    import subprocess
    import sys

    code = ("import sys; sys.argv = ['remote.provenance', '--provenance', 'copy=" + str(setup["drafter"]) + "'];"
            "import remote.provenance as p; from remote.events import EventWriter;"
            "p.provenance_main(EventWriter(stream=sys.stderr), sys.argv[1:]); print('torch' in sys.modules, 'transformers' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "False False"
