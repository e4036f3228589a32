"""The extractor's check phase (remote.extract_check): bad input refused before the window, with one
clear line and nothing written that looks complete; `--check-only` for the console's preflight."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from remote import extract
from remote.drafter import save_random_drafter
from remote.events import WorkerError
from tests.fixtures_models import error_of, result_of, run_in_process, run_module


def _argv(target: Path, completions: Path, out: Path | None = None, *extra: str) -> list[str]:
    argv = ["--model", str(target), "--completions", str(completions), "--kernels", "torch", "--device", "cpu"]
    return argv + (["--out", str(out)] if out else ["--check-only"]) + list(extra)


def _vocab(target: Path) -> int:
    return json.loads((target / "config.json").read_text())["vocab_size"]


def _edited(completions: Path, tmp: Path, edit) -> Path:
    data = json.loads(completions.read_text())
    edit(data)
    path = tmp / "edited.json"
    path.write_text(json.dumps(data))
    return path


def _refused(target: Path, completions: Path, tmp: Path, *extra: str) -> str:
    """The full worker refuses in its check phase: one line, and the output directory never created."""
    out = tmp / "out"
    with pytest.raises(WorkerError) as err:
        run_in_process(extract.main, _argv(target, completions, out, *extra))
    assert "\n" not in err.value.msg and not out.exists()
    # the preflight form says the same, with every problem in its result
    with pytest.raises(WorkerError) as again:
        _, events = run_in_process(extract.main, _argv(target, completions, None, *extra))
    assert again.value.msg == err.value.msg
    return err.value.msg


def test_check_only_of_intact_inputs_writes_nothing(tiny_target, tiny_completions, tmp_path):
    code, events = run_module("remote.extract", _argv(tiny_target, tiny_completions), tmp_path)
    data = result_of(events)
    assert code == 0 and data["ok"] and data["check_only"] and data["problems"] == []
    assert data["vocab_size"] > 0 and data["max_position_embeddings"] == 8192 and data["prompts"] == 3
    assert data["layers"] == [3] and data["incomplete"] == [] and data["max_tokens"] <= data["tokens"]
    assert not any(e["type"] == "phase" and e["name"] in ("load", "forward") for e in events)


@pytest.mark.parametrize("where, value", [("completion_ids", 10**6), ("completion_ids", -1), ("prompt_ids", 10**5)])
def test_token_ids_outside_the_vocabulary_are_refused(tiny_target, tiny_completions, tmp_path, where, value):
    def edit(data):
        data["prompts"][1][where][2] = value

    msg = _refused(tiny_target, _edited(tiny_completions, tmp_path, edit), tmp_path)
    assert f"prompts[1] (binary_search).{where}[2] = {value} is outside the target's vocabulary" in msg


def test_prompt_beyond_the_context_is_refused(tiny_target, tiny_completions, tmp_path):
    small = tmp_path / "small-context"
    small.mkdir()
    for item in tiny_target.iterdir():
        (small / item.name).symlink_to(item)
    config = json.loads((tiny_target / "config.json").read_text())
    config["max_position_embeddings"] = 40
    (small / "config.json").unlink()
    (small / "config.json").write_text(json.dumps(config))
    msg = _refused(small, tiny_completions, tmp_path)
    assert "beyond the target's context (max_position_embeddings 40" in msg and "(+2 more)" in msg
    code, events = run_module("remote.extract", _argv(small, tiny_completions), tmp_path)
    data = result_of(events)  # the preflight still gets every problem
    assert code == 2 and not data["ok"] and len(data["problems"]) == 3 and error_of(events) == msg


def test_incomplete_generations_are_refused_unless_allowed(tiny_target, tiny_completions, tmp_path):
    def edit(data):
        data["prompts"][0].update(finish_reason="abort", complete=False, incomplete_reason="finish_reason 'abort'")

    from remote.completions import completeness

    edited = _edited(tiny_completions, tmp_path, edit)
    _, why = completeness(json.loads(edited.read_text())["prompts"][0])  # the cache's own reading of it
    msg = _refused(tiny_target, edited, tmp_path)
    assert f"1 of 3 generations are incomplete (fizzbuzz: {why})" in msg and "abort" in why
    out = tmp_path / "allowed"
    result, events = run_in_process(extract.main, _argv(tiny_target, edited, out, "--allow-incomplete", "--limit", "1",
                                                        "--layers", "1"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["incomplete_allowed"] == [{"id": "fizzbuzz", "reason": why}]
    assert any(e["type"] == "log" and "--allow-incomplete" in e["msg"] for e in events)


def test_drafter_without_ids_is_refused_and_an_override_is_recorded(tiny_target, tiny_completions, tmp_path):
    drafter = save_random_drafter(tmp_path / "mine", 64, _vocab(tiny_target), [1, 2], 4, block_size=4, mask_token_id=5)
    config = json.loads((drafter / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (drafter / "config.json").write_text(json.dumps(config))
    msg = _refused(tiny_target, tiny_completions, tmp_path, "--drafter", str(drafter))
    assert "target_layer_ids' is missing and required" in msg and "--layers-override mine=" in msg
    checked, _ = run_in_process(extract.main, _argv(tiny_target, tiny_completions, None, "--drafter", str(drafter),
                                                    "--layers-override", "mine=0,2"))
    assert checked["layers"] == [0, 2, 3] and checked["drafters"]["mine"]["layers_source"] == "override"
    assert "--layers-override names ['other']" in _refused(tiny_target, tiny_completions, tmp_path, "--drafter",
                                                             str(drafter), "--layers-override", "other=1")


@pytest.mark.parametrize("kwargs, message", [
    ({"hidden": 32}, "hidden_size 32 .* but the target's is 64"),
    ({"target_layers": 8}, "num_target_layers 8 .* but the target has 4 decoder layers"),
    ({"mask": 2000, "vocab": 4096}, "mask_token_id 2000 .* outside the target vocabulary"),
])
def test_drafters_that_do_not_fit_the_target_are_refused(tiny_target, tiny_completions, tmp_path, kwargs, message):
    drafter = save_random_drafter(tmp_path / "d", kwargs.get("hidden", 64), kwargs.get("vocab", _vocab(tiny_target)), [1, 2],
                                  kwargs.get("target_layers", 4), block_size=4, mask_token_id=kwargs.get("mask", 5))
    with pytest.raises(WorkerError, match=message):
        run_in_process(extract.main, _argv(tiny_target, tiny_completions, None, "--drafter", str(drafter)))
    ok = save_random_drafter(tmp_path / "ok", 64, _vocab(tiny_target), [1, 2], 4, block_size=4, mask_token_id=5)
    assert run_in_process(extract.main, _argv(tiny_target, tiny_completions, None, "--drafter", str(ok)))[0]["ok"]


def test_the_manifest_holds_per_layer_soundness(tiny_target, tiny_completions, tmp_path):
    out = tmp_path / "x"
    run_in_process(extract.main, _argv(tiny_target, tiny_completions, out, "--layers", "0,2", "--limit", "2"))
    manifest = json.loads((out / "manifest.json").read_text())
    sound = manifest["soundness"]
    assert [r["layer"] for r in sound["layers"]] == [0, 2, 3] and sound["flagged"] == []
    tokens = sum(p["num_tokens"] for p in manifest["prompts"])
    for row in sound["layers"]:
        assert row["tokens"] == tokens and row["nan"] == row["inf"] == 0 and row["zero_rows"] == 0
        assert 0 < row["norm_p1"] <= row["norm_p50"] <= row["norm_p99"] and 0 <= row["zero_share"] < 0.5
    with safe_open(str(out / manifest["prompts"][0]["file"]), "pt") as fh:
        assert fh.get_tensor("hidden").shape[1] == 3


def test_a_go_file_and_limit_still_checked_with_check_only(tiny_target, tiny_completions, tmp_path):
    shutil.copy(tiny_completions, tmp_path / "c.json")
    checked, _ = run_in_process(extract.main, _argv(tiny_target, tmp_path / "c.json", None, "--limit", "1"))
    assert checked["prompts"] == 1


def test_a_damaged_manifest_is_named(tmp_path):
    from remote.artifacts import read_manifest, write_manifest

    (tmp_path / "a.bin").write_bytes(b"x")
    write_manifest(tmp_path, {"a.bin": {}})
    assert read_manifest(tmp_path, verify=True)["files"]["a.bin"]["size"] == 1  # control
    (tmp_path / "manifest.json").write_bytes(b"\0" * 40)  # zeroed by a host crash
    with pytest.raises(ValueError, match=r"manifest.json: not valid JSON .*a damaged manifest"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {"a.bin": {"sha256": "x"}}}))
    with pytest.raises(ValueError, match=r"files\['a.bin'\] has no integer 'size' and 'sha256'"):
        read_manifest(tmp_path)


def test_check_only_says_which_extracted_layers_each_drafter_reads(tiny_target, tiny_completions, tmp_path):
    ok = save_random_drafter(tmp_path / "ok", 64, _vocab(tiny_target), [1, 2], 4, block_size=4, mask_token_id=5)
    checked, _ = run_in_process(extract.main, _argv(tiny_target, tiny_completions, None, "--drafter", str(ok),
                                                    "--layers", "0"))
    assert checked["layers"] == [0, 1, 2, 3]
    assert checked["drafters"]["ok"]["reads"] == [{"layer": 1, "index": 1}, {"layer": 2, "index": 2}]


@settings(max_examples=60, deadline=None)
@given(damage=st.lists(st.sampled_from(["none", "flip", "truncate", "delete", "no-sha", "path"]), min_size=1,
                       max_size=6))
def test_verify_files_keeps_exactly_the_files_that_match(damage, tmp_path_factory):
    """A kept prompt file is one whose size and sha256 match its manifest entry now; every other
    entry is named with why, whatever was done to it."""
    from remote.artifacts import sha256_file
    from remote.extract_check import verify_files

    root = tmp_path_factory.mktemp("verify")
    files, expect_why = {}, {}
    why_of = {"flip": "does not match its sha256", "truncate": "size 3, the manifest says", "delete": "missing",
              "no-sha": "no size and sha256", "path": "not a file name"}
    for i, how in enumerate(damage):
        name = f"p{i}.safetensors"
        (root / name).write_bytes(bytes([i]) * (64 + i))
        facts = {"size": 64 + i, "sha256": sha256_file(root / name), "prompt_id": f"p{i}"}
        if how == "flip":
            (root / name).write_bytes(bytes([i + 1]) * (64 + i))
        elif how == "truncate":
            (root / name).write_bytes(bytes([i]) * 3)
        elif how == "delete":
            (root / name).unlink()
        elif how == "no-sha":
            del facts["sha256"]
        elif how == "path":
            name = f"../{name}"
        files[name] = facts
        if how != "none":
            expect_why[name] = why_of[how]
    good, bad = verify_files(root, files)
    expect_good = {f"p{i}.safetensors" for i, how in enumerate(damage) if how == "none"}
    assert set(good) == expect_good and set(bad) == set(files) - expect_good
    assert all(good[name] == files[name] for name in good)
    assert all(expect_why[name] in why for name, why in bad.items()), bad
