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


def _without_ids(path: Path) -> Path:
    config = json.loads((path / "config.json").read_text())
    del config["dflash_config"]["target_layer_ids"]
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_missing_layer_ids_are_refused_with_the_formula_only_as_a_guess(tmp_path: Path) -> None:
    """z-lab/dflash PR #157: target_layer_ids is required; the formula's answer is offered as a guess only."""
    path = _without_ids(save_random_drafter(tmp_path / "d", H, 97, [1, 9, 17, 25, 33], 36, block_size=4,
                                            mask_token_id=5, num_layers=5))
    with pytest.raises(DrafterError) as err:
        load_drafter(path)
    msg = str(err.value)
    assert "\n" not in msg and "target_layer_ids' is missing and required" in msg and "PR #157" in msg
    assert "would guess [1, 9, 17, 25, 33] for 5 drafter layers" in msg and "only a guess" in msg
    assert "--layers-override d=" in msg and str(path / "config.json") in msg
    # control: the same checkpoint with the ids loads
    assert load_drafter(save_random_drafter(tmp_path / "ok", H, 97, [1, 9, 17, 25, 33], 36, block_size=4,
                                            mask_token_id=5, num_layers=5)).spec.target_layer_ids == [1, 9, 17, 25, 33]


def test_missing_ids_with_an_fc_of_another_width_offers_both_guesses(tmp_path: Path) -> None:
    """The story's bug class: a 1-layer drafter whose fc takes 5 layers; the refusal names both counts."""
    path = _without_ids(save_random_drafter(tmp_path / "d", H, 97, [1, 9, 17, 25, 33], 36, block_size=4,
                                            mask_token_id=5))
    with pytest.raises(DrafterError, match=r"guess \[18\] for 1 drafter layers or \[1, 9, 17, 25, 33\] for 5 fc width"):
        load_drafter(path)


def test_layers_override_replaces_the_ids_and_says_so(tmp_path: Path) -> None:
    path = _without_ids(save_random_drafter(tmp_path / "d", H, 97, [1, 3], 4, block_size=4, mask_token_id=5))
    spec = load_drafter(path, layers_override=[0, 2]).spec
    assert spec.target_layer_ids == [0, 2] and spec.layers_source == "override" and spec.config_layer_ids is None
    assert spec.facts()["layers_source"] == "override"
    with pytest.raises(DrafterError, match=r"fc.weight takes 2 target layers .* the layers override names 3: \[0, 1, 2\]"):
        load_drafter(path, layers_override=[0, 1, 2])
    with pytest.raises(DrafterError, match=r"layer 2 repeated in \[2, 2\]"):
        load_drafter(path, layers_override=[2, 2])
    intact = load_drafter(save_random_drafter(tmp_path / "ok", H, 97, [1, 3], 4, block_size=4, mask_token_id=5)).spec
    assert intact.layers_source == "config" and intact.config_layer_ids == [1, 3]


def test_cache_lacking_layers_is_named(gqa_drafter: Path) -> None:
    spec = load_drafter(gqa_drafter).spec
    with pytest.raises(DrafterError, match=r"fc takes 2 layers \[1, 3\].*holds 2 layers \[1, 2\]; missing: \[3\]"):
        check_against_cache(spec, [1, 2], H, "mine")
    with pytest.raises(DrafterError, match="hidden_size 64 but the cached hidden states have 128"):
        check_against_cache(spec, [1, 3], 128, "mine")
    check_against_cache(spec, [0, 1, 2, 3], H, "mine")


