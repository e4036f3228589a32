"""Metrics of EVAL-SPEC 3 from draft-output dumps: the sanity checks of section 5 and the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote.evaluate import write_dump
from remote.metrics import (
    DumpError,
    PromptDump,
    acc_ddtree,
    acc_topk,
    acc_vanilla,
    bootstrap_ci,
    compute,
    drafter_metrics,
    load_dump,
    main,
)


def make_dump(truth: list[int], prompt_len: int, block: int, top1_hits: torch.Tensor | None = None,
              k: int = 8, vocab: int = 50, prompt_id: str = "p", seed: int = 0) -> PromptDump:
    """A dump whose top-1 at (anchor, slot) is the truth where `top1_hits` [A, L] is True, else a wrong
    token; ranks 2..k are other wrong tokens, the truth never appearing below rank 1."""
    n, slots = len(truth), block - 1
    anchors = torch.arange(prompt_len, n - 1)
    g = torch.tensor(truth)
    if top1_hits is None:
        top1_hits = torch.ones(anchors.shape[0], slots, dtype=torch.bool)
    ids = torch.zeros(anchors.shape[0], slots, k, dtype=torch.long)
    for i, a in enumerate(anchors.tolist()):
        for j in range(slots):
            t = int(g[a + j]) if a + j <= n - 2 else 0
            wrong = [v for v in range(vocab) if v != t][:k]
            ids[i, j] = torch.tensor(([t] + wrong[:k - 1]) if top1_hits[i, j] else wrong)
    logprobs = torch.log_softmax(-10.0 * torch.arange(k, dtype=torch.float32), -1).expand(anchors.shape[0], slots, k)
    return PromptDump(prompt_id, "d", prompt_len, block, anchors, ids, logprobs.contiguous(), g)


def _truth(n: int, seed: int = 0) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    t = torch.randint(0, 50, (n,), generator=gen).tolist()
    t[-1] = -1
    return t


def test_perfect_drafter_reaches_block_size() -> None:
    dump = make_dump(_truth(60), prompt_len=10, block=16, k=16)
    m = drafter_metrics([dump], [8, 16], 8)
    assert m["tau"]["vanilla"]["macro"] == 16.0  # B on every full round
    assert m["pos1_acc"] == 1.0 and m["streak"] == 15.0
    assert m["per_position"] == [1.0] * 15
    assert m["tau"]["ddtree-b8"]["macro"] == 9.0  # a budget of 8 caps tau at 9
    assert m["tau"]["ddtree-b16"]["macro"] == 16.0
    assert m["tau_all_anchor"] == 16.0


def test_never_right_drafter() -> None:
    dump = make_dump(_truth(60), 10, 16, torch.zeros(49, 15, dtype=torch.bool))
    m = drafter_metrics([dump], [8], 8)
    for method in ("vanilla", "ddtree-b8", "top8"):
        assert m["tau"][method]["macro"] == 1.0
    assert m["pos1_acc"] == 0.0 and m["per_position"] == [0.0] * 15


def test_walk_rounds_and_dropped_tail_by_hand() -> None:
    # B=4 (L=3), P=2, N=12: anchors 2..10. Hits chosen so the vanilla walk goes
    # a=2: r=1 -> a=4: r=3 -> a=8: a+3 = 11 <= 11, r=0 -> a=9: 9+3 > 11, stop; dropped 11-9 = 2.
    hits = torch.zeros(9, 3, dtype=torch.bool)
    hits[0, 0] = True  # a=2: slot 1 right, slot 2 wrong
    hits[2] = True  # a=4: all three
    hits[3] = True  # a=5 (never visited by the walk, but counts for pos1 and the all-anchor tau)
    dump = make_dump(_truth(12), 2, 4, hits)
    assert acc_vanilla(dump).tolist() == [1, 0, 3, 3, 0, 0, 0, 0, 0]
    m = drafter_metrics([dump], [2], 8)
    van = m["tau"]["vanilla"]
    assert van["rounds"] == 3 and van["dropped"] == 2
    assert van["macro"] == pytest.approx((2 + 4 + 1) / 3)
    assert m["pos1_acc"] == pytest.approx(3 / 9)
    assert m["per_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    # all-anchor tau over a in [2, 8]: acc [1,0,3,3,0,0,0] -> mean of acc+1
    assert m["tau_all_anchor"] == pytest.approx((2 + 1 + 4 + 4 + 1 + 1 + 1) / 7)


def test_topk_counts_truth_below_rank_one() -> None:
    dump = make_dump(_truth(30), 5, 4, torch.zeros(24, 3, dtype=torch.bool))
    truth_at = torch.stack([dump.truth[(dump.anchors + j).clamp(max=29)].clamp(min=0) for j in range(3)], 1)
    dump.topk_ids[:, :, 3] = truth_at  # rank 4 holds the truth everywhere
    assert (acc_topk(dump, 4)[:-2] == 3).all()
    assert (acc_topk(dump, 3) == 0).all()


def test_ddtree_spec_example_on_a_dump() -> None:
    # depth-1 probabilities [0.5, 0.4, ...], depth-2 top-1 0.5, truth at depth 1 = the rank-2 token.
    dump = make_dump([1, 2, 3, 4, 5, -1], prompt_len=1, block=3, top1_hits=torch.zeros(4, 2, dtype=torch.bool))
    lp = torch.log(torch.tensor([[0.5, 0.4, 0.05, 0.05], [0.5, 0.3, 0.1, 0.1]]))
    dump.topk_logprobs = lp.expand(4, 2, 4).contiguous()
    dump.topk_ids = dump.topk_ids[:, :, :4].clone()
    dump.topk_ids[0, 0, 1] = dump.truth[1]  # anchor 1: the truth at depth 1 is rank 2
    assert acc_ddtree(dump, 1, 0) == 0  # tau 1
    assert acc_ddtree(dump, 2, 0) == 1  # tau 2


def test_macro_micro_and_bootstrap() -> None:
    short = make_dump(_truth(20, 1), 5, 4, prompt_id="a")  # perfect: tau 4
    long_hits = torch.zeros(79, 3, dtype=torch.bool)
    long = make_dump(_truth(100, 2), 20, 4, long_hits, prompt_id="b")  # never: tau 1
    m = drafter_metrics([short, long], [4], 4)
    van = m["tau"]["vanilla"]
    assert van["macro"] == pytest.approx((4 + 1) / 2)
    r_short, r_long = m["per_prompt"]["a"]["tau"]["vanilla"]["rounds"], m["per_prompt"]["b"]["tau"]["vanilla"]["rounds"]
    assert van["micro"] == pytest.approx((4 * r_short + r_long) / (r_short + r_long))
    lo, hi = van["ci95"]
    assert lo <= van["macro"] <= hi and lo >= 1.0 and hi <= 4.0
    assert drafter_metrics([short, long], [4], 4)["tau"]["vanilla"]["ci95"] == van["ci95"]  # fixed seed
    assert bootstrap_ci([2.5]) == [2.5, 2.5]


def test_g_vs_x_mismatch_from_input_ids() -> None:
    dump = make_dump(_truth(30), 5, 4)
    x = torch.zeros(30, dtype=torch.long)
    x[1:] = dump.truth[:-1]
    x[10] = x[10] + 1  # g[9] != x[10]
    dump.input_ids = x
    m = drafter_metrics([dump], [4], 4)
    assert m["g_x_mismatch"] == pytest.approx(1 / 25)  # p in [P-1, N-2] = 25 positions


def test_dump_too_narrow_for_budget_is_refused() -> None:
    dump = make_dump(_truth(30), 5, 4, k=8)
    with pytest.raises(DumpError, match="top-8 per slot.*need 64"):
        drafter_metrics([dump], [64], 8)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 6), st.integers(1, 8), st.integers(3, 40), st.floats(0.0, 1.0), st.integers(0, 2**16))
def test_walk_covers_every_token(block: int, prompt_len: int, completion: int, p_hit: float, seed: int) -> None:
    n = prompt_len + completion
    gen = torch.Generator().manual_seed(seed)
    hits = torch.rand(n - 1 - prompt_len, block - 1, generator=gen) < p_hit
    dump = make_dump(_truth(n, seed), prompt_len, block, hits)
    m = drafter_metrics([dump], [1, 3], 3)
    for method, t in m["per_prompt"]["p"]["tau"].items():
        covered = round((t["macro"] or 0) * t["rounds"]) + t["dropped"]
        # rounds + tail cover the completion; the last round's bonus may reach one past N-1.
        assert covered == n - 1 - prompt_len or (covered == n - prompt_len and t["dropped"] == 0), method
        if t["macro"] is not None:
            assert 1 <= t["macro"] <= block
    for i in range(dump.anchors.shape[0]):  # a tree of budget B never beats the top-B list
        assert acc_ddtree(dump, 3, i) <= int(acc_topk(dump, 3)[i])


def _write(dump: PromptDump, root: Path) -> None:
    x = torch.cat([torch.tensor([0]), dump.truth[:-1]])
    write_dump(root / dump.drafter / f"{dump.prompt_id}.safetensors", dump.drafter, dump.prompt_id, dump.prompt_len,
               dump.block_size, dump.anchors, dump.topk_ids, dump.topk_logprobs, dump.truth, x)


def _write_run(root: Path, dumps: list[PromptDump]) -> Path:
    """Dumps written by the evaluator's writer, with the manifest the evaluator writes last."""
    from remote.artifacts import write_manifest

    files = {}
    for dump in dumps:
        _write(dump, root)
        files[f"{dump.drafter}/{dump.prompt_id}.safetensors"] = {"kind": "draft-dump", "drafter": dump.drafter,
                                                                 "prompt_id": dump.prompt_id}
    write_manifest(root, files, kind="evaluation")
    return root


