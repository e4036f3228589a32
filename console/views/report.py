"""The report of an evaluation: read a complete results directory, write report.md and report.json.

Shared by `dflash-ops report`, the engine's report step and the TUI's export keys, so the three
never disagree about what a report holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from console.views.tables import (
    export_json,
    export_markdown,
    kernel_rows,
    parity_rows,
    per_prompt_rows,
    summary_rows,
)

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


def write_report(results_dir: Path, out_dir: Path | None = None) -> tuple[dict[str, Any], tuple[Path, Path]]:
    """Read the complete evaluation in `results_dir` and write report.md / report.json into `out_dir`
    (default: beside the results). Returns the results and the two paths."""
    from console.cli.report import read_run

    out_dir = out_dir or results_dir
    results, parity, probes = read_run(results_dir)
    hosts = two_hosts(probes)
    markdown = export_markdown(results, out_dir / MARKDOWN_FILE, parity=parity, probes=hosts)
    tables = {"summary": table_json(summary_rows(results)), "per_prompt": table_json(per_prompt_rows(results))}
    if parity:
        tables["parity"] = table_json(parity_rows(parity))
    if hosts:
        tables["kernels"] = table_json(kernel_rows(*hosts))
    report = {"format": REPORT_FORMAT, "run_dir": str(results_dir.resolve()), "results": results,
              "parity": parity, "probes": probes, "tables": tables}
    return results, (markdown, export_json(report, out_dir / JSON_FILE))
