"""The evaluate worker end to end: real files, a hand-built copying drafter, the real extractor on the
tiny target, and the clear errors operators rely on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from remote.drafter import load_drafter, save_random_drafter
from remote.drill.synthetic import build_copying_setup, random_sequences, write_extraction
from remote.evaluate import draft_topk, draft_topk_naive
from remote.evaluate import main as evaluate_main
from remote.events import EventWriter, WorkerError
from remote.metrics import compute
from remote.target_io import read_target_heads, save_target_heads
from tests.fixtures_models import run_module

ROOT = Path(__file__).resolve().parents[1]


def run_evaluate(tmp_path: Path, *args: str) -> tuple[int, list[dict]]:
    """Run `python -m remote.evaluate` as the console does; return its exit code and events."""
    code, events = run_module("remote.evaluate", list(args), tmp_path, timeout=300)
    assert events and events[-1]["type"] == "exit", events[-3:]
    return code, events


def evaluate_error(tmp_path: Path, *args: str) -> str:
    """Run the worker's main in this process (no interpreter start-up) and return its clear error."""
    with pytest.raises(WorkerError) as err:
        evaluate_main(EventWriter(path=str(tmp_path / "inproc-events.jsonl")), list(args))
    return err.value.msg


def _error(events: list[dict]) -> str:
    return next(e["msg"] for e in events if e["type"] == "error")


