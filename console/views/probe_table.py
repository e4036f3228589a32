"""Two (or more) hosts' environment probes side by side, with the asymmetries that matter flagged.

`probe_rows` flattens each host's `remote.probe` JSON into labelled rows; `find_asymmetries` says
which rows differ between hosts and how much that matters: a kernel bound to fla / causal-conv1d on
one host and to the torch fallback on the other is an error (the story's bug: causal-conv1d missing
on the training host only, so hidden states differed between hosts); a different package version is
a warning; free disk or RAM is information. `probe_table` renders it as a rich Table.

`host_findings` says what is wrong on one host whatever the others run: a kernel binding scheme the
workers cannot read (what runs there is not known, so it is never shown as the torch fallback) and a
transformers outside the range the project was tested with (pyproject.toml's worker extra).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version
from rich.table import Table
from rich.text import Text

# stdlib only at import: no torch here
from remote.kernels import KERNEL_FUNCTIONS, TESTED_TRANSFORMERS, is_fast_impl, is_unknown_scheme

SEVERITY_STYLE = {"error": "bold red", "warning": "yellow", "info": ""}


@dataclass(frozen=True)
class Asymmetry:
    """One row whose value differs between hosts."""

    row: str
    severity: str  # "error" | "warning" | "info"
    values: dict[str, str]
    why: str


def _gb(value: Any) -> str:
    return f"{value / 1e9:.1f} GB" if isinstance(value, (int, float)) else "?"


def _package(status: dict[str, Any] | None) -> str:
    if not status:
        return "?"
    if status.get("importable"):
        return str(status.get("version") or "installed")
    return "missing"


def kernel_label(module: str | None, scheme: str | None = None) -> str:
    """'fla.ops.gated_delta_rule.chunk' -> 'fla (fla.ops...)'; the modeling module -> 'torch fallback';
    anything under a scheme the probe could not read -> 'unknown' (never guessed)."""
    if is_unknown_scheme(scheme):
        return "unknown (binding not read)"
    if not module:
        return "?"
    if is_fast_impl(module):
        return f"{module.split('.')[0]} ({module})"
    return "torch fallback"


def probe_rows(probe: dict[str, Any]) -> dict[str, str]:
    """Row label -> display value for one host's probe JSON (missing facts show as '?')."""
    torch = probe.get("torch") or {}
    packages = probe.get("packages") or {}
    kernels = probe.get("kernels") or {}
    devices = torch.get("devices") or []
    model = probe.get("model") or {}
    triton = probe.get("triton_cache") or {}
    rows = {
        "python": str((probe.get("python") or {}).get("version", "?")),
        "torch": str(torch.get("version", "missing" if torch.get("importable") is False else "?")),
        "CUDA": str(torch.get("cuda") or "none"),
        "GPUs": ", ".join(f"{d.get('name')} (sm {d.get('capability')})" for d in devices) or "none",
        "transformers": _package(packages.get("transformers")),
        "fla": _package(packages.get("fla")),
        "causal_conv1d": _package(packages.get("causal_conv1d")),
        "triton": _package(packages.get("triton")),
        "kernel scheme": str(kernels.get("scheme") or kernels.get("error") or "?"),
    }
    bound = kernels.get("bound") or {}
    for fn in KERNEL_FUNCTIONS:
        rows[f"kernel {fn}"] = kernel_label(bound.get(fn), kernels.get("scheme"))
    rows["torch path forced (no GPU)"] = "yes" if kernels.get("would_force_torch") else "no"
    rows["Triton cache"] = f"{_gb(triton.get('bytes'))} in {triton.get('files', '?')} files ({triton.get('dir', '?')})"
    rows["disk free"] = _gb((probe.get("disk") or {}).get("free"))
    rows["RAM available"] = _gb((probe.get("ram") or {}).get("available"))
    if model.get("path"):
        rows["model"] = (f"{model.get('num_layers', '?')} layers, {model.get('tensors', '?')} tensors, "
                         f"{_gb(model.get('tensor_bytes'))}" if not model.get("error") else f"error: {model['error']}")
    return rows


