"""The report of an evaluation: its tables to print, and report.md / report.json to keep.

Shared by `dflash-ops report`, the engine's report step, `run --headless` and the console's export
key, so they never disagree about what a report holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import RenderableType

from console.views.tables import (
    MISMATCH_THRESHOLD,
    FittedTable,
    acceptance_chart,
    export_json,
    export_markdown,
    histogram_chart,
    kernel_rows,
    kernel_table,
    parity_rows,
    parity_soundness_rows,
    parity_soundness_table,
    parity_table,
    per_prompt_rows,
    per_prompt_table,
    provenance_rows,
    provenance_table,
    soundness_rows,
    soundness_table,
    summary_rows,
    summary_table,
    warning_lines,
    warnings_block,
)
from console.views.units import duration
from remote.artifacts import atomic_path

REPORT_FORMAT = "dflash-ops.report/1"
MARKDOWN_FILE, JSON_FILE = "report.md", "report.json"


def table_json(rows: tuple[list[str], list[list[str]], list[str]]) -> dict[str, Any]:
    headers, body, styles = rows
    return {"headers": headers, "rows": body, "flagged": [bool(s and ("red" in s or "yellow" in s)) for s in styles]}


def two_hosts(probes: dict[str, dict] | None) -> tuple[str, dict, str, dict] | None:
    """The first two hosts' probes, for the kernel table (None with fewer than two)."""
    if not probes or len(probes) < 2:
        return None
    (host_a, probe_a), (host_b, probe_b) = list(probes.items())[:2]
    return host_a, probe_a, host_b, probe_b


def report_renderables(results: dict[str, Any], parity: dict[str, Any] | None, probes: dict[str, dict] | None,
                       threshold: float = MISMATCH_THRESHOLD) -> list[RenderableType]:
    """Everything the terminal shows of a report, warnings first."""
    parts: list[RenderableType] = []
    if warning_lines(results, threshold):
        parts.append(warnings_block(results, threshold))
    parts += [summary_table(results), provenance_table(results), per_prompt_table(results),
              acceptance_chart(results), histogram_chart(results)]
    if results.get("soundness"):
        parts.append(soundness_table(results["soundness"]))
    if parity:
        parts.append(parity_table(parity))
        if parity.get("soundness"):
            parts.append(parity_soundness_table(parity))
    hosts = two_hosts(probes)
    if hosts:
        parts.append(kernel_table(*hosts))
    return parts


def read_online(out_dir: Path, results_dir: Path) -> dict[str, Any] | None:
    """The run's online cross-check (crosscheck.json beside the report, or in the run directory above
    its results), as report.json's `online`; None when the run has none."""
    from console.procedure.crosscheck import load

    for directory in dict.fromkeys((out_dir, results_dir.parent)):
        found = load(directory)
        if found is not None:
            return found.to_json()
    return None


def online_markdown(online: dict[str, Any]) -> str:
    """report.md's "Online" section: the served drafter's online tau beside its offline tau, per prompt,
    the definitions, and the triage list when they disagree."""
    from console.procedure.crosscheck import PROMPT_HEADERS, prompt_rows, summary_sentence, triage_lines

    lines = ["", "## Online", "", summary_sentence(online) + "."]
    if online.get("tau") is not None:
        lines += ["", f"- online: {online.get('definition')}", f"- offline: {online.get('offline_definition')}",
                  f"- {online.get('agreement')}", "", "| " + " | ".join(PROMPT_HEADERS) + " |",
                  "|" + "---|" * len(PROMPT_HEADERS)]
        lines += ["| " + " | ".join(row) + " |" for row in prompt_rows(online)]
    if online.get("triage"):
        lines += ["", "Triage (suspects first):", "", *(f"- {line}" for line in triage_lines(online))]
    return "\n".join([*lines, ""])


WINDOW_HEADERS = ["phase", "forecast", "measured", "error", "forecast's basis"]


def window_rows(out_dir: Path) -> list[list[str]] | None:
    """The window's forecast against what it measured, per phase (a run's own directory only)."""
    from console.procedure import forecast as fc
    from console.procedure.store import STATE, RunStore, RunStoreError

    if not (out_dir / STATE).is_file():
        return None
    try:
        state = RunStore(out_dir.parent).open(str(out_dir)).state
    except RunStoreError:
        return None
    rows = fc.against(state)
    return [[r.phase, duration(r.forecast_s, tenths=True),
             duration(r.measured_s, tenths=True),
             f"{r.error:+.0%}" if r.error is not None else "-", r.basis] for r in rows] or None


WINDOW_TITLE = "Window: forecast against measured"


