"""The DFlash drafter: checkpoint loading and validation, and the forward's two forms agreeing with each
other and with transformers' own Qwen3 building blocks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote.drafter import (
    DrafterError,
    check_against_cache,
    load_drafter,
    save_random_drafter,
)
from remote.layers import default_target_layers

H = 64


@pytest.fixture(scope="module")
def gqa_drafter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three layers, GQA (4 query heads over 2 kv heads), block 5, random weights with larger norms."""
    path = tmp_path_factory.mktemp("drafters") / "gqa"
    save_random_drafter(path, H, 97, [1, 3], 4, block_size=5, num_layers=3, mask_token_id=96, seed=3,
                        num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96, rope_theta=500.0)
    return path


def _inputs(n: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(n, 2 * H, generator=gen)
    embed = torch.randn(97, H, generator=gen)
    tokens = torch.randint(0, 97, (n,), generator=gen)
    return feats, embed, tokens


def _sharpen(drafter) -> None:
    # Random 0.02-std weights give near-uniform attention; scale so that masks and positions matter.
    for name, w in drafter.w.items():
        if w.dim() == 2:
            drafter.w[name] = w * 25


def test_default_layer_ids() -> None:
    assert default_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layers(64, 1) == [32]


def test_load_reads_config_and_weights(gqa_drafter: Path) -> None:
    d = load_drafter(gqa_drafter)
    s = d.spec
    assert (s.hidden_size, s.num_layers, s.num_heads, s.num_kv_heads, s.head_dim) == (H, 3, 4, 2, 16)
    assert s.block_size == 5 and s.mask_token_id == 96 and s.target_layer_ids == [1, 3] and s.fc_layers == 2
    assert s.facts()["fc_width"] == 2


def test_wrong_fc_width_is_refused_naming_both_counts(tmp_path: Path) -> None:
    save_random_drafter(tmp_path / "bad", H, 97, [0, 1, 2, 3, 4], 8, block_size=4, mask_token_id=5, fc_layers=4)
    with pytest.raises(DrafterError) as err:
        load_drafter(tmp_path / "bad")
    msg = str(err.value)
    assert "takes 4 target layers" in msg and "names 5" in msg and "[0, 1, 2, 3, 4]" in msg


def test_missing_layer_ids_default_to_one_per_drafter_layer(tmp_path: Path) -> None:
    """z-lab's default: one target layer per drafter layer, spread over the target (EVAL-SPEC 1)."""
    path = save_random_drafter(tmp_path / "d", H, 97, [1, 9, 17, 25, 33], 36, block_size=4, mask_token_id=5,
                               num_layers=5)
    config = json.loads((path / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (path / "config.json").write_text(json.dumps(config))
    assert load_drafter(path).spec.target_layer_ids == [1, 9, 17, 25, 33]


def test_missing_layer_ids_with_an_fc_of_another_width_is_refused(tmp_path: Path) -> None:
    """The story's bug class: an fc over 5 layers in a 1-layer drafter without explicit ids must not be
    evaluated on layers guessed from the fc width; the error names both counts."""
    path = save_random_drafter(tmp_path / "d", H, 97, [1, 9, 17, 25, 33], 36, block_size=4, mask_token_id=5)
    config = json.loads((path / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=r"fc.weight takes 5 target layers .* the default for 1 drafter layers\) names 1: \[18\]"):
        load_drafter(path)


def test_cache_lacking_layers_is_named(gqa_drafter: Path) -> None:
    spec = load_drafter(gqa_drafter).spec
    with pytest.raises(DrafterError, match=r"fc takes 2 layers \[1, 3\].*holds 2 layers \[1, 2\]; missing: \[3\]"):
        check_against_cache(spec, [1, 2], H, "mine")
    with pytest.raises(DrafterError, match="hidden_size 64 but the cached hidden states have 128"):
        check_against_cache(spec, [1, 3], 128, "mine")
    check_against_cache(spec, [0, 1, 2, 3], H, "mine")


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "expected \\['DFlashDraftModel'\\]"),
    (lambda c: c.pop("hidden_size"), "missing field 'hidden_size'"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4}), "rope_type 'yarn' is not supported"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "no mask_token_id"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
])
def test_bad_configs_are_named(tmp_path: Path, edit, message: str) -> None:
    path = save_random_drafter(tmp_path / "d", H, 97, [1, 3], 4, block_size=4, mask_token_id=5)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=message):
        load_drafter(path)


