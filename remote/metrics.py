"""Every metric of EVAL-SPEC section 3, recomputed from the draft-output dumps alone.

A dump (section 4) is one safetensors file per drafter and prompt, `<drafter>/<prompt_id>.safetensors`:
`anchors` [A] (every a in [P, N-2]), `topk_ids` / `topk_logprobs` [A, L, K], `truth` [N] (g), and
metadata `prompt_len`, `block_size`, `prompt_id`, `drafter`. The evaluator also stores `input_ids`
[N] (x) so that the g-vs-x mismatch rate can be recomputed from the dump too, and the metadata
`vocab_size` (a vocabulary smaller than a budget gives K = V); both are optional here.

    python -m remote.metrics DIR --budgets 8,16,64 --topk 8 [--json out.json] [--seed 0] [--no-manifest]

DIR is an evaluation output directory (one sub-directory per drafter) or one drafter's directory.
Only the dumps its complete `manifest.json` lists are read (sizes and sha256 verified), each checked
(metadata, shapes, finite descending log-probs, truth, ids; drafter and prompt ids as listed; no
prompt twice; one truth per prompt across drafters); a directory without a complete manifest is
refused unless --no-manifest.

Definitions (L = B-1 slots, W_a = min(L, N-1-a) slots with known truth at anchor a):
- vanilla: leading slots j with top1[a,j] == g[a+j-1]; topK: leading slots whose truth is in the top-K;
  ddtree-bB: nodes walked in the DDTree of budget B (`remote.ddtree`).
- the walk: a = P; while a + L <= N-1: r = acc(a); record r+1; a += r+1. Each method walks alone;
  `dropped` counts the tail tokens no round covered (N-1-a at the end, summed over prompts).
- tau macro = mean of per-prompt means (prompts with no round are left out), micro = all rounds
  pooled; ci95 = percentile bootstrap over prompts of the macro figure (fixed seed, 2000 draws).
- pos1_acc over a in [P, N-2]; per_position[j-1] = share of vanilla rounds with r >= j;
  tau_all_anchor = mean of acc_vanilla(a)+1 over a in [P, N-1-L] (a diagnostic, not the papers' tau).
- g_x_mismatch = share of p in [P-1, N-2] with g[p] != x[p+1] (completion positions only: a prompt
  token is not the model's prediction); flagged above 2%.
- simulated_acc_len (EVAL-SPEC 6, SpecForge's number, not tau) = sum_k prod_{i<=k} a_i with a_i the
  slot-i top-1 accuracy over all anchors in [P, N-1-L], counts pooled over prompts; slot_accuracy
  lists a_i; pooled_slot_accuracy is the single pooled accuracy SpecForge's DFlash strategy logs.
- acceptance_histogram[r] = share of vanilla-walk rounds that accepted exactly r, r = 0..L (z-lab).
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from remote.ddtree import build_tree, walk_tree

BOOTSTRAP_DRAWS = 2000


class DumpError(ValueError):
    """A dump that does not follow EVAL-SPEC section 4; the message names the file and the problem."""


@dataclass
class PromptDump:
    """One drafter's outputs on one prompt."""

    prompt_id: str
    drafter: str
    prompt_len: int
    block_size: int
    anchors: torch.Tensor  # [A] int64
    topk_ids: torch.Tensor  # [A, L, K] int64
    topk_logprobs: torch.Tensor  # [A, L, K] float32
    truth: torch.Tensor  # [N] int64
    input_ids: torch.Tensor | None = None  # [N] int64, optional
    vocab_size: int | None = None  # optional metadata: a top-K narrower than a budget is complete if K == V

    @property
    def num_tokens(self) -> int:
        return self.truth.shape[0]

    @property
    def slots(self) -> int:
        return self.block_size - 1


def method_ids(budgets: list[int], topk: int) -> list[str]:
    """The method ids reported: vanilla, ddtree-b{B} per budget, top{K}."""
    return ["vanilla", *[f"ddtree-b{b}" for b in budgets], f"top{topk}"]


