"""DFLASH speculative decoding in the rehearsal server: greedy output identical to plain greedy decoding,
SGLang's per-request counts consistent with what was emitted, and the drafter reading the right layers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

for _name in ("fla", "causal_conv1d"):  # CPU: keep the GPU-only kernels out, as the standin does
    sys.modules.setdefault(_name, None)  # type: ignore[arg-type]

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from console.drill.assets import ensure_assets  # noqa: E402
from remote.drafter import DrafterError, save_random_drafter  # noqa: E402
from remote.drill.drafters import SERVING_DTYPE  # noqa: E402
from remote.drill.specdecode import SpecOutput, load_speculator  # noqa: E402
from remote.prompts import load_prompts, prompt_token_ids  # noqa: E402


@pytest.fixture(scope="module")
def fp32_target(tiny_target: Path):
    return AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def random_drafters(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[tuple, Path]:
    """Random drafters of the tiny target's shape: block sizes 2, 4 and 8, various layers."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    mask = tok.convert_tokens_to_ids("<|mask|>")
    root = tmp_path_factory.mktemp("drafters")
    out = {}
    for block, layers in ((2, [0]), (4, [1, 3]), (8, [1, 2, 3])):
        out[(block, tuple(layers))] = save_random_drafter(root / f"b{block}", 64, len(tok), layers, 4, block_size=block,
                                                          mask_token_id=mask, seed=block, num_heads=4, num_kv_heads=2,
                                                          head_dim=16, intermediate_size=128, rope_theta=10000.0)
    return out


def plain_greedy(model, ids: list[int], max_new_tokens: int, eos_id: int, pad_id: int) -> list[int]:
    x = torch.tensor([ids])
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos_id, pad_token_id=pad_id)[0, len(ids):].tolist()
    return out[: out.index(eos_id) + 1] if eos_id in out else out


def check_counts(out: SpecOutput, max_new_tokens: int, eos_id: int) -> None:
    """What SGLang reports must follow from the rounds: r + 1 tokens per verify step after the prefill's one."""
    meta = out.meta_info()
    assert len(out.output_ids) <= max_new_tokens
    assert out.verify_ct == len(out.correct_drafts) == meta.get("spec_verify_ct", 0)
    assert all(0 <= r <= out.block_size - 1 for r in out.correct_drafts)
    produced = 1 + sum(r + 1 for r in out.correct_drafts)
    # Every round but the last emits all its tokens; the last may be cut by max_new_tokens or the EOS.
    assert produced >= len(out.output_ids)
    if out.correct_drafts:
        assert produced - (out.correct_drafts[-1] + 1) < len(out.output_ids)
    if out.finish == "length":
        assert len(out.output_ids) == max_new_tokens and eos_id not in out.output_ids
    else:
        assert out.output_ids[-1] == eos_id and eos_id not in out.output_ids[:-1]
    if meta:
        histogram = meta["spec_correct_drafts_histogram"]
        assert sum(histogram) == out.verify_ct
        assert sum(r * n for r, n in enumerate(histogram)) == meta["spec_num_correct_drafts"]
        assert meta["spec_accept_length"] == len(out.output_ids) / out.verify_ct
        assert meta["spec_num_proposed_drafts"] == out.verify_ct * (out.block_size - 1)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.lists(st.integers(0, 1 << 20), min_size=1, max_size=40), max_new=st.integers(1, 30),
       which=st.sampled_from([(2, (0,)), (4, (1, 3)), (8, (1, 2, 3))]))
def test_speculative_greedy_is_plain_greedy(fp32_target, tiny_target, random_drafters, prompt, max_new, which):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    prompt = [i % len(tok) for i in prompt]  # any token of the tiny target's vocabulary
    speculator = load_speculator(fp32_target, tiny_target, random_drafters[which])
    out = speculator.generate(prompt, max_new, {tok.eos_token_id})
    assert out.output_ids == plain_greedy(fp32_target, prompt, max_new, tok.eos_token_id, tok.pad_token_id)
    check_counts(out, max_new, tok.eos_token_id)


def test_the_end_of_sequence_token_ends_the_generation_inside_a_round(fp32_target, tiny_target, random_drafters):
    """The output stops right after the EOS token, even mid-round, finish "stop": the EOS is taken as the
    sixth token plain greedy emits (any id is an EOS to the decoder), so the cut falls inside a round."""
    tok = AutoTokenizer.from_pretrained(tiny_target)
    speculator = load_speculator(fp32_target, tiny_target, random_drafters[(4, (1, 3))])
    ids = [5, 6, 7, 8]
    free = plain_greedy(fp32_target, ids, 12, -1, tok.pad_token_id)
    eos = free[5]
    cut = free[: free.index(eos) + 1]
    out = speculator.generate(ids, 12, {eos})
    assert out.output_ids == cut and out.finish == "stop"
    check_counts(out, 12, eos)


