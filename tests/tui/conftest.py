"""Fixtures of the TUI tests: no blinking cursor, UTC clock faces, a finished run from the real
producers, and the stand-in operator."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from textual.reactive import reactive
from textual.widgets import Input

from tests.tui.rundir import build_run, evaluation, parity


@pytest.fixture(autouse=True)
def no_cursor_blink(monkeypatch: pytest.MonkeyPatch) -> None:
    """A blinking cursor makes two screenshots of the same state differ."""
    steady = reactive(False, init=False)
    steady.__set_name__(Input, "cursor_blink")
    monkeypatch.setattr(Input, "cursor_blink", steady)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):
    """Clock faces (HH:MM:SS) in UTC, whatever the machine's zone."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture(scope="session")
def evaluation_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return evaluation(tmp_path_factory.mktemp("tui-eval"))


@pytest.fixture(scope="session")
def parity_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return parity(tmp_path_factory.mktemp("tui-parity"))


@pytest.fixture
def runs_root(tmp_path: Path, evaluation_dir: Path, parity_report: dict) -> Path:
    """A run store holding two finished runs (the second a little better and quicker)."""
    root = tmp_path / "runs"
    build_run(root, evaluation_dir, parity_report)
    build_run(root, evaluation_dir, parity_report, run_id="20251130-170000-cd34", headline_shift=-0.4,
              created=1_764_522_000.0)
    return root