@pytest.fixture(scope="module")
def copying(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("copying")
    paths = build_copying_setup(root / "right", block_size=16)
    paths["never"] = build_copying_setup(root / "wrong", block_size=16, shift=1)["states"]
    return paths


def test_copying_drafter_reaches_tau_b(copying: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, events = run_evaluate(tmp_path, "--states", str(copying["states"]), "--target", str(copying["target"]),
                                "--drafter", f"copy={copying['drafter']}", "--out", str(out), "--device", "cpu",
                                "--budgets", "8,16", "--topk", "8", "--anchor-chunk", "7")
    assert code == 0, _error(events)
    results = json.loads((out / "results.json").read_text())
    m = results["drafters"]["copy"]
    assert m["tau"]["vanilla"]["macro"] == 16.0 and m["tau"]["vanilla"]["micro"] == 16.0  # tau = B
    assert m["pos1_acc"] == 1.0 and m["per_position"] == [1.0] * 15
    assert m["tau"]["ddtree-b8"]["macro"] == 9.0 and m["tau"]["ddtree-b16"]["macro"] == 16.0
    assert m["g_x_mismatch"] == pytest.approx(10 / 70, abs=1e-9)  # every 7th of 70 completion positions
    assert m["facts"]["layers"] == [1, 2] and m["facts"]["fc_width"] == 2 and m["facts"]["block_size"] == 16
    assert results["reference"] == "copy"
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) == {"results.json", "copy/prompt00.safetensors", "copy/prompt01.safetensors",
                                      "copy/prompt02.safetensors"}
    # The dump is EVAL-SPEC section 4 exactly (plus input_ids for the g-vs-x diagnostic).
    with safe_open(str(out / "copy" / "prompt01.safetensors"), "pt") as fh:
        meta = fh.metadata()
        t = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
    assert meta == {"prompt_len": "20", "block_size": "16", "prompt_id": "prompt01", "drafter": "copy",
                    "vocab_size": "32"}
    assert t["anchors"].tolist() == list(range(20, 89)) and t["anchors"].dtype == torch.int64
    assert t["topk_ids"].shape == (69, 15, 16) and t["topk_ids"].dtype == torch.int64
    assert t["topk_logprobs"].dtype == torch.float32
    assert (t["topk_logprobs"][..., :-1] >= t["topk_logprobs"][..., 1:]).all()
    assert t["truth"].shape == (90,) and t["truth"][-1] == -1
    progress = [e for e in events if e["type"] == "progress" and e["key"] == "prompts"]
    assert [p["done"] for p in progress] == [1, 2, 3] and "copy [3/3] prompt02" in progress[-1]["label"]
    # The metrics command recomputes the same figures from the dumps alone.
    again = compute(out, [8, 16], 8)["drafters"]["copy"]
    assert again["tau"] == m["tau"] and again["per_prompt"] == m["per_prompt"]


def test_two_drafters_and_never_right(copying: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "out"
    # The same drafter on states whose encoded token is always off by one: never right.
    code, events = run_evaluate(tmp_path, "--states", str(copying["never"]), "--target", str(copying["target"]),
                                "--drafter", f"a={copying['drafter']}", "--drafter", f"b={copying['drafter']}",
                                "--reference", "b", "--out", str(out), "--device", "auto", "--budgets", "8")
    assert code == 0, _error(events)
    results = json.loads((out / "results.json").read_text())
    assert results["reference"] == "b" and set(results["drafters"]) == {"a", "b"}
    for m in results["drafters"].values():
        assert m["tau"]["vanilla"]["macro"] == 1.0 and m["pos1_acc"] == 0.0
        # The sure-but-wrong top-1 makes the budget-8 tree a chain of rank-1 nodes: also never right.
        assert m["tau"]["ddtree-b8"]["macro"] == 1.0


def test_wrong_fc_width_is_a_clear_error(copying: dict[str, Path], tmp_path: Path) -> None:
    bad = save_random_drafter(tmp_path / "bad", 34, 32, [0, 1, 2], 4, block_size=4, mask_token_id=3, fc_layers=2)
    code, events = run_evaluate(tmp_path, "--states", str(copying["states"]), "--target", str(copying["target"]),
                                "--drafter", f"bad={bad}", "--out", str(tmp_path / "out"), "--device", "cpu")
    assert code == 2
    err = next(e for e in events if e["type"] == "error")
    assert "fc.weight takes 2 target layers" in err["msg"] and "names 3: [0, 1, 2]" in err["msg"]
    assert err["where"] == str(bad)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_drafter_needing_uncached_layers_names_them(copying: dict[str, Path], tmp_path: Path) -> None:
    other = save_random_drafter(tmp_path / "other", 34, 32, [2, 3, 5], 8, block_size=4, mask_token_id=3)
    msg = evaluate_error(tmp_path, "--states", str(copying["states"]), "--target", str(copying["target"]),
                         "--drafter", f"ok={copying['drafter']}", "--drafter", f"other={other}",
                         "--out", str(tmp_path / "out"), "--device", "cpu")
    assert "fc takes 3 layers [2, 3, 5] (target_layer_ids)" in msg and "holds layers [0, 1, 2]: missing [3, 5]" in msg
    assert not (tmp_path / "out" / "ok").exists()  # refused before any work


def test_incomplete_states_and_bad_arguments(copying: dict[str, Path], tmp_path: Path) -> None:
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "prompt00.safetensors").write_bytes(b"")
    common = ["--target", str(copying["target"]), "--out", str(tmp_path / "o")]
    assert "no manifest.json: the output is incomplete" in evaluate_error(
        tmp_path, "--states", str(incomplete), "--drafter", f"d={copying['drafter']}", *common)
    assert "expected NAME=PATH" in evaluate_error(tmp_path, "--states", str(copying["states"]), "--drafter", "nopath",
                                                  *common)
    assert "no safetensors weights" in evaluate_error(
        tmp_path, "--states", str(copying["states"]), "--drafter", f"d={copying['drafter']}",
        "--out", str(tmp_path / "o"), "--target", str(tmp_path))
    assert "--reference 'zz' is not one of the drafters ['d']" in evaluate_error(
        tmp_path, "--states", str(copying["states"]), "--drafter", f"d={copying['drafter']}", "--reference", "zz",
        *common)
    assert "'x' is not a positive integer" in evaluate_error(
        tmp_path, "--states", str(copying["states"]), "--drafter", f"d={copying['drafter']}", "--budgets", "8,x",
        *common)
    # A prompt file that does not hold what the manifest says is named.
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(copying["states"], broken)
    manifest = json.loads((broken / "manifest.json").read_text())
    manifest["layers"] = [0, 1, 2, 4]
    (broken / "manifest.json").write_text(json.dumps(manifest))
    msg = evaluate_error(tmp_path, "--states", str(broken), "--drafter", f"d={copying['drafter']}", *common)
    assert "prompt00.safetensors: hidden has shape [90, 3, 34], expected [90, 4, 34]" in msg


def test_target_heads_read_alone(tmp_path: Path) -> None:
    embed, head = torch.randn(11, 6), torch.randn(11, 6)
    save_target_heads(tmp_path / "sharded", embed, head)
    heads = read_target_heads(tmp_path / "sharded")
    assert torch.equal(heads.embed, embed) and torch.equal(heads.lm_head, head) and not heads.tied
    save_target_heads(tmp_path / "tied", embed, None, shard=False)
    tied = read_target_heads(tmp_path / "tied")
    assert tied.tied and torch.equal(tied.lm_head, embed)


def test_batched_dump_equals_naive_loop(tmp_path: Path) -> None:
    """draft_topk (chunks over precomputed context K/V) == one anchor at a time from scratch."""
    path = save_random_drafter(tmp_path / "d", 48, 61, [0, 2], 3, block_size=6, num_layers=2, mask_token_id=60,
                               seed=5, num_heads=3, num_kv_heads=1, head_dim=16, intermediate_size=64)
    d = load_drafter(path)
    for name, w in d.w.items():
        if w.dim() == 2:
            d.w[name] = w * 20
    gen = torch.Generator().manual_seed(0)
    feats, embed, lm_head = torch.randn(50, 96, generator=gen), torch.randn(61, 48, generator=gen), torch.randn(61, 48, generator=gen)
    tokens = torch.randint(0, 61, (50,), generator=gen)
    anchors, ids, lp = draft_topk(d, embed, lm_head, feats, tokens, 12, 8, chunk=5)
    naive_ids, naive_lp = draft_topk_naive(d, embed, lm_head, feats, tokens, anchors.tolist(), 8)
    assert torch.equal(ids, naive_ids)
    torch.testing.assert_close(lp, naive_lp, atol=1e-4, rtol=1e-4)


# -- with the real extractor on the tiny target -------------------------------------------------------

@pytest.fixture(scope="module")
def extracted(tiny_target: Path, tiny_completions: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("extract") / "states"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DFLASH_EVENTS": str(out.parent / "events.jsonl")}
    proc = subprocess.run([sys.executable, "-m", "remote.extract", "--model", str(tiny_target), "--completions",
                           str(tiny_completions), "--out", str(out), "--layers", "0,1,2,3", "--device", "cpu",
                           "--kernels", "torch"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (out.parent / "events.jsonl").read_text()[-2000:] + proc.stderr[-2000:]
    return out


def _tiny_drafter(tiny_target: Path, path: Path) -> Path:
    from transformers import AutoTokenizer

    mask = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids("<|mask|>")
    return save_random_drafter(path, 64, 799, [1, 2], 4, block_size=4, num_layers=1, mask_token_id=mask, seed=2)


def test_real_extraction_then_evaluate(tiny_target: Path, extracted: Path, tmp_path: Path) -> None:
    drafter = _tiny_drafter(tiny_target, tmp_path / "drafter")
    out = tmp_path / "eval"
    code, events = run_evaluate(tmp_path, "--states", str(extracted), "--target", str(tiny_target),
                                "--drafter", f"random={drafter}", "--out", str(out), "--device", "cpu",
                                "--budgets", "2,8", "--topk", "4")
    assert code == 0, _error(events)
    m = json.loads((out / "results.json").read_text())["drafters"]["random"]
    assert 1.0 <= m["tau"]["vanilla"]["macro"] <= 4.0 and m["prompts"] == 3
    assert m["g_x_mismatch"] is not None and m["g_x_mismatch"] > 0.5  # random completions: g rarely equals x


def test_layer_off_by_one_changes_the_result(tiny_target: Path, extracted: Path, tmp_path: Path) -> None:
    """The cache's layer k is HF hidden_states[k+1]; feeding hidden_states[k] changes the drafts."""
    from transformers import AutoModelForCausalLM

    manifest = json.loads((extracted / "manifest.json").read_text())
    entry = manifest["prompts"][0]
    with safe_open(str(extracted / entry["file"]), "pt") as fh:
        cached, ids = fh.get_tensor("hidden"), fh.get_tensor("input_ids")
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.float32)
    with torch.no_grad():
        states = model(ids[None], output_hidden_states=True).hidden_states
    layers = manifest["layers"]
    # HF applies the final norm to its last hidden_states entry, so only k < last is comparable there.
    for i, k in enumerate(layers[:-1]):
        assert (cached[:, i].float() - states[k + 1][0]).abs().max() < 0.01
    d = load_drafter(_tiny_drafter(tiny_target, tmp_path / "d"))
    for name, w in d.w.items():
        if w.dim() == 2:
            d.w[name] = w * 20
    heads = read_target_heads(tiny_target)
    embed, lm_head = heads.embed.float(), heads.lm_head.float()
    good = torch.cat([states[k + 1][0] for k in (1, 2)], dim=-1)
    off = torch.cat([states[k][0] for k in (1, 2)], dim=-1)
    p = entry["prompt_len"]
    _, ids_good, _ = draft_topk(d, embed, lm_head, good, ids, p, 4, 16)
    _, ids_off, _ = draft_topk(d, embed, lm_head, off, ids, p, 4, 16)
    _, ids_cache, _ = draft_topk(d, embed, lm_head, cached[:, [1, 2]].flatten(1).float(), ids, p, 4, 16)
    agree_cache = (ids_cache[..., 0] == ids_good[..., 0]).float().mean()
    agree_off = (ids_off[..., 0] == ids_good[..., 0]).float().mean()
    assert agree_cache > 0.9 and agree_off < agree_cache - 0.2


def test_write_extraction_format_is_read(tmp_path: Path) -> None:
    seqs = random_sequences(1, 5, 12, 20)
    seqs[0]["hidden"] = torch.randn(12, 2, 8)
    out = write_extraction(tmp_path / "s", seqs, [3, 7], 8)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["prompts"] == [{"id": "prompt00", "file": "prompt00.safetensors", "prompt_len": 5, "num_tokens": 12}]
    with safe_open(str(out / "prompt00.safetensors"), "pt") as fh:
        assert json.loads(fh.metadata()["layers"]) == [3, 7] and fh.get_tensor("hidden").dtype == torch.bfloat16
