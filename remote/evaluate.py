"""Evaluate DFlash drafters on cached target hidden states (EVAL-SPEC): dumps, then metrics.

    python -m remote.evaluate --states DIR --target MODEL_DIR --drafter NAME=PATH [--drafter ...]
        [--reference NAME] --out DIR [--device auto|cpu|cuda] [--budgets 8,16,64] [--topk 8]
        [--anchor-chunk N] [--layers-override NAME=1,2,3] [--allow-unsound] [--allow-partial]

Reads the extraction directory (refused without its manifest; every file checked against its size
and sha256 there, its shapes, metadata and token ids), only `embed_tokens` / `lm_head` of the target
(finite), and each drafter checkpoint (field by field, weights finite, provenance against the cached
layers and their soundness: a flagged layer refused unless --allow-unsound), all before any work. A
partial extraction (remote.extract --stop-file) is refused unless --allow-partial, which evaluates the
prompts it holds and says so (`states_partial` in results.json and the manifest). For every
drafter and prompt it runs all anchors a in [P, N-2], batched in chunks over the prompt's context K/V
computed once, and writes `<out>/<drafter>/<prompt_id>.safetensors` (section 4, plus `input_ids` for
the g-vs-x diagnostic and the metadata `vocab_size`). Then `<out>/results.json` (remote.metrics per drafter, drafter facts, the
reference name) and `manifest.json` last.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from remote.artifacts import MANIFEST, atomic_path, read_manifest, write_json_atomic, write_manifest
from remote.drafter import (
    Drafter,
    DrafterError,
    check_against_cache,
    load_drafter,
    parse_overrides,
    provenance,
)
from remote.events import EventWriter, WorkerError, run_worker
from remote.extract_check import PARTIAL_MANIFEST, read_partial
from remote.metrics import DumpError, drafter_metrics, load_dump, method_ids, parse_budgets
from remote.prompts import ID_RE
from remote.target_io import TargetError, TargetHeads, read_target_heads

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def pick_device(choice: str) -> torch.device:
    """auto -> cuda when available, else cpu; an explicit cuda without a GPU is a clear error."""
    if choice == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if choice == "cuda" and not torch.cuda.is_available():
        raise WorkerError("--device cuda: no CUDA device is available here", where="device")
    if choice not in ("cpu", "cuda"):
        raise WorkerError(f"--device {choice!r}: expected auto, cpu or cuda", where="device")
    return torch.device(choice)


def compute_dtype(device: torch.device) -> torch.dtype:
    # bf16 is the checkpoints' dtype and fast on GPUs; CPU bf16 matmuls are slow, so float32 there.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


@torch.inference_mode()
def draft_topk(drafter: Drafter, embed: torch.Tensor, lm_head: torch.Tensor, feats: torch.Tensor,
               tokens: torch.Tensor, prompt_len: int, k: int, chunk: int,
               on_chunk: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k ids and log-probs [A, B-1, k] at every anchor in [P, N-2], anchors batched by `chunk`.

    `feats` [N, n*H] (the drafter's layers, concatenated), `tokens` [N]; all on the drafter's device.
    Returns (anchors, ids, logprobs) on the CPU.
    """
    n = tokens.shape[0]
    anchors = torch.arange(prompt_len, n - 1, device=drafter.device)
    ctx_kv = drafter.context_kv(feats)
    ids_out, lp_out = [], []
    for start in range(0, anchors.shape[0], chunk):
        batch = anchors[start:start + chunk]
        hidden = drafter.block_hidden(ctx_kv, embed, tokens, batch)
        logprobs = drafter.logits(hidden, lm_head).float().log_softmax(-1)
        top = logprobs.topk(k, dim=-1)
        ids_out.append(top.indices.cpu())
        lp_out.append(top.values.cpu())
        if on_chunk is not None:
            on_chunk(min(start + chunk, anchors.shape[0]), anchors.shape[0])
    if not ids_out:
        empty = torch.zeros(0, drafter.spec.block_size - 1, k)
        return anchors.cpu(), empty.long(), empty.float()
    return anchors.cpu(), torch.cat(ids_out), torch.cat(lp_out)


