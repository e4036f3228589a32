"""The DFlash drafter (z-lab checkpoint format): loading, validation and the forward of EVAL-SPEC 1.

A checkpoint is a directory with `config.json` (`architectures: ["DFlashDraftModel"]`, `block_size`,
`dflash_config: {mask_token_id, target_layer_ids}`, `num_target_layers`, Qwen3 attention fields) and
safetensors weights without `embed_tokens` / `lm_head` (they come from the target, `target_io`).

The forward is written with plain tensor ops over a dict of weights, in two forms with the same math:

- `Drafter.context_kv` + `Drafter.block_hidden`: the context K/V of a prompt computed once per layer,
  then many anchors in one batch through SDPA with a mask "key position < anchor, plus the anchor's
  own block" (the evaluation path);
- `Drafter.reference_hidden`: one anchor from scratch with an explicit softmax (the naive loop the
  tests and the benchmark compare against).

    python -m remote.drafter random OUT_DIR --hidden 64 --layer-ids 1,3 --target-layers 4 ...
    python -m remote.drafter --provenance NAME=DIR [--provenance ...] [--states DIR] [--target DIR]
        [--layers-override NAME=1,2,3] [--no-weights] [--allow-unsound]

The provenance worker (`provenance_main`, through remote.events) checks each checkpoint field by
field, its weights for shape and finiteness, its layers against the extraction, and emits a result
event {"drafters": {name: provenance dict}, "states": DIR, "states_layers": [...]}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from remote.layers import LayerIdsError, default_target_layers, missing_layer_ids_message  # noqa: F401
from remote.layers import parse_layer_ids as _parse_layer_ids
from remote.weights import safetensors_files

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


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a drafter checkpoint, with a common `model.` prefix removed."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path, DrafterError):
        if not file.is_file():
            raise DrafterError(f"{path}: {file.name} is named by the index but missing")
        try:
            weights.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise DrafterError(f"{file}: unreadable safetensors ({exc})") from exc
    if weights and all(name.startswith("model.") for name in weights):
        weights = {name[len("model."):]: t for name, t in weights.items()}
    return weights


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3RMSNorm: normalise in float32, cast back, then scale."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Drafter:
    """A loaded drafter: its spec and weights on one device in one dtype."""

    def __init__(self, spec: DrafterSpec, weights: dict[str, torch.Tensor], device: torch.device | str,
                 dtype: torch.dtype):
        self.spec = spec
        self.device = torch.device(device)
        self.dtype = dtype
        self.w = {name: t.to(device=self.device, dtype=dtype) for name, t in weights.items()}
        hd = spec.head_dim
        self.inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device=self.device).float() / hd))

    # -- pieces shared by both forms -------------------------------------------------------------

    def _linear(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return F.linear(x, self.w[name + ".weight"], self.w.get(name + ".bias"))

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., head_dim] for integer positions (computed in float32, like HF)."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    @staticmethod
    def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + _rotate_half(x) * sin

    def context_features(self, feats: torch.Tensor) -> torch.Tensor:
        """ctx = hidden_norm(fc(concat_k H_k[p])) for `feats` [N, n*H]."""
        return rms_norm(self._linear(feats.to(self.dtype), "fc"), self.w["hidden_norm.weight"], self.spec.rms_norm_eps)

    def _keys(self, i: int, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s, p = self.spec, f"layers.{i}.self_attn."
        k = self._linear(x, p + "k_proj").unflatten(-1, (s.num_kv_heads, s.head_dim))
        k = self._apply_rope(rms_norm(k, self.w[p + "k_norm.weight"], s.rms_norm_eps), cos, sin)
        v = self._linear(x, p + "v_proj").unflatten(-1, (s.num_kv_heads, s.head_dim))
        return k, v

    def _mlp(self, i: int, h: torch.Tensor) -> torch.Tensor:
        p = f"layers.{i}."
        n = rms_norm(h, self.w[p + "post_attention_layernorm.weight"], self.spec.rms_norm_eps)
        return self._linear(F.silu(self._linear(n, p + "mlp.gate_proj")) * self._linear(n, p + "mlp.up_proj"),
                            p + "mlp.down_proj")

    def _block_input(self, embed: torch.Tensor, first_tokens: torch.Tensor) -> torch.Tensor:
        s = self.spec
        ids = torch.full((first_tokens.shape[0], s.block_size), s.mask_token_id, dtype=torch.long, device=self.device)
        ids[:, 0] = first_tokens
        return F.embedding(ids, embed).to(self.dtype) * s.input_embedding_scale

    def _visible(self, i: int, qpos: torch.Tensor, kpos: torch.Tensor) -> torch.Tensor | None:
        """Extra per-layer visibility (causal / sliding window) on absolute positions, or None."""
        window, causal = self.spec.layer_windows[i], self.spec.layer_causal[i]
        if window is None and not causal:
            return None
        diff = qpos[..., :, None] - kpos[..., None, :]
        visible = torch.ones_like(diff, dtype=torch.bool)
        if causal:
            visible &= diff >= 0
        if window is not None:
            visible &= diff < window
            if not causal:
                visible &= -diff < window
        return visible

    # -- batched form ----------------------------------------------------------------------------

    def context_kv(self, feats: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (K, V) of the context, [kv_heads, N, head_dim], RoPE'd at positions 0..N-1."""
        ctx = self.context_features(feats)
        cos, sin = self.rope(torch.arange(ctx.shape[0], device=self.device))
        out = []
        for i in range(self.spec.num_layers):
            k, v = self._keys(i, ctx, cos[:, None], sin[:, None])
            out.append((k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()))
        return out

    def block_hidden(self, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]], embed: torch.Tensor,
                     tokens: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
        """norm(h) of slots 1..B-1 for a batch of anchors: [C, B-1, H].

        `tokens` [N] on the device; `anchors` [C] ascending. Keys are the context positions < max
        anchor plus each anchor's own block; the mask keeps, per anchor, positions < anchor.
        """
        s = self.spec
        B, C = s.block_size, anchors.shape[0]
        ctx_len = int(anchors.max())
        h = self._block_input(embed, tokens[anchors])
        qpos = anchors[:, None] + torch.arange(B, device=self.device)  # [C, B]
        cos, sin = self.rope(qpos)
        cos, sin = cos[:, :, None], sin[:, :, None]
        ctx_pos = torch.arange(ctx_len, device=self.device)
        base_mask = torch.cat([
            (ctx_pos[None, :] < anchors[:, None])[:, None, :].expand(C, B, ctx_len),
            torch.ones(C, B, B, dtype=torch.bool, device=self.device),
        ], dim=-1)  # [C, B, ctx+B]
        kpos = torch.cat([ctx_pos[None, :].expand(C, ctx_len), qpos], dim=-1)
        for i in range(s.num_layers):
            p = f"layers.{i}.self_attn."
            n = rms_norm(h, self.w[f"layers.{i}.input_layernorm.weight"], s.rms_norm_eps)
            q = self._linear(n, p + "q_proj").unflatten(-1, (s.num_heads, s.head_dim))
            q = self._apply_rope(rms_norm(q, self.w[p + "q_norm.weight"], s.rms_norm_eps), cos, sin)
            kb, vb = self._keys(i, n, cos, sin)
            kc, vc = ctx_kv[i]
            k = torch.cat([kc[None, :, :ctx_len].expand(C, -1, -1, -1), kb.transpose(1, 2)], dim=2)
            v = torch.cat([vc[None, :, :ctx_len].expand(C, -1, -1, -1), vb.transpose(1, 2)], dim=2)
            mask = base_mask
            extra = self._visible(i, qpos, kpos)
            if extra is not None:
                mask = mask & extra
            attn = F.scaled_dot_product_attention(
                q.transpose(1, 2), k, v, attn_mask=mask[:, None], scale=s.head_dim ** -0.5,
                enable_gqa=s.num_heads != s.num_kv_heads,
            )
            h = h + self._linear(attn.transpose(1, 2).flatten(2), p + "o_proj")
            h = h + self._mlp(i, h)
        return rms_norm(h, self.w["norm.weight"], s.rms_norm_eps)[:, 1:]

    # -- naive reference form --------------------------------------------------------------------

    def reference_hidden(self, feats: torch.Tensor, embed: torch.Tensor, tokens: torch.Tensor, anchor: int) -> torch.Tensor:
        """norm(h) of slots 1..B-1 for one anchor, from scratch, explicit softmax: [B-1, H]."""
        s = self.spec
        B, a = s.block_size, anchor
        ctx = self.context_features(feats[:a])
        h = self._block_input(embed, tokens[a:a + 1])[0]  # [B, H]
        qpos = a + torch.arange(B, device=self.device)
        kpos = torch.cat([torch.arange(a, device=self.device), qpos])
        qcos, qsin = self.rope(qpos)
        kcos, ksin = self.rope(kpos)
        groups = s.num_heads // s.num_kv_heads
        for i in range(s.num_layers):
            p = f"layers.{i}.self_attn."
            n = rms_norm(h, self.w[f"layers.{i}.input_layernorm.weight"], s.rms_norm_eps)
            q = self._linear(n, p + "q_proj").unflatten(-1, (s.num_heads, s.head_dim))
            q = self._apply_rope(rms_norm(q, self.w[p + "q_norm.weight"], s.rms_norm_eps), qcos[:, None], qsin[:, None])
            k, v = self._keys(i, torch.cat([ctx, n]), kcos[:, None], ksin[:, None])
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
            scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) / math.sqrt(s.head_dim)
            extra = self._visible(i, qpos, kpos)
            if extra is not None:
                scores = scores.masked_fill(~extra[None], float("-inf"))
            attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(self.dtype)
            h = h + self._linear(attn.flatten(1), p + "o_proj")
            h = h + self._mlp(i, h)
        return rms_norm(h, self.w["norm.weight"], s.rms_norm_eps)[1:]

    def logits(self, hidden: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
        """Target lm_head on the drafter's output, with z-lab's optional multiplier and softcap."""
        logits = F.linear(hidden, lm_head.to(hidden.dtype))
        if self.spec.output_multiplier != 1.0:
            logits = logits * self.spec.output_multiplier
        if self.spec.logit_softcap is not None:
            logits = torch.tanh(logits / self.spec.logit_softcap) * self.spec.logit_softcap
        return logits


def check_weights(path: Path, spec: DrafterSpec, weights: dict[str, torch.Tensor]) -> None:
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
        if not tensor.is_floating_point():
            raise DrafterError(f"{path}: tensor {name!r} has dtype {str(tensor.dtype).replace('torch.', '')}, "
                               "expected a floating-point dtype")
        finite = torch.isfinite(tensor)
        if not bool(finite.all()):
            bad = tensor[~finite]
            nan, inf = int(bad.isnan().sum()), int(bad.isinf().sum())
            raise DrafterError(f"{path}: tensor {name!r} holds {nan} NaN and {inf} Inf of {tensor.numel()} values: "
                               "refused (a diverged or corrupted checkpoint)")


def load_drafter(path: str | os.PathLike, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, layers_override: list[int] | None = None) -> Drafter:
    """Load and validate a z-lab format drafter checkpoint; raise DrafterError naming the problem.

    `layers_override` replaces `target_layer_ids` explicitly (the spec records it as overridden).
    """
    path = Path(path)
    if not path.is_dir():
        raise DrafterError(f"{path}: not a directory")
    # Config errors first (the fc width from the safetensors header), before reading the weights.
    read_spec(path, _fc_shape_or_none(path), layers_override=layers_override)
    weights = read_weights(path)
    if "fc.weight" not in weights:
        raise DrafterError(f"{path}: no fc.weight in the checkpoint")
    spec = read_spec(path, tuple(weights["fc.weight"].shape), layers_override=layers_override)
    check_weights(path, spec, weights)
    return Drafter(spec, weights, device, dtype)


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
        loaded = read_weights(path)
        if "fc.weight" not in loaded:
            raise DrafterError(f"{path}: no fc.weight in the checkpoint")
        spec = read_spec(path, tuple(loaded["fc.weight"].shape), layers_override=layers_override)
        check_weights(path, spec, loaded)
        del loaded
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
    """`python -m remote.drafter --provenance NAME=DIR ...`: the provenance of each drafter as a result event."""
    from remote.events import WorkerError

    parser = argparse.ArgumentParser(prog="python -m remote.drafter --provenance",
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


# -- writing checkpoints (tests, drill, benchmark) ---------------------------------------------------

def drafter_config(hidden_size: int, target_layer_ids: list[int], num_target_layers: int, block_size: int,
                   num_layers: int, mask_token_id: int, vocab_size: int | None = None,
                   num_heads: int | None = None, num_kv_heads: int | None = None, head_dim: int | None = None,
                   intermediate_size: int | None = None, rope_theta: float = 1_000_000.0,
                   rms_norm_eps: float = 1e-6) -> dict[str, Any]:
    """A z-lab style config.json for a DFlash drafter of the given shape."""
    head_dim = head_dim or (128 if hidden_size >= 1024 else 16)
    num_heads = num_heads or max(1, hidden_size // head_dim)
    num_kv_heads = num_kv_heads or max(1, num_heads // 4)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "block_size": block_size,
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": list(target_layer_ids)},
        "num_target_layers": num_target_layers,
        "num_hidden_layers": num_layers,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size or 3 * hidden_size,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": rope_theta,
        "vocab_size": vocab_size,
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }


def random_weights(config: dict[str, Any], fc_layers: int | None = None, seed: int = 0,
                   dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Random weights (std 0.02, norms at 1) of the shape a config describes."""
    spec = read_spec_from_config(config)
    shapes = _expected_shapes(spec)
    if fc_layers is not None:  # a deliberately inconsistent checkpoint (tests of the fc-width check)
        shapes["fc.weight"] = (spec.hidden_size, fc_layers * spec.hidden_size)
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            weights[name] = torch.ones(shape, dtype=dtype, device=device)
        else:
            weights[name] = (torch.randn(shape, generator=gen, device=device) * 0.02).to(dtype)
    return weights


def read_spec_from_config(config: dict[str, Any]) -> DrafterSpec:
    """The spec of an in-memory config (through a temporary directory, so the rules are the same)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        return read_spec(tmp)


def save_drafter(path: str | os.PathLike, config: dict[str, Any], weights: dict[str, torch.Tensor]) -> Path:
    """Write a checkpoint directory (config.json + model.safetensors), each file atomically."""
    from safetensors.torch import save_file

    from remote.artifacts import atomic_path, write_json_atomic

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with atomic_path(path / "model.safetensors") as tmp:
        save_file({k: v.contiguous().cpu() for k, v in weights.items()}, str(tmp), metadata={"format": "pt"})
    write_json_atomic(path / "config.json", config)
    return path


def save_random_drafter(path: str | os.PathLike, hidden_size: int, vocab_size: int | None,
                        target_layer_ids: list[int], num_target_layers: int, block_size: int = 16,
                        num_layers: int = 1, mask_token_id: int = 0, seed: int = 0,
                        fc_layers: int | None = None, **shape: Any) -> Path:
    """Write a random DFlash drafter in the z-lab format. `fc_layers` != len(ids) makes a broken one.

    `shape` may set num_heads, num_kv_heads, head_dim, intermediate_size, rope_theta.
    """
    config = drafter_config(hidden_size, target_layer_ids, num_target_layers, block_size, num_layers,
                            mask_token_id, vocab_size, **shape)
    weights = random_weights(config, fc_layers, seed)
    return save_drafter(path, config, weights)


def main() -> None:
    import sys

    if "--provenance" in sys.argv[1:]:
        from remote.events import run_worker

        run_worker(provenance_main)
        return
    parser = argparse.ArgumentParser(description="Write a random DFlash drafter checkpoint (z-lab format).")
    parser.add_argument("out_dir")
    parser.add_argument("--hidden", type=int, required=True)
    parser.add_argument("--layer-ids", required=True, help="comma-separated target layer ids")
    parser.add_argument("--target-layers", type=int, required=True)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--mask-token-id", type=int, required=True)
    parser.add_argument("--vocab", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    argv = sys.argv[1:]
    args = parser.parse_args(argv[1:] if argv[:1] == ["random"] else argv)
    ids = [int(k) for k in args.layer_ids.split(",")]
    print(save_random_drafter(args.out_dir, args.hidden, args.vocab, ids, args.target_layers, args.block_size,
                              args.layers, args.mask_token_id, args.seed))


if __name__ == "__main__":
    main()
