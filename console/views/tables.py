"""Result tables: the evaluation's `results.json` (and parity / probe dicts) as rich renderables,
and the same tables exported as Markdown and JSON beside the run.

Each table is built once as plain rows (`*_rows` -> headers, rows of strings, row styles) and then
rendered either as a rich `Table` (the TUI's results screen) or as a Markdown pipe table, so the two
never disagree. Method ids are printed exactly as in the results (`vanilla`, `ddtree-b8`, `top8`):
never an unlabelled "DDTree-8".
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.markup import escape
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from remote.artifacts import atomic_path, write_json_atomic
from remote.kernels import is_unknown_scheme

Rows = tuple[list[str], list[list[str]], list[str]]  # headers, rows, per-row style ("" = none)
BAR_WIDTH = 40
_EIGHTHS = " ▏▎▍▌▋▊▉█"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def ratio_text(value: float | None, reference: float | None) -> str:
    """'0.24x' (value / reference), or '-' when either is missing or the reference is 0."""
    if value is None or not reference:
        return "-"
    return f"{value / reference:.2f}x"


def drafter_order(results: dict[str, Any]) -> list[str]:
    """Drafter names, the reference first."""
    names = list(results.get("drafters", {}))
    ref = results.get("reference")
    return ([ref] if ref in names else []) + [n for n in names if n != ref]


def _methods(results: dict[str, Any]) -> list[str]:
    if results.get("methods"):
        return list(results["methods"])
    first = next(iter(results.get("drafters", {}).values()), {})
    return list(first.get("tau", {}))


# -- summary ----------------------------------------------------------------------------------------

MISMATCH_THRESHOLD = 0.02
MISMATCH_MEANING = ("the cached completions are not what this target predicts greedily (serving engine vs Hugging "
                    "Face numerics, or completions from another model or kernels); tau is scored against g, the "
                    "target's own argmax, so it stays right, but the drafted contexts are off-policy for this target")


def _layers_text(m: dict[str, Any]) -> str:
    facts, prov = m.get("facts") or {}, m.get("provenance") or {}
    layers = prov.get("target_layer_ids", facts.get("layers", "-"))
    if (prov.get("layers_source") or facts.get("layers_source")) == "override":
        return f"{layers} (override; config: {prov.get('config_target_layer_ids', facts.get('config_layer_ids'))})"
    return str(layers)


def summary_rows(results: dict[str, Any], mismatch_threshold: float = MISMATCH_THRESHOLD) -> Rows:
    """Drafters side by side (reference first); tau per method as macro [95% CI] and the ratio to the
    reference, micro, SpecForge's simulated_acc_len (labelled), pos1_acc, streak, all-anchor tau
    (diagnostic), rounds/dropped, g-vs-x (flagged above `mismatch_threshold`), facts."""
    names = drafter_order(results)
    ref_name = results.get("reference")
    drafters = results["drafters"]
    ref = drafters.get(ref_name, {})
    headers = ["metric"] + [f"{n} (reference)" if n == ref_name else n for n in names]
    rows: list[list[str]] = []
    styles: list[str] = []

    def add(label: str, cell, style: str = "") -> None:
        rows.append([label] + [cell(n, drafters[n]) for n in names])
        styles.append(style)

    for method in _methods(results):
        def macro(n: str, m: dict[str, Any], method: str = method) -> str:
            t = m["tau"].get(method) or {}
            ci = t.get("ci95")
            text = _num(t.get("macro")) + (f" [{_num(ci[0])}, {_num(ci[1])}]" if ci else "")
            if n != ref_name:
                ref_t = (ref.get("tau") or {}).get(method) or {}
                text += f"  {ratio_text(t.get('macro'), ref_t.get('macro'))}"
            return text

        add(f"tau {method} (macro [95% CI])", macro, "bold" if method == "vanilla" else "")
        add(f"tau {method} (micro)", lambda n, m, method=method: _num((m["tau"].get(method) or {}).get("micro")))
    add("simulated_acc_len (SpecForge: teacher-forced, no bonus; not tau)",
        lambda n, m: _num(m.get("simulated_acc_len")), "dim")
    add("pos1_acc", lambda n, m: _pct(m.get("pos1_acc")))
    add("streak (tau vanilla - 1)", lambda n, m: _num(m.get("streak")))
    add("tau all anchors (diagnostic, not the papers' tau)", lambda n, m: _num(m.get("tau_all_anchor")), "dim")
    add("rounds / dropped tail (vanilla)", lambda n, m: "{} / {}".format(
        (m["tau"].get("vanilla") or {}).get("rounds", "-"), (m["tau"].get("vanilla") or {}).get("dropped", "-")), "dim")
    flagged = any((drafters[n].get("g_x_mismatch") or 0) > mismatch_threshold for n in names)
    add(f"g != x (serving vs HF argmax; flagged > {100 * mismatch_threshold:g}%)",
        lambda n, m: _pct(m.get("g_x_mismatch")) + (" (!)" if (m.get("g_x_mismatch") or 0) > mismatch_threshold else ""),
        "yellow" if flagged else "dim")
    add("prompts", lambda n, m: str(m.get("prompts", "-")), "dim")
    add("target layers", lambda n, m: _layers_text(m), "dim")
    add("block size", lambda n, m: str((m.get("facts") or {}).get("block_size", m.get("block_size", "-"))), "dim")
    add("fc width (layers)", lambda n, m: str((m.get("facts") or {}).get("fc_width", "-")), "dim")
    return headers, rows, styles


def summary_table(results: dict[str, Any]) -> Table:
    """The summary as a rich Table."""
    ref = results.get("reference")
    title = f"Drafter evaluation (ratios against {ref})" if ref else "Drafter evaluation"
    return _rich(summary_rows(results), title, fold=0)


# -- per prompt -------------------------------------------------------------------------------------

def per_prompt_rows(results: dict[str, Any], methods: list[str] | None = None) -> Rows:
    """One row per prompt: tokens, then per drafter tau for each method and pos1_acc."""
    names = drafter_order(results)
    methods = methods or ["vanilla", *[m for m in _methods(results) if m.startswith("ddtree")][-1:]]
    drafters = results["drafters"]
    headers = ["prompt", "tokens"]
    for n in names:
        headers += [f"{n} tau {m}" for m in methods] + [f"{n} pos1"]
    prompt_ids: list[str] = []
    for n in names:
        for pid in drafters[n].get("per_prompt", {}):
            if pid not in prompt_ids:
                prompt_ids.append(pid)
    rows = []
    for pid in prompt_ids:
        first = next((drafters[n]["per_prompt"][pid] for n in names if pid in drafters[n].get("per_prompt", {})), {})
        row = [pid, f"{first.get('prompt_len', '?')}+{(first.get('num_tokens') or 0) - (first.get('prompt_len') or 0)}"]
        for n in names:
            rec = drafters[n].get("per_prompt", {}).get(pid, {})
            row += [_num(((rec.get("tau") or {}).get(m) or {}).get("macro")) for m in methods]
            row.append(_pct(rec.get("pos1_acc")))
        rows.append(row)
    return headers, rows, [""] * len(rows)


def per_prompt_table(results: dict[str, Any]) -> Table:
    """Per-prompt figures as a rich Table (tokens shown as prompt+completion)."""
    return _rich(per_prompt_rows(results), "Per prompt")


# -- per-position acceptance chart ------------------------------------------------------------------

def bar(value: float, width: int = BAR_WIDTH) -> str:
    """A horizontal bar of `value` in [0, 1] with eighth-block resolution."""
    value = min(max(value, 0.0), 1.0)
    eighths = int(round(value * width * 8))
    full, rest = divmod(eighths, 8)
    return ("█" * full + (_EIGHTHS[rest] if rest else "")).ljust(width)


def acceptance_lines(results: dict[str, Any], width: int = BAR_WIDTH) -> list[tuple[str, str]]:
    """(text, style) lines of the chart: per drafter, per slot j, the share of rounds with r >= j."""
    lines: list[tuple[str, str]] = []
    for n in drafter_order(results):
        curve = results["drafters"][n].get("per_position") or []
        lines.append((f"{n}: share of vanilla rounds accepting at least j slots", "bold"))
        for j, share in enumerate(curve, start=1):
            shown = "-" if share is None else f"{100 * share:5.1f}%"
            lines.append((f"  j={j:<3d}{bar(share or 0.0, width)} {shown}", "green"))
    return lines


def acceptance_chart(results: dict[str, Any], width: int = BAR_WIDTH) -> Group:
    """Per-position acceptance drawn as unicode bars, one block per drafter."""
    return Group(*[Text(text, style=style) for text, style in acceptance_lines(results, width)])


# -- hidden-state parity ----------------------------------------------------------------------------

def parity_rows(parity: dict[str, Any], cosine_floor: float = 0.999) -> Rows:
    """Per layer: mean |d|, max |d|, relative error, cosine (float64, 12 digits), argmax agreement.

    Rows with a cosine under `cosine_floor` are flagged yellow.
    """
    headers = ["layer", "mean |d|", "max |d|", "rel err", "cosine (float64)", "argmax agree"]
    rows, styles = [], []
    for rec in parity.get("layers", []):
        cos = rec.get("cosine")
        rows.append([
            str(rec.get("layer")),
            "-" if rec.get("mean_abs") is None else f"{rec['mean_abs']:.3e}",
            "-" if rec.get("max_abs") is None else f"{rec['max_abs']:.3e}",
            "-" if rec.get("rel_err") is None else f"{rec['rel_err']:.3e}",
            "-" if cos is None else f"{cos:.12f}",
            "",  # argmax (g) is one figure for the whole output: the row below
        ])
        styles.append("yellow" if cos is not None and cos < cosine_floor else "")
    # remote.parity writes `argmax_agreement` (g from the last layer, all positions of all prompts).
    agreement = parity.get("argmax_agreement")
    tokens = parity.get("tokens")
    rows.append([f"argmax g, whole output ({tokens} positions)" if tokens else "argmax g, whole output",
                 "", "", "", "", _pct(agreement)])
    styles.append("yellow" if agreement is not None and agreement < 1.0 else "")
    return headers, rows, styles


def parity_table(parity: dict[str, Any]) -> Table:
    """Hidden-state parity (fast kernels vs torch path) per layer."""
    return _rich(parity_rows(parity), "Hidden-state parity per layer")


# -- soundness, provenance, histogram, warnings ------------------------------------------------------

SOUNDNESS_HEADERS = ["layer", "NaN / Inf", "zeros", "norm p1", "norm p50", "norm p99", "all-zero rows",
                     "constant rows", "flag"]


def _soundness_cells(rec: dict[str, Any]) -> list[str]:
    def g(key: str) -> str:
        value = rec.get(key)
        return "-" if value is None else f"{value:.4g}"

    return [f"{rec.get('nan', '-')} / {rec.get('inf', '-')}", _pct(rec.get("zero_share")), g("norm_p1"), g("norm_p50"),
            g("norm_p99"), str(rec.get("zero_rows", "-")), str(rec.get("constant_rows", "-")),
            ("UNSOUND: " + "; ".join(rec.get("reasons") or [])) if rec.get("flagged") else "ok"]


def soundness_rows(soundness: dict[str, Any] | None) -> Rows:
    """Per extracted layer (EVAL-SPEC 6): NaN/Inf, share of exact zeros, per-token L2 norm p1/p50/p99,
    all-zero and constant rows, the flag (red)."""
    rows, styles = [], []
    for rec in (soundness or {}).get("layers", []):
        rows.append([str(rec.get("layer")), *_soundness_cells(rec)])
        styles.append("bold red" if rec.get("flagged") else "")
    return SOUNDNESS_HEADERS, rows, styles


def soundness_table(soundness: dict[str, Any] | None, title: str = "Feature soundness per extracted layer") -> Table:
    return _rich(soundness_rows(soundness), title)


def parity_soundness_rows(parity: dict[str, Any]) -> Rows:
    """The same statistics for both runs of a parity comparison, side by side per layer."""
    sides = parity.get("soundness") or {}
    rows, styles = [], []
    by_side = {side: {r.get("layer"): r for r in (sides.get(side) or {}).get("layers", [])} for side in ("a", "b")}
    layers = list(dict.fromkeys([*by_side["a"], *by_side["b"]]))
    for k in layers:
        for side in ("a", "b"):
            rec = by_side[side].get(k)
            if rec is None:
                continue
            policy = (parity.get(side) or {}).get("policy")
            rows.append([f"{k} ({side}{', ' + policy if policy else ''})", *_soundness_cells(rec)])
            styles.append("bold red" if rec.get("flagged") else "")
    return SOUNDNESS_HEADERS, rows, styles


def parity_soundness_table(parity: dict[str, Any]) -> Table:
    return _rich(parity_soundness_rows(parity), "Feature soundness of both parity runs")


def provenance_rows(results: dict[str, Any]) -> Rows:
    """Per drafter where its numbers come from: target_layer_ids (and whether overridden), fc input
    width (from the weights), block size, mask token, hidden size, the extracted layers it reads."""
    headers = ["drafter", "target_layer_ids", "source", "fc width", "block", "mask token", "hidden",
               "reads (extraction index)", "weights checked"]
    rows, styles = [], []
    for n in drafter_order(results):
        m = results["drafters"][n]
        p = m.get("provenance") or {}
        facts = m.get("facts") or {}
        source = p.get("layers_source") or facts.get("layers_source") or "-"
        if source == "override":
            source = f"override (config: {p.get('config_target_layer_ids', facts.get('config_layer_ids'))})"
        reads = p.get("reads")
        rows.append([
            n, str(p.get("target_layer_ids", facts.get("layers", "-"))), source,
            str(p.get("fc_width", facts.get("fc_width", "-"))), str(p.get("block_size", facts.get("block_size", "-"))),
            str(p.get("mask_token_id", facts.get("mask_token_id", "-"))),
            str(p.get("hidden_size", facts.get("hidden_size", "-"))),
            ", ".join(f"{r['layer']}@{r['index']}" for r in reads) if reads else "-",
            "yes" if p.get("weights_checked") else "-",
        ])
        styles.append("yellow" if source.startswith("override") else "")
    return headers, rows, styles


def provenance_table(results: dict[str, Any]) -> Table:
    return _rich(provenance_rows(results), "Layer provenance per drafter")


def histogram_lines(results: dict[str, Any], width: int = BAR_WIDTH) -> list[tuple[str, str]]:
    """(text, style) lines: per drafter, z-lab's acceptance-length histogram, the share of vanilla-walk
    rounds that accepted exactly r draft tokens, r = 0..L."""
    lines: list[tuple[str, str]] = []
    for n in drafter_order(results):
        hist = results["drafters"][n].get("acceptance_histogram")
        if not hist:
            continue
        lines.append((f"{n}: share of vanilla rounds accepting exactly r draft tokens (z-lab histogram)", "bold"))
        for r, share in enumerate(hist):
            lines.append((f"  r={r:<3d}{bar(share or 0.0, width)} {100 * (share or 0.0):5.1f}%", "cyan"))
    return lines


def histogram_chart(results: dict[str, Any], width: int = BAR_WIDTH) -> Group:
    return Group(*[Text(text, style=style) for text, style in histogram_lines(results, width)])


def warning_lines(results: dict[str, Any], mismatch_threshold: float = MISMATCH_THRESHOLD) -> list[str]:
    """What an operator must read before trusting the numbers: g-vs-x above the threshold and what it
    means, unsound layers evaluated anyway, overridden layer ids, incomplete generations extracted."""
    out = []
    for n in drafter_order(results):
        m = results["drafters"][n]
        mismatch = m.get("g_x_mismatch")
        if mismatch is not None and mismatch > mismatch_threshold:
            out.append(f"{n}: g != x on {100 * mismatch:.1f}% of completion positions (above "
                       f"{100 * mismatch_threshold:g}%): {MISMATCH_MEANING}.")
        prov = m.get("provenance") or {}
        bad = [r["layer"] for r in prov.get("soundness") or [] if r.get("flagged")]
        if bad:
            out.append(f"{n}: evaluated on layers flagged unsound {bad} (--allow-unsound): its tau is not to be trusted.")
        if (prov.get("layers_source") or (m.get("facts") or {}).get("layers_source")) == "override":
            out.append(f"{n}: target_layer_ids overridden to {prov.get('target_layer_ids')} "
                       f"(config: {prov.get('config_target_layer_ids')}).")
    incomplete = results.get("states_incomplete_allowed") or []
    if incomplete:
        out.append(f"{len(incomplete)} incomplete generations were extracted (--allow-incomplete): "
                   + ", ".join(str(e.get("id")) for e in incomplete) + ".")
    return out


def warnings_block(results: dict[str, Any], mismatch_threshold: float = MISMATCH_THRESHOLD) -> Group:
    return Group(*[Text("! " + line, style="bold yellow") for line in warning_lines(results, mismatch_threshold)])


# -- kernels of two hosts ---------------------------------------------------------------------------

def _kernel_map(probe: dict[str, Any]) -> dict[str, str | None]:
    kernels = probe.get("kernels") or {}
    # remote.probe nests the bound functions under "bound"; a flat {fn: module} is accepted too.
    bound = kernels.get("bound") if isinstance(kernels.get("bound"), dict) else kernels
    return {fn: (mod if isinstance(mod, str) or mod is None else str(mod)) for fn, mod in bound.items()}


def _package_map(probe: dict[str, Any]) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, value in (probe.get("packages") or {}).items():
        if isinstance(value, dict):  # remote.probe: {"importable": bool, "version": str}
            value = (value.get("version") or "installed") if value.get("importable") else None
        out[name] = value
    return out


def _impl(module: str | None, scheme: str | None = None) -> str:
    if is_unknown_scheme(scheme):  # never guessed: what runs there is not known
        return "unknown (binding not read)"
    if module is None:
        return "missing"
    root = module.split(".")[0]
    return f"{root} ({module})" if root in ("fla", "causal_conv1d") else f"torch fallback ({module})"


def kernel_rows(host_a: str, probe_a: dict[str, Any], host_b: str, probe_b: dict[str, Any]) -> Rows:
    """Kernel function and package rows of two hosts; rows that differ are styled red."""
    headers = ["kernel / package", host_a, host_b]
    rows, styles = [], []
    ka, kb = _kernel_map(probe_a), _kernel_map(probe_b)
    for fn in list(dict.fromkeys([*ka, *kb])):
        a = _impl(ka.get(fn), (probe_a.get("kernels") or {}).get("scheme"))
        b = _impl(kb.get(fn), (probe_b.get("kernels") or {}).get("scheme"))
        rows.append([fn, a, b])
        styles.append("bold red" if a.split(" ")[0] != b.split(" ")[0] else "")
    pa, pb = _package_map(probe_a), _package_map(probe_b)
    for name in list(dict.fromkeys([*pa, *pb])):
        a, b = pa.get(name) or "missing", pb.get(name) or "missing"
        rows.append([name, a, b])
        styles.append("bold red" if a != b else "")
    return headers, rows, styles


def kernel_table(host_a: str, probe_a: dict[str, Any], host_b: str, probe_b: dict[str, Any]) -> Table:
    """The two hosts' kernel bindings side by side, asymmetric rows in red."""
    return _rich(kernel_rows(host_a, probe_a, host_b, probe_b), "Kernels on both hosts")