@torch.inference_mode()
def draft_topk_naive(drafter: Drafter, embed: torch.Tensor, lm_head: torch.Tensor, feats: torch.Tensor,
                     tokens: torch.Tensor, anchors: list[int], k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive loop: each anchor on its own, from scratch (`Drafter.reference_hidden`)."""
    ids_out, lp_out = [], []
    for a in anchors:
        hidden = drafter.reference_hidden(feats, embed, tokens, a)
        top = drafter.logits(hidden, lm_head).float().log_softmax(-1).topk(k, dim=-1)
        ids_out.append(top.indices.cpu())
        lp_out.append(top.values.cpu())
    return torch.stack(ids_out), torch.stack(lp_out)


def select_layers(hidden: torch.Tensor, cached_layers: list[int], wanted: list[int]) -> torch.Tensor:
    """[T, n_cached, H] -> [T, n*H]: the wanted layers in the drafter's order, concatenated."""
    index = torch.tensor([cached_layers.index(k) for k in wanted], device=hidden.device)
    return hidden.index_select(1, index).flatten(1)


def read_prompt_states(path: Path, layers: list[int], hidden_size: int) -> dict[str, Any]:
    """One prompt's cached states, checked against the manifest's layers and hidden size."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), "pt") as fh:
            meta = fh.metadata() or {}
            names = set(fh.keys())
            missing = {"hidden", "input_ids", "g"} - names
            if missing:
                raise WorkerError(f"{path}: missing tensors {sorted(missing)}", where=str(path))
            data = {name: fh.get_tensor(name) for name in ("hidden", "input_ids", "g")}
    except (SafetensorError, OSError) as exc:
        raise WorkerError(f"{path}: unreadable safetensors ({exc})", where=str(path)) from exc
    hidden = data["hidden"]
    t = data["input_ids"].shape[0]
    if hidden.dim() != 3 or tuple(hidden.shape) != (t, len(layers), hidden_size):
        raise WorkerError(f"{path}: hidden has shape {list(hidden.shape)}, expected [{t}, {len(layers)}, {hidden_size}] "
                          f"(tokens, layers {layers}, hidden)", where=str(path))
    if data["g"].shape[0] != t:
        raise WorkerError(f"{path}: g has {data['g'].shape[0]} positions, input_ids {t}", where=str(path))
    data["meta"] = meta
    return data


def parse_drafters(items: list[str]) -> dict[str, Path]:
    """NAME=PATH items -> {name: path}, names checked (they become directory names)."""
    out: dict[str, Path] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise WorkerError(f"--drafter {item!r}: expected NAME=PATH", where="--drafter")
        if not NAME_RE.match(name):
            raise WorkerError(f"--drafter {item!r}: name may hold letters, digits, '.', '_', '-'", where="--drafter")
        if name in out:
            raise WorkerError(f"--drafter {name!r} given twice", where="--drafter")
        out[name] = Path(path)
    if not out:
        raise WorkerError("no --drafter given", where="--drafter")
    return out


def write_dump(path: Path, drafter: str, prompt_id: str, prompt_len: int, block_size: int, anchors: torch.Tensor,
               ids: torch.Tensor, logprobs: torch.Tensor, truth: torch.Tensor, input_ids: torch.Tensor,
               vocab_size: int | None = None) -> None:
    """Write one draft-output dump (EVAL-SPEC 4) atomically."""
    from safetensors.torch import save_file

    tensors = {
        "anchors": anchors.long().contiguous(),
        "topk_ids": ids.long().contiguous(),
        "topk_logprobs": logprobs.float().contiguous(),
        "truth": truth.long().contiguous(),
        "input_ids": input_ids.long().contiguous(),
    }
    meta = {"prompt_len": str(prompt_len), "block_size": str(block_size), "prompt_id": prompt_id, "drafter": drafter}
    if vocab_size is not None:
        meta["vocab_size"] = str(vocab_size)
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=meta)


def check_states(states: Path, manifest: dict[str, Any], vocab_size: int | None, events: EventWriter) -> None:
    """Every prompt file the evaluation reads, checked before any work: listed, its size and sha256
    those of the manifest (done by the caller), its tensors' shapes and metadata those the manifest
    says, its token ids inside the target's vocabulary. One line naming the file and field otherwise."""
    from safetensors import SafetensorError, safe_open

    layers, hidden_size = manifest["layers"], int(manifest["hidden_size"])
    listed = manifest.get("files") or {}
    for i, prompt in enumerate(manifest["prompts"]):
        where = f"{states}/{prompt.get('file')}"
        if not isinstance(prompt, dict) or not ID_RE.match(str(prompt.get("id", ""))) \
                or prompt.get("file") not in listed:
            raise WorkerError(f"{states}/manifest.json: prompts[{i}] is not a listed file with a safe id "
                              f"(found {json.dumps(prompt)[:80]})", where=str(states))
        try:
            with safe_open(str(states / prompt["file"]), "pt") as fh:
                meta = fh.metadata() or {}
                names = set(fh.keys())
                missing = {"hidden", "input_ids", "g"} - names
                if missing:
                    raise WorkerError(f"{where}: missing tensors {sorted(missing)}", where=where)
                shape = list(fh.get_slice("hidden").get_shape())
                ids, g = fh.get_tensor("input_ids"), fh.get_tensor("g")
        except (SafetensorError, OSError) as exc:
            raise WorkerError(f"{where}: unreadable safetensors ({exc})", where=where) from exc
        t = ids.shape[0]
        if shape != [t, len(layers), hidden_size]:
            raise WorkerError(f"{where}: hidden has shape {shape}, expected [{t}, {len(layers)}, {hidden_size}] "
                              f"(tokens, layers {layers}, hidden)", where=where)
        if g.shape[0] != t:
            raise WorkerError(f"{where}: g has {g.shape[0]} positions, input_ids {t}", where=where)
        prompt_len = prompt.get("prompt_len")
        if not isinstance(prompt_len, int) or not 1 <= prompt_len < t:
            raise WorkerError(f"{where}: prompt_len {prompt_len!r} (manifest) must be in 1..{t - 1} for {t} tokens",
                              where=where)
        if meta.get("prompt_len") not in (None, str(prompt_len)) or meta.get("prompt_id") not in (None, prompt["id"]):
            raise WorkerError(f"{where}: metadata prompt_id {meta.get('prompt_id')!r} / prompt_len "
                              f"{meta.get('prompt_len')!r} disagree with the manifest's {prompt['id']!r} / {prompt_len}",
                              where=where)
        if vocab_size is not None and t:
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                raise WorkerError(f"{where}: input_ids holds token {bad}, outside the target vocabulary "
                                  f"(0..{vocab_size - 1}): it cannot be embedded", where=where)
            truth = g[:-1]
            if t > 1 and (int(truth.min()) < 0 or int(truth.max()) >= vocab_size):
                raise WorkerError(f"{where}: g holds token ids outside the target vocabulary (0..{vocab_size - 1})",
                                  where=where)
    events.log(f"states checked: {len(manifest['prompts'])} prompt files, sizes and sha256 as in the manifest")


def evaluate(states: Path, target: Path, drafter_paths: dict[str, Path], out: Path, device: torch.device,
             budgets: list[int], topk: int, chunk: int | None, reference: str | None,
             events: EventWriter, overrides: dict[str, list[int]] | None = None,
             allow_unsound: bool = False, allow_partial: bool = False) -> dict[str, Any]:
    """The whole evaluation; returns the results dict also written to `<out>/results.json`.

    Everything is checked before the first weight reaches the device: the states' manifest (sizes and
    sha256 of every file), each drafter's provenance against the states (layers, hidden size, fc width,
    the soundness of the layers it reads: a flagged layer refused unless `allow_unsound`), the target
    heads (finite), each checkpoint field by field and its weights (finite).
    """
    overrides = overrides or {}
    unknown = sorted(set(overrides) - set(drafter_paths))
    if unknown:
        raise WorkerError(f"--layers-override names {unknown}, not among the drafters {sorted(drafter_paths)}",
                          where="--layers-override")
    if reference is not None and reference not in drafter_paths:
        raise WorkerError(f"--reference {reference!r} is not one of the drafters {sorted(drafter_paths)}",
                          where="--reference")
    reference = reference or next(iter(drafter_paths))
    events.phase("check")
    partial = None
    if not (states / MANIFEST).is_file() and (states / PARTIAL_MANIFEST).is_file():
        manifest = read_partial(states, allow_partial)  # refused unless allowed; every file verified
        partial = {"prompts_done": manifest["prompts_done"], "prompts_missing": manifest["prompts_missing"]}
        events.log(f"evaluating a partial extraction (--allow-partial): {len(partial['prompts_done'])} prompts, "
                   f"missing {len(partial['prompts_missing'])}", level="warning")
    else:
        try:
            # sha256 too: a host crash can leave a renamed file zeroed (written without fsync) at its full size.
            manifest = read_manifest(states, verify=True)
        except ValueError as exc:
            raise WorkerError(str(exc), where=str(states)) from exc
    for key in ("layers", "hidden_size", "prompts"):
        if key not in manifest:
            raise WorkerError(f"{states}/manifest.json: no {key!r}: not an extraction manifest", where=str(states))
    layers = [int(k) for k in manifest["layers"]]
    hidden_size = int(manifest["hidden_size"])
    prompts = manifest["prompts"]
    soundness = manifest.get("soundness")
    if soundness is None:
        from remote.soundness import of_files

        events.log("the extraction's manifest has no soundness statistics (an older extractor): computed now",
                   level="warning")
        soundness = of_files(states, [p["file"] for p in prompts], layers)
    facts = {"dir": str(states), "layers": layers, "hidden_size": hidden_size, "soundness": soundness}
    provenances: dict[str, dict[str, Any]] = {}
    for name, path in drafter_paths.items():
        try:
            provenances[name] = provenance(path, name, overrides.get(name), facts, weights=False,
                                           allow_unsound=allow_unsound)
        except DrafterError as exc:
            raise WorkerError(str(exc), where=str(path)) from exc
        if allow_unsound and any(r.get("flagged") for r in provenances[name]["soundness"] or []):
            events.log(f"drafter {name} reads unsound layers (--allow-unsound): "
                       f"{[r['layer'] for r in provenances[name]['soundness'] if r.get('flagged')]}", level="warning")

    events.phase("load")
    try:
        heads: TargetHeads = read_target_heads(target)
    except (TargetError, OSError) as exc:
        raise WorkerError(str(exc), where=str(target)) from exc
    if heads.hidden_size != hidden_size:
        raise WorkerError(f"{target}: embed_tokens has hidden size {heads.hidden_size}, the cached states "
                          f"{hidden_size}", where=str(target))
    for label, tensor in (("embed_tokens", heads.embed), ("lm_head", heads.lm_head)):
        if not bool(torch.isfinite(tensor).all()):
            raise WorkerError(f"{target}: {label} holds non-finite values: refused", where=str(target))
    check_states(states, manifest, heads.vocab_size, events)
    dtype = compute_dtype(device)
    drafters: dict[str, Drafter] = {}
    for name, path in drafter_paths.items():
        try:
            # Weights checked (shapes, finite) on the CPU first; then moved to the device.
            drafter = load_drafter(path, "cpu", dtype, layers_override=overrides.get(name))
            check_against_cache(drafter.spec, layers, hidden_size, name)
        except DrafterError as exc:
            raise WorkerError(str(exc), where=str(path)) from exc
        if not 0 <= drafter.spec.mask_token_id < heads.vocab_size:
            raise WorkerError(f"{path}: mask_token_id {drafter.spec.mask_token_id} is outside the target "
                              f"vocabulary ({heads.vocab_size})", where=str(path))
        drafters[name] = drafter
        provenances[name]["weights_checked"] = True
    for name, drafter in drafters.items():
        drafters[name] = Drafter(drafter.spec, drafter.w, device, dtype)
        source = " (override)" if drafter.spec.layers_source == "override" else ""
        events.log(f"drafter {name}: layers {drafter.spec.target_layer_ids}{source}, block {drafter.spec.block_size}, "
                   f"{drafter.spec.num_layers} layers, fc width {drafter.spec.fc_layers}")
    embed = heads.embed.to(device)
    lm_head = heads.lm_head.to(device=device, dtype=dtype)
    k = min(max([*budgets, topk]), heads.vocab_size)
    chunk = chunk or (64 if device.type == "cuda" else 16)

    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).unlink(missing_ok=True)  # the directory is incomplete until this run finishes
    files: dict[str, dict[str, Any]] = {}
    results: dict[str, Any] = {"drafters": {}}
    for d_index, (name, drafter) in enumerate(drafters.items()):
        events.phase(f"draft {name}")
        started = time.perf_counter()
        for p_index, prompt in enumerate(prompts):
            pid = prompt["id"]
            data = read_prompt_states(states / prompt["file"], layers, hidden_size)
            prompt_len = int(prompt["prompt_len"])
            feats = select_layers(data["hidden"].to(device), layers, drafter.spec.target_layer_ids)
            tokens = data["input_ids"].to(device)
            label = f"{name} [{p_index + 1}/{len(prompts)}] {pid}"

            def on_chunk(done: int, total: int, label: str = label) -> None:
                events.progress("anchors", done, total, "anchor", label=label)

            anchors, ids, logprobs = draft_topk(drafter, embed, lm_head, feats, tokens, prompt_len, k, chunk, on_chunk)
            rel = f"{name}/{pid}.safetensors"
            write_dump(out / rel, name, pid, prompt_len, drafter.spec.block_size, anchors, ids, logprobs,
                       data["g"], data["input_ids"], heads.vocab_size)
            files[rel] = {"kind": "draft-dump", "drafter": name, "prompt_id": pid}
            events.progress("prompts", p_index + 1, len(prompts), "prompt", label=label)
        events.log(f"drafter {name}: {len(prompts)} prompts in {time.perf_counter() - started:.1f} s")
        try:
            dumps = [load_dump(out / name / f"{p['id']}.safetensors", drafter=name, prompt_id=p["id"]) for p in prompts]
            metrics = drafter_metrics(dumps, budgets, topk)
        except DumpError as exc:
            raise WorkerError(str(exc), where=str(out / name)) from exc
        metrics["facts"] = {**drafter.spec.facts(), "path": str(drafter_paths[name])}
        metrics["provenance"] = provenances[name]
        vanilla, pos1 = metrics["tau"]["vanilla"]["macro"], metrics["pos1_acc"]
        events.log(f"drafter {name}: tau vanilla {'-' if vanilla is None else f'{vanilla:.2f}'}, "
                   f"pos1_acc {'-' if pos1 is None else f'{pos1:.3f}'}")
        results["drafters"][name] = metrics
        events.progress("drafters", d_index + 1, len(drafters), "drafter", label=name)

    results.update({
        "reference": reference,
        "budgets": budgets,
        "topk": topk,
        "methods": method_ids(budgets, topk),
        "states": str(states),
        "target": str(target),
        "layers": layers,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "kernels": manifest.get("kernels"),
        "soundness": soundness,
        "states_incomplete_allowed": manifest.get("incomplete_allowed") or [],
        "states_partial": partial,
        "g_x_mismatch": next(iter(results["drafters"].values()))["g_x_mismatch"] if results["drafters"] else None,
    })
    write_json_atomic(out / "results.json", results)
    files["results.json"] = {"kind": "results"}
    write_manifest(out, files, kind="evaluation", reference=reference, drafters=list(drafters), states_partial=partial)
    events.artifact(str(out / "results.json"), "results")
    return results


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    """The worker's entry (through `run_worker`); `argv` defaults to the command line."""
    parser = argparse.ArgumentParser(description="Evaluate DFlash drafters on cached hidden states.")
    parser.add_argument("--states", required=True, help="extraction directory (with manifest.json)")
    parser.add_argument("--target", required=True, help="target model directory (embed_tokens, lm_head)")
    parser.add_argument("--drafter", action="append", default=[], metavar="NAME=PATH")
    parser.add_argument("--reference", default=None)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--budgets", default="8,16,64")
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--anchor-chunk", type=int, default=None)
    parser.add_argument("--layers-override", action="append", default=[], metavar="NAME=1,2,3",
                        help="a drafter's target layer ids, replacing its config's (the console's [[drafters]] layers)")
    parser.add_argument("--allow-unsound", action="store_true", help="evaluate on layers flagged unsound")
    parser.add_argument("--allow-partial", action="store_true",
                        help="evaluate a partial extraction's prompts (said in the results)")
    args = parser.parse_args(argv)
    try:
        overrides = parse_overrides(args.layers_override)
    except DrafterError as exc:
        raise WorkerError(str(exc), where="--layers-override") from exc
    try:
        budgets = parse_budgets(args.budgets)
    except ValueError as exc:
        raise WorkerError(str(exc), where="--budgets") from exc
    if args.topk < 1:
        raise WorkerError(f"--topk {args.topk}: must be at least 1", where="--topk")
    if args.anchor_chunk is not None and args.anchor_chunk < 1:
        raise WorkerError(f"--anchor-chunk {args.anchor_chunk}: must be at least 1", where="--anchor-chunk")
    drafters = parse_drafters(args.drafter)
    device = pick_device(args.device)
    results = evaluate(Path(args.states), Path(args.target), drafters, Path(args.out), device, budgets, args.topk,
                       args.anchor_chunk, args.reference, events, overrides, args.allow_unsound, args.allow_partial)
    summary = {name: {"tau_vanilla": m["tau"]["vanilla"]["macro"], "pos1_acc": m["pos1_acc"]}
               for name, m in results["drafters"].items()}
    return {"results": str(Path(args.out) / "results.json"), "reference": results["reference"], "summary": summary}


if __name__ == "__main__":
    run_worker(main)
