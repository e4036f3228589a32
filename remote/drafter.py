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

from remote.layers import default_target_layers
from remote.weights import safetensors_files

ARCHITECTURE = "DFlashDraftModel"


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used as it is; the message names what and where."""


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

    def facts(self) -> dict[str, Any]:
        """The facts a results table shows about the drafter."""
        return {
            "layers": list(self.target_layer_ids),
            "block_size": self.block_size,
            "fc_width": self.fc_layers,
            "num_hidden_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "mask_token_id": self.mask_token_id,
        }


def _draft_value(config: dict[str, Any], name: str, default: Any = None) -> Any:
    # z-lab reads dflash_config first, then the top level (model.py `_draft_value`).
    sub = config.get("dflash_config") or {}
    if name in sub and sub[name] is not None:
        return sub[name]
    value = config.get(name)
    return default if value is None else value


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


def _rope_theta(config: dict[str, Any], where: Path) -> float:
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default":
        raise DrafterError(f"{where}: rope_type {rope_type!r} is not supported (only default RoPE)")
    theta = config.get("rope_theta", params.get("rope_theta"))
    if theta is None:
        raise DrafterError(f"{where}: no rope_theta (top level or rope_parameters)")
    return float(theta)


def read_spec(path: str | os.PathLike, fc_shape: tuple[int, ...] | None = None, partial: bool = False) -> DrafterSpec:
    """Read and check a drafter's config.json; `fc_shape` (from the weights) gives the fc width.

    `partial` checks the config alone (before the weights are read): layer ids that only the fc
    width could give are left empty then.
    """
    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise DrafterError(f"{path}: no config.json (not a DFlash drafter checkpoint)")
    try:
        config = json.loads(cfg_path.read_text())
    except ValueError as exc:
        raise DrafterError(f"{cfg_path}: invalid JSON ({exc})") from exc
    archs = config.get("architectures") or []
    if ARCHITECTURE not in archs:
        raise DrafterError(f"{cfg_path}: architectures is {archs}, expected [{ARCHITECTURE!r}]")

    def need(name: str) -> Any:
        value = config.get(name)
        if value is None:
            raise DrafterError(f"{cfg_path}: missing field {name!r}")
        return value

    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    head_dim = int(config.get("head_dim") or hidden // num_heads)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise DrafterError(f"{cfg_path}: hidden_act {act!r} is not supported (silu only)")
    num_layers = int(need("num_hidden_layers"))
    mask_token_id = _draft_value(config, "mask_token_id")
    if mask_token_id is None:
        raise DrafterError(f"{cfg_path}: no mask_token_id (dflash_config or top level)")
    num_target_layers = _draft_value(config, "num_target_layers")
    layer_ids = _draft_value(config, "target_layer_ids")

    if fc_shape is not None:
        if len(fc_shape) != 2 or fc_shape[0] != hidden or fc_shape[1] % hidden:
            raise DrafterError(
                f"{path}: fc.weight has shape {list(fc_shape)}, expected [{hidden}, n*{hidden}] (hidden_size {hidden})"
            )
        fc_layers = fc_shape[1] // hidden
    elif layer_ids is not None:
        fc_layers = len(layer_ids)
    elif partial:
        fc_layers, layer_ids = 0, []
    else:
        raise DrafterError(f"{cfg_path}: no target_layer_ids and no fc.weight to infer them from")
    if layer_ids is None:
        if num_target_layers is None:
            raise DrafterError(f"{cfg_path}: neither target_layer_ids nor num_target_layers is set")
        # z-lab's default counts one target layer per drafter layer (not the fc width), so that a
        # checkpoint whose fc disagrees is caught by the width check below, not silently followed.
        layer_ids = default_target_layers(int(num_target_layers), num_layers)
        source = f"target_layer_ids (not in config.json: the default for {num_layers} drafter layers)"
    else:
        source = "target_layer_ids"
    layer_ids = [int(k) for k in layer_ids]
    if len(layer_ids) != fc_layers:
        raise DrafterError(
            f"{path}: fc.weight takes {fc_layers} target layers ([{hidden}, {fc_layers}*{hidden}]) "
            f"but {source} names {len(layer_ids)}: {layer_ids}"
        )

    layer_types = config.get("layer_types") or ["full_attention"] * num_layers
    is_causal = config.get("is_causal")
    windows: list[int | None] = []
    causal: list[bool] = []
    for kind in layer_types[:num_layers]:
        sliding = kind == "sliding_attention"
        if kind not in ("full_attention", "sliding_attention"):
            raise DrafterError(f"{cfg_path}: layer type {kind!r} is not supported")
        windows.append(int(config["sliding_window"]) if sliding else None)
        # z-lab: a layer is causal iff it slides, unless is_causal says otherwise.
        causal.append(sliding if is_causal is None else bool(is_causal))

    softcap = _draft_value(config, "final_logit_softcapping")
    return DrafterSpec(
        path=str(path),
        hidden_size=hidden,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=head_dim,
        intermediate_size=int(need("intermediate_size")),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=_rope_theta(config, cfg_path),
        block_size=int(_draft_value(config, "block_size", 16)),
        mask_token_id=int(mask_token_id),
        target_layer_ids=layer_ids,
        num_target_layers=None if num_target_layers is None else int(num_target_layers),
        fc_layers=fc_layers,
        vocab_size=config.get("vocab_size"),
        layer_windows=windows,
        layer_causal=causal,
        input_embedding_scale=float(_draft_value(config, "input_embedding_scale", 1.0)),
        output_multiplier=float(_draft_value(config, "output_multiplier", 1.0)),
        logit_softcap=None if softcap is None or float(softcap) <= 0 else float(softcap),
    )


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


def load_drafter(path: str | os.PathLike, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> Drafter:
    """Load and validate a z-lab format drafter checkpoint; raise DrafterError naming the problem."""
    path = Path(path)
    if not path.is_dir():
        raise DrafterError(f"{path}: not a directory")
    read_spec(path, partial=True)  # config errors first, before reading weights
    weights = read_weights(path)
    if "fc.weight" not in weights:
        raise DrafterError(f"{path}: no fc.weight in the checkpoint")
    spec = read_spec(path, tuple(weights["fc.weight"].shape))
    expected = _expected_shapes(spec)
    missing = [name for name in expected if name not in weights]
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise DrafterError(f"{path}: missing weights {missing[:5]}{more}")
    wrong = [f"{name} {list(weights[name].shape)} (expected {list(shape)})"
             for name, shape in expected.items() if tuple(weights[name].shape) != shape]
    if wrong:
        raise DrafterError(f"{path}: wrong weight shapes: {'; '.join(wrong[:5])}")
    if spec.num_heads % spec.num_kv_heads:
        raise DrafterError(f"{path}: num_attention_heads {spec.num_heads} is not a multiple of "
                           f"num_key_value_heads {spec.num_kv_heads}")
    return Drafter(spec, weights, device, dtype)


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
    args = parser.parse_args()
    ids = [int(k) for k in args.layer_ids.split(",")]
    print(save_random_drafter(args.out_dir, args.hidden, args.vocab, ids, args.target_layers, args.block_size,
                              args.layers, args.mask_token_id, args.seed))


if __name__ == "__main__":
    main()