# -- rendering and export ---------------------------------------------------------------------------

LABEL_MIN = 8  # the label column folds down to this width before a table gives way to blocks


def _width(cell: str) -> int:
    return max((cell_len(line) for line in cell.splitlines()), default=0)


class FittedTable(Table):
    """A table of `Rows` that never cuts a value: the first column (the labels) folds, every other
    column keeps its values whole on one line. Where even that does not fit (a narrow terminal, or
    80 columns piped), it is drawn as blocks instead: each row's first value, then `header: value`
    lines (the value on a line of its own where both do not fit), wrapped only between words.
    `fold`: the column of labels or prose that may fold (None: every column holds values, such as
    run ids); `wrap`: columns of phrases (a run's status) that wrap between their words, never
    inside one; `justify`: of the value columns (figures right-aligned, text left)."""

    def __init__(self, rows: Rows, title: str, fold: int | None = None, justify: str = "right",
                 wrap: tuple[int, ...] = ()):
        super().__init__(title=title, title_justify="left", header_style="bold")
        self.rows_shown = rows
        self.fold = fold
        self.wrap = wrap
        headers, body, styles = rows
        for i, h in enumerate(headers):
            if i == fold:
                self.add_column(h, justify="left", overflow="fold", min_width=LABEL_MIN)
            elif i in wrap:  # as narrow as its longest word (or header word)
                words = [w for row in body for w in row[i].split()] + h.split()
                self.add_column(Text(h, no_wrap=False, overflow="fold"), justify="left",
                                min_width=max((cell_len(w) for w in words), default=1))
            else:  # the values whole on one line; a longer header wraps between its words (`squeezed`)
                width = max([_width(row[i]) for row in body] + [cell_len(word) for word in h.split()] or [1])
                self.add_column(Text(h, no_wrap=False, overflow="fold"), justify="left" if i == 0 else justify,
                                no_wrap=True, min_width=width)
        for row, style in zip(body, styles, strict=True):
            # values, not markup: '[service] stop_grace_s' keeps its brackets
            self.add_row(*(escape(cell) for cell in row), style=style or None)

    def squeezed(self) -> Table:
        """This table narrower than its natural width: each value column exactly as wide as its
        values. A copy, so that measuring this one (Textual sizes a widget by it) stays as it was."""
        table = Table.__new__(Table)
        table.__dict__.update(self.__dict__)
        table.columns = [dataclasses.replace(column, max_width=column.min_width) if column.no_wrap else column
                         for column in self.columns]
        return table

    def min_table_width(self) -> int:
        """The narrowest width at which every value stays whole: values, padding and borders, and
        the label column folded to `LABEL_MIN`."""
        widths = [column.min_width or 0 for column in self.columns]
        if self.fold is not None:
            widths[self.fold] = LABEL_MIN
        return sum(widths) + 3 * len(widths) + 1  # one space either side of each cell, the rules between

    def blocks(self, width: int) -> list[RenderableType]:
        """The rows one below the other, for a width the table does not fit."""
        headers, body, styles = self.rows_shown
        lines: list[RenderableType] = [Text(str(self.title), style="bold italic")]
        for row, style in zip(body, styles, strict=True):
            lines.append(Text(row[0], style=f"bold {style}".strip()))
            for header, value in zip(headers[1:], row[1:], strict=True):
                line = f"  {header}: {value}"
                if cell_len(line) > width or "\n" in value:  # on lines of its own, indented, never cut in two
                    lines += [Text(f"  {header}:", style=style), Padding(Text(value, style=style), (0, 0, 0, 4), expand=False)]
                else:
                    lines.append(Text(line, style=style))
        return lines

    def natural_width(self) -> int:
        """The width with nothing folded: every label and header on one line."""
        headers, body, _ = self.rows_shown
        widths = [max([_width(row[i]) for row in body] + [cell_len(h)]) for i, h in enumerate(headers)]
        return sum(widths) + 3 * len(widths) + 1

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        if self.min_table_width() > options.max_width:
            yield from self.blocks(options.max_width)
            return
        if self.natural_width() > options.max_width:
            yield from self.squeezed().__rich_console__(console, options)
        else:
            yield from super().__rich_console__(console, options)