def _severity(row: str) -> tuple[str, str]:
    if row.startswith("kernel ") and row != "kernel scheme":
        return "error", "hidden states differ between hosts when one runs the torch fallback"
    if row in ("fla", "causal_conv1d", "torch path forced (no GPU)"):
        return "error", "decides which kernels transformers binds"
    if row in ("python", "torch", "CUDA", "transformers", "triton", "kernel scheme"):
        return "warning", "numerics may differ between versions"
    if row == "model":
        return "warning", "the hosts see different checkpoints"
    return "info", "differs between hosts"


def find_asymmetries(probes: dict[str, dict[str, Any]]) -> list[Asymmetry]:
    """Rows whose values differ between hosts, errors first. Free disk/RAM, GPUs and the Triton
    cache are expected to differ and are not reported."""
    rows = {host: probe_rows(p) for host, p in probes.items()}
    labels: list[str] = []
    for host_rows in rows.values():
        labels += [label for label in host_rows if label not in labels]
    found = []
    for label in labels:
        if label in ("disk free", "RAM available", "GPUs", "Triton cache"):
            continue
        # A row only some hosts report (the model: only the target host is given its path) is
        # compared between those that do.
        values = {host: host_rows[label] for host, host_rows in rows.items() if label in host_rows}
        if len(values) > 1 and len(set(values.values())) > 1:
            severity, why = _severity(label)
            found.append(Asymmetry(label, severity, values, why))
    order = {"error": 0, "warning": 1, "info": 2}
    return sorted(found, key=lambda a: order[a.severity])


@dataclass(frozen=True)
class HostFinding:
    """Something wrong on one host, whatever the other hosts run."""

    host: str
    severity: str  # "error" | "warning"
    text: str


def outside_tested_range(version: str | None, tested: str = TESTED_TRANSFORMERS) -> bool:
    """True when `version` is a version and falls outside `tested` (an unreadable one is not judged)."""
    try:
        return Version(str(version)) not in SpecifierSet(tested)
    except InvalidVersion:
        return False


def host_findings(probes: dict[str, dict[str, Any]]) -> list[HostFinding]:
    """Per host: an unknown kernel binding scheme (an error: which kernels run there is not known) and
    a transformers outside the tested range (a warning naming both), errors first."""
    found = []
    for host, probe in probes.items():
        scheme = (probe.get("kernels") or {}).get("scheme")
        package = (probe.get("packages") or {}).get("transformers") or {}
        version = package.get("version") if package.get("importable") else None
        if is_unknown_scheme(scheme):
            found.append(HostFinding(host, "error", f"{host}: {scheme}: dflash-ops cannot read which kernels "
                                     "transformers binds there; kernel policy 'fast' refuses it"))
        if version and outside_tested_range(version):
            found.append(HostFinding(host, "warning", f"{host} runs transformers {version}, outside the tested "
                                     f"range {TESTED_TRANSFORMERS} (pyproject.toml's worker extra)"))
    return sorted(found, key=lambda f: f.severity != "error")


def probe_table(probes: dict[str, dict[str, Any]], title: str = "Hosts: environment and kernels") -> Table:
    """A rich Table with one column per host; differing rows styled by severity, with a reason."""
    rows = {host: probe_rows(p) for host, p in probes.items()}
    flagged = {a.row: a for a in find_asymmetries(probes)}
    table = Table(title=title, show_lines=False)
    table.add_column("what", style="bold", no_wrap=True)
    for host in probes:
        table.add_column(host)
    if flagged:  # a column of its own only when a row differs, and labelled
        table.add_column("why it differs")
    labels: list[str] = []
    for host_rows in rows.values():
        labels += [label for label in host_rows if label not in labels]
    for label in labels:
        asym = flagged.get(label)
        style = SEVERITY_STYLE[asym.severity] if asym else ""
        cells = [Text(rows[h].get(label, "-"), style=style) for h in probes]
        note = Text(("MISMATCH: " if asym.severity == "error" else "differs: ") + asym.why, style=style) if asym else Text("")
        table.add_row(label, *cells, *([note] if flagged else []))
    return table
