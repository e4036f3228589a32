"""Atomic artifacts: written under a temporary name, fsynced, then renamed; with a manifest.

Nothing half-written is ever taken as complete: readers trust a file only if it has its final
name, and a directory of outputs only if its `manifest.json` exists (the manifest is renamed into
place last, after every file it lists).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike, fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success fsync it and rename it to `final`.

    On an exception the temporary file is removed and `final` is untouched. `fsync=False` is for
    a writer that syncs its files itself before writing the manifest that marks them complete (a
    killed process cannot leave a renamed file short; only a host crash could, and the manifest's
    sha256 catches that).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".partial", dir=final.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if fsync:
            sync_file(tmp_path)
        os.replace(tmp_path, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def sync_file(path: str | os.PathLike) -> None:
    """fsync a file (or a directory, to make the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(final: str | os.PathLike, data: Any) -> Path:
    return write_bytes_atomic(final, (json.dumps(data, indent=2, sort_keys=True, default=str) + "\n").encode())


def write_bytes_atomic(final: str | os.PathLike, data: bytes) -> Path:
    """`data` as `final`, atomically (temp file, fsync, rename), as write_json_atomic."""
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)
    return Path(final)


def write_manifest(directory: str | os.PathLike, files: dict[str, dict[str, Any]], **meta: Any) -> Path:
    """Write `directory/manifest.json` listing `files` (relative name -> facts) with size and sha256.

    Call it after every listed file is in place; its presence marks the directory complete.
    """
    directory = Path(directory)
    entries = {}
    for name, facts in sorted(files.items()):
        path = directory / name
        entries[name] = {"size": path.stat().st_size, "sha256": sha256_file(path), **facts}
    return write_json_atomic(directory / MANIFEST, {**meta, "files": entries})


def read_manifest(directory: str | os.PathLike, verify: bool = False) -> dict[str, Any]:
    """Read a complete directory's manifest; raise ValueError naming what is missing or altered."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{directory}: no {MANIFEST}: the output is incomplete (interrupted run?)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}): a damaged manifest") from None
    files = manifest.get("files", {}) if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise ValueError(f"{path}: expected an object with a 'files' object")
    for name, facts in files.items():
        file = directory / name
        if not isinstance(facts, dict) or not isinstance(facts.get("size"), int) or not isinstance(facts.get("sha256"), str):
            raise ValueError(f"{path}: files[{name!r}] has no integer 'size' and 'sha256'")
        if not file.is_file():
            raise ValueError(f"{directory}: {name} is listed in {MANIFEST} but missing")
        if file.stat().st_size != facts["size"]:
            raise ValueError(f"{directory}: {name} has size {file.stat().st_size}, manifest says {facts['size']}")
        if verify and sha256_file(file) != facts["sha256"]:
            raise ValueError(f"{directory}: {name} does not match its sha256 in {MANIFEST}")
    return manifest
