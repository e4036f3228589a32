"""A small real filesystem for full-disk tests, created and removed by the test: a tmpfs (we run as
root here and in CI), else an ext2 image on a loop device; filled to the last byte on request.
Where neither can be mounted the test fails under CI=true (it must run there) and is skipped only on
a developer's machine without the right."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


def mount_small(mount: Path, size_kib: int) -> str | None:
    """Mount a `size_kib` KiB filesystem at `mount`: "tmpfs", else "loop"; None where neither works."""
    mount.mkdir(parents=True, exist_ok=True)
    tmpfs = ["mount", "-t", "tmpfs", "-o", f"size={size_kib}k,mode=0700", "tmpfs", str(mount)]
    if subprocess.run(tmpfs, capture_output=True).returncode == 0:
        return "tmpfs"
    image = mount.with_suffix(".img")
    image.write_bytes(b"\0" * (max(size_kib, 256) << 10))
    if shutil.which("mkfs.ext2") and subprocess.run(["mkfs.ext2", "-q", "-F", str(image)], capture_output=True).returncode == 0 \
            and subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True).returncode == 0:
        return "loop"
    return None


@contextlib.contextmanager
def small_filesystem(where: Path, size_kib: int = 256) -> Iterator[Path]:
    if mount_small(where, size_kib) is None:
        why = f"no small filesystem can be made at {where} (tmpfs and loop mounts refused)"
        if os.environ.get("CI") == "true":
            pytest.fail(why + ": the full-disk tests must run in CI")
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
