"""remote.metrics reads only what a complete manifest lists and checks every dump; SpecForge's
simulated_acc_len by hand; z-lab's acceptance histogram (property). Dumps are written by the
evaluator's own writer (`remote.evaluate.write_dump`) with the manifest the evaluator writes."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from remote.evaluate import main as evaluate_main
from remote.evaluate import write_dump
from remote.metrics import DumpError, PromptDump, compute, drafter_metrics, load_dumps, main
from tests.fixtures_models import run_in_process
from tests.test_metrics import _truth, _write, _write_run, make_dump


def _dumps(n: int = 2, drafter: str = "d") -> list[PromptDump]:
    out = []
    for i in range(n):
        dump = make_dump(_truth(30, i), 6, 4, prompt_id=f"p{i}")
        dump.drafter = drafter
        out.append(dump)
    return out


def _rewrite(path: Path, **change) -> None:
    """Rewrite one dump file in place with some tensors or metadata changed (through the real writer)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as fh:
        t = {k: fh.get_tensor(k) for k in fh.keys()}  # noqa: SIM118
        meta = fh.metadata()
    t.update({k: v for k, v in change.items() if k in t})
    meta.update({k: v for k, v in change.items() if k not in t})
    path.unlink()
    write_dump(path, meta["drafter"], meta["prompt_id"], meta["prompt_len"], meta["block_size"], t["anchors"],
               t["topk_ids"], t["topk_logprobs"], t["truth"], t["input_ids"], meta.get("vocab_size"))


def _refused(root: Path, *extra: str) -> str:
    with pytest.raises(DumpError) as err:
        compute(root, [2], 4, require_manifest="--no-manifest" not in extra)
    assert "\n" not in str(err.value)
    assert main([str(root), "--budgets", "2", "--topk", "4", "--json", str(root / "out.json"), *extra]) == 2
    assert not (root / "out.json").exists()
    return str(err.value)


def test_control_an_intact_run_is_read(tmp_path) -> None:
    _write_run(tmp_path, _dumps())
    assert set(compute(tmp_path, [2], 4)["drafters"]["d"]["per_prompt"]) == {"p0", "p1"}


def test_a_stale_file_not_in_the_manifest_is_never_counted(tmp_path) -> None:
    _write_run(tmp_path, _dumps())
    stale = make_dump(_truth(30, 9), 6, 4, prompt_id="old")
    _write(stale, tmp_path)  # left by an earlier run: same directory, not listed
    assert set(compute(tmp_path, [2], 4)["drafters"]["d"]["per_prompt"]) == {"p0", "p1"}
    assert "old" not in compute(tmp_path, [2], 4, require_manifest=False)["drafters"]["d"]["per_prompt"]
    (tmp_path / "manifest.json").unlink()  # only without a manifest does --no-manifest read everything
    assert "old" in compute(tmp_path, [2], 4, require_manifest=False)["drafters"]["d"]["per_prompt"]


def test_an_altered_listed_dump_is_refused(tmp_path) -> None:
    _write_run(tmp_path, _dumps())
    _rewrite(tmp_path / "d" / "p1.safetensors", prompt_len="7")
    assert "p1.safetensors" in _refused(tmp_path)


def test_no_manifest_is_refused_unless_told(tmp_path) -> None:
    for dump in _dumps():
        _write(dump, tmp_path)
    assert "no complete manifest.json here or in its parent" in _refused(tmp_path)
    assert set(compute(tmp_path, [2], 4, require_manifest=False)["drafters"]) == {"d"}


