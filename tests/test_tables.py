"""Result tables rendered to text (rich Console, record=True, width 120) and exported as Markdown/JSON."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console

from console.views.tables import (
    acceptance_chart,
    bar,
    export_json,
    export_markdown,
    kernel_rows,
    kernel_table,
    parity_table,
    per_prompt_table,
    ratio_text,
    summary_table,
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
    console = Console(record=True, width=120)
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


def test_parity_table_digits() -> None:
    parity = {"layers": [{"layer": 1, "mean_abs": 0.0012, "max_abs": 0.25, "rel_err": 0.003,
                          "cosine": 0.9997512345678, "argmax_agree": 0.995},
                         {"layer": 23, "mean_abs": 0.0, "max_abs": 0.0, "rel_err": 0.0,
                          "cosine": 1.0000000000000004, "argmax_agree": 1.0}]}
    text = render(parity_table(parity))
    assert "0.999751234568" in text and "1.000000000000" in text and "99.5%" in text and "2.500e-01" in text


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
                         parity={"layers": [{"layer": 1, "cosine": 0.9, "mean_abs": 1, "max_abs": 2, "rel_err": 3,
                                             "argmax_agree": 0.5}]})
    text = md.read_text()
    assert "| tau vanilla (macro [95% CI]) |" in text and "0.24x" in text and "## Hidden-state parity" in text
    assert "| 1 (!) |" in text  # a low cosine is flagged in Markdown too
    js = export_json(RESULTS, tmp_path / "report.json")
    assert json.loads(js.read_text()) == RESULTS
    assert not list(tmp_path.glob("*.partial"))
