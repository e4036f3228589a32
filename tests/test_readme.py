"""README.md stays true: its two commands are what CI runs, and its config examples are real output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from console.cli.main import main
from console.config import example_config_text

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI_RUN = ROOT / ".ci" / "run"
ENTRY_POINT = Path(sys.executable).parent / "dflash-ops"


def code_blocks() -> list[list[str]]:
    return [block.strip("\n").splitlines() for block in re.findall(r"^```\n(.*?)^```", README.read_text(), re.S | re.M)]


def first_two_lines() -> list[str]:
    lines = README.read_text().splitlines()
    assert lines[0].startswith("# "), "README starts with its title"
    assert lines[2] == "```" and lines[5] == "```", "the two commands are the first lines, in a code block"
    return lines[3:5]


def test_first_lines_are_the_two_newcomer_commands() -> None:
    start, test = first_two_lines()
    for line in (start, test):
        parts = line.split(" && ")
        assert parts[0] == "python3 -m venv .venv"
        # torch first and on its own, so the package's install keeps that build; both from the lock.
        assert parts[1] == ".venv/bin/pip install -c constraints.txt torch==2.13.0"
        assert parts[2].startswith(".venv/bin/pip install -c constraints.txt -e '.[worker")
    assert start.split(" && ")[-1] == ".venv/bin/dflash-ops drill"  # the newcomer's first run is the drill
    assert test.split(" && ")[2] == ".venv/bin/pip install -c constraints.txt -e '.[worker,dev]'"
    assert test.split(" && ")[-1] == ".venv/bin/python -m pytest -q -n 3 --dist loadfile"


def test_ci_runs_the_readme_test_line() -> None:
    assert os.access(CI_RUN, os.X_OK)
    assert subprocess.run(["bash", "-n", str(CI_RUN)], capture_output=True).returncode == 0
    printed = subprocess.run([str(CI_RUN), "--print"], capture_output=True, text=True, check=True, timeout=30)
    stages = [line.split(": ", 1) for line in printed.stdout.splitlines()]
    installs = [cmd for kind, cmd in stages if kind == "install"]
    tests = [cmd for kind, cmd in stages if kind == "test"]
    assert " && ".join(installs + tests) == first_two_lines()[1]
    assert ("lint", ".venv/bin/ruff check .") in [tuple(s) for s in stages]


def test_installed_entry_point_answers_help() -> None:
    assert ENTRY_POINT.exists(), f"{ENTRY_POINT} missing: install the package (README line 2)"
    result = subprocess.run([str(ENTRY_POINT), "--help"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: dflash-ops")
    assert "config" in result.stdout


def _readme_error_examples() -> list[str]:
    block = next(b for b in code_blocks() if b and b[0].startswith("dflash-ops: error:"))
    return block


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ('address = "10.1.230.172"', 'adress = "10.1.230.172"'),
        ("budgets = [8, 16, 64]", 'budgets = [8, "16", 64]'),
        ('name = "v4-step4000"\nhost = "ct200"', 'name = "v4-step4000"\nhost = "ct300"'),
    ],
)
def test_readme_error_examples_are_real(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], old: str, new: str
) -> None:
    text = example_config_text()
    assert old in text
    monkeypatch.chdir(tmp_path)
    Path("dflash-ops.toml").write_text(text.replace(old, new, 1))
    assert main(["config", "check"]) == 2
    assert capsys.readouterr().err.rstrip("\n") in _readme_error_examples()


def test_the_exit_status_table_names_every_status_run_returns() -> None:
    """The README's table of `run`'s exit statuses has a row for each (a paused run is not done: 4; a
    run that left the served drafter degraded is not done either: 5)."""
    from console.procedure.engine import EXIT_DEGRADED, EXIT_DONE, EXIT_DOWN, EXIT_FAILED, EXIT_USAGE
    from console.runner import EXIT_PAUSED

    text = (Path(__file__).parent.parent / "README.md").read_text()
    rows = dict(re.findall(r"^\| (\d) \| (.+) \|$", text, flags=re.MULTILINE))
    assert set(rows) == {str(c) for c in (EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_DOWN, EXIT_PAUSED, EXIT_DEGRADED)}
    assert rows[str(EXIT_PAUSED)].startswith("paused with the service up")
    assert rows[str(EXIT_DEGRADED)].startswith("degraded")
