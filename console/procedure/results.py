"""Reading an evaluation's results: `results.json` (with `parity.json` and `probes.json` beside it)
of a complete evaluation directory (its `manifest.json`, written last, lists every file), for the
report, the results screen, the engine's report step and the online cross-check alike.

Errors name the file and what was expected (`ResultsError`); nothing incomplete is read as finished.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remote.artifacts import read_manifest

RESULTS_FILE = "results.json"
PARITY_FILE = "parity.json"
PROBES_FILE = "probes.json"  # the name `dflash-ops report` looks for beside results.json


class ResultsError(Exception):
    """An evaluation directory that cannot be read as complete results; the message names it."""


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultsError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); expected {what}") from None
    except UnicodeDecodeError:
        raise ResultsError(f"{path}: not UTF-8 text; expected {what}") from None
    if not isinstance(data, dict):
        raise ResultsError(f"{path}: expected {what} (a JSON object), found {type(data).__name__}")
    return data


def read_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict] | None]:
    """(results, parity or None, {host: probe} or None) of a complete evaluation directory."""
    if not run_dir.exists():
        raise ResultsError(f"{run_dir}: no such directory (give the --out directory of an evaluation)")
    if not run_dir.is_dir():
        raise ResultsError(f"{run_dir}: not a directory (give the --out directory of an evaluation)")
    try:
        read_manifest(run_dir)
    except ValueError as exc:  # incomplete or altered: never reported as if it were finished
        raise ResultsError(str(exc)) from None
    results_path = run_dir / RESULTS_FILE
    if not results_path.is_file():
        raise ResultsError(f"{run_dir}: no {RESULTS_FILE}: not an evaluation output directory")
    results = _read_json(results_path, "the results of remote.evaluate")
    drafters = results.get("drafters")
    if not isinstance(drafters, dict) or not drafters:
        raise ResultsError(f"{results_path}: `drafters`: expected an object with at least one drafter's metrics, "
                         f"found {json.dumps(drafters)[:60]}")
    for name, metrics in drafters.items():
        if not isinstance(metrics, dict) or not isinstance(metrics.get("tau"), dict):
            raise ResultsError(f"{results_path}: `drafters.{name}.tau`: expected an object of tau per method")
    parity = _read_json(run_dir / PARITY_FILE, "a remote.parity report") if (run_dir / PARITY_FILE).is_file() else None
    probes = None
    if (run_dir / PROBES_FILE).is_file():
        saved = _read_json(run_dir / PROBES_FILE, "the probes written by `dflash-ops probe --out`")
        hosts = saved.get("hosts")
        if not isinstance(hosts, dict) or not all(isinstance(p, dict) for p in hosts.values()):
            raise ResultsError(f"{run_dir / PROBES_FILE}: `hosts`: expected an object of host name -> probe")
        probes = hosts
    return results, parity, probes