def _set_sub(key: str, value):
    return lambda c: c["dflash_config"].update({key: value})


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(architectures=["DFlash2DraftModel"]), "expected \\['DFlashDraftModel'\\]"),
    (lambda c: c.pop("hidden_size"), "missing field 'hidden_size'"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4}), "rope_type 'yarn' is not supported"),
    (lambda c: c["dflash_config"].pop("mask_token_id"), "no mask_token_id"),
    (lambda c: c.update(hidden_act="gelu"), "hidden_act 'gelu'"),
    (lambda c: c.update(num_attention_heads=0), "field 'num_attention_heads': expected an integer >= 1, found 0"),
    (lambda c: c.update(num_attention_heads="4"), "field 'num_attention_heads': expected an integer >= 1, found '4'"),
    (lambda c: c.update(num_key_value_heads=3), "field 'num_key_value_heads': expected a divisor of num_attention_heads 4, found 3"),
    (lambda c: c.update(head_dim=15), "field 'head_dim': expected an even integer"),
    (lambda c: c.update(head_dim=True), "field 'head_dim': expected an integer >= 2, found true"),
    (lambda c: c.update(block_size=1), "field 'block_size': expected an integer >= 2, found 1"),
    (lambda c: c.pop("block_size"), "missing field 'block_size'"),
    (_set_sub("mask_token_id", 97), "field 'dflash_config.mask_token_id': expected an integer >= 0 and < 97, found 97"),
    (_set_sub("mask_token_id", -1), "field 'dflash_config.mask_token_id': expected an integer >= 0 and < 97, found -1"),
    (_set_sub("target_layer_ids", ["1", 3]), "field 'dflash_config.target_layer_ids': expected a non-empty list of integer"),
    (_set_sub("target_layer_ids", [3, 3]), "field 'dflash_config.target_layer_ids': layer 3 repeated in \\[3, 3\\]"),
    (_set_sub("target_layer_ids", []), "expected a non-empty list of integer layer ids, found \\[\\]"),
    (_set_sub("target_layer_ids", [1, 4]), "target layer ids \\[4\\] \\(config\\) are beyond num_target_layers 4"),
    (lambda c: c.update(dflash_config=[1, 2]), "field 'dflash_config': expected an object"),
    (lambda c: c.update(layer_types=["full_attention", "full_attention"]), "field 'layer_types': expected a list of 1"),
    (lambda c: c.update(layer_types=["mamba"]), "field 'layer_types\\[0\\]': expected 'full_attention' or 'sliding_attention', found 'mamba'"),
    (lambda c: c.update(layer_types=["sliding_attention"], sliding_window=None), "missing field 'sliding_window'"),
    (lambda c: c.update(layer_types=["sliding_attention"], sliding_window=0), "field 'sliding_window': expected an integer >= 1, found 0"),
    (lambda c: c.update(is_causal="yes"), "field 'is_causal': expected true, false or null"),
    (lambda c: c.update(rms_norm_eps=0), "field 'rms_norm_eps': expected a finite number > 0, found 0"),
    (lambda c: c.update(rope_theta=-1.0), "field 'rope_theta': expected a finite number > 0"),
    (lambda c: c.update(intermediate_size=0), "field 'intermediate_size': expected an integer >= 1, found 0"),
    (lambda c: c.update(num_hidden_layers=0), "field 'num_hidden_layers': expected an integer >= 1, found 0"),
])
def test_bad_configs_are_named(tmp_path: Path, edit, message: str) -> None:
    """Each bad field ends in one line naming the file, the field, expected vs found; never a traceback
    from the forward. The intact checkpoint (control) loads."""
    path = save_random_drafter(tmp_path / "d", H, 97, [1, 3], 4, block_size=4, mask_token_id=5)
    load_drafter(path)
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterError, match=message) as err:
        load_drafter(path)
    assert "\n" not in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("name, value", [
    ("layers.0.mlp.up_proj.weight", float("nan")),
    ("fc.weight", float("inf")),
    ("norm.weight", float("-inf")),
])
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path: Path, name: str, value: float) -> None:
    from safetensors.torch import load_file, save_file

    path = save_random_drafter(tmp_path / "d", H, 97, [1, 3], 4, block_size=4, mask_token_id=5)
    load_drafter(path)  # control
    weights = load_file(str(path / "model.safetensors"))
    weights[name] = weights[name].clone()
    weights[name].view(-1)[:3] = value
    save_file(weights, str(path / "model.safetensors"))
    with pytest.raises(DrafterError, match=rf"tensor '{name}' holds \d NaN and \d Inf of \d+ values: refused") as err:
        load_drafter(path)
    assert "\n" not in str(err.value)


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
