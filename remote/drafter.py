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

The checkpoint's config, its checks and the provenance worker live in `remote.provenance`, which
imports no torch (the preflight runs it on every drafter host); they are re-exported here.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from remote.layers import LayerIdsError, default_target_layers, missing_layer_ids_message  # noqa: F401
from remote.provenance import (  # noqa: F401 - the checkpoint's config and provenance, re-exported
    ARCHITECTURE,
    DrafterError,
    DrafterSpec,
    WeightFacts,
    _expected_shapes,
    _fc_shape_or_none,
    check_against_cache,
    check_weight_facts,
    fc_shape_of,
    parse_layer_ids,
    parse_overrides,
    provenance,
    provenance_main,
    read_spec,
    read_spec_from_config,
    states_facts,
    target_vocab_size,
)
from remote.weights import safetensors_files


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


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def check_weights(path: Path, spec: DrafterSpec, weights: dict[str, torch.Tensor]) -> None:
    """`check_weight_facts` on loaded tensors: present, of their shape, floating point and finite."""
    facts = {}
    for name, tensor in weights.items():
        dtype = str(tensor.dtype).replace("torch.", "")
        nan = inf = 0
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            nan, inf = int(tensor.isnan().sum()), int(tensor.isinf().sum())
        facts[name] = WeightFacts(tuple(tensor.shape), _SAFETENSORS_DTYPES.get(dtype, dtype), nan, inf)
    check_weight_facts(path, spec, facts)


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

    if "--provenance" in sys.argv[1:]:  # the worker's old address (`python -m remote.provenance` imports no torch)
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
