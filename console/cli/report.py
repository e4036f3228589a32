"""`dflash-ops report RUN_DIR`: an evaluation's result tables in the terminal, and exported beside it.

RUN_DIR is the output directory of `remote.evaluate` (or its `results.json`), or a run's own directory
in the run store (`RUNS/<id>`, what `dflash-ops runs` lists, or the bare id): its `results/` are read
and its report is written beside its `state.json`, where the engine's report step keeps it. It is read only when
complete (its `manifest.json`, written last, lists every file); `parity.json` (from `remote.parity`)
and `probes.json` (from `dflash-ops probe --out`) are added to the report when they lie beside it.
Shown too: warnings first (g-vs-x above 2% and what it means, unsound layers evaluated anyway,
overridden layer ids, incomplete generations extracted), each drafter's layer provenance, z-lab's
acceptance-length histogram, SpecForge's simulated_acc_len (labelled, beside tau), and per-layer
feature soundness of the extraction (and of both parity runs).
The Markdown and JSON exports are written there as `report.md` and `report.json`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from console.cli.main import UsageError
from console.cli.probe import PROBES_FILE
from console.procedure.store import STATE, RunStore, RunStoreError
from console.views.report import report_renderables, write_report
from console.views.tables import MISMATCH_THRESHOLD
from remote.artifacts import read_manifest

RESULTS_FILE = "results.json"
PARITY_FILE = "parity.json"


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}); expected {what}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not UTF-8 text; expected {what}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected {what} (a JSON object), found {type(data).__name__}")
    return data


def read_run(run_dir: Path) -> tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict] | None]:
    """(results, parity or None, {host: probe} or None) of a complete evaluation directory."""
    if not run_dir.exists():
        raise UsageError(f"{run_dir}: no such directory (give the --out directory of an evaluation)")
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir}: not a directory (give the --out directory of an evaluation)")
    try:
        read_manifest(run_dir)
    except ValueError as exc:  # incomplete or altered: never reported as if it were finished
        raise UsageError(str(exc)) from None
    results_path = run_dir / RESULTS_FILE
    if not results_path.is_file():
        raise UsageError(f"{run_dir}: no {RESULTS_FILE}: not an evaluation output directory")
    results = _read_json(results_path, "the results of remote.evaluate")
    drafters = results.get("drafters")
    if not isinstance(drafters, dict) or not drafters:
        raise UsageError(f"{results_path}: `drafters`: expected an object with at least one drafter's metrics, "
                         f"found {json.dumps(drafters)[:60]}")
    for name, metrics in drafters.items():
        if not isinstance(metrics, dict) or not isinstance(metrics.get("tau"), dict):
            raise UsageError(f"{results_path}: `drafters.{name}.tau`: expected an object of tau per method")
    parity = _read_json(run_dir / PARITY_FILE, "a remote.parity report") if (run_dir / PARITY_FILE).is_file() else None
    probes = None
    if (run_dir / PROBES_FILE).is_file():
        saved = _read_json(run_dir / PROBES_FILE, "the probes written by `dflash-ops probe --out`")
        hosts = saved.get("hosts")
        if not isinstance(hosts, dict) or not all(isinstance(p, dict) for p in hosts.values()):
            raise UsageError(f"{run_dir / PROBES_FILE}: `hosts`: expected an object of host name -> probe")
        probes = hosts
    return results, parity, probes


def evaluation_dirs(given: Path, runs: str | None = None) -> tuple[Path, Path]:
    """(the evaluation's directory, where its report goes) for what `report` was given: the evaluation
    directory or its results.json (the report beside them), or a run of the store (its results/, the
    report in the run's directory)."""
    if given.name == RESULTS_FILE and given.is_file():
        return given.parent, given.parent
    store = RunStore(runs)
    if not given.exists() and len(given.parts) == 1 and (store.root / given / STATE).is_file():
        given = store.root / given  # a bare run id, as `runs` lists it
    if not (given / STATE).is_file():
        return given, given
    results = given / "results"
    if not (results / RESULTS_FILE).is_file():
        try:
            status = store.open(str(given)).state.status
        except RunStoreError as exc:
            status = f"unreadable: {exc}"
        raise UsageError(f"{given}: this run has no results yet (status {status}): its evaluation has not "
                         f"been fetched; `dflash-ops run --resume {given.name}` continues it")
    return results, given


def run(args: argparse.Namespace) -> int:
    """`dflash-ops report RUN_DIR`: print the tables, write report.md and report.json beside them
    (a run's: in its directory)."""
    run_dir, out_dir = evaluation_dirs(Path(args.run_dir), getattr(args, "runs", None))
    loaded = read_run(run_dir)
    threshold = float(getattr(args, "mismatch_threshold", None) or MISMATCH_THRESHOLD)
    console = Console()
    for part in report_renderables(*loaded, threshold=threshold):
        console.print(part)
    _, (markdown, exported) = write_report(run_dir, out_dir, threshold=threshold, loaded=loaded)
    console.print(Text(f"wrote {markdown} and {exported}"))
    return 0