def test_missing_and_misshapen_weights(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = save_random_drafter(tmp_path / "d", H, 97, [1, 3], 4, block_size=4, mask_token_id=5)
    weights = load_file(str(path / "model.safetensors"))
    weights["layers.0.mlp.up_proj.weight"] = torch.zeros(3, H)
    del weights["norm.weight"]
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match="missing weights \\['norm.weight'\\]"):
        load_drafter(path)
    weights["norm.weight"] = torch.ones(H)
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match=r"layers.0.mlp.up_proj.weight \[3, 64\] \(expected \[192, 64\]\)"):
        load_drafter(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(DrafterError, match="no safetensors weights"):
        load_drafter(path)
    with pytest.raises(DrafterError, match="no config.json"):
        load_drafter(tmp_path)


@pytest.fixture(scope="module")
def naive_outputs(gqa_drafter: Path) -> torch.Tensor:
    """The one-anchor-at-a-time reference at every anchor 1..38 (computed once)."""
    d = load_drafter(gqa_drafter)
    _sharpen(d)
    feats, embed, tokens = _inputs()
    return torch.stack([d.reference_hidden(feats, embed, tokens, a) for a in range(1, 39)])


@settings(max_examples=10, deadline=None)
@given(chunk=st.integers(1, 40), first=st.integers(1, 20))
def test_batched_equals_one_anchor_reference(gqa_drafter: Path, naive_outputs: torch.Tensor, chunk: int,
                                             first: int) -> None:
    d = load_drafter(gqa_drafter)
    _sharpen(d)
    feats, embed, tokens = _inputs()
    anchors = torch.arange(first, 39)
    ctx = d.context_kv(feats)
    batched = torch.cat([d.block_hidden(ctx, embed, tokens, anchors[i:i + chunk])
                         for i in range(0, len(anchors), chunk)])
    assert batched.shape == (len(anchors), 4, H)
    torch.testing.assert_close(batched, naive_outputs[first - 1:], atol=2e-5, rtol=1e-4)


def test_sliding_window_layers_agree(tmp_path: Path) -> None:
    path = save_random_drafter(tmp_path / "d", H, 97, [1, 3], 4, block_size=5, num_layers=2, mask_token_id=96,
                               seed=1, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=96)
    config = json.loads((path / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    (path / "config.json").write_text(json.dumps(config))
    d = load_drafter(path)
    assert d.spec.layer_windows == [6, None] and d.spec.layer_causal == [True, False]
    _sharpen(d)
    feats, embed, tokens = _inputs()
    anchors = torch.arange(8, 39)
    batched = d.block_hidden(d.context_kv(feats), embed, tokens, anchors)
    naive = torch.stack([d.reference_hidden(feats, embed, tokens, int(a)) for a in anchors])
    torch.testing.assert_close(batched, naive, atol=2e-5, rtol=1e-4)
    full = load_drafter(gqa_drafter_like(tmp_path, config))
    _sharpen(full)
    assert not torch.allclose(full.block_hidden(full.context_kv(feats), embed, tokens, anchors), batched, atol=1e-3)


def gqa_drafter_like(tmp_path: Path, config: dict) -> Path:
    """The same checkpoint with full attention everywhere (to show the window changes the output)."""
    import shutil

    other = tmp_path / "full"
    shutil.copytree(tmp_path / "d", other)
    config = dict(config, layer_types=["full_attention", "full_attention"])
    (other / "config.json").write_text(json.dumps(config))
    return other


def test_matches_transformers_qwen3_blocks(gqa_drafter: Path) -> None:
    """One anchor computed with transformers' Qwen3RMSNorm / RotaryEmbedding / apply_rotary_pos_emb /
    Qwen3MLP and z-lab's attention layout (k_norm and RoPE on context and block keys alike)."""
    from transformers import Qwen3Config
    from transformers.models.qwen3 import modeling_qwen3 as q3

    d = load_drafter(gqa_drafter)
    _sharpen(d)
    s, w = d.spec, d.w
    feats, embed, tokens = _inputs()
    cfg = Qwen3Config(hidden_size=H, intermediate_size=s.intermediate_size, num_attention_heads=s.num_heads,
                      num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
                      rope_theta=s.rope_theta, max_position_embeddings=4096)
    rotary = q3.Qwen3RotaryEmbedding(cfg)

    def norm(weight: torch.Tensor, dim: int) -> q3.Qwen3RMSNorm:
        m = q3.Qwen3RMSNorm(dim, eps=s.rms_norm_eps)
        m.weight.data.copy_(weight)
        return m

    a, B = 30, s.block_size
    with torch.no_grad():
        ctx = norm(w["hidden_norm.weight"], H)(feats[:a] @ w["fc.weight"].T)[None]
        ids = torch.full((1, B), s.mask_token_id)
        ids[0, 0] = tokens[a]
        h = embed[ids]
        pos = torch.arange(a + B)[None]
        cos, sin = rotary(h, pos)
        for i in range(s.num_layers):
            p = f"layers.{i}."
            n = norm(w[p + "input_layernorm.weight"], H)(h)
            q = (n @ w[p + "self_attn.q_proj.weight"].T).view(1, B, -1, s.head_dim)
            q = norm(w[p + "self_attn.q_norm.weight"], s.head_dim)(q).transpose(1, 2)
            both = torch.cat([ctx, n], dim=1)
            k = (both @ w[p + "self_attn.k_proj.weight"].T).view(1, a + B, -1, s.head_dim)
            k = norm(w[p + "self_attn.k_norm.weight"], s.head_dim)(k).transpose(1, 2)
            v = (both @ w[p + "self_attn.v_proj.weight"].T).view(1, a + B, -1, s.head_dim).transpose(1, 2)
            q, _ = q3.apply_rotary_pos_emb(q, q, cos[:, a:], sin[:, a:])
            _, k = q3.apply_rotary_pos_emb(k, k, cos, sin)
            groups = s.num_heads // s.num_kv_heads
            attn = torch.softmax(q @ q3.repeat_kv(k, groups).transpose(2, 3) / s.head_dim ** 0.5, -1)
            out = (attn @ q3.repeat_kv(v, groups)).transpose(1, 2).reshape(1, B, -1)
            h = h + out @ w[p + "self_attn.o_proj.weight"].T
            mlp = q3.Qwen3MLP(cfg)
            mlp.gate_proj.weight.data.copy_(w[p + "mlp.gate_proj.weight"])
            mlp.up_proj.weight.data.copy_(w[p + "mlp.up_proj.weight"])
            mlp.down_proj.weight.data.copy_(w[p + "mlp.down_proj.weight"])
            h = h + mlp(norm(w[p + "post_attention_layernorm.weight"], H)(h))
        expected = norm(w["norm.weight"], H)(h)[0, 1:]
        ours = d.block_hidden(d.context_kv(feats), embed, tokens, torch.tensor([a]))[0]
    torch.testing.assert_close(ours, expected, atol=2e-5, rtol=1e-4)