@pytest.mark.parametrize("change, message", [
    ({"topk_logprobs": "nan"}, r"topk_logprobs holds 1 non-finite values \(first at anchor index 2, slot 1, rank 1\)"),
    ({"topk_logprobs": "positive"}, r"topk_logprobs holds 3 > 0: not log-probabilities"),
    ({"topk_logprobs": "ascending"}, r"topk_logprobs are not descending along K"),
    ({"truth": "short"}, r"anchors must be every position 6\.\.27 \(prompt_len 6, 29 tokens\)"),
    ({"truth": "hole"}, r"truth holds ids outside the vocabulary before its last position"),
    ({"drafter": "someone-else"}, r"metadata 'drafter' is 'someone-else', expected 'd' \(a stale or foreign dump\)"),
    ({"prompt_id": "p9"}, r"metadata 'prompt_id' is 'p9', expected 'p1'"),
    ({"block_size": "x"}, r"metadata 'block_size': expected an integer >= 2, found 'x'"),
    ({"block_size": "1"}, r"metadata 'block_size': expected an integer >= 2, found '1'"),
    ({"prompt_len": "0"}, r"metadata 'prompt_len': expected an integer >= 1, found '0'"),
    ({"vocab_size": "3"}, r"topk_ids holds ids outside the vocabulary 0..2"),
])
def test_bad_dumps_are_named_by_file_and_field(tmp_path, change, message) -> None:
    dumps = _dumps()
    target = dumps[1]
    key, how = next(iter(change.items()))
    if key == "topk_logprobs":
        lp = target.topk_logprobs.clone()
        if how == "nan":
            lp[2, 0, 0] = float("nan")
        elif how == "positive":
            lp[0, 0, 0] = 3.0
        else:
            lp[0, 0] = lp[0, 0].flip(0)
        target.topk_logprobs = lp
    elif key == "truth":
        if how == "short":
            target.truth = target.truth[:-1]
        else:
            target.truth = target.truth.clone()
            target.truth[10] = -1
    _write_run(tmp_path, dumps)
    if key not in ("topk_logprobs", "truth"):
        _rewrite(tmp_path / "d" / "p1.safetensors", **change)
        manifest = json.loads((tmp_path / "manifest.json").read_text())
        from remote.artifacts import write_manifest

        files = {k: {kk: v[kk] for kk in ("kind", "drafter", "prompt_id")} for k, v in manifest["files"].items()}
        write_manifest(tmp_path, files, kind="evaluation")  # listed as it now is: only the check can tell
    msg = _refused(tmp_path)
    assert "p1.safetensors" in msg
    assert re.search(message, msg), msg


def test_duplicates_and_foreign_truth_are_refused(tmp_path) -> None:
    for dump in _dumps():
        _write(dump, tmp_path / "a")
    copy = tmp_path / "a" / "d" / "p1-copy.safetensors"
    shutil.copy(tmp_path / "a" / "d" / "p1.safetensors", copy)
    assert "prompt 'p1' of drafter 'd' is also in" in _refused(tmp_path / "a", "--no-manifest")
    copy.unlink()
    # a second drafter whose p0 came from another extraction (another truth g)
    other = _dumps(drafter="e")
    other[0] = make_dump(_truth(30, 5), 6, 4, prompt_id="p0")
    other[0].drafter = "e"
    _write_run(tmp_path / "b", _dumps() + other)
    assert "prompt 'p0' has another truth g than in" in _refused(tmp_path / "b")
    _write_run(tmp_path / "c", _dumps() + _dumps(drafter="e"))  # control: same truths
    assert set(compute(tmp_path / "c", [2], 4)["drafters"]) == {"d", "e"}


def test_simulated_acc_len_by_hand() -> None:
    """B=4 (L=3), P=2, N=12: anchors 2..10, full ones (a <= N-1-L = 8) are 2..8 (7). Teacher-forced:
    slot i counts on its own, whatever the earlier slots did; the non-full anchors 9, 10 never count."""
    hits = torch.zeros(9, 3, dtype=torch.bool)
    hits[:7, 0] = True  # a_1 = 7/7
    hits[[0, 2, 4, 6], 1] = True  # a_2 = 4/7
    hits[[1, 3], 2] = True  # a_3 = 2/7 (anchors 3 and 5: slot 2 wrong there, slot 3 right)
    hits[7:] = True  # anchors 9, 10: excluded
    dump = make_dump(_truth(12), 2, 4, hits)
    m = drafter_metrics([dump], [2], 4)
    assert m["slot_accuracy"] == pytest.approx([1.0, 4 / 7, 2 / 7])
    assert m["simulated_acc_len"] == pytest.approx(1 + 4 / 7 + 1 * 4 / 7 * 2 / 7)
    assert m["pooled_slot_accuracy"] == pytest.approx((7 + 4 + 2) / 21) and m["simulated_anchors"] == 7
    # Pooled over prompts by counts, not a mean of per-prompt ratios: add a prompt with 3 full anchors, all wrong.
    wrong = make_dump(_truth(8, 1), 2, 4, torch.zeros(5, 3, dtype=torch.bool), prompt_id="q")
    both = drafter_metrics([dump, wrong], [2], 4)
    assert both["slot_accuracy"] == pytest.approx([7 / 10, 4 / 10, 2 / 10])
    assert both["simulated_acc_len"] == pytest.approx(0.7 + 0.7 * 0.4 + 0.7 * 0.4 * 0.2)


