"""constraints.txt, the lock, fixes every package of a fresh install: nothing floats to a new release.

The README's two lines and .ci/run install with `-c constraints.txt`. A package installed in this
venv that the lock does not pin (a new dependency of a dependency), or pins at another version, would
make tomorrow's fresh install differ from today's.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

from packaging.utils import canonicalize_name
from packaging.version import Version

LOCK = Path(__file__).resolve().parent.parent / "constraints.txt"
# The installer's own, and this project (installed editable from the checkout).
NOT_LOCKED = {"pip", "setuptools", "wheel", "dflash-ops"}


def locked() -> dict[str, str]:
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([^\s;]+)", line)
        assert match, f"{LOCK}:{number}: not an exact pin: {line!r}"
        pins[canonicalize_name(match[1])] = match[2]
    return pins


def test_every_installed_package_is_pinned_at_its_version():
    pins = locked()
    installed = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions()}
    floating = sorted(set(installed) - set(pins) - NOT_LOCKED)
    assert not floating, f"installed but not in {LOCK.name} (add them at these versions): " + ", ".join(
        f"{name}=={installed[name]}" for name in floating)
    # A local build label (torch's +cpu) is the build, not the version: `torch==2.13.0` admits it.
    moved = {n: (pins[n], v) for n, v in installed.items() if n in pins and Version(v).public != Version(pins[n]).public}
    assert not moved, f"installed at other versions than {LOCK.name} pins (pin, installed): {moved}"


def test_the_lock_holds_what_the_tested_range_names():
    """The lock's transformers is the newest of the tested range: the venv's workers run what CI tested."""
    from remote.kernels import TESTED_TRANSFORMERS

    assert TESTED_TRANSFORMERS.endswith("<=" + locked()["transformers"])