def _meta_int(path: Path, meta: dict[str, str], key: str, lo: int) -> int:
    value = meta.get(key)
    if value is None:
        raise DumpError(f"{path}: no metadata {key!r}")
    try:
        number = int(value)
    except ValueError:
        number = None
    if number is None or number < lo:
        raise DumpError(f"{path}: metadata {key!r}: expected an integer >= {lo}, found {value!r}")
    return number


def load_dump(path: str | Path, drafter: str | None = None, prompt_id: str | None = None) -> PromptDump:
    """Read and check one dump file: metadata, shapes, dtypes and values, each error naming the file
    and the field. `drafter` / `prompt_id`: what the manifest or the directory says it must be."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    try:
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            tensors = {name: fh.get_tensor(name) for name in fh.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as exc:
        raise DumpError(f"{path}: unreadable safetensors ({exc})") from exc
    for name in ("anchors", "topk_ids", "topk_logprobs", "truth"):
        if name not in tensors:
            raise DumpError(f"{path}: no tensor {name!r} (not a draft-output dump)")
    for key in ("prompt_len", "block_size", "prompt_id", "drafter"):
        if key not in meta:
            raise DumpError(f"{path}: no metadata {key!r}")
    for key, expected in (("drafter", drafter), ("prompt_id", prompt_id)):
        if expected is not None and meta[key] != expected:
            raise DumpError(f"{path}: metadata {key!r} is {meta[key]!r}, expected {expected!r} (a stale or foreign dump)")
    for name, dtypes in (("anchors", (torch.int64, torch.int32)), ("topk_ids", (torch.int64, torch.int32)),
                         ("truth", (torch.int64, torch.int32)), ("topk_logprobs", (torch.float32, torch.float64)),
                         ("input_ids", (torch.int64, torch.int32))):
        if name in tensors and tensors[name].dtype not in dtypes:
            raise DumpError(f"{path}: tensor {name!r} has dtype {str(tensors[name].dtype).replace('torch.', '')}, "
                            f"expected {str(dtypes[0]).replace('torch.', '')}")
    vocab = _meta_int(path, meta, "vocab_size", 1) if meta.get("vocab_size") else None
    dump = PromptDump(
        prompt_id=meta["prompt_id"], drafter=meta["drafter"], prompt_len=_meta_int(path, meta, "prompt_len", 1),
        block_size=_meta_int(path, meta, "block_size", 2), anchors=tensors["anchors"].long(),
        topk_ids=tensors["topk_ids"].long(), topk_logprobs=tensors["topk_logprobs"].float(),
        truth=tensors["truth"].long(), input_ids=tensors["input_ids"].long() if "input_ids" in tensors else None,
        vocab_size=vocab,
    )
    n, p, slots = dump.num_tokens, dump.prompt_len, dump.slots
    if dump.truth.dim() != 1 or n < p + 1:
        raise DumpError(f"{path}: truth has shape {list(dump.truth.shape)}, expected [N] with N > prompt_len {p}")
    expected = torch.arange(p, n - 1)
    if dump.anchors.shape != expected.shape or not torch.equal(dump.anchors, expected):
        raise DumpError(f"{path}: anchors must be every position {p}..{n - 2} (prompt_len {p}, {n} tokens)")
    a = expected.shape[0]
    if dump.topk_ids.dim() != 3 or tuple(dump.topk_ids.shape[:2]) != (a, slots) or dump.topk_ids.shape[2] < 1:
        raise DumpError(f"{path}: topk_ids has shape {list(dump.topk_ids.shape)}, expected [{a}, {slots}, K]")
    if dump.topk_logprobs.shape != dump.topk_ids.shape:
        raise DumpError(f"{path}: topk_logprobs {list(dump.topk_logprobs.shape)} != topk_ids {list(dump.topk_ids.shape)}")
    lp = dump.topk_logprobs
    finite = torch.isfinite(lp)
    if not bool(finite.all()):
        bad = (~finite).nonzero()[0].tolist()
        raise DumpError(f"{path}: topk_logprobs holds {int((~finite).sum())} non-finite values "
                        f"(first at anchor index {bad[0]}, slot {bad[1] + 1}, rank {bad[2] + 1})")
    if lp.numel() and float(lp.max()) > 1e-4:
        raise DumpError(f"{path}: topk_logprobs holds {float(lp.max()):.4g} > 0: not log-probabilities")
    if lp.shape[2] > 1 and bool((lp[..., 1:] > lp[..., :-1] + 1e-5).any()):
        raise DumpError(f"{path}: topk_logprobs are not descending along K (best first)")
    ids_high = vocab if vocab is not None else None
    if dump.topk_ids.numel() and (int(dump.topk_ids.min()) < 0 or (ids_high and int(dump.topk_ids.max()) >= ids_high)):
        raise DumpError(f"{path}: topk_ids holds ids outside the vocabulary 0..{(ids_high or 0) - 1 if ids_high else 'V-1'}")
    head = dump.truth[:-1]
    if head.numel() and (int(head.min()) < 0 or (ids_high and int(head.max()) >= ids_high)):
        raise DumpError(f"{path}: truth holds ids outside the vocabulary before its last position "
                        "(only truth[N-1] may be -1)")
    if dump.input_ids is not None and tuple(dump.input_ids.shape) != (n,):
        raise DumpError(f"{path}: input_ids has shape {list(dump.input_ids.shape)}, expected [{n}] like truth")
    return dump


def _manifest_dumps(directory: Path) -> tuple[dict[str, list[tuple[Path, str]]], Path] | None:
    """drafter -> [(file, prompt_id)] that a complete evaluation manifest lists, for `directory` (the
    evaluation dir) or one drafter's directory inside it; None when neither holds a manifest."""
    from remote.artifacts import MANIFEST, read_manifest

    for root, only in ((directory, None), (directory.parent, directory.name)):
        if not (root / MANIFEST).is_file():
            continue
        try:
            manifest = read_manifest(root, verify=True)
        except (ValueError, OSError) as exc:
            raise DumpError(str(exc)) from exc
        groups: dict[str, list[tuple[Path, str]]] = {}
        for name, facts in manifest.get("files", {}).items():
            if not isinstance(facts, dict) or facts.get("kind") != "draft-dump":
                continue
            drafter, _, file = name.partition("/")
            if facts.get("drafter") != drafter or not file or "/" in file:
                raise DumpError(f"{root}/{MANIFEST}: files[{name!r}] does not name a <drafter>/<prompt_id> dump "
                                f"(drafter {facts.get('drafter')!r})")
            if only is None or drafter == only:
                groups.setdefault(drafter, []).append((root / name, str(facts.get("prompt_id"))))
        if only is not None and not groups:
            continue  # a manifest above that is not this evaluation's
        return groups, root / MANIFEST
    return None