@settings(max_examples=40, deadline=None)
@given(block=st.integers(2, 9), prompt_len=st.integers(1, 12), completion=st.integers(1, 40),
       prompts=st.integers(1, 3), p_hit=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_acceptance_histogram_sums_to_one(block, prompt_len, completion, prompts, p_hit, seed) -> None:
    gen = torch.Generator().manual_seed(seed)
    dumps = []
    for i in range(prompts):
        n = prompt_len + completion
        hits = torch.rand(n - 1 - prompt_len, block - 1, generator=gen) < p_hit
        dumps.append(make_dump(_truth(n, seed + i), prompt_len, block, hits, prompt_id=f"p{i}"))
    m = drafter_metrics(dumps, [2], 4)
    hist = m["acceptance_histogram"]
    if m["tau"]["vanilla"]["rounds"] == 0:
        assert hist is None
        return
    assert len(hist) == block and sum(hist) == pytest.approx(1.0) and all(h >= 0 for h in hist)
    # consistent with the walk: the mean of (r + 1) is the micro tau, the tail sums the per-position curve
    assert sum((r + 1) * h for r, h in enumerate(hist)) == pytest.approx(m["tau"]["vanilla"]["micro"])
    for j in range(1, block):
        assert sum(hist[j:]) == pytest.approx(m["per_position"][j - 1])
    assert 0.0 <= (m["simulated_acc_len"] or 0.0) <= block - 1


def test_evaluator_output_carries_both_labelled_numbers(tmp_path) -> None:
    from remote.drill.synthetic import build_copying_setup

    setup = build_copying_setup(tmp_path / "setup", prompts=2, num_tokens=50)
    out = tmp_path / "out"
    run_in_process(evaluate_main, ["--states", str(setup["states"]), "--target", str(setup["target"]), "--drafter",
                                   f"copy={setup['drafter']}", "--out", str(out), "--device", "cpu",
                                   "--budgets", "8", "--topk", "8"])
    m = json.loads((out / "results.json").read_text())["drafters"]["copy"]
    assert m["simulated_acc_len"] == pytest.approx(15.0) and m["acceptance_histogram"][-1] == 1.0
    assert load_dumps(out)["copy"][0].drafter == "copy"


def test_cli_flags_g_vs_x_above_two_percent(tmp_path, capsys) -> None:
    from remote.artifacts import write_manifest

    dump = make_dump(_truth(40), 8, 5, prompt_id="p0")
    x = torch.cat([torch.tensor([0]), dump.truth[:-1]])
    x[20:25] = (x[20:25] + 1) % 50  # 5 of 32 completion positions: g != x
    write_dump(tmp_path / "d" / "p0.safetensors", "d", "p0", 8, 5, dump.anchors, dump.topk_ids, dump.topk_logprobs,
               dump.truth, x)
    write_manifest(tmp_path, {"d/p0.safetensors": {"kind": "draft-dump", "drafter": "d", "prompt_id": "p0"}})
    assert main([str(tmp_path), "--budgets", "2", "--topk", "4"]) == 0
    out = capsys.readouterr().out
    assert "WARNING g != x on 15.6% of completion positions (> 2%)" in out and "off-policy" in out
    _write_run(tmp_path / "clean", [make_dump(_truth(40), 8, 5, prompt_id="p0")])  # control: g == x
    assert main([str(tmp_path / "clean"), "--budgets", "2", "--topk", "4"]) == 0
    assert "WARNING" not in capsys.readouterr().out
