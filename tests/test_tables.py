"""Result tables rendered to text (rich Console, record=True, width 120) and exported as Markdown/JSON."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from console.views.tables import (
    acceptance_chart,
    bar,
    export_json,
    export_markdown,
    histogram_chart,
    kernel_rows,
    kernel_table,
    parity_rows,
    parity_soundness_rows,
    parity_soundness_table,
    parity_table,
    per_prompt_table,
    provenance_rows,
    provenance_table,
    ratio_text,
    soundness_rows,
    soundness_table,
    summary_table,
    warning_lines,
)


def _drafter(tau: float, pos1: float, per_position: list[float]) -> dict:
    methods = {"vanilla": tau, "ddtree-b8": min(tau + 0.5, 9.0), "top8": tau + 1.0}
    tau_block = {m: {"macro": v, "micro": v - 0.1, "ci95": [v - 0.3, v + 0.3], "rounds": 100, "dropped": 7}
                 for m, v in methods.items()}
    prompt = {"prompt_len": 120, "num_tokens": 900, "pos1_acc": pos1, "per_position": per_position,
              "tau": {m: {"macro": v, "micro": v, "ci95": None, "rounds": 50, "dropped": 3} for m, v in methods.items()}}
    return {"block_size": 16, "prompts": 2, "pos1_acc": pos1, "per_position": per_position, "tau_all_anchor": tau + 0.2,
            "tau": tau_block, "streak": tau - 1, "g_x_mismatch": 0.012,
            "per_prompt": {"fizzbuzz": prompt, "lru_cache": prompt},
            "facts": {"layers": [1, 13, 25, 37, 49], "block_size": 16, "fc_width": 5}}


RESULTS = {
    "reference": "zlab",
    "methods": ["vanilla", "ddtree-b8", "top8"],
    "drafters": {"ours-step4000": _drafter(1.5, 0.31, [0.3, 0.1, 0.05]),
                 "zlab": _drafter(6.25, 0.88, [0.88, 0.75, 0.5])},
}


def render(renderable) -> str:
    return render_at(renderable, 120)


def render_at(renderable, width: int) -> str:
    console = Console(record=True, width=width)
    console.print(renderable)
    return console.export_text()


def test_summary_side_by_side_with_ratio() -> None:
    text = render(summary_table(RESULTS))
    assert "zlab (reference)" in text and "ours-step4000" in text
    assert text.index("zlab (reference)") < text.index("ours-step4000")  # reference first
    assert "0.24x" in text  # 1.5 / 6.25
    assert "1.50 [1.20, 1.80]" in text
    for label in ("tau vanilla (macro [95% CI])", "tau ddtree-b8 (macro", "tau top8 (micro)", "pos1_acc",
                  "streak", "diagnostic", "fc width"):
        assert label in text
    assert "DDTree-8" not in text
    assert ratio_text(3.0, 0) == "-" and ratio_text(None, 2.0) == "-"


def test_per_prompt_and_chart() -> None:
    text = render(per_prompt_table(RESULTS))
    assert "fizzbuzz" in text and "lru_cache" in text and "120+780" in text
    chart = render(acceptance_chart(RESULTS, width=20))
    assert "j=1" in chart and "j=3" in chart and "88.0%" in chart and "5.0%" in chart
    assert bar(0.5, 8) == "████    " and bar(1 / 16, 2) == "▏ " and bar(1.2, 4) == "████"


def _real_parity(root: Path, flip_g: bool = False, zero_layer: bool = False) -> dict:
    """A comparison made by the real producer (remote.parity.compare_dirs) of two real extraction
    directories (remote.drill.synthetic), layer 2 differing; optionally g differing on a few positions
    and side b's layer 2 all zero (flagged unsound)."""
    import torch

    from remote.drill.synthetic import random_sequences, write_extraction
    from remote.parity import compare_dirs

    seqs = random_sequences(2, 8, 20, 32, seed=1)
    hidden = [torch.randn(20, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    a = write_extraction(root / "a", [{**s, "hidden": h} for s, h in zip(seqs, hidden, strict=True)], [1, 2], 16)
    other = []
    for s, h in zip(seqs, hidden, strict=True):
        h = h.clone()
        h[:, 1] = 0.0 if zero_layer else h[:, 1] * 1.001
        g = s["g"].clone()
        if flip_g:
            g[:4] = (g[:4] + 1) % 32
        other.append({**s, "g": g, "hidden": h})
    b = write_extraction(root / "b", other, [1, 2], 16)
    return compare_dirs(a, b)


def test_parity_table_digits_and_the_argmax_row(tmp_path: Path) -> None:
    parity = _real_parity(tmp_path, flip_g=True)
    assert "argmax_agreement" in parity and all("argmax_agree" not in rec for rec in parity["layers"])
    text = render(parity_table(parity))
    assert "1.000000000000" in text and "argmax g, whole output (40 positions)" in text
    assert parity["argmax_agreement"] == 32 / 40 and "80.0%" in text
    headers, rows, styles = parity_rows(parity)
    assert rows[-1][-1] == "80.0%" and styles[-1] == "yellow"  # 4 positions of each prompt disagree
    assert rows[0][-1] == ""  # g is one figure for the whole output, not per layer


def test_parity_soundness_of_both_runs(tmp_path: Path) -> None:
    parity = _real_parity(tmp_path, zero_layer=True)
    headers, rows, styles = parity_soundness_rows(parity)
    assert [r[0] for r in rows] == ["1 (a)", "1 (b)", "2 (a)", "2 (b)"]
    assert styles == ["", "", "", "bold red"] and rows[3][-1].startswith("UNSOUND: 40 of 40 tokens all zero")
    assert "Feature soundness of both parity runs" in render(parity_soundness_table(parity))


def test_soundness_provenance_histogram_and_warnings() -> None:
    results = json.loads(json.dumps(RESULTS))
    d = results["drafters"]["ours-step4000"]
    d["acceptance_histogram"] = [0.5, 0.25, 0.25, 0.0]
    d["simulated_acc_len"] = 1.2345
    d["g_x_mismatch"] = 0.05
    d["provenance"] = {"target_layer_ids": [1, 2], "layers_source": "override", "config_target_layer_ids": None,
                       "fc_width": 2, "block_size": 4, "mask_token_id": 9, "hidden_size": 16,
                       "reads": [{"layer": 1, "index": 0}, {"layer": 2, "index": 1}], "weights_checked": True,
                       "soundness": [{"layer": 2, "flagged": True}]}
    results["soundness"] = {"layers": [{"layer": 1, "nan": 0, "inf": 0, "zero_share": 0.0, "norm_p1": 1.0,
                                        "norm_p50": 2.0, "norm_p99": 3.0, "zero_rows": 0, "constant_rows": 0,
                                        "flagged": False, "reasons": []},
                                       {"layer": 2, "nan": 0, "inf": 0, "zero_share": 1.0, "norm_p1": 0.0,
                                        "norm_p50": 0.0, "norm_p99": 0.0, "zero_rows": 5, "constant_rows": 0,
                                        "flagged": True, "reasons": ["5 of 5 tokens all zero"]}]}
    text = render_at(summary_table(results), 200)  # wide enough for the labels too (narrower, they fold)
    assert "simulated_acc_len (SpecForge: teacher-forced, no bonus; not tau)" in text and "1.23" in text
    assert "5.0% (!)" in text and "1.2%" in text and "1.2% (!)" not in text
    assert "[1, 2] (override; config:" in text
    chart = render(histogram_chart(results, width=8))
    assert "r=0  ████      50.0%" in chart and "r=3" in chart and "zlab" not in chart  # zlab has no histogram
    assert "Layer provenance per drafter" in render(provenance_table(results))
    headers, rows, styles = provenance_rows(results)
    ours = rows[[r[0] for r in rows].index("ours-step4000")]
    assert ours[1:4] == ["[1, 2]", "override (config: None)", "2"] and ours[7] == "1@0, 2@1"
    assert styles[[r[0] for r in rows].index("ours-step4000")] == "yellow"
    sound = render(soundness_table(results["soundness"]))
    assert "Feature soundness per extracted layer" in sound and "100.0%" in sound and "UNSOUND" in sound
    headers, rows, styles = soundness_rows(results["soundness"])
    assert rows[1][-1] == "UNSOUND: 5 of 5 tokens all zero" and styles == ["", "bold red"] and rows[0][-1] == "ok"
    warnings = warning_lines(results)
    assert any("5.0% of completion positions (above 2%)" in w and "off-policy" in w for w in warnings)
    assert any("flagged unsound [2]" in w for w in warnings) and any("overridden" in w for w in warnings)
    assert warning_lines(RESULTS) == []  # 1.2% is under the threshold
    assert len(warning_lines(results, mismatch_threshold=0.1)) == 2


def test_kernel_asymmetry_is_red() -> None:
    fast = {"kernels": {"bound": {"causal_conv1d_fn": "causal_conv1d.cpp_functions",
                                  "torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk"}},
            "packages": {"causal_conv1d": {"importable": True, "version": "1.5.2"}, "fla": "0.3.1"}}
    slow = {"kernels": {"causal_conv1d_fn": "transformers.models.qwen3_5.modeling_qwen3_5",
                        "torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk"},
            "packages": {"causal_conv1d": None, "fla": "0.3.1"}}
    headers, rows, styles = kernel_rows("ct129", fast, "ct200", slow)
    by_name = dict(zip([r[0] for r in rows], styles, strict=True))
    assert by_name["causal_conv1d_fn"] == "bold red" and by_name["causal_conv1d"] == "bold red"
    assert by_name["torch_chunk_gated_delta_rule"] == "" and by_name["fla"] == ""
    text = render(kernel_table("ct129", fast, "ct200", slow))
    assert "torch fallback" in text and "missing" in text and "ct200" in text


def test_exports_beside_the_run(tmp_path: Path) -> None:
    md = export_markdown(RESULTS, tmp_path / "report.md",
                         parity={"layers": [{"layer": 1, "cosine": 0.9, "mean_abs": 1, "max_abs": 2, "rel_err": 3}],
                                 "argmax_agreement": 0.5, "tokens": 10})
    text = md.read_text()
    assert "| tau vanilla (macro [95% CI]) |" in text and "0.24x" in text and "## Hidden-state parity" in text
    assert "| 1 (!) |" in text  # a low cosine is flagged in Markdown too
    js = export_json(RESULTS, tmp_path / "report.json")
    assert json.loads(js.read_text()) == RESULTS
    assert not list(tmp_path.glob("*.partial"))


# -- narrow terminals and pipes: labels fold, values never cut ---------------------------------------

drafter_names = st.from_regex(r"[a-z][a-z0-9_.-]{0,27}", fullmatch=True)


@settings(max_examples=60, deadline=None)
@given(names=st.lists(drafter_names, min_size=1, max_size=4, unique=True),
       taus=st.lists(st.floats(1.0, 16.0), min_size=4, max_size=4), width=st.sampled_from([40, 80, 120]))
@example(names=["b00000000000000", "a", "b", "a0"], taus=[1.0] * 4, width=120)  # headers wider than their values
@example(names=["a000000000000000"], taus=[1.0] * 4, width=40)
def test_summary_never_cuts_a_drafter_name_or_a_tau(names: list[str], taus: list[float], width: int) -> None:
    """At 40, 80 and 120 columns every drafter's name and its vanilla tau (macro [95% CI] and the ratio)
    stand whole on one line: the table folds its labels, or gives way to one block per metric."""
    results = {"reference": names[0], "methods": ["vanilla", "ddtree-b8", "top8"],
               "drafters": {n: _drafter(t, 0.5, [0.5]) for n, t in zip(names, taus, strict=False)}}
    text = render_at(summary_table(results), width)
    lines = text.splitlines()
    assert all(len(line.rstrip()) <= width for line in lines)
    for name in names:
        assert any(name in line for line in lines), name
        tau = results["drafters"][name]["tau"]["vanilla"]
        shown = f"{tau['macro']:.2f} [{tau['ci95'][0]:.2f}, {tau['ci95'][1]:.2f}]"
        if name != names[0]:
            shown += f"  {ratio_text(tau['macro'], results['drafters'][names[0]]['tau']['vanilla']['macro'])}"
        assert any(shown in line for line in lines), (shown, text)
    assert "…" not in text
    provenance = render_at(provenance_table(results), width)  # where a squeezed table lost its first column
    assert all(any(name in line for line in provenance.splitlines()) for name in names), provenance
    assert "…" not in provenance


def test_a_table_that_fits_folds_only_its_labels() -> None:
    text = render_at(summary_table(RESULTS), 80)
    assert "┃ metric" in text  # still a table at 80 columns
    assert "1.50 [1.20, 1.80]  0.24x" in text and "simulated_acc_len" in text
    assert "(SpecForge: teacher-forced," in text  # the label folded onto a second line, the values whole


def test_a_value_in_brackets_is_shown_not_taken_for_markup() -> None:
    """The walk's Window tab read `the stop's grace ( stop_grace_s)`: rich took `[service]` for a
    style tag and dropped it. A table's cells are values, never markup."""
    from console.views.report import window_table

    basis = "estimate: the stop's grace ([service] stop_grace_s); [bold]not a style[/bold]"
    text = render_at(window_table([["stop", "2.0 s", "2.7 s", "-26%", basis]]), 200)
    assert basis in text