def _rich(rows: Rows, title: str, fold: int | None = None) -> Table:
    """`fold=0`: the first column holds labels (the summary's metrics), not values (prompt ids,
    drafter names, layers, kernel functions), and may fold."""
    return FittedTable(rows, title, fold=fold)


def markdown_table(rows: Rows) -> str:
    """A Markdown pipe table of the same rows (asymmetric/flagged rows marked with a trailing '!')."""
    headers, body, styles = rows

    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in headers) + " |", "|" + "---|" * len(headers)]
    for row, style in zip(body, styles, strict=True):
        flagged = "red" in style or "yellow" in style
        cells = [esc(c) for c in row]
        if flagged:
            cells[0] += " (!)"
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def results_markdown(results: dict[str, Any], parity: dict[str, Any] | None = None,
                     probes: tuple[str, dict, str, dict] | None = None) -> str:
    """The whole report as Markdown: summary, per prompt, acceptance chart, and parity / kernels if given."""
    parts = ["# Drafter evaluation", ""]
    if results.get("reference"):
        parts += [f"Reference drafter: `{results['reference']}`; ratios are drafter / reference.", ""]
    warnings = warning_lines(results)
    if warnings:
        parts += ["## Warnings", "", *[f"- {w}" for w in warnings], ""]
    parts += ["## Summary", "", markdown_table(summary_rows(results)), "",
              "## Layer provenance", "", markdown_table(provenance_rows(results)), "",
              "## Per prompt", "", markdown_table(per_prompt_rows(results)), "",
              "## Per-position acceptance (vanilla walk)", "", "```",
              *[text for text, _ in acceptance_lines(results)], "```", ""]
    if any(results["drafters"][n].get("acceptance_histogram") for n in results["drafters"]):
        parts += ["## Acceptance-length histogram (z-lab; vanilla walk)", "", "```",
                  *[text for text, _ in histogram_lines(results)], "```", ""]
    if results.get("soundness"):
        parts += ["## Feature soundness per extracted layer", "", markdown_table(soundness_rows(results["soundness"])), ""]
    if parity:
        parts += ["## Hidden-state parity", "", markdown_table(parity_rows(parity)), ""]
        if parity.get("soundness"):
            parts += ["### Soundness of both runs", "", markdown_table(parity_soundness_rows(parity)), ""]
    if probes:
        parts += ["## Kernels", "", markdown_table(kernel_rows(*probes)), ""]
    return "\n".join(parts)


def export_markdown(results: dict[str, Any], path: str | os.PathLike, parity: dict[str, Any] | None = None,
                    probes: tuple[str, dict, str, dict] | None = None) -> Path:
    """Write the Markdown report atomically; return its path."""
    path = Path(path)
    with atomic_path(path) as tmp:
        tmp.write_text(results_markdown(results, parity, probes), encoding="utf-8")
    return path


def export_json(results: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write the results dict as JSON atomically; return its path."""
    return write_json_atomic(path, results)
