"""The drill's command and assets for the tests that bring up rehearsal hosts of their own
(tests/test_drill_hosts.py, tests/test_drill_fleet.py); `drill_cache` is a fixture (tests/conftest.py
loads this module as a plugin)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from console.drill.assets import cache_root, ensure_assets

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = Path(sys.executable).parent / "dflash-ops"


@pytest.fixture(scope="module")
def drill_cache() -> Path:
    """The assets cache these tests use: the one the console and the other drill tests use (built
    once per machine, under its lock, whichever test or console comes first)."""
    ensure_assets()
    return cache_root()


def drill_up(drill_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENTRY_POINT), "drill", "up", "--dir", str(drill_dir), *extra], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def http_status(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.status
