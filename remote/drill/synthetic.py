"""Synthetic inputs for the evaluator: extraction directories in the extractor's exact format, and a
hand-built "copying" drafter that runs the real DFlash forward yet always drafts the truth.

Used by the tests and the benchmark; nothing here is used to evaluate a real drafter.

Extraction format (the extract worker's): per prompt `<id>.safetensors` holding `hidden` bf16
[T, n_layers, H] (order = manifest `layers`), `input_ids` int64 [T], `g` int64 [T], `topk_ids` [T, 8],
`topk_logprobs` [T, 8], metadata `prompt_id`, `prompt_len`, `layers` (JSON); `manifest.json` last.

The copying drafter (`save_copying_drafter` + `copying_states`), vocabulary V, hidden H = V + 2
(dims 0..V-1: a token one-hot, V: a constant unit, V+1: the embedding marker):
- the cache: layer `copy_layer` at position p holds one-hot(g[p+B-1] + shift) + the constant unit; the
  other cached layers hold noise, so reading the wrong layer breaks the copy;
- fc passes that layer's block through; every target embedding is the marker unit, so the block's
  queries are one fixed vector per slot before RoPE;
- the query is the key direction rotated back by B positions in every RoPE frequency pair, so after
  RoPE the score peaks where (query position - key position) == B: slot j (position a+j) attends to
  the context position a+j-B, whose value is one-hot(g[a+j-1]); block keys are zero. q_norm's weight
  makes the softmax nearly hard;
- o_proj writes the value into the token subspace, the MLP is zero, and the target lm_head reads the
  token subspace: slot j's top-1 is g[a+j-1] (shift 0), or never the truth (shift 1).
It needs a >= B-1 (every anchor's context reaches B positions back), i.e. prompt_len >= B-1.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from remote.artifacts import atomic_path, write_manifest
from remote.drafter import drafter_config, save_drafter
from remote.target_io import save_target_heads


def write_extraction(out: str | os.PathLike, prompts: list[dict[str, Any]], layers: list[int], hidden_size: int,
                     model_path: str = "synthetic", kernels: dict | None = None, soundness: bool = True) -> Path:
    """Write an extraction directory. Each prompt: {"id", "prompt_len", "input_ids", "g", "hidden"}.

    `hidden` [T, len(layers), H] (stored bf16); top-k fields are filled from `g` (rank 1 = g). The
    manifest carries the extractor's per-layer `soundness` (computed by the same code, from the saved
    bf16 states) unless `soundness` is false (an extraction made before it existed).
    """
    from safetensors.torch import save_file

    from remote.soundness import Accumulator

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    entries = []
    stats = Accumulator(layers)
    for prompt in prompts:
        ids = prompt["input_ids"].long()
        g = prompt["g"].long()
        t = ids.shape[0]
        topk_ids = torch.stack([g.clamp(min=0) + i for i in range(8)], dim=1)
        topk_lp = torch.linspace(-0.1, -8.0, 8).expand(t, 8).contiguous()
        name = f"{prompt['id']}.safetensors"
        with atomic_path(out / name) as tmp:
            save_file({
                "hidden": prompt["hidden"].to(torch.bfloat16).contiguous(),
                "input_ids": ids.contiguous(), "g": g.contiguous(),
                "topk_ids": topk_ids, "topk_logprobs": topk_lp.float(),
            }, str(tmp), metadata={"prompt_id": prompt["id"], "prompt_len": str(prompt["prompt_len"]),
                                   "layers": json.dumps(layers)})
        stats.add(prompt["hidden"].to(torch.bfloat16))
        files[name] = {"prompt_id": prompt["id"]}
        entries.append({"id": prompt["id"], "file": name, "prompt_len": int(prompt["prompt_len"]), "num_tokens": t})
    extra = {"soundness": stats.result()} if soundness else {}
    write_manifest(out, files, format="dflash-ops.extract/1", layers=layers, hidden_size=hidden_size, prompts=entries,
                   model_path=model_path, kernels=kernels or {}, dtype="bfloat16", **extra)
    return out


def random_sequences(count: int, prompt_len: int, num_tokens: int, vocab: int, mismatch_every: int = 0,
                     seed: int = 0) -> list[dict[str, Any]]:
    """Token sequences x and the target's argmax g (g[p] = x[p+1], changed every `mismatch_every`
    completion positions to model a serving-vs-HF mismatch; g[N-1] = -1)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        x = torch.randint(0, vocab, (num_tokens,), generator=gen)
        g = torch.full((num_tokens,), -1, dtype=torch.long)
        g[:-1] = x[1:]
        if mismatch_every:
            for p in range(prompt_len - 1, num_tokens - 1, mismatch_every):
                g[p] = (x[p + 1] + 1) % vocab
        out.append({"id": f"prompt{i:02d}", "prompt_len": prompt_len, "input_ids": x, "g": g})
    return out


