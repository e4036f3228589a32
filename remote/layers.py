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


def drafter_target_layers(drafter_dir: str | Path) -> list[int]:
    """A drafter's `dflash_config.target_layer_ids`, or the EVAL-SPEC default when missing."""
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise WorkerError(f"drafter {drafter_dir}: no config.json", str(path))
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise WorkerError(f"drafter config is not valid JSON: {exc}", str(path)) from exc
    # Where z-lab's loader looks: dflash_config first, then the top level (as remote.drafter does).
    ids = (config.get("dflash_config") or {}).get("target_layer_ids", config.get("target_layer_ids"))
    if ids is not None:
        if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise WorkerError(f"dflash_config.target_layer_ids must be a list of integers, found {ids!r}", str(path))
        return list(ids)
    # z-lab's default: one target layer per drafter layer.
    total, n = config.get("num_target_layers"), config.get("num_hidden_layers")
    if not isinstance(total, int) or not isinstance(n, int) or n < 1:
        raise WorkerError("no dflash_config.target_layer_ids and no num_target_layers/num_hidden_layers "
                          "to derive them from", str(path))
    return default_target_layers(total, n)


def parse_layer_list(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]; clear error otherwise."""
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise WorkerError(f"--layers must be comma-separated integers, found {text!r}", "--layers") from exc


def select_layers(num_layers: int, explicit: list[int], drafters: list[str | Path]) -> list[int]:
    """The union of explicit layers and the drafters' target layers, plus the last layer; sorted.

    A layer outside 0..num_layers-1 is a clear error naming it and the model's count.
    """
    wanted: dict[int, str] = {}
    for k in explicit:
        wanted.setdefault(k, "--layers")
    for drafter in drafters:
        for k in drafter_target_layers(drafter):
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
