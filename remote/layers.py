"""Decoder layers: found by walking the module tree, chosen from drafter configs, captured by hooks.

Layer id k means Hugging Face `hidden_states[k+1]` (EVAL-SPEC section 1): the output of decoder
layer k, which a forward hook on `layers[k]` gives for every layer but the last. Hugging Face applies
the final norm to its last entry, and z-lab's training reads that entry, so the extractor replaces the
last layer's hook output with the normed final hidden state (see `remote.extract.forward_one`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remote.events import WorkerError


def find_decoder_layers(model: Any) -> tuple[str, Any]:
    """Return (dotted path, ModuleList) of the text decoder layers of `model`.

    The candidates are ModuleLists whose children all share one class named `*DecoderLayer`; the
    longest wins (a vision tower's blocks are not decoder layers). Works for `Qwen3_5ForCausalLM`
    (`model.layers`), `Qwen3_5ForConditionalGeneration` (`model.language_model.layers`) and others.
    """
    import torch

    best: tuple[str, Any] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        classes = {type(child).__name__ for child in module}
        if len(classes) == 1 and next(iter(classes)).endswith("DecoderLayer") and (
            best is None or len(module) > len(best[1])
        ):
            best = (name, module)
    if best is None:
        raise WorkerError(f"no decoder layers found in {type(model).__name__} (no ModuleList of *DecoderLayer)")
    return best


def is_linear_attention(layer: Any) -> bool:
    """A layer is linear attention (Gated DeltaNet) iff it has a `linear_attn` child."""
    return hasattr(layer, "linear_attn")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text part of a (possibly multimodal) config.json dict."""
    return config.get("text_config") or config


def default_target_layers(num_target_layers: int, n: int) -> list[int]:
    """EVAL-SPEC 1: round(1 + i*(T-4)/(n-1)) for i in 0..n-1, or [T//2] when n = 1."""
    if n == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (n - 1)) for i in range(n)]


class LayerIdsError(ValueError):
    """Layer ids that cannot be used; the message names the field and where."""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_layer_ids(value: Any, label: str, where: str) -> list[int]:
    """A list of distinct non-negative integer layer ids, or LayerIdsError naming `label` and `where`."""
    if not isinstance(value, list) or not value or not all(_is_int(k) for k in value):
        raise LayerIdsError(f"{where}: field {label!r}: expected a non-empty list of integer layer ids, "
                           f"found {json.dumps(value)[:80]}")
    negative = [k for k in value if k < 0]
    if negative:
        raise LayerIdsError(f"{where}: field {label!r}: layer ids must be >= 0, found {negative} in {value}")
    repeated = sorted({k for k in value if value.count(k) > 1})
    if repeated:
        raise LayerIdsError(f"{where}: field {label!r}: layer {', '.join(map(str, repeated))} repeated in {value} "
                           "(each target layer may feed the fc once)")
    return list(value)


def missing_layer_ids_message(cfg_path: Path, num_target_layers: Any, num_layers: Any, fc_layers: int | None,
                              name: str | None = None) -> str:
    """The refusal of a checkpoint without target_layer_ids: the spacing formula offered only as a guess."""
    guesses = []
    counts = [n for n in (num_layers, fc_layers) if _is_int(n) and n >= 1]
    if _is_int(num_target_layers) and num_target_layers >= 1:
        for n in dict.fromkeys(counts):
            which = "fc width" if n == fc_layers and n != num_layers else "drafter layers"
            guesses.append(f"{default_target_layers(num_target_layers, n)} for {n} {which}")
    guess = (f"the spacing formula would guess {' or '.join(guesses)} of a {num_target_layers}-layer target, "
             "only a guess (it disagreed with the trained layers for 14 of 20 published checkpoints)"
             if guesses else "no num_target_layers to even guess from")
    label = name or cfg_path.parent.name
    return (f"{cfg_path}: field 'dflash_config.target_layer_ids' is missing and required (z-lab/dflash PR #157); "
            f"{guess}; give the trained ids explicitly: [[drafters]] layers = [...] "
            f"(--layers-override {label}=1,2,...)")