def served_drafter(out_dir: Path) -> dict[str, Any] | None:
    """The served drafter's check (steps/drafter.py): its acceptance length before the window and
    after, and what was done about a fall; None for a directory without a run that checked it."""
    from console.procedure.store import STATE, RunStore, RunStoreError

    if not (out_dir / STATE).is_file():
        return None
    try:
        record = RunStore(out_dir.parent).open(str(out_dir)).state.facts.get("drafter")
    except RunStoreError:
        return None
    return record if isinstance(record, dict) and record.get("line") else None


def drafter_markdown(record: dict[str, Any]) -> str:
    lines = ["", "## Served drafter", "", record["line"] + "."]
    if record.get("remedy"):
        lines += ["", f"Remedy: {record['remedy']}."]
    return "\n".join([*lines, ""])


def forecast_error_line(out_dir: Path) -> str | None:
    """The forecast's error on the window's downtime in one line, so that it is seen, not assumed:
    'the forecast was off by +55%: 10.2 s forecast, 6.6 s measured (30 s of your answers left out of
    both)'. None for a directory without a run's forecast and measured downtime."""
    from console.procedure import forecast as fc
    from console.procedure.store import STATE, RunStore, RunStoreError

    if not (out_dir / STATE).is_file():
        return None
    try:
        whole, answers = fc.error_of(RunStore(out_dir.parent).open(str(out_dir)).state)
    except (RunStoreError, KeyError, TypeError, ValueError, StopIteration):  # a damaged state: no error to tell
        return None
    if whole is None or whole.error is None:
        return None
    left_out = f" ({duration(answers, tenths=True)} of your answers left out of both)" if answers else ""
    return (f"the forecast was off by {whole.error:+.0%}: {duration(whole.forecast_s, tenths=True)} forecast, "
            f"{duration(whole.measured_s, tenths=True)} measured{left_out}")


def window_table(rows: list[list[str]]) -> FittedTable:
    """The window's phases as forecast and as measured, for the terminal and the Window tab: the
    figures whole, the basis (a sentence) wrapping between its words. The whole downtime's basis is
    the phases' (report.md spells it out): said so, rather than its figures wrapped in two."""
    shown = [[*row[:4], "the phases above, added up"] if row[0] == "downtime" else row for row in rows]
    return FittedTable((WINDOW_HEADERS, shown, [""] * len(shown)), WINDOW_TITLE, wrap=(4,))


def window_markdown(rows: list[list[str]]) -> str:
    lines = ["", f"## {WINDOW_TITLE}", "", "| " + " | ".join(WINDOW_HEADERS) + " |",
             "|" + "---|" * len(WINDOW_HEADERS), *("| " + " | ".join(row) + " |" for row in rows)]
    return "\n".join([*lines, ""])


def write_report(results_dir: Path, out_dir: Path | None = None, threshold: float = MISMATCH_THRESHOLD,
                 loaded: tuple[dict[str, Any], dict[str, Any] | None, dict[str, dict] | None] | None = None,
                 ) -> tuple[dict[str, Any], tuple[Path, Path]]:
    """Write report.md / report.json of the complete evaluation in `results_dir` into `out_dir`
    (default: beside the results). `loaded`: what `read_run` already read. Returns the results and
    the two paths."""
    from console.procedure.results import read_run

    out_dir = out_dir or results_dir
    results, parity, probes = loaded or read_run(results_dir)
    hosts = two_hosts(probes)
    markdown = export_markdown(results, out_dir / MARKDOWN_FILE, parity=parity, probes=hosts)
    tables = {"summary": table_json(summary_rows(results, threshold)),
              "provenance": table_json(provenance_rows(results)),
              "per_prompt": table_json(per_prompt_rows(results)),
              "soundness": table_json(soundness_rows(results.get("soundness")))}
    if parity:
        tables["parity"] = table_json(parity_rows(parity))
        tables["parity_soundness"] = table_json(parity_soundness_rows(parity))
    if hosts:
        tables["kernels"] = table_json(kernel_rows(*hosts))
    report = {"format": REPORT_FORMAT, "run_dir": str(results_dir.resolve()), "results": results,
              "parity": parity, "probes": probes, "tables": tables, "warnings": warning_lines(results, threshold)}
    extra = ""
    window = window_rows(out_dir)  # a run's report: its window as forecast and as measured
    if window is not None:
        report["window"] = {"headers": WINDOW_HEADERS, "rows": window}
        extra += window_markdown(window)
    checked = served_drafter(out_dir)  # the served drafter before and after the window (issue 40)
    if checked is not None:
        report["drafter"] = checked
        extra += drafter_markdown(checked)
    online = read_online(out_dir, results_dir)  # the online cross-check (issue 20), when the run has one
    if online is not None:
        report["online"] = online
        extra += online_markdown(online)
    if extra:
        with atomic_path(markdown) as tmp:
            tmp.write_text(markdown.read_text(encoding="utf-8") + extra, encoding="utf-8")
    return results, (markdown, export_json(report, out_dir / JSON_FILE))