def copying_states(sequences: list[dict[str, Any]], vocab: int, block_size: int, layers: list[int], copy_layer: int,
                   shift: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """Add `hidden` to each sequence: `copy_layer` encodes g[p+B-1] + shift, other layers noise."""
    hidden_size = vocab + 2
    gen = torch.Generator().manual_seed(seed + 1)
    out = []
    for seq in sequences:
        g = seq["g"]
        t = g.shape[0]
        hidden = torch.randn(t, len(layers), hidden_size, generator=gen)
        code = torch.zeros(t, hidden_size)
        code[:, vocab] = 1.0
        ahead = torch.arange(t) + block_size - 1
        valid = ahead < t
        future = torch.where(valid, g[ahead.clamp(max=t - 1)], torch.full_like(g, -1))
        ok = future >= 0
        code[ok.nonzero()[:, 0], (future[ok] + shift) % vocab] = 1.0
        hidden[:, layers.index(copy_layer)] = code
        out.append({**seq, "hidden": hidden})
    return out


def save_copying_target(path: str | os.PathLike, vocab: int, read_scale: float = 4.0) -> Path:
    """A target checkpoint with only the heads: every embedding = the marker unit, lm_head reads the token dims."""
    hidden_size = vocab + 2
    embed = torch.zeros(vocab, hidden_size)
    embed[:, vocab + 1] = 1.0
    lm_head = torch.zeros(vocab, hidden_size)
    lm_head[:, :vocab] = torch.eye(vocab) * read_scale
    return save_target_heads(path, embed.to(torch.bfloat16), lm_head.to(torch.bfloat16))


def save_copying_drafter(path: str | os.PathLike, vocab: int, block_size: int, target_layer_ids: list[int],
                         copy_layer: int, num_target_layers: int, num_layers: int = 2, sharpness: float = 100.0,
                         rope_theta: float = 10000.0) -> Path:
    """The hand-built drafter described in the module docstring (head_dim = vocab, 2 query heads, 1 kv head).

    Layers after the first are identity (zero o_proj and down_proj) so stacking is exercised too.
    """
    hidden_size = vocab + 2
    head_dim = vocab
    if head_dim % 2:
        raise ValueError("vocab must be even (it is the head dimension)")
    config = drafter_config(hidden_size, target_layer_ids, num_target_layers, block_size, num_layers,
                            mask_token_id=vocab - 1, vocab_size=vocab, num_heads=2, num_kv_heads=1,
                            head_dim=head_dim, intermediate_size=8, rope_theta=rope_theta)
    n = len(target_layer_ids)
    const, marker = vocab, vocab + 1
    w: dict[str, torch.Tensor] = {}
    fc = torch.zeros(hidden_size, n * hidden_size)
    block = target_layer_ids.index(copy_layer)
    fc[:, block * hidden_size:(block + 1) * hidden_size] = torch.eye(hidden_size)
    w["fc.weight"] = fc
    w["hidden_norm.weight"] = torch.ones(hidden_size)
    w["norm.weight"] = torch.ones(hidden_size)
    half = head_dim // 2
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    key_dir = torch.cat([torch.ones(half), torch.zeros(half)])
    # Rotating a (1, 0) pair by -B*w: after RoPE, q.k ~ sum_i cos(w_i (qpos - kpos - B)).
    query_dir = torch.cat([torch.cos(-block_size * inv_freq), torch.sin(-block_size * inv_freq)])
    for i in range(num_layers):
        p = f"layers.{i}."
        q = torch.zeros(2 * head_dim, hidden_size)
        k = torch.zeros(head_dim, hidden_size)
        v = torch.zeros(head_dim, hidden_size)
        o = torch.zeros(hidden_size, 2 * head_dim)
        if i == 0:
            q[:head_dim, marker] = query_dir
            q[head_dim:, marker] = query_dir
            k[:, const] = key_dir
            v[:vocab, :vocab] = torch.eye(vocab)
            o[:vocab, :vocab] = torch.eye(vocab)
        w.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": o,
            p + "self_attn.q_norm.weight": torch.full((head_dim,), sharpness),
            p + "self_attn.k_norm.weight": torch.ones(head_dim),
            p + "input_layernorm.weight": torch.ones(hidden_size),
            p + "post_attention_layernorm.weight": torch.ones(hidden_size),
            p + "mlp.gate_proj.weight": torch.zeros(8, hidden_size),
            p + "mlp.up_proj.weight": torch.zeros(8, hidden_size),
            p + "mlp.down_proj.weight": torch.zeros(hidden_size, 8),
        })
    return save_drafter(path, config, {name: t.float() for name, t in w.items()})


def build_copying_setup(root: str | os.PathLike, vocab: int = 32, block_size: int = 16, prompts: int = 3,
                        prompt_len: int = 20, num_tokens: int = 90, shift: int = 0, mismatch_every: int = 7,
                        seed: int = 0) -> dict[str, Path]:
    """States dir + target heads + copying drafter under `root`; returns their paths."""
    root = Path(root)
    layers, ids, copy_layer = [0, 1, 2], [1, 2], 2
    seqs = random_sequences(prompts, prompt_len, num_tokens, vocab, mismatch_every, seed)
    states = write_extraction(root / "states", copying_states(seqs, vocab, block_size, layers, copy_layer, shift, seed),
                              layers, vocab + 2)
    target = save_copying_target(root / "target", vocab)
    drafter = save_copying_drafter(root / "drafter", vocab, block_size, ids, copy_layer, num_target_layers=4)
    return {"states": states, "target": target, "drafter": drafter}
