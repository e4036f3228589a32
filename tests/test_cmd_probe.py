"""`dflash-ops probe` against two real SSH hosts (embedded servers), run in-process through `main`."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path

import pytest
from safetensors import safe_open

from console.cli.main import main
from tests.cli_hosts import ThreadedHosts, python_with_path, write_config


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "250")  # rich wraps to the terminal; keep a table row on one line


def _line(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if label in line)


def test_story_asymmetry_is_flagged_and_exits_1(hosts: ThreadedHosts, tmp_path: Path, fake_kernel_paths,
                                                tiny_target: Path, capsys: pytest.CaptureFixture[str]):
    # The inference host has fla and causal-conv1d (FAKE packages), the training host fla only.
    inference_py = python_with_path(tmp_path / "py-inference", list(fake_kernel_paths.values()))
    training_py = python_with_path(tmp_path / "py-training", [fake_kernel_paths["fla"]])
    config = write_config(tmp_path / "ops.toml", {
        "ct129": hosts.host_table("ct129", python=str(inference_py)),
        "ct200": hosts.host_table("ct200", python=str(training_py)),
    }, target={"model_path": str(tiny_target)})
    out_file = tmp_path / "probes.json"

    assert main(["probe", "--config", str(config), "--out", str(out_file)]) == 1
    captured = capsys.readouterr()
    out = captured.out
    header = _line(out, "ct129")
    assert "ct200" in header and header.index("ct129") < header.index("ct200")
    row = _line(out, "kernel causal_conv1d_fn")
    assert "causal_conv1d (causal_conv1d.causal_conv1d_interface)" in row and "torch fallback" in row and "MISMATCH" in row
    assert "MISMATCH" not in _line(out, "kernel torch_chunk_gated_delta_rule")  # fla on both hosts
    assert "MISMATCH" in _line(out, "causal_conv1d ") and "0.0.0+fake" in _line(out, "causal_conv1d ")
    assert "KERNEL ASYMMETRY between ct129, ct200" in out and "causal_conv1d" in _line(out, "KERNEL ASYMMETRY")
    # The target host probed the model: its size is in the table (only on that host's column).
    with safe_open(str(tiny_target / "model.safetensors"), "pt") as fh:
        tensors = len(list(fh.keys()))
    assert f"4 layers, {tensors} tensors" in _line(out, "model")
    assert "probe running" in captured.err and "Traceback" not in captured.err

    saved = json.loads(out_file.read_text())
    assert saved["format"] == "dflash-ops.probes/1" and saved["failed"] == {}
    assert saved["hosts"]["ct129"]["packages"]["causal_conv1d"]["importable"] is True
    assert saved["hosts"]["ct200"]["packages"]["causal_conv1d"]["importable"] is False
    # Each probe ran as a job in its host's workdir, with the shipped code.
    assert list((hosts.workdir("ct200") / "runs").glob("*-probe-*/events.jsonl"))


def test_identical_hosts_pass_with_exit_0(hosts: ThreadedHosts, tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    config = write_config(tmp_path / "ops.toml", {name: hosts.host_table(name) for name in ("ct129", "ct200")})
    assert main(["probe", "--config", str(config), "--cached"]) == 0  # nothing kept yet: probed, and kept
    captured = capsys.readouterr()
    out = captured.out
    assert "environment unchanged" not in captured.err
    # --cached again: torch, packages and kernel binding from that probe (the log says so), the same table.
    assert main(["probe", "--config", str(config), "--cached"]) == 0
    again = capsys.readouterr()
    # The same table but for the sizes measured every time (free disk and RAM move between two probes).
    def kept(table: str) -> str:
        return re.sub(r"\d+(\.\d+)? [KMGT]?B\b", "<size>", table)
    assert kept(again.out) == kept(out) and again.err.count("environment unchanged since") == 2
    assert len(list((hosts.workdir("ct129") / "probe-cache").glob("environment-*.json"))) == 1
    assert "no kernel asymmetry between ct129, ct200" in out and "MISMATCH" not in out
    # Only the target host is given the model: a model row on one host alone is no difference.
    assert "differs" not in out
    # The configured model path does not exist: reported in the table, not a failure.
    row = _line(out, "model")
    assert "model path does not exist" in row and row.split("│")[3].strip() == "-"


def test_unreachable_and_untrusted_hosts_are_one_line_each(hosts: ThreadedHosts, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    empty_known_hosts = tmp_path / "known_hosts"
    empty_known_hosts.write_text("")
    config = write_config(tmp_path / "ops.toml", {
        "ct129": hosts.host_table("ct129", port=closed_port),
        "ct200": hosts.host_table("ct200", known_hosts=str(empty_known_hosts)),
    })
    assert main(["probe", "--config", str(config)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.out + captured.err
    failures = [line for line in captured.out.splitlines() if line.startswith("probe failed")]
    assert len(failures) == 2, captured.out
    assert f"ct129: cannot reach {hosts.servers['ct129'].user}@127.0.0.1:{closed_port}: Connection refused" in failures[0]
    port = hosts.servers["ct200"].port
    assert f"ct200: unknown host key for [127.0.0.1]:{port}" in failures[1]
    assert f"ssh-keyscan -p {port} 127.0.0.1 >> {empty_known_hosts}" in failures[1]


def test_bad_config_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    assert main(["probe", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml: no such file" in capsys.readouterr().err
