"""Feature soundness of extracted hidden states, per layer (EVAL-SPEC 6).

A serving engine once returned all-zero hidden states for hybrid targets; drafters trained on them
reach ~0% acceptance, and nothing downstream fails loudly. Per extracted layer the extraction
manifest records: NaN / Inf counts, the share of exact zeros, per-token L2 norm percentiles
(p1 / p50 / p99) and the rows (tokens) that are all zero or constant; a layer with any non-finite
value, all-zero or constant row is flagged, and the evaluator refuses a flagged layer unless told.

The statistics are computed from the saved bf16 states (what the evaluator reads), a few reductions
per prompt and layer, after the target has left the GPU: none of it is inside the downtime window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HOW = "from the saved bf16 states, after gpu_released"


class SoundnessError(ValueError):
    """A layer whose statistics are flagged; the message names the layer and why."""


class Accumulator:
    """Running per-layer counts over prompts; `result()` gives the manifest's `soundness` entry."""

    def __init__(self, layers: list[int]):
        self.layers = list(layers)
        self._counts = {k: {"tokens": 0, "elements": 0, "nan": 0, "inf": 0, "zeros": 0, "zero_rows": 0,
                            "constant_rows": 0} for k in self.layers}
        self._norms: dict[int, list[Any]] = {k: [] for k in self.layers}

    def add(self, hidden: Any) -> None:
        """One prompt's `hidden` [T, n_layers, H] (layer order as `layers`)."""
        import torch

        if hidden.dim() != 3 or hidden.shape[1] != len(self.layers):
            raise ValueError(f"hidden has shape {list(hidden.shape)}, expected [T, {len(self.layers)}, H]")
        for i, k in enumerate(self.layers):
            x = hidden[:, i].float()
            c = self._counts[k]
            finite = torch.isfinite(x)
            c["tokens"] += x.shape[0]
            c["elements"] += x.numel()
            c["nan"] += int(x.isnan().sum())
            c["inf"] += int(x.isinf().sum())
            zero = x == 0
            c["zeros"] += int(zero.sum())
            c["zero_rows"] += int(zero.all(-1).sum())
            c["constant_rows"] += int(((x.amax(-1) == x.amin(-1)) & ~zero.all(-1)).sum())
            self._norms[k].append(torch.where(finite, x, 0.0).norm(dim=-1))

    def result(self) -> dict[str, Any]:
        import torch

        rows = []
        for k in self.layers:
            c = self._counts[k]
            norms = torch.cat(self._norms[k]).sort().values if self._norms[k] else torch.zeros(0)

            def pct(q: float, norms: Any = norms) -> float | None:
                if norms.numel() == 0:
                    return None
                return float(norms[min(norms.numel() - 1, max(0, round(q * (norms.numel() - 1))))])

            reasons = []
            if c["nan"] or c["inf"]:
                reasons.append(f"{c['nan']} NaN and {c['inf']} Inf values")
            if c["zero_rows"]:
                reasons.append(f"{c['zero_rows']} of {c['tokens']} tokens all zero")
            if c["constant_rows"]:
                reasons.append(f"{c['constant_rows']} of {c['tokens']} tokens constant")
            rows.append({
                "layer": k, "tokens": c["tokens"], "nan": c["nan"], "inf": c["inf"],
                "zero_share": c["zeros"] / c["elements"] if c["elements"] else None,
                "norm_p1": pct(0.01), "norm_p50": pct(0.50), "norm_p99": pct(0.99),
                "zero_rows": c["zero_rows"], "constant_rows": c["constant_rows"],
                "flagged": bool(reasons), "reasons": reasons,
            })
        return {"layers": rows, "flagged": [r["layer"] for r in rows if r["flagged"]], "computed": HOW}


def of_files(directory: str | Path, names: list[str], layers: list[int]) -> dict[str, Any]:
    """Soundness of an extraction's prompt files (their `hidden` tensors), read one at a time."""
    from safetensors import safe_open

    acc = Accumulator(layers)
    for name in names:
        with safe_open(str(Path(directory) / name), "pt") as fh:
            acc.add(fh.get_tensor("hidden"))
    return acc.result()


def rows_for(soundness: dict[str, Any] | None, layers: list[int]) -> list[dict[str, Any]]:
    """The statistics rows of `layers` (in that order) from a manifest's `soundness` entry."""
    by_layer = {r.get("layer"): r for r in (soundness or {}).get("layers", [])}
    return [by_layer[k] for k in layers if k in by_layer]


def check_layers(soundness: dict[str, Any] | None, layers: list[int], who: str, where: str) -> None:
    """Raise SoundnessError when any of `layers` is flagged, naming the layer, why, and the way past."""
    bad = [r for r in rows_for(soundness, layers) if r.get("flagged")]
    if bad:
        first = bad[0]
        more = f" (and layers {[r['layer'] for r in bad[1:]]})" if len(bad) > 1 else ""
        raise SoundnessError(f"{who} reads layer {first['layer']} of {where}, flagged unsound: "
                             f"{'; '.join(first.get('reasons') or ['flagged'])}{more}; "
                             "refused (--allow-unsound to evaluate anyway)")
