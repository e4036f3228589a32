"""A DFlash drafter checkpoint's config and provenance, checked before any GPU time (EVAL-SPEC 6),
without torch: the preflight's provenance worker and the extraction's check import neither torch nor
transformers (a worker's start on a host is then a fraction of a second, not seconds of importing).

A checkpoint is a directory with `config.json` (`architectures: ["DFlashDraftModel"]`, `block_size`,
`dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers`, Qwen3 attention fields) and
safetensors weights without `embed_tokens` / `lm_head` (they come from the target, `target_io`).
`remote.drafter` holds the forward and loads the weights with torch; it re-exports what is here.

    python -m remote.provenance --provenance NAME=DIR [--provenance ...] [--states DIR] [--target DIR]
        [--layers-override NAME=1,2,3] [--no-weights] [--allow-unsound]

The worker (`provenance_main`, through remote.events) checks each checkpoint field by field, its
weights for shape and finiteness (read from the files with numpy, never all in memory at once), its
layers against the extraction, and emits a result event
{"drafters": {name: provenance dict}, "states": DIR, "states_layers": [...]}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from remote.layers import LayerIdsError, default_target_layers, missing_layer_ids_message  # noqa: F401
from remote.layers import parse_layer_ids as _parse_layer_ids
from remote.weights import DTYPE_BYTES, safetensors_files, safetensors_header

ARCHITECTURE = "DFlashDraftModel"


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used as it is; the message names what and where."""


def parse_layer_ids(value: Any, label: str, where: str) -> list[int]:
    """Distinct non-negative integer layer ids (`remote.layers.parse_layer_ids`), as a DrafterError."""
    try:
        return _parse_layer_ids(value, label, where)
    except LayerIdsError as exc:
        raise DrafterError(str(exc)) from exc


@dataclass(frozen=True)
class DrafterSpec:
    """What a drafter checkpoint is, read from its config and checked against its weights."""

    path: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]
    num_target_layers: int | None
    fc_layers: int
    vocab_size: int | None = None
    layer_windows: list[int | None] = field(default_factory=list)
    layer_causal: list[bool] = field(default_factory=list)
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    logit_softcap: float | None = None
    layers_source: str = "config"  # "config" or "override" (the console's [[drafters]] layers)
    config_layer_ids: list[int] | None = None  # what config.json says, whatever the override

    def facts(self) -> dict[str, Any]:
        """The facts a results table shows about the drafter."""
        return {
            "layers": list(self.target_layer_ids),
            "layers_source": self.layers_source,
            "config_layer_ids": self.config_layer_ids,
            "block_size": self.block_size,
            "fc_width": self.fc_layers,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "mask_token_id": self.mask_token_id,
        }