def test_an_abort_ends_the_generation_before_the_next_verify_step(fp32_target, tiny_target, random_drafters):
    tok = AutoTokenizer.from_pretrained(tiny_target)
    speculator = load_speculator(fp32_target, tiny_target, random_drafters[(4, (1, 3))])
    asked = []
    out = speculator.generate([5, 6, 7, 8], 20, {tok.eos_token_id}, aborted=lambda: asked.append(1) or len(asked) > 2)
    assert out.finish == "abort" and out.verify_ct == 2 == len(asked) - 1
    full = plain_greedy(fp32_target, [5, 6, 7, 8], 20, tok.eos_token_id, tok.pad_token_id)
    assert out.output_ids == full[: len(out.output_ids)]


@pytest.fixture(scope="module")
def drill():
    return ensure_assets(say=lambda msg: None)


def test_reference_drafter_is_accepted_and_the_off_by_one_candidate_is_not(drill):
    """On the drill's prompts, served in bf16 as the drill serves: the reference's drafts (fitted on
    hidden_states[k+1]) are accepted far more than the candidate's (fitted on hidden_states[k]);
    both emit exactly plain greedy's tokens."""
    tok = AutoTokenizer.from_pretrained(drill.target)
    model = AutoModelForCausalLM.from_pretrained(drill.target, dtype=getattr(torch, SERVING_DTYPE)).eval()
    accept = {}
    for name in ("reference", "candidate"):
        speculator = load_speculator(model, drill.target, getattr(drill, name))
        tokens = steps = 0
        for prompt in load_prompts(drill.prompts).prompts:
            ids = prompt_token_ids(tok, prompt)
            out = speculator.generate(ids, prompt.max_new_tokens, {tok.eos_token_id})
            assert out.output_ids == plain_greedy(model, ids, prompt.max_new_tokens, tok.eos_token_id,
                                                  tok.pad_token_id)
            check_counts(out, prompt.max_new_tokens, tok.eos_token_id)
            tokens += len(out.output_ids)
            steps += out.verify_ct
        accept[name] = tokens / steps
    assert accept["reference"] > accept["candidate"] + 2.0, accept


def test_server_args_name_sglangs_speculative_settings(fp32_target, tiny_target, random_drafters):
    path = random_drafters[(8, (1, 2, 3))]
    args = load_speculator(fp32_target, tiny_target, path).server_args()
    assert args["speculative_algorithm"] == "DFLASH"
    assert args["speculative_draft_model_path"] == str(path)
    assert args["speculative_num_draft_tokens"] == args["speculative_dflash_block_size"] == 8


def test_a_drafter_that_cannot_draft_for_the_target_is_refused(fp32_target, tiny_target, tmp_path):
    wide = save_random_drafter(tmp_path / "wide", 32, 1024, [1], 4, block_size=4, mask_token_id=3)
    with pytest.raises(DrafterError, match="hidden_size 32"):
        load_speculator(fp32_target, tiny_target, wide)
    beyond = save_random_drafter(tmp_path / "beyond", 64, 1024, [1, 7], 8, block_size=4, mask_token_id=3)
    with pytest.raises(DrafterError, match=r"target_layer_ids \[7\] beyond the target's 4 layers"):
        load_speculator(fp32_target, tiny_target, beyond)
    with pytest.raises(DrafterError, match="not a directory"):
        load_speculator(fp32_target, tiny_target, tmp_path / "absent")


@pytest.mark.parametrize("survives", [False, True])
def test_a_weights_release_leaves_the_drafter_wrong_unless_the_switch_says_sglang_is_fixed(drill, survives):
    """SGLang 0.5.23 (PR #31674): after a `weights` release and resume the target is back, its drafter
    is not. The rehearsal server's memory saver does the same: the same greedy tokens, but acceptance ~1;
    `--draft-weights-survive-release` (a fixed SGLang) brings the drafter back too."""
    import threading
    from types import SimpleNamespace

    from remote.drill.memory_saver import MemorySaver
    from remote.drill.standin.arguments import parse_args

    tok = AutoTokenizer.from_pretrained(drill.target)
    model = AutoModelForCausalLM.from_pretrained(drill.target, dtype=getattr(torch, SERVING_DTYPE)).eval()
    speculator = load_speculator(model, drill.target, drill.reference)
    server = SimpleNamespace(model=SimpleNamespace(model=model, torch=torch, speculator=speculator),
                             counter_lock=threading.Lock(), running=[], waiting=[], flush_cache=lambda: None)
    switch = ["--draft-weights-survive-release"] if survives else []
    args = parse_args(["--model", str(drill.target), "--port", "1", "--enable-memory-saver",
                       "--enable-weights-cpu-backup", *switch])
    server.args = args
    saver = MemorySaver(server, args)
    ids = prompt_token_ids(tok, load_prompts(drill.prompts).prompts[0])

    def acceptance() -> tuple[list[int], float]:
        out = speculator.generate(ids, 48, {tok.eos_token_id})
        return out.output_ids, out.meta_info()["spec_accept_length"]

    tokens, before = acceptance()
    saver.release(["weights"])
    saver.resume(["weights"])
    tokens_after, after = acceptance()
    assert tokens_after == tokens  # the target verifies every token: outputs stay correct
    assert before > 2.0
    if survives:
        assert after == before
    else:
        assert after < 1.2, after
