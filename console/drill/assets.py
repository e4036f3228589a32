"""The drill's assets, built once and cached: the tiny target, two drafters, the prompt set.

The build itself is `python -m remote.drill.assets OUT` (torch and transformers live on the worker
side), run as a child process into a temporary directory beside the cache entry and renamed to
`<cache>/<key>` when it has exited 0. A complete entry is therefore exactly a directory under its
final name: a build that is killed, crashes or is cut short by a full disk leaves only a
`.<key>.build-*` directory, never taken as complete and removed by the next build. Builds are
serialised by a lock file, so two consoles starting a drill at once build once.

The key changes with the code that decides what is built (the builders, the drafter format, the
shipped prompts) and with the torch / transformers / tokenizers versions that write the files.

Cache: `platformdirs.user_cache_dir("dflash-ops")/drill`, or `$DFLASH_OPS_DRILL_CACHE`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import platformdirs

import remote
from remote.drill.locks import locked

CACHE_ENV = "DFLASH_OPS_DRILL_CACHE"
ASSETS_FILE = "assets.json"
FORMAT = "dflash-ops.drill-assets/1"
# What decides the assets' content: a change in any of these builds them anew.
_KEY_SOURCES = ("drill/tinymodel.py", "drill/drafters.py", "drill/assets.py", "drafter.py", "prompts.py",
                "data/prompts.jsonl")
_KEY_PACKAGES = ("torch", "transformers", "tokenizers", "safetensors")


class AssetsError(Exception):
    """The assets could not be built; the message says why and ends with the build's output."""


@dataclass(frozen=True)
class DrillAssets:
    """A complete cache entry: where each asset is, and what the build recorded (assets.json)."""

    root: Path
    facts: dict[str, Any]

    @property
    def target(self) -> Path:
        return self.root / self.facts["target"]

    @property
    def prompts(self) -> Path:
        return self.root / self.facts["prompts"]

    @property
    def reference(self) -> Path:
        return self.root / self.facts["drafters"]["reference"]["path"]

    @property
    def candidate(self) -> Path:
        return self.root / self.facts["drafters"]["candidate"]["path"]

    @property
    def fit_taus(self) -> dict[str, float]:
        """The vanilla tau each drafter reached in the build's own check (the drill's prompts)."""
        return {name: d["fit_check_tau"] for name, d in self.facts["drafters"].items()}


def cache_root() -> Path:
    """Where cache entries live: $DFLASH_OPS_DRILL_CACHE, else the user cache dir's `drill`."""
    override = os.environ.get(CACHE_ENV)
    return Path(override) if override else Path(platformdirs.user_cache_dir("dflash-ops")) / "drill"


def version_key(gpu: bool = False) -> str:
    """`v1-<hash>` of the builders' sources and the versions of the packages that write the files
    (`-gpu` after it for the GPU drill's assets)."""
    digest = hashlib.sha256()
    base = Path(remote.__file__).parent
    for name in _KEY_SOURCES:
        digest.update(name.encode() + b"\0" + (base / name).read_bytes() + b"\0")
    for package in _KEY_PACKAGES:
        try:
            digest.update(f"{package}={metadata.version(package)}\0".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=none\0".encode())
    return f"v1-{digest.hexdigest()[:16]}" + ("-gpu" if gpu else "")


def find_assets(root: Path | None = None, key: str | None = None) -> DrillAssets | None:
    """The complete cache entry for `key` (default: this code's), or None when there is none."""
    entry = (root or cache_root()) / (key or version_key())
    try:
        facts = json.loads((entry / ASSETS_FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(facts, dict) or facts.get("format") != FORMAT:
        return None
    return DrillAssets(entry, facts)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def ensure_assets(python: str = sys.executable, root: Path | None = None,
                  say: Callable[[str], None] = _say, timeout_s: float = 600.0, gpu: bool = False,
                  on_progress: Callable[[str], None] | None = None) -> DrillAssets:
    """The drill's assets, built first when the cache has no complete entry for this code.
    `gpu`: the GPU drill's (the few-GB target, built on this machine's GPU). `on_progress` gets each
    line the build writes as it writes it (its stage); on a terminal by default a progress line
    shows it with the time so far (console/views/headless.py: build_progress)."""
    root = root or cache_root()
    key = version_key(gpu)
    found = find_assets(root, key)
    if found is not None:
        return found
    root.mkdir(parents=True, exist_ok=True)
    with locked(root / f".{key}.lock"):
        found = find_assets(root, key)  # built by another console while we waited for the lock
        if found is not None:
            return found
        # Under the lock no build is running: what is left of earlier ones is debris.
        for stale in root.glob(f".{key}.build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        entry = root / key
        if entry.exists():  # a directory under the final name without a readable assets.json
            shutil.rmtree(entry)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.build-", dir=root))
        say(f"building the drill's assets once ({'a 1.7 B target on the GPU' if gpu else 'tiny target'}, "
            f"two drafters) into {entry}")
        log = tmp / "build.log"
        try:
            with log.open("wb") as out, _progress(on_progress, "building the drill's assets") as tell:
                proc = subprocess.Popen([python, "-m", "remote.drill.assets", str(tmp), *(["--gpu"] if gpu else [])],
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        cwd=Path(remote.__file__).parent.parent)
                _follow(proc, log, tell, timeout_s)
            if proc.returncode != 0 or not (tmp / ASSETS_FILE).is_file():
                tail = log.read_text(errors="replace")[-2000:]
                raise AssetsError(f"building the drill's assets failed (exit {proc.returncode}):\n{tail}")
            os.rename(tmp, entry)
        except subprocess.TimeoutExpired as exc:
            raise AssetsError(f"building the drill's assets took more than {timeout_s:g} s") from exc
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    found = find_assets(root, key)
    if found is None:
        raise AssetsError(f"{entry}: built, but {ASSETS_FILE} cannot be read")
    say(f"drill assets built in {found.facts.get('build_s', '?')} s; fit check taus {found.fit_taus}")
    return found


@contextlib.contextmanager
def _progress(on_progress: Callable[[str], None] | None, title: str) -> Iterator[Callable[[str], None]]:
    """The caller's progress callback, else on a terminal a progress line (nothing when piped)."""
    if on_progress is not None:
        yield on_progress
    elif sys.stderr.isatty():
        from console.views.headless import build_progress

        with build_progress(title) as tell:
            yield tell
    else:
        yield lambda line: None


def _follow(proc: subprocess.Popen, log: Path, tell: Callable[[str], None], timeout_s: float) -> None:
    """Wait for the build, telling each new line of its log; kill it past `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    seen = 0
    while True:
        try:
            proc.wait(timeout=0.25)
            done = True
        except subprocess.TimeoutExpired:
            done = False
        text = log.read_bytes()[seen:]
        complete = text[: text.rfind(b"\n") + 1] if not done else text
        for line in complete.decode(errors="replace").splitlines():
            if line.strip():
                tell(line.strip())
        seen += len(complete)
        if done:
            return
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise subprocess.TimeoutExpired(proc.args, timeout_s)


def main(argv: list[str] | None = None) -> int:
    """`python -m console.drill.assets [--root DIR]`: build (or find) the assets, print their directory."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m console.drill.assets", description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help=f"cache directory (default ${CACHE_ENV} or the user cache)")
    args = parser.parse_args(argv)
    print(ensure_assets(root=args.root).root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
