"""Real transformers releases side by side, for the kernel check (tests/test_transformers_matrix.py).

Each entry of `transformers-matrix.txt` is installed with `pip install --no-deps --target` into a
directory of its own; a worker run with that directory first on PYTHONPATH imports that release (and
the huggingface-hub, tokenizers, kernels it was released with) instead of the venv's, and everything
else from the venv.
An entry whose real install has no `kernels` package gets a `sitecustomize.py` that keeps the venv's
out of the process (`sys.modules["kernels"] = None`, which `importlib.util.find_spec` then answers
None for, as transformers asks): that is how a host with `pip install transformers==5.24.0` looks.

Directories are kept between runs under the user's cache, one per entry and pins, and a directory is
only taken once complete: it is installed beside its final name and renamed into place.

`DFLASH_TRANSFORMERS_NEWEST=registry` (set by `.ci/newest`) replaces the lock's newest entry with
the newest release the registry serves today, resolved as a fresh install would resolve it.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

LOCK = Path(__file__).with_name("transformers-matrix.txt")
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dflash-ops-tests" / "transformers"
HIDE_KERNELS = ('# This entry\'s real install has no `kernels` package: keep the venv\'s out of this process.\n'
                'import sys\n\nsys.modules["kernels"] = None\n')


@dataclass(frozen=True)
class Entry:
    """One transformers release as a host would have it installed."""

    name: str
    kernels_package: bool
    pins: tuple[str, ...]

    @property
    def version(self) -> str:
        return next(p.split("==", 1)[1] for p in self.pins if p.startswith("transformers=="))


def read_lock(path: Path = LOCK) -> list[Entry]:
    """The lock's entries, in its order; a malformed line is an error naming it."""
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, kernels, *pins = line.split()
        if kernels not in ("absent", "present") or not any(p.startswith("transformers==") for p in pins) \
                or not all("==" in p for p in pins):
            raise ValueError(f"{path}:{number}: expected 'entry absent|present name==version ...', got {line!r}")
        entries.append(Entry(name, kernels == "present", tuple(pins)))
    return entries


def newest_from_registry() -> Entry:
    """The newest transformers as `pip install --upgrade transformers` resolves it today beside the
    venv: it and every package it would add or change (never torch: the venv's build stays)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--dry-run", "--upgrade", "--report",
                        str(report), "transformers", "torch==" + _installed("torch")],
                       check=True, stdout=subprocess.DEVNULL)
        installs = json.loads(report.read_text())["install"]
    found = {i["metadata"]["name"].lower().replace("_", "-"): i["metadata"]["version"] for i in installs}
    found.pop("torch", None)
    version = found.get("transformers") or _installed("transformers")
    found.setdefault("transformers", version)
    kernels = "kernels" in found or bool(_installed("kernels"))
    return Entry(f"{version} (newest)", kernels, tuple(f"{name}=={v}" for name, v in sorted(found.items())))


def _installed(name: str) -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return ""


def matrix() -> list[Entry]:
    """The entries to test: the lock's, with its newest replaced by the registry's when asked."""
    entries = read_lock()
    if os.environ.get("DFLASH_TRANSFORMERS_NEWEST") == "registry":
        entries[-1] = newest_from_registry()
    return entries


def install(entry: Entry, root: Path = CACHE) -> Path:
    """The entry's directory, installed once (kept between runs); never a half-installed one."""
    key = hashlib.sha256(json.dumps([entry.pins, entry.kernels_package, sys.version, platform.machine()])
                         .encode()).hexdigest()[:16]
    final = root / f"{entry.version}-{key}"
    if (final / ".complete").exists():
        return final
    root.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=f".{entry.version}-", dir=root))
    try:
        # --no-compile: only the modules a probe imports get compiled, on first import.
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                               "--disable-pip-version-check", "--target", str(building), *entry.pins],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"installing {' '.join(entry.pins)} failed:\n{proc.stderr[-2000:]}")
        if not entry.kernels_package:
            (building / "sitecustomize.py").write_text(HIDE_KERNELS)
        (building / ".complete").write_text(" ".join(entry.pins) + "\n")
        try:
            building.rename(final)
        except OSError:  # another process finished the same entry first: take its directory
            if not (final / ".complete").exists():
                raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return final
