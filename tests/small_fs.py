"""A small real filesystem for full-disk tests: a tmpfs mounted for the test (we run as root here
and in CI), filled to the last byte on request. Where no tmpfs can be mounted the test fails under
CI=true (it must run there) and is skipped only on a developer's machine without the right."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_filesystem(where: Path, size_kib: int = 256) -> Iterator[Path]:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        why = f"cannot mount a {size_kib} KiB tmpfs at {where}: {done.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def fill(filesystem: Path) -> None:
    """Write until the filesystem has no byte left (unbuffered: nothing is left to flush)."""
    for name, chunk in (("filler", 4096), ("filler-tail", 1)):
        with contextlib.suppress(OSError), open(filesystem / name, "wb", buffering=0) as f:
            while True:
                f.write(b"\0" * chunk)
