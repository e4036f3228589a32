"""`dflash-ops report [RUN_DIR]`: an evaluation's result tables in the terminal, and exported beside it.

RUN_DIR is the output directory of `remote.evaluate` (or its `results.json`), or a run's own directory
in the run store (`RUNS/<id>`, what `dflash-ops runs` lists, or the bare id): its `results/` are read
and its report is written beside its `state.json`, where the engine's report step keeps it. Without
RUN_DIR: the store's latest run. It is read only when
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
from pathlib import Path

from rich.console import Console
from rich.text import Text

from console.cli.usage import UsageError
from console.procedure.results import RESULTS_FILE, read_run
from console.procedure.store import STATE, RunStore, RunStoreError, what_next
from console.views.report import report_renderables, window_rows, window_table, write_report
from console.views.tables import MISMATCH_THRESHOLD


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
            run = store.open(str(given))
        except RunStoreError as exc:
            raise UsageError(f"{given}: this run has no results, and its state cannot be read: {exc}") from None
        raise UsageError(f"{given}: this run has no results yet (status {run.state.status}): its evaluation has not "
                         f"been fetched; {what_next(run)}")
    return results, given


def latest_run(runs: str | None) -> Path:
    """The store's newest run (`report` without RUN_DIR), said on stderr."""
    store = RunStore(runs)
    ids = store.run_ids()
    if not ids:
        raise UsageError(f"no run in {store.root}: give RUN_DIR (an evaluation's directory, or a run's directory or id)")
    Console(stderr=True).print(Text(f"dflash-ops: the latest run: {ids[-1]} ({store.root / ids[-1]})"), soft_wrap=True)
    return store.root / ids[-1]


def run(args: argparse.Namespace) -> int:
    """`dflash-ops report [RUN_DIR]`: print the tables, write report.md and report.json beside them
    (a run's: in its directory)."""
    given = Path(args.run_dir) if args.run_dir is not None else latest_run(getattr(args, "runs", None))
    run_dir, out_dir = evaluation_dirs(given, getattr(args, "runs", None))
    loaded = read_run(run_dir)
    threshold = float(getattr(args, "mismatch_threshold", None) or MISMATCH_THRESHOLD)
    console = Console()
    for part in report_renderables(*loaded, threshold=threshold):
        console.print(part)
    window = window_rows(out_dir)  # a run's report: its window, forecast against measured, as report.md has it
    if window is not None:
        console.print(window_table(window))
    _, (markdown, exported) = write_report(run_dir, out_dir, threshold=threshold, loaded=loaded)
    console.print(Text(f"wrote {markdown} and {exported}"))
    return 0
