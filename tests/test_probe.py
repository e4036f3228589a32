"""Environment probe (remote.probe) and the side-by-side host table (console.views.probe_table)."""

from __future__ import annotations

import copy

from rich.console import Console
from safetensors import safe_open

from console.views.probe_table import find_asymmetries, probe_rows, probe_table
from remote import probe


def test_probe_reports_this_host_and_the_model(tiny_target, tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    (cache / "ab").mkdir(parents=True)
    (cache / "ab" / "kernel.cubin").write_bytes(b"x" * 1000)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    facts = probe.probe(str(tiny_target), str(tmp_path))
    with safe_open(str(tiny_target / "model.safetensors"), "pt") as fh:
        tensors = len(list(fh.keys()))
    assert facts["model"]["tensors"] == tensors and facts["model"]["num_layers"] == 4
    assert facts["model"]["layer_types"] == {"linear_attention": 3, "full_attention": 1}
    assert facts["triton_cache"] == {"dir": str(cache), "from_env": True, "exists": True, "bytes": 1000, "files": 1}
    assert facts["torch"]["cuda_available"] is False and facts["torch"]["devices"] == []
    assert facts["packages"]["fla"]["importable"] is False
    assert facts["kernels"]["fast"] is False and facts["kernels"]["would_force_torch"] is True
    assert facts["disk"]["free"] > 0 and facts["ram"]["available"] > 0


def test_probe_of_a_missing_model_reports_instead_of_failing(tmp_path):
    facts = probe.probe(str(tmp_path / "nope"))
    assert "model path does not exist" in facts["model"]["error"]
    assert facts["kernels"]["bound"]  # still inspects the default model type


def test_story_asymmetry_causal_conv1d_missing_on_training_host(fake_probes):
    found = {a.row: a for a in find_asymmetries(fake_probes)}
    assert found["causal_conv1d"].severity == "error"
    assert found["causal_conv1d"].values == {"inference": "0.0.0+fake", "training": "missing"}
    assert found["kernel causal_conv1d_fn"].severity == "error"
    assert found["kernel causal_conv1d_fn"].values["training"] == "torch fallback"
    assert "kernel torch_chunk_gated_delta_rule" not in found  # fla on both: no asymmetry there
    assert "fla" not in found and "disk free" not in found
    assert list(found.values())[0].severity == "error"


def test_identical_hosts_have_no_asymmetry_and_versions_warn(fake_probes):
    same = {"a": fake_probes["inference"], "b": copy.deepcopy(fake_probes["inference"])}
    same["b"]["disk"]["free"] = 1
    assert find_asymmetries(same) == []
    same["b"]["packages"]["transformers"]["version"] = "5.14.0"
    (only,) = find_asymmetries(same)
    assert only.row == "transformers" and only.severity == "warning"


def test_table_shows_hosts_side_by_side_and_flags_mismatch(fake_probes):
    console = Console(record=True, width=220)
    console.print(probe_table(fake_probes))
    text = console.export_text()
    assert "inference" in text and "training" in text
    line = next(ln for ln in text.splitlines() if "kernel causal_conv1d_fn" in ln)
    assert "causal_conv1d (causal_conv1d.causal_conv1d_interface)" in line and "torch fallback" in line and "MISMATCH" in line
    chunk = next(ln for ln in text.splitlines() if "kernel torch_chunk_gated_delta_rule" in ln)
    assert "MISMATCH" not in chunk


def test_rows_tolerate_a_partial_probe():
    rows = probe_rows({"torch": {"importable": False}})
    assert rows["torch"] == "missing" and rows["fla"] == "?" and rows["kernel causal_conv1d_fn"] == "?"


def test_probe_measures_the_model_files_read_speed_and_says_what_it_read(tiny_target, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    (model / "small.safetensors").write_bytes(b"\0" * 1000)  # not the largest: not the one read
    largest = model / "model.safetensors"
    speed = probe.disk_read_speed(str(model))
    assert speed["measured"] is True and speed["file"] == str(largest)
    assert speed["bytes"] == largest.stat().st_size and speed["seconds"] > 0
    assert speed["bytes_per_s"] == speed["bytes"] / speed["seconds"]
    assert "whole file" in speed["what"] and "page cache" in speed["what"]
    bounded = probe.disk_read_speed(str(model), limit=100_000)
    assert bounded["bytes"] == 100_000 and "the first 0.1 MiB of model.safetensors" in bounded["what"]
    facts = probe.probe(str(model), str(tmp_path))
    assert facts["speeds"]["disk_read"]["file"] == str(largest)


def test_probe_speeds_say_why_they_are_absent(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    speed = probe.disk_read_speed(str(tmp_path))
    assert speed == {"measured": False, "why": f"no *.safetensors file in {tmp_path}"}
    assert probe.disk_read_speed(None) == {"measured": False, "why": "no model directory given"}
    h2d = probe.h2d_speed()
    assert h2d == {"measured": False, "why": "no CUDA device (torch sees none): no host-to-GPU copy to time"}


def test_hosts_that_agree_get_no_empty_unlabelled_column(fake_probes):
    """Issue 28: the Kernels tab showed an empty, unlabelled 4th column."""
    same = {"a": fake_probes["inference"], "b": copy.deepcopy(fake_probes["inference"])}
    assert [c.header for c in probe_table(same).columns] == ["what", "a", "b"]
    assert [c.header for c in probe_table(fake_probes).columns][-1] == "why it differs"


def test_an_unknown_scheme_is_shown_as_unknown_and_named_with_its_host(fake_probes):
    """A host whose transformers binds in a shape the workers cannot read: every kernel row says
    unknown (never 'torch fallback'), the verdict names the host and the scheme, and no 'all clear'."""
    from console.cli.probe import summary_lines
    from console.views.probe_table import host_findings

    probes = {"inference": fake_probes["inference"], "training": copy.deepcopy(fake_probes["inference"])}
    probes["training"]["kernels"]["scheme"] = "unknown binding scheme (transformers 5.31.0)"
    probes["training"]["kernels"]["bound"] = dict.fromkeys(probes["training"]["kernels"]["bound"])
    probes["training"]["packages"]["transformers"]["version"] = "5.31.0"
    rows = probe_rows(probes["training"])
    assert rows["kernel scheme"] == "unknown binding scheme (transformers 5.31.0)"
    assert {rows[f"kernel {fn}"] for fn in probes["training"]["kernels"]["bound"]} == {"unknown (binding not read)"}
    findings = host_findings(probes)
    assert [(f.host, f.severity) for f in findings] == [("training", "error"), ("training", "warning")]
    assert findings[0].text.startswith("training: unknown binding scheme (transformers 5.31.0): ")
    assert findings[1].text == ("training runs transformers 5.31.0, outside the tested range >=5.2,<=5.25.0 "
                                "(pyproject.toml's worker extra)")
    lines = [line.plain for line in summary_lines(probes, find_asymmetries(probes), findings)]
    assert lines[:2] == [f.text for f in findings]
    assert not any(line.startswith("no kernel asymmetry") for line in lines)


def test_a_transformers_inside_the_tested_range_is_not_warned_about(fake_probes):
    from console.views.probe_table import host_findings, outside_tested_range

    assert host_findings({"a": fake_probes["inference"]}) == []
    assert outside_tested_range("5.1.0") and outside_tested_range("5.26.0") and outside_tested_range("4.57.6")
    assert not outside_tested_range("5.2.0") and not outside_tested_range("5.25.0")
    assert not outside_tested_range("not-a-version")  # unreadable: not judged