def _expected_shapes(spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    h, hd, nh, kv, inter = spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, spec.fc_layers * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (nh * hd, h),
            p + "self_attn.k_proj.weight": (kv * hd, h),
            p + "self_attn.v_proj.weight": (kv * hd, h),
            p + "self_attn.o_proj.weight": (h, nh * hd),
            p + "self_attn.q_norm.weight": (hd,),
            p + "self_attn.k_norm.weight": (hd,),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    return shapes


_MISSING = object()


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class _Fields:
    """Typed, ranged reads of a drafter config.json; every failure is one line naming the file, the
    field, what was expected and what was found."""

    def __init__(self, config: dict[str, Any], cfg_path: Path):
        self.config, self.cfg_path = config, cfg_path
        sub = config.get("dflash_config")
        if sub is not None and not isinstance(sub, dict):
            raise self.bad("dflash_config", "an object", sub)
        self.sub = sub or {}

    def bad(self, label: str, expected: str, found: Any) -> DrafterError:
        shown = json.dumps(found) if not isinstance(found, str) else repr(found)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return DrafterError(f"{self.cfg_path}: field {label!r}: expected {expected}, found {shown}")

    def raw(self, name: str, draft: bool = False) -> tuple[Any, str]:
        # z-lab reads dflash_config first, then the top level (model.py `_draft_value`).
        if draft and self.sub.get(name) is not None:
            return self.sub[name], f"dflash_config.{name}"
        return self.config.get(name), name

    def _missing(self, label: str, expected: str, default: Any) -> Any:
        if default is _MISSING:
            raise DrafterError(f"{self.cfg_path}: missing field {label!r} (expected {expected})")
        return default

    def int(self, name: str, lo: int | None = None, hi: int | None = None, default: Any = _MISSING,
            draft: bool = False) -> Any:
        value, label = self.raw(name, draft)
        expected = "an integer" + (f" >= {lo}" if lo is not None else "") + (f" and < {hi}" if hi is not None else "")
        if value is None:
            return self._missing(label, expected, default)
        if not _is_int(value) or (lo is not None and value < lo) or (hi is not None and value >= hi):
            raise self.bad(label, expected, value)
        return value

    def number(self, name: str, positive: bool = False, non_negative: bool = False, default: Any = _MISSING,
               draft: bool = False, extra: dict[str, Any] | None = None) -> Any:
        value, label = self.raw(name, draft)
        if value is None and extra is not None:
            value, label = extra.get(name), f"rope_parameters.{name}"
        expected = "a finite number" + (" > 0" if positive else " >= 0" if non_negative else "")
        if value is None:
            return self._missing(label, expected, default)
        if not _is_number(value) or (positive and value <= 0) or (non_negative and value < 0):
            raise self.bad(label, expected, value)
        return float(value)


def read_spec(path: str | os.PathLike, fc_shape: tuple[int, ...] | None = None, partial: bool = False,
              layers_override: list[int] | None = None) -> DrafterSpec:
    """Read and check a drafter's config.json field by field; `fc_shape` (from the weights) gives the
    fc width, checked against the layer ids.

    `target_layer_ids` is required (z-lab/dflash PR #157); `layers_override` (the console's
    `[[drafters]] layers`) replaces it explicitly and the spec says so (`layers_source`).
    `partial` is accepted for callers that check the config alone before the weights are read.
    """
    del partial  # the ids are required now, so the config alone always names them
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"{path}: no config.json (not a DFlash drafter checkpoint)")
    try:
        config = json.loads(cfg_path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise DrafterError(f"{cfg_path}: invalid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise DrafterError(f"{cfg_path}: expected a JSON object, found {type(config).__name__}")
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or ARCHITECTURE not in archs:
        raise DrafterError(f"{cfg_path}: field 'architectures': expected [{ARCHITECTURE!r}], found {archs}")
    f = _Fields(config, cfg_path)

    hidden = f.int("hidden_size", lo=1)
    num_heads = f.int("num_attention_heads", lo=1)
    num_kv_heads = f.int("num_key_value_heads", lo=1, default=num_heads)
    if num_heads % num_kv_heads:
        raise DrafterError(f"{cfg_path}: field 'num_key_value_heads': expected a divisor of num_attention_heads "
                           f"{num_heads}, found {num_kv_heads}")
    head_dim = f.int("head_dim", lo=2, default=None)
    if head_dim is None:
        if hidden % num_heads:
            raise DrafterError(f"{cfg_path}: field 'head_dim': missing, and hidden_size {hidden} is not a multiple "
                               f"of num_attention_heads {num_heads} to derive it from")
        head_dim = hidden // num_heads
    if head_dim % 2:
        raise f.bad("head_dim", "an even integer (RoPE rotates pairs)", head_dim)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise DrafterError(f"{cfg_path}: hidden_act {act!r} is not supported (silu only)")
    num_layers = f.int("num_hidden_layers", lo=1)
    intermediate = f.int("intermediate_size", lo=1)
    vocab_size = f.int("vocab_size", lo=1, default=None)
    block_size = f.int("block_size", lo=2, draft=True)
    mask_value, _ = f.raw("mask_token_id", draft=True)
    if mask_value is None:
        raise DrafterError(f"{cfg_path}: no mask_token_id (dflash_config or top level)")
    mask_token_id = f.int("mask_token_id", lo=0, hi=vocab_size, draft=True)
    num_target_layers = f.int("num_target_layers", lo=1, default=None, draft=True)
    eps = f.number("rms_norm_eps", positive=True, default=1e-6)
    rope_theta = _rope_theta(config, cfg_path, f)

    fc_layers: int | None = None
    if fc_shape is not None:
        if len(fc_shape) != 2 or fc_shape[0] != hidden or fc_shape[1] % hidden or fc_shape[1] == 0:
            raise DrafterError(
                f"{path}: fc.weight has shape {list(fc_shape)}, expected [{hidden}, n*{hidden}] (hidden_size {hidden})"
            )
        fc_layers = fc_shape[1] // hidden
    raw_ids, ids_label = f.raw("target_layer_ids", draft=True)
    config_ids = None if raw_ids is None else parse_layer_ids(raw_ids, ids_label, str(cfg_path))
    if layers_override is not None:
        layer_ids = parse_layer_ids(list(layers_override), "layers override", str(path))
        source = "override"
        what = f"the layers override names {len(layer_ids)}: {layer_ids} (config.json has {config_ids})"
    elif config_ids is not None:
        layer_ids, source, what = config_ids, "config", f"{ids_label} names {len(config_ids)}: {config_ids}"
    else:
        raise DrafterError(missing_layer_ids_message(cfg_path, num_target_layers, num_layers, fc_layers))
    if num_target_layers is not None:
        beyond = [k for k in layer_ids if k >= num_target_layers]
        if beyond:
            raise DrafterError(f"{cfg_path}: target layer ids {beyond} ({source}) are beyond num_target_layers "
                               f"{num_target_layers} (layers 0..{num_target_layers - 1})")
    if fc_layers is None:
        fc_layers = len(layer_ids)
    if len(layer_ids) != fc_layers:
        raise DrafterError(
            f"{path}: fc.weight takes {fc_layers} target layers ([{hidden}, {fc_layers}*{hidden}]) "
            f"but {what}"
        )

    layer_types = config.get("layer_types")
    if layer_types is None:
        layer_types = ["full_attention"] * num_layers
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise f.bad("layer_types", f"a list of {num_layers} layer types (one per num_hidden_layers)", layer_types)
    is_causal = config.get("is_causal")
    if is_causal is not None and not isinstance(is_causal, bool):
        raise f.bad("is_causal", "true, false or null", is_causal)
    windows: list[int | None] = []
    causal: list[bool] = []
    for i, kind in enumerate(layer_types):
        if kind not in ("full_attention", "sliding_attention"):
            raise f.bad(f"layer_types[{i}]", "'full_attention' or 'sliding_attention'", kind)
        sliding = kind == "sliding_attention"
        windows.append(f.int("sliding_window", lo=1) if sliding else None)
        # z-lab: a layer is causal iff it slides, unless is_causal says otherwise.
        causal.append(sliding if is_causal is None else is_causal)

    softcap = f.number("final_logit_softcapping", non_negative=True, default=None, draft=True)
    return DrafterSpec(
        path=str(path),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        rms_norm_eps=eps,
        rope_theta=rope_theta,
        block_size=block_size,
        mask_token_id=mask_token_id,
        target_layer_ids=layer_ids,
        num_target_layers=num_target_layers,
        fc_layers=fc_layers,
        vocab_size=vocab_size,
        layer_windows=windows,
        layer_causal=causal,
        input_embedding_scale=f.number("input_embedding_scale", default=1.0, draft=True),
        output_multiplier=f.number("output_multiplier", default=1.0, draft=True),
        logit_softcap=None if softcap is None or softcap <= 0 else softcap,
        layers_source=source,
        config_layer_ids=config_ids,
    )


def _rope_theta(config: dict[str, Any], where: Path, f: _Fields) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise f.bad("rope_parameters", "an object", params)
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise DrafterError(f"{where}: rope_type {rope_type!r} is not supported (only default RoPE)")
    value, _ = f.raw("rope_theta")
    if value is None and params.get("rope_theta") is None:
        raise DrafterError(f"{where}: no rope_theta (top level or rope_parameters)")
    return f.number("rope_theta", positive=True, extra=params)


def check_against_cache(spec: DrafterSpec, cached_layers: list[int], hidden_size: int, name: str) -> None:
    """Refuse a drafter that the cached hidden states cannot feed, naming what is missing."""
    if spec.hidden_size != hidden_size:
        raise DrafterError(
            f"drafter {name}: hidden_size {spec.hidden_size} but the cached hidden states have {hidden_size}"
        )
    missing = [k for k in spec.target_layer_ids if k not in cached_layers]
    if missing:
        raise DrafterError(
            f"drafter {name}: fc takes {spec.fc_layers} layers {spec.target_layer_ids}, "
            f"the cache holds {len(cached_layers)} layers {cached_layers}; missing: {missing}"
        )



# -- the weights, as the files hold them ------------------------------------------------------------

FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2")
# How a non-finite value is seen in each float format's bits: (unsigned view, exponent mask, mantissa
# mask). All exponent bits set is Inf (mantissa 0) or NaN; float8 e4m3 (the "fn" variant torch and
# safetensors use) has no Inf, and its only NaN is S.1111.111.
_NON_FINITE_BITS = {"F16": ("<u2", 0x7C00, 0x03FF), "BF16": ("<u2", 0x7F80, 0x007F),
                    "F8_E5M2": ("u1", 0x7C, 0x03), "F8_E4M3": ("u1", 0x7F, 0x00)}
_CHUNK_VALUES = 1 << 24  # values read at a time: a checkpoint's memory is never all read at once


@dataclass(frozen=True)
class WeightFacts:
    """What the provenance needs of one tensor: its shape, dtype (safetensors' name) and the count of
    NaN and Inf values among its floats."""

    shape: tuple[int, ...]
    dtype: str
    nan: int = 0
    inf: int = 0

    @property
    def floating(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _count_non_finite(data: Any, dtype: str) -> tuple[int, int]:
    """(NaN, Inf) among `data`, a flat uint8 array of one tensor's bytes in safetensors `dtype`."""
    import numpy as np

    if dtype in ("F32", "F64"):
        values = data.view("<f4" if dtype == "F32" else "<f8")
        return int(np.isnan(values).sum()), int(np.isinf(values).sum())
    view, exponent, mantissa = _NON_FINITE_BITS[dtype]
    bits = data.view(view)
    if dtype == "F8_E4M3":
        return int(((bits & exponent) == exponent).sum()), 0
    special = (bits & exponent) == exponent
    nan = int((special & ((bits & mantissa) != 0)).sum())
    return nan, int(special.sum()) - nan


def scan_weights(path: str | os.PathLike) -> dict[str, WeightFacts]:
    """Every tensor of a checkpoint directory (a common `model.` prefix removed), read from its
    safetensors files: shape, dtype and non-finite counts; DrafterError naming the file otherwise."""
    import numpy as np

    path = Path(path)
    facts: dict[str, WeightFacts] = {}
    for file in safetensors_files(path, DrafterError):
        if not file.is_file():
            raise DrafterError(f"{path}: {file.name} is named by the index but missing")
        try:
            header = safetensors_header(file)
            with open(file, "rb") as fh:
                start = 8 + int.from_bytes(fh.read(8), "little")
            size = file.stat().st_size
            data = np.memmap(file, dtype=np.uint8, mode="r") if size > start else np.zeros(0, np.uint8)
            for name, entry in header.items():
                dtype, shape, (begin, end) = entry["dtype"], tuple(int(n) for n in entry["shape"]), entry["data_offsets"]
                if not 0 <= begin <= end <= size - start:
                    raise ValueError(f"tensor {name!r} lies outside the file ({begin}..{end} of {size - start} bytes)")
                nan = inf = 0
                if dtype in FLOAT_DTYPES:
                    width = DTYPE_BYTES[dtype]
                    if end - begin != math.prod(shape) * width:
                        raise ValueError(f"tensor {name!r}: {end - begin} bytes for {list(shape)} {dtype}")
                    step = _CHUNK_VALUES * width
                    for at in range(start + begin, start + end, step):
                        n, i = _count_non_finite(data[at:min(at + step, start + end)], dtype)
                        nan, inf = nan + n, inf + i
                facts[name] = WeightFacts(shape, dtype, nan, inf)
            del data
        except (ValueError, KeyError, TypeError, OSError) as exc:
            raise DrafterError(f"{file}: unreadable safetensors ({exc})") from exc
    if facts and all(name.startswith("model.") for name in facts):
        facts = {name[len("model."):]: f for name, f in facts.items()}
    return facts


def check_weight_facts(path: Path, spec: DrafterSpec, weights: dict[str, WeightFacts]) -> None:
    """Every tensor the forward uses present, of its shape, floating point and finite; else DrafterError
    naming the tensor."""
    expected = _expected_shapes(spec)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise DrafterError(f"{path}: missing weights {missing[:5]}{more}")
    wrong = [f"{name} {list(weights[name].shape)} (expected {list(shape)})"
             for name, shape in expected.items() if tuple(weights[name].shape) != shape]
    if wrong:
        raise DrafterError(f"{path}: wrong weight shapes: {'; '.join(wrong[:5])}")
    for name in expected:
        tensor = weights[name]
        if not tensor.floating:
            raise DrafterError(f"{path}: tensor {name!r} has dtype {tensor.dtype}, expected a floating-point dtype")
        if tensor.nan or tensor.inf:
            raise DrafterError(f"{path}: tensor {name!r} holds {tensor.nan} NaN and {tensor.inf} Inf of {tensor.numel} "
                               "values: refused (a diverged or corrupted checkpoint)")


# -- provenance (before any GPU time) --------------------------------------------------------------

def fc_shape_of(path: str | os.PathLike) -> tuple[int, ...]:
    """fc.weight's shape from the safetensors headers alone (no tensor read)."""
    from remote.weights import safetensors_header, tensor_files

    path = Path(path)
    names = tensor_files(path, DrafterError)
    name = "fc.weight" if "fc.weight" in names else "model.fc.weight" if "model.fc.weight" in names else None
    if name is None:
        raise DrafterError(f"{path}: no fc.weight in the checkpoint")
    file = names[name]
    if not file.is_file():
        raise DrafterError(f"{path}: {file.name} (holding {name}) is named by the index but missing")
    try:
        return tuple(safetensors_header(file)[name]["shape"])
    except (ValueError, KeyError) as exc:
        raise DrafterError(f"{file}: unreadable safetensors header ({exc})") from exc


def _fc_shape_or_none(path: Path) -> tuple[int, ...] | None:
    try:
        return fc_shape_of(path)
    except DrafterError:
        return None  # reported with the weights, after the config's own checks


def states_facts(states: str | os.PathLike) -> dict[str, Any]:
    """Layers, hidden size and soundness of a complete extraction directory (sizes checked, no hashing)."""
    from remote.artifacts import read_manifest

    try:
        manifest = read_manifest(states)
    except (ValueError, OSError) as exc:
        raise DrafterError(str(exc)) from exc
    layers, hidden = manifest.get("layers"), manifest.get("hidden_size")
    if not isinstance(layers, list) or not all(isinstance(k, int) for k in layers) or not isinstance(hidden, int):
        raise DrafterError(f"{states}: manifest.json has no integer 'layers' list and 'hidden_size'")
    return {"dir": str(states), "layers": layers, "hidden_size": hidden, "soundness": manifest.get("soundness")}


def provenance(path: str | os.PathLike, name: str | None = None, layers_override: list[int] | None = None,
               states: str | os.PathLike | dict[str, Any] | None = None, target_vocab: int | None = None,
               weights: bool = True, allow_unsound: bool = False) -> dict[str, Any]:
    """Where a drafter's numbers will come from, checked before any GPU time (EVAL-SPEC 6).

    Its target_layer_ids (and whether overridden), fc input width (from the weights), block size,
    mask token, hidden size and, given `states` (an extraction dir, or `states_facts` of one), the
    extracted layers it reads and their soundness. A disagreement raises DrafterError naming both
    sides; so do non-finite weights (`weights`: the tensors are read and checked, on the CPU).
    """
    from remote.soundness import SoundnessError, check_layers, rows_for

    path = Path(path)
    name = name or path.name
    if not path.is_dir():
        raise DrafterError(f"drafter {name}: {path} is not a directory")
    spec = read_spec(path, layers_override=layers_override)
    if weights:
        scanned = scan_weights(path)
        if "fc.weight" not in scanned:
            raise DrafterError(f"{path}: no fc.weight in the checkpoint")
        spec = read_spec(path, scanned["fc.weight"].shape, layers_override=layers_override)
        check_weight_facts(path, spec, scanned)
    else:
        spec = read_spec(path, fc_shape_of(path), layers_override=layers_override)
    if target_vocab is not None and not 0 <= spec.mask_token_id < target_vocab:
        raise DrafterError(f"drafter {name}: mask_token_id {spec.mask_token_id} ({path / 'config.json'}) is outside "
                           f"the target vocabulary of {target_vocab} tokens")
    if target_vocab is not None and spec.vocab_size is not None and spec.vocab_size != target_vocab:
        raise DrafterError(f"drafter {name}: vocab_size {spec.vocab_size} ({path / 'config.json'}) but the target "
                           f"has {target_vocab} tokens")
    record: dict[str, Any] = {
        "name": name, "path": str(path),
        "target_layer_ids": list(spec.target_layer_ids), "layers_source": spec.layers_source,
        "config_target_layer_ids": spec.config_layer_ids,
        "fc_width": spec.fc_layers, "block_size": spec.block_size, "mask_token_id": spec.mask_token_id,
        "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
        "num_target_layers": spec.num_target_layers, "vocab_size": spec.vocab_size,
        "weights_checked": bool(weights), "states": None, "reads": None, "soundness": None,
    }
    if states is not None:
        facts = states if isinstance(states, dict) else states_facts(states)
        source = "the layers override" if spec.layers_source == "override" else "target_layer_ids"
        if facts["hidden_size"] != spec.hidden_size:
            raise DrafterError(f"drafter {name}: hidden_size {spec.hidden_size} ({path / 'config.json'}) but the "
                               f"extraction {facts['dir']} holds hidden size {facts['hidden_size']}")
        missing = [k for k in spec.target_layer_ids if k not in facts["layers"]]
        if missing:
            raise DrafterError(f"drafter {name}: fc takes {spec.fc_layers} layers {spec.target_layer_ids} ({source}), "
                               f"the extraction {facts['dir']} holds layers {facts['layers']}: missing {missing}")
        record["states"] = facts["dir"]
        record["reads"] = [{"layer": k, "index": facts["layers"].index(k)} for k in spec.target_layer_ids]
        if facts.get("soundness") is not None:
            record["soundness"] = rows_for(facts["soundness"], spec.target_layer_ids)
            if not allow_unsound:
                try:
                    check_layers(facts["soundness"], spec.target_layer_ids, f"drafter {name}", facts["dir"])
                except SoundnessError as exc:
                    raise DrafterError(str(exc)) from exc
    return record


def parse_overrides(items: list[str], where: str = "--layers-override") -> dict[str, list[int]]:
    """NAME=1,2,3 items -> {name: [1, 2, 3]}; a clear error on anything else."""
    out: dict[str, list[int]] = {}
    for item in items:
        name, sep, text = item.partition("=")
        try:
            ids = [int(part) for part in text.split(",") if part.strip()]
        except ValueError:
            ids = []
        if not sep or not name or not ids:
            raise DrafterError(f"{where} {item!r}: expected NAME=1,2,3 (the drafter's name and its layer ids)")
        if name in out:
            raise DrafterError(f"{where}: drafter {name!r} given twice")
        out[name] = parse_layer_ids(ids, "layers override", f"{where} {name}")
    return out


def provenance_main(events: Any, argv: list[str] | None = None) -> dict[str, Any]:
    """`python -m remote.provenance --provenance NAME=DIR ...`: each drafter's provenance as a result event."""
    from remote.events import WorkerError

    parser = argparse.ArgumentParser(prog="python -m remote.provenance",
                                     description="Drafter provenance, checked before any GPU time.")
    parser.add_argument("--provenance", action="append", required=True, metavar="[NAME=]DIR")
    parser.add_argument("--states", default=None, help="extraction directory the drafters will read")
    parser.add_argument("--target", default=None, help="target model dir: its config.json's vocab_size")
    parser.add_argument("--layers-override", action="append", default=[], metavar="NAME=1,2,3")
    parser.add_argument("--no-weights", action="store_true", help="fc width from headers; skip the finite check")
    parser.add_argument("--allow-unsound", action="store_true")
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.layers_override)
        drafters: dict[str, Path] = {}
        for item in args.provenance:
            name, sep, directory = item.partition("=")
            if not sep:
                name, directory = Path(item).name, item
            if name in drafters:
                raise DrafterError(f"--provenance: drafter {name!r} given twice")
            drafters[name] = Path(directory)
        unknown = sorted(set(overrides) - set(drafters))
        if unknown:
            raise DrafterError(f"--layers-override names {unknown}, not among the drafters {sorted(drafters)}")
        vocab = target_vocab_size(args.target) if args.target else None
        facts = states_facts(args.states) if args.states else None
        out = {}
        for name, directory in drafters.items():
            events.phase(f"provenance {name}")
            out[name] = provenance(directory, name, overrides.get(name), facts, vocab, weights=not args.no_weights,
                                   allow_unsound=args.allow_unsound)
    except DrafterError as exc:
        raise WorkerError(str(exc)) from exc
    return {"drafters": out, "states": args.states, "states_layers": facts["layers"] if facts else None}


def target_vocab_size(model_dir: str | os.PathLike) -> int:
    """The target's vocab_size from its config.json (text config of a multimodal one)."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DrafterError(f"{path}: cannot read the target config ({exc})") from exc
    text = config.get("text_config") or config
    vocab = text.get("vocab_size", config.get("vocab_size"))
    if not _is_int(vocab) or vocab < 1:
        raise DrafterError(f"{path}: field 'vocab_size': expected a positive integer, found {vocab!r}")
    return vocab



def read_spec_from_config(config: dict[str, Any]) -> DrafterSpec:
    """The spec of an in-memory config (through a temporary directory, so the rules are the same)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return read_spec(tmp)


if __name__ == "__main__":
    from remote.events import run_worker

    run_worker(provenance_main)