def drafter_target_layers(drafter_dir: str | Path, override: list[int] | None = None) -> list[int]:
    """A drafter's `dflash_config.target_layer_ids` (required, z-lab/dflash PR #157), or `override`.

    Without either: a WorkerError offering the spacing formula's answer only as a guess.
    """
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise WorkerError(f"drafter {drafter_dir}: no config.json", str(path))
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WorkerError(f"drafter config is not valid JSON: {exc}", str(path)) from exc
    if not isinstance(config, dict):
        raise WorkerError(f"{path}: expected a JSON object", str(path))
    try:
        if override is not None:
            return parse_layer_ids(list(override), "layers override", str(drafter_dir))
        # Where z-lab's loader looks: dflash_config first, then the top level (as remote.drafter does).
        sub = config.get("dflash_config") or {}
        label = "dflash_config.target_layer_ids" if sub.get("target_layer_ids") is not None else "target_layer_ids"
        ids = sub.get("target_layer_ids", config.get("target_layer_ids"))
        if ids is None:
            raise LayerIdsError(missing_layer_ids_message(path, sub.get("num_target_layers", config.get(
                "num_target_layers")), config.get("num_hidden_layers"), None))
        return parse_layer_ids(ids, label, str(path))
    except LayerIdsError as exc:
        raise WorkerError(str(exc), str(path)) from exc


def parse_layer_list(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]; clear error otherwise."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise WorkerError(f"--layers must be comma-separated integers, found {text!r}", "--layers") from exc


def select_layers(num_layers: int, explicit: list[int], drafters: list[str | Path],
                  overrides: dict[str, list[int]] | None = None) -> list[int]:
    """The union of explicit layers and the drafters' target layers, plus the last layer; sorted.

    `overrides` (drafter directory name -> ids) replaces a drafter's target_layer_ids explicitly.
    A layer outside 0..num_layers-1 is a clear error naming it and the model's count.
    """
    wanted: dict[int, str] = {}
    for k in explicit:
        wanted.setdefault(k, "--layers")
    overrides = overrides or {}
    for drafter in drafters:
        for k in drafter_target_layers(drafter, overrides.get(Path(drafter).name)):
            wanted.setdefault(k, f"drafter {drafter}")
    for k, source in wanted.items():
        if not 0 <= k < num_layers:
            raise WorkerError(
                f"layer {k} (from {source}) is beyond the model: it has {num_layers} decoder layers (0..{num_layers - 1})",
                "layers",
            )
    wanted.setdefault(num_layers - 1, "last layer")
    return sorted(wanted)


class LayerCapture:
    """Forward hooks on chosen decoder layers; `take()` returns [T, n_layers, H] for batch item 0.

    Each captured tensor stays on its layer's device until `take()` gathers them on one device, so
    a model split across GPUs is handled without extra synchronisation.
    """

    def __init__(self, layers: Any, layer_ids: list[int]):
        self.layer_ids = list(layer_ids)
        self._layers = layers
        self._out: dict[int, Any] = {}
        self._handles: list[Any] = []

    def __enter__(self) -> LayerCapture:
        for k in self.layer_ids:
            self._handles.append(self._layers[k].register_forward_hook(self._hook(k)))
        return self

    def _hook(self, k: int) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, tuple) else output
            self._out[k] = out.detach()

        return hook

    def take(self, device: Any = None) -> Any:
        """The captured layers stacked as [T, n_layers, H] on `device` (default: the first layer's).

        Stays on the accelerator: the caller copies everything to the host in one go, since one
        synchronous copy per layer would stall the GPU several times per prompt.
        """
        import torch

        missing = [k for k in self.layer_ids if k not in self._out]
        if missing:
            raise RuntimeError(f"layers {missing} did not run in the forward pass")
        outs = [self._out[k][0] for k in self.layer_ids]
        device = outs[0].device if device is None else device
        stacked = torch.stack([out.to(device) for out in outs], dim=1)
        self._out.clear()
        return stacked

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._out.clear()