def load_dumps(directory: str | Path, require_manifest: bool = True) -> dict[str, list[PromptDump]]:
    """drafter name -> its prompt dumps, from an evaluation directory or one drafter's directory.

    Only the dumps a complete manifest lists are read (sizes and sha256 verified): a stale file from an
    earlier run or one copied in from elsewhere is never counted. Without a manifest the directory is
    refused unless `require_manifest` is false (`--no-manifest`); then every `*.safetensors` is read,
    and still checked (metadata drafter = its directory, no prompt twice).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DumpError(f"{directory}: not a directory")
    found = _manifest_dumps(directory)
    if found is not None:
        listed, _ = found
        if not listed:
            raise DumpError(f"{directory}: its manifest lists no draft-output dumps")
        groups = {drafter: entries for drafter, entries in sorted(listed.items())}
    elif require_manifest:
        raise DumpError(f"{directory}: no complete manifest.json here or in its parent (an interrupted run, or "
                        "files from elsewhere): refused; --no-manifest reads every dump anyway")
    else:
        dirs = [directory] if any(directory.glob("*.safetensors")) else sorted(
            d for d in directory.iterdir() if d.is_dir() and any(d.glob("*.safetensors")))
        if not dirs:
            raise DumpError(f"{directory}: no draft-output dumps (<drafter>/<prompt_id>.safetensors)")
        groups = {}
        for d in dirs:
            files = sorted(d.glob("*.safetensors"))
            name = d.name if d != directory else load_dump(files[0]).drafter
            groups[name] = [(f, None) for f in files]
    out: dict[str, list[PromptDump]] = {}
    truths: dict[str, tuple[Path, torch.Tensor]] = {}
    for drafter, entries in groups.items():
        seen: dict[str, Path] = {}
        dumps = []
        for file, prompt_id in entries:
            dump = load_dump(file, drafter=drafter, prompt_id=prompt_id)
            if dump.prompt_id in seen:
                raise DumpError(f"{file}: prompt {dump.prompt_id!r} of drafter {drafter!r} is also in "
                                f"{seen[dump.prompt_id]} (a duplicate)")
            seen[dump.prompt_id] = file
            if dump.prompt_id in truths:
                other, truth = truths[dump.prompt_id]
                if not torch.equal(truth, dump.truth):
                    raise DumpError(f"{file}: prompt {dump.prompt_id!r} has another truth g than in {other} "
                                    "(dumps from different extractions)")
            else:
                truths[dump.prompt_id] = (file, dump.truth)
            dumps.append(dump)
        out[drafter] = dumps
    return out


# -- acceptance per anchor ---------------------------------------------------------------------------

def _truth_at(dump: PromptDump) -> tuple[torch.Tensor, torch.Tensor]:
    """truth[a+j-1] per anchor and slot [A, L], and the mask of slots with known truth (j <= W_a)."""
    slots = torch.arange(dump.slots)
    idx = dump.anchors[:, None] + slots[None, :]
    known = idx <= dump.num_tokens - 2
    return dump.truth[idx.clamp(max=dump.num_tokens - 1)], known


def _leading(hits: torch.Tensor) -> torch.Tensor:
    return hits.long().cumprod(dim=1).sum(dim=1)


def acc_vanilla(dump: PromptDump) -> torch.Tensor:
    """acc_vanilla(a) for every anchor [A]."""
    truth, known = _truth_at(dump)
    return _leading((dump.topk_ids[:, :, 0] == truth) & known)


def acc_topk(dump: PromptDump, k: int) -> torch.Tensor:
    """acc_topK(a) for every anchor [A]."""
    truth, known = _truth_at(dump)
    return _leading((dump.topk_ids[:, :, :k] == truth[..., None]).any(-1) & known)


def acc_ddtree(dump: PromptDump, budget: int, anchor_index: int) -> int:
    """acc_ddtree_B at one anchor (by its index in `anchors`)."""
    a = int(dump.anchors[anchor_index])
    limit = min(dump.slots, dump.num_tokens - 1 - a)
    logprobs = dump.topk_logprobs[anchor_index, :, :budget].double().tolist()
    tree = build_tree(logprobs, budget, max_depth=dump.slots)
    truth = dump.truth[a:a + limit].tolist()
    return walk_tree(tree, dump.topk_ids[anchor_index, :limit].tolist(), truth, limit)


def walk(dump: PromptDump, acc: Callable[[int], int]) -> tuple[list[int], int]:
    """The speculative walk: accepted counts r per round, and the dropped tail (tokens)."""
    a, n, slots = dump.prompt_len, dump.num_tokens, dump.slots
    rounds = []
    while a + slots <= n - 1:
        r = acc(a - dump.prompt_len)
        rounds.append(r)
        a += r + 1
    return rounds, max(0, n - 1 - a)


# -- aggregation -------------------------------------------------------------------------------------

def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def bootstrap_ci(values: list[float], seed: int = 0, draws: int = BOOTSTRAP_DRAWS) -> list[float] | None:
    """95% percentile bootstrap interval of the mean of `values` (resampled with replacement)."""
    if not values:
        return None
    rng = random.Random(seed)
    n = len(values)
    means = sorted(sum(rng.choice(values) for _ in range(n)) / n for _ in range(draws))
    return [means[int(0.025 * (draws - 1))], means[int(round(0.975 * (draws - 1)))]]


def _prompt_metrics(dump: PromptDump, budgets: list[int], topk: int) -> tuple[dict[str, Any], dict[str, list[int]], dict]:
    """Per-prompt figures, plus the raw round lists and pooled counts for the drafter totals."""
    need = max([*budgets, topk])
    if dump.vocab_size is not None:
        need = min(need, dump.vocab_size)  # K = min(B, V) candidates per depth
    if dump.topk_ids.shape[2] < need:
        raise DumpError(f"{dump.drafter}/{dump.prompt_id}: dump holds top-{dump.topk_ids.shape[2]} per slot, "
                        f"budgets {budgets} and top{topk} need {need}")
    vanilla = acc_vanilla(dump)
    top = acc_topk(dump, topk)
    accs: dict[str, Callable[[int], int]] = {
        "vanilla": lambda i: int(vanilla[i]),
        **{f"ddtree-b{b}": (lambda i, b=b: acc_ddtree(dump, b, i)) for b in budgets},
        f"top{topk}": lambda i: int(top[i]),
    }
    rounds: dict[str, list[int]] = {}
    tau: dict[str, Any] = {}
    for method, acc in accs.items():
        r, dropped = walk(dump, acc)
        rounds[method] = r
        value = _mean([x + 1 for x in r])
        tau[method] = {"macro": value, "micro": value, "ci95": None, "rounds": len(r), "dropped": dropped}

    truth, known = _truth_at(dump)
    pos1_hits = int((dump.topk_ids[:, 0, 0] == truth[:, 0]).sum())
    full = dump.anchors <= dump.num_tokens - 1 - dump.slots
    all_anchor = (vanilla[full] + 1).tolist()
    # SpecForge's teacher-forced slot accuracy: every slot of every full anchor, counts kept for pooling.
    slot_hits = (dump.topk_ids[full, :, 0] == truth[full]).sum(0).tolist()
    n_full = int(full.sum())
    mismatch = None
    if dump.input_ids is not None:
        p0 = dump.prompt_len - 1
        g, x = dump.truth[p0:dump.num_tokens - 1], dump.input_ids[p0 + 1:]
        mismatch = (int((g != x).sum()), int(g.shape[0]))
    pooled = {"pos1": (pos1_hits, int(dump.anchors.shape[0])), "all_anchor": all_anchor, "mismatch": mismatch,
              "slot_hits": slot_hits, "full_anchors": n_full}
    record = {
        "prompt_len": dump.prompt_len,
        "num_tokens": dump.num_tokens,
        "anchors": int(dump.anchors.shape[0]),
        "pos1_acc": pos1_hits / dump.anchors.shape[0] if dump.anchors.shape[0] else None,
        "per_position": _per_position(rounds["vanilla"], dump.slots),
        "tau_all_anchor": _mean(all_anchor),
        "tau": tau,
        "streak": None if tau["vanilla"]["macro"] is None else tau["vanilla"]["macro"] - 1,
        "g_x_mismatch": None if mismatch is None else (mismatch[0] / mismatch[1] if mismatch[1] else None),
        **simulated_acc_len(slot_hits, n_full),
        "acceptance_histogram": acceptance_histogram(rounds["vanilla"], dump.slots),
    }
    return record, rounds, pooled


SIMULATED_FORM = ("SpecForge simulated_acc_len: sum over k of prod_{i<=k} a_i, a_i the teacher-forced slot-i "
                  "accuracy pooled over all anchors in [P, N-1-L] of all prompts; no bonus token; not the papers' tau. "
                  "(SpecForge's DFlash strategy logs a single pooled accuracy there instead: pooled_slot_accuracy.)")


def simulated_acc_len(slot_hits: list[int], anchors: int) -> dict[str, Any]:
    """EVAL-SPEC 6 from pooled counts: {simulated_acc_len, slot_accuracy [a_1..a_L], pooled_slot_accuracy,
    simulated_anchors}; None values when no anchor has a full block of known truth."""
    if anchors <= 0:
        return {"simulated_acc_len": None, "slot_accuracy": [None] * len(slot_hits), "pooled_slot_accuracy": None,
                "simulated_anchors": 0}
    accuracy = [h / anchors for h in slot_hits]
    total, running = 0.0, 1.0
    for a in accuracy:
        running *= a
        total += running
    return {"simulated_acc_len": total, "slot_accuracy": accuracy,
            "pooled_slot_accuracy": sum(slot_hits) / (anchors * len(slot_hits)) if slot_hits else None,
            "simulated_anchors": anchors}


def acceptance_histogram(rounds: list[int], slots: int) -> list[float] | None:
    """z-lab's acceptance-length histogram: the share of rounds that accepted exactly r draft tokens,
    r = 0..L (sums to 1); None without rounds."""
    if not rounds:
        return None
    counts = [0] * (slots + 1)
    for r in rounds:
        counts[r] += 1
    return [c / len(rounds) for c in counts]


def _per_position(rounds: list[int], slots: int) -> list[float | None]:
    if not rounds:
        return [None] * slots
    return [sum(1 for r in rounds if r >= j) / len(rounds) for j in range(1, slots + 1)]


def drafter_metrics(dumps: list[PromptDump], budgets: list[int], topk: int, seed: int = 0) -> dict[str, Any]:
    """All section-3 figures for one drafter over its prompts (section 4's JSON layout)."""
    if not dumps:
        raise DumpError("no prompts to compute metrics over")
    blocks = {d.block_size for d in dumps}
    if len(blocks) != 1:
        raise DumpError(f"drafter {dumps[0].drafter}: dumps disagree on block_size: {sorted(blocks)}")
    slots = dumps[0].slots
    per_prompt: dict[str, Any] = {}
    all_rounds: dict[str, list[list[int]]] = {m: [] for m in method_ids(budgets, topk)}
    pos1 = [0, 0]
    all_anchor: list[int] = []
    mismatch = [0, 0]
    have_mismatch = True
    slot_hits = [0] * slots
    full_anchors = 0
    for dump in dumps:
        record, rounds, pooled = _prompt_metrics(dump, budgets, topk)
        per_prompt[dump.prompt_id] = record
        for method, r in rounds.items():
            all_rounds[method].append(r)
        pos1[0] += pooled["pos1"][0]
        pos1[1] += pooled["pos1"][1]
        all_anchor.extend(pooled["all_anchor"])
        slot_hits = [a + b for a, b in zip(slot_hits, pooled["slot_hits"], strict=True)]
        full_anchors += pooled["full_anchors"]
        if pooled["mismatch"] is None:
            have_mismatch = False
        else:
            mismatch[0] += pooled["mismatch"][0]
            mismatch[1] += pooled["mismatch"][1]

    tau: dict[str, Any] = {}
    for method, per in all_rounds.items():
        prompt_means = [sum(x + 1 for x in r) / len(r) for r in per if r]
        pooled_rounds = [x for r in per for x in r]
        tau[method] = {
            "macro": _mean(prompt_means),
            "micro": _mean([x + 1 for x in pooled_rounds]),
            "ci95": bootstrap_ci(prompt_means, seed),
            "rounds": len(pooled_rounds),
            "dropped": sum(per_prompt[d.prompt_id]["tau"][method]["dropped"] for d in dumps),
        }
    vanilla_rounds = [x for r in all_rounds["vanilla"] for x in r]
    return {
        "block_size": slots + 1,
        "prompts": len(dumps),
        "budgets": list(budgets),
        "topk": topk,
        "pos1_acc": pos1[0] / pos1[1] if pos1[1] else None,
        "per_position": _per_position(vanilla_rounds, slots),
        "tau_all_anchor": _mean(all_anchor),
        "tau": tau,
        "streak": None if tau["vanilla"]["macro"] is None else tau["vanilla"]["macro"] - 1,
        "g_x_mismatch": mismatch[0] / mismatch[1] if have_mismatch and mismatch[1] else None,
        **simulated_acc_len(slot_hits, full_anchors),
        "simulated_acc_len_form": SIMULATED_FORM,
        "acceptance_histogram": acceptance_histogram(vanilla_rounds, slots),
        "per_prompt": per_prompt,
    }


def compute(directory: str | Path, budgets: list[int], topk: int, seed: int = 0,
            require_manifest: bool = True) -> dict[str, Any]:
    """Metrics of every drafter found under `directory`: {"drafters": {name: metrics}, ...}."""
    groups = load_dumps(directory, require_manifest)
    return {
        "budgets": list(budgets),
        "topk": topk,
        "methods": method_ids(budgets, topk),
        "drafters": {name: drafter_metrics(dumps, budgets, topk, seed) for name, dumps in groups.items()},
    }


def parse_budgets(text: str) -> list[int]:
    """'8,16,64' -> [8, 16, 64]; raise ValueError naming a bad item."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise ValueError(f"budgets: {item!r} is not a positive integer (expected e.g. 8,16,64)")
        out.append(int(item))
    return sorted(set(out))


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


MISMATCH_THRESHOLD = 0.02


def summary_lines(results: dict[str, Any], mismatch_threshold: float = MISMATCH_THRESHOLD) -> list[str]:
    """A plain-text summary (no rich on the hosts); every tau-like number labelled with what it is."""
    lines = []
    for name, m in results["drafters"].items():
        lines.append(f"{name}: block {m['block_size']}, {m['prompts']} prompts, pos1_acc {_fmt(m['pos1_acc'])}, "
                     f"tau_all_anchor {_fmt(m['tau_all_anchor'])} (diagnostic, not the papers' tau)")
        for method, t in m["tau"].items():
            ci = t["ci95"]
            ci_text = f"[{_fmt(ci[0])}, {_fmt(ci[1])}]" if ci else "[-]"
            lines.append(f"  tau {method:<12} macro {_fmt(t['macro'])} {ci_text}  micro {_fmt(t['micro'])}  "
                         f"rounds {t['rounds']}  dropped {t['dropped']}  (EVAL-SPEC walk, the papers' tau)")
        if "simulated_acc_len" in m:
            lines.append(f"  simulated_acc_len  {_fmt(m['simulated_acc_len'])}  (SpecForge: teacher-forced "
                         f"sum_k prod_i<=k a_i, no bonus token; not tau; pooled slot accuracy "
                         f"{_fmt(m.get('pooled_slot_accuracy'))})")
        hist = m.get("acceptance_histogram")
        if hist:
            lines.append("  accepted r (share of vanilla rounds, z-lab histogram): "
                         + " ".join(f"{r}:{100 * share:.1f}%" for r, share in enumerate(hist)))
        mismatch = m.get("g_x_mismatch")
        if mismatch is not None and mismatch > mismatch_threshold:
            lines.append(f"  WARNING g != x on {100 * mismatch:.1f}% of completion positions (> "
                         f"{100 * mismatch_threshold:.0f}%): {MISMATCH_MEANING}")
    return lines


MISMATCH_MEANING = ("the cached completion is not what this target predicts greedily (serving engine vs Hugging "
                    "Face numerics, another model or kernels); tau is scored against g, the target's own argmax, "
                    "so it stays right, but the contexts are off-policy for this target")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Recompute EVAL-SPEC metrics from draft-output dumps.")
    parser.add_argument("directory")
    parser.add_argument("--budgets", default="8,16,64")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_out", default=None, help="write the metrics JSON here")
    parser.add_argument("--no-manifest", action="store_true",
                        help="read every dump of a directory without a complete manifest (still checked)")
    args = parser.parse_args(argv)
    try:
        budgets = parse_budgets(args.budgets)
        if args.topk < 1:
            raise ValueError(f"--topk {args.topk}: must be at least 1")
        results = compute(args.directory, budgets, args.topk, args.seed, require_manifest=not args.no_manifest)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json_out:
        from remote.artifacts import write_json_atomic

        write_json_atomic(args.json_out, results)
    print("\n".join(summary_lines(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
