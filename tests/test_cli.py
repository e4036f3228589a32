"""The `dflash-ops` command line: through the installed entry point, and in-process for the details."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from console.cli.main import main
from console.config import example_config_text
from console.views.plan import STEPS

ENTRY_POINT = Path(sys.executable).parent / "dflash-ops"


def dflash_ops(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the installed console script, as a user would."""
    assert ENTRY_POINT.exists(), f"{ENTRY_POINT} missing: install the package (README line 2)"
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    return subprocess.run([str(ENTRY_POINT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_init_then_check_prints_the_plan(tmp_path: Path) -> None:
    init = dflash_ops("config", "init", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    written = tmp_path / "dflash-ops.toml"
    assert written.read_text() == example_config_text()

    check = dflash_ops("config", "check", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    out = check.stdout
    assert "ct129" in out and "ct200" in out and "sglang-qwen" in out
    assert "auto: from drafter configs at run time" in out
    assert "fizzbuzz" in out and "matrix_multiply" in out
    for step in STEPS:
        assert step in out
    assert out.rstrip().endswith("dflash-ops.toml: OK")


def test_check_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "ops.toml"
    config.write_text(example_config_text().replace("address = ", "adress = ", 1))
    assert_one_line_error(
        dflash_ops("config", "check", "--config", str(config), cwd=tmp_path),
        "unknown key `hosts.ct129.adress`", "did you mean `address`?",
    )
    assert_one_line_error(dflash_ops("config", "check", cwd=tmp_path), "dflash-ops.toml: no such file")
    assert_one_line_error(dflash_ops("config", "frobnicate", cwd=tmp_path), "invalid choice: 'frobnicate'")


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "my.toml"
    assert main(["config", "init", str(path)]) == 0
    path.write_text("# my edits\n")
    assert main(["config", "init", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"dflash-ops: error: {path}: already exists; use --force to overwrite it\n"
    assert path.read_text() == "# my edits\n"
    assert main(["config", "init", "--force", str(path)]) == 0
    assert path.read_text() == example_config_text()
    assert [p.name for p in path.parent.iterdir()] == ["my.toml"]  # no temporary left behind


def test_init_into_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "init", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_check_reports_bad_values_with_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ops.toml"
    config.write_text(example_config_text().replace("budgets = [8, 16, 64]", 'budgets = [8, "16", 64]'))
    assert main(["config", "check", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f'dflash-ops: error: {config}: `eval.budgets[1]`: expected a positive integer, found "16" (a string)\n'
    )


def test_check_reports_syntax_errors_with_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ops.toml"
    config.write_text('[hosts.a]\naddress = "a"\nuser = root\n')
    assert main(["config", "check", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(f"dflash-ops: error: {config}, line 3, column ")


def test_no_command_shows_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "config" in capsys.readouterr().err


def test_usage_errors_exit_2_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "check", "--nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --nope" in err


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "init" in out and "check" in out