def test_cli_recomputes_from_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    _write_run(tmp_path / "run", [make_dump(_truth(40, i), 8, 5, prompt_id=f"p{i}") for i in range(3)])
    loaded = load_dump(tmp_path / "run" / "d" / "p0.safetensors")
    assert loaded.topk_ids.dtype == torch.int64 and loaded.prompt_len == 8
    out = tmp_path / "m.json"
    assert main([str(tmp_path / "run"), "--budgets", "2,8", "--topk", "4", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    d = data["drafters"]["d"]
    assert set(d["tau"]) == {"vanilla", "ddtree-b2", "ddtree-b8", "top4"}
    for key in ("macro", "micro", "ci95", "rounds", "dropped"):
        assert key in d["tau"]["ddtree-b8"]
    assert d["tau"]["vanilla"]["macro"] == 5.0 and d["streak"] == 4.0
    assert d["simulated_acc_len"] == 4.0 and d["acceptance_histogram"] == [0.0, 0.0, 0.0, 0.0, 1.0]
    assert "SpecForge" in d["simulated_acc_len_form"]
    assert set(d["per_prompt"]) == {"p0", "p1", "p2"}
    assert data == json.loads(json.dumps(compute(tmp_path / "run", [2, 8], 4)))
    printed = capsys.readouterr().out
    assert "tau ddtree-b8" in printed and "(EVAL-SPEC walk, the papers' tau)" in printed
    assert "simulated_acc_len  4.000  (SpecForge: teacher-forced" in printed and "not tau" in printed
    # one drafter's directory is read through its parent's manifest
    assert main([str(tmp_path / "run" / "d"), "--budgets", "2"]) == 0


def test_cli_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path)]) == 2
    assert "no complete manifest.json" in capsys.readouterr().err
    assert main([str(tmp_path), "--no-manifest"]) == 2
    assert "no draft-output dumps" in capsys.readouterr().err
    _write(make_dump(_truth(20), 5, 4), tmp_path)
    assert main([str(tmp_path), "--no-manifest", "--budgets", "8"]) == 0
    capsys.readouterr()
    assert main([str(tmp_path), "--budgets", "8,x", "--no-manifest"]) == 2
    assert "'x' is not a positive integer" in capsys.readouterr().err
    (tmp_path / "d" / "broken.safetensors").write_bytes(b"not a safetensors file")
    assert main([str(tmp_path), "--no-manifest", "--json", str(tmp_path / "m.json")]) == 2
    assert "broken.safetensors: unreadable" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()


def test_vocabulary_smaller_than_budget_is_complete() -> None:
    dump = make_dump(_truth(30), 5, 4, k=8, vocab=50)
    dump.vocab_size = 8  # K = min(B, V): eight candidates are the whole vocabulary
    m = drafter_metrics([dump], [64], 8)
    assert m["tau"]["ddtree-b64"]["macro"] is not None
