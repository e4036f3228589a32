"""The extractor's `check` phase: everything checkable before the server stops, checked first.

    python -m remote.extract --check-only --model DIR --completions FILE [--drafter DIR ...]
        [--layers 1,8] [--layers-override NAME=1,2,3] [--allow-incomplete] [--limit N]

Needs no GPU and touches no output directory: config.json of the target and the completions cache
are read, and each drafter's config and safetensors headers. Checked: every token id inside the
target's vocabulary (`vocab_size`), every prompt + completion within its context
(`max_position_embeddings`), every generation complete (a stop or length finish, not empty; the
operator may accept others with --allow-incomplete), and per drafter its provenance against the
target (hidden size, num_target_layers, mask token inside the vocabulary, layer ids inside the
model, fc width against the ids).

On success the result is a dict (see `check`); on failure a one-line error naming the file and the
first problem, "(+N more)" when there are more; `--check-only` then also emits the result with
`ok: false` and every problem, for the console's preflight to show.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from remote.artifacts import sha256_file
from remote.completions import completeness
from remote.events import EventWriter, WorkerError

# A stopped extraction's manifest (remote.extract --stop-file): a name no completeness check reads
# (they all want `manifest.json`), so a part is never taken for the whole.
PARTIAL_MANIFEST = "manifest.partial.json"


def _where(file: str | Path, i: int, entry: dict[str, Any]) -> str:
    return f"{file}: prompts[{i}] ({entry.get('id')})"


def check(model: str | Path, model_config: dict[str, Any], completions_file: str | Path,
          completions: dict[str, Any], prompts: list[dict[str, Any]], layer_ids: list[int],
          drafters: list[str], overrides: dict[str, list[int]], allow_incomplete: bool,
          events: EventWriter | None = None, check_only: bool = False) -> dict[str, Any]:
    """Validate the completions (of `prompts`) and the drafters against the target; returns
    {"ok", "check_only", "model", "completions", "vocab_size", "max_position_embeddings",
    "num_layers", "hidden_size", "layers", "prompts", "tokens", "max_tokens", "incomplete":
    [{"id", "reason"}], "allowed_incomplete", "drafters": {name: provenance}, "problems": [str]}."""
    text = model_config.get("text_config") or model_config
    vocab = text.get("vocab_size", model_config.get("vocab_size"))
    max_pos = text.get("max_position_embeddings", model_config.get("max_position_embeddings"))
    num_layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    cfg = Path(model) / "config.json"
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < 1:
        raise WorkerError(f"{cfg}: field 'vocab_size': expected a positive integer, found {vocab!r}", str(cfg))
    if max_pos is not None and (not isinstance(max_pos, int) or isinstance(max_pos, bool) or max_pos < 1):
        raise WorkerError(f"{cfg}: field 'max_position_embeddings': expected a positive integer, found {max_pos!r}",
                          str(cfg))
    problems: list[str] = []
    incomplete: list[dict[str, Any]] = []
    tokens = longest = 0
    index = {id(e): i for i, e in enumerate(completions["prompts"])}
    for entry in prompts:
        i = index[id(entry)]
        where = _where(completions_file, i, entry)
        for key in ("prompt_ids", "completion_ids"):
            bad = next(((j, t) for j, t in enumerate(entry[key]) if not 0 <= t < vocab), None)
            if bad is not None:
                problems.append(f"{where}.{key}[{bad[0]}] = {bad[1]} is outside the target's vocabulary "
                                f"(0..{vocab - 1}, vocab_size of {cfg})")
        n = len(entry["prompt_ids"]) + len(entry["completion_ids"])
        tokens += n
        longest = max(longest, n)
        if max_pos is not None and n > max_pos:
            problems.append(f"{where} has {n} tokens ({len(entry['prompt_ids'])} prompt + "
                            f"{len(entry['completion_ids'])} completion), beyond the target's context "
                            f"(max_position_embeddings {max_pos} in {cfg})")
        complete, why = completeness(entry)
        if entry.get("complete") is False and complete:
            complete, why = False, str(entry.get("incomplete_reason") or "marked incomplete by remote.completions")
        if not complete:
            incomplete.append({"id": entry.get("id"), "reason": why})
    if incomplete and not allow_incomplete:
        listed = "; ".join(f"{e['id']}: {e['reason']}" for e in incomplete[:3])
        more = f"; +{len(incomplete) - 3} more" if len(incomplete) > 3 else ""
        problems.append(f"{completions_file}: {len(incomplete)} of {len(prompts)} generations are incomplete "
                        f"({listed}{more}): re-run remote.completions, or pass --allow-incomplete to extract them anyway")
    elif incomplete and events is not None:
        events.log(f"extracting {len(incomplete)} incomplete generations (--allow-incomplete): "
                   + ", ".join(str(e["id"]) for e in incomplete), level="warning")

    records: dict[str, Any] = {}
    for directory in drafters:
        name = Path(directory).name
        try:
            records[name] = _drafter(directory, name, overrides.get(name), vocab, num_layers, hidden)
            # What it will read from this extraction (its layers' positions in the manifest's `layers`).
            records[name]["reads"] = [{"layer": k, "index": layer_ids.index(k)}
                                      for k in records[name]["target_layer_ids"] if k in layer_ids]
        except ValueError as exc:
            problems.append(str(exc))
    result = {
        "ok": not problems, "check_only": check_only, "model": str(model), "completions": str(completions_file),
        "vocab_size": vocab, "max_position_embeddings": max_pos, "num_layers": num_layers, "hidden_size": hidden,
        "layers": layer_ids, "prompts": len(prompts), "tokens": tokens, "max_tokens": longest,
        "incomplete": incomplete, "allowed_incomplete": bool(allow_incomplete and incomplete),
        "drafters": records, "problems": problems,
    }
    if problems:
        if check_only and events is not None:
            events.result(result)
        more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
        raise WorkerError(problems[0] + more, str(completions_file))
    return result


def _drafter(directory: str, name: str, override: list[int] | None, vocab: int, num_layers: Any,
             hidden: Any) -> dict[str, Any]:
    from remote.provenance import provenance

    # Headers only: the weights' finite check belongs to the evaluator's host (remote.provenance).
    record = provenance(directory, name, override, target_vocab=vocab, weights=False)
    if isinstance(hidden, int) and record["hidden_size"] != hidden:
        raise ValueError(f"drafter {name}: hidden_size {record['hidden_size']} ({directory}/config.json) but the "
                         f"target's is {hidden}")
    if isinstance(num_layers, int) and record["num_target_layers"] not in (None, num_layers):
        raise ValueError(f"drafter {name}: num_target_layers {record['num_target_layers']} ({directory}/config.json) "
                         f"but the target has {num_layers} decoder layers")
    return record


def parse_overrides(items: list[str], drafters: list[str]) -> dict[str, list[int]]:
    """--layers-override NAME=1,2,3 items (NAME: a --drafter directory's name), as a WorkerError when
    malformed or naming no drafter."""
    if not items:
        return {}
    from remote.provenance import DrafterError
    from remote.provenance import parse_overrides as parse

    try:
        overrides = parse(items)
    except DrafterError as exc:
        raise WorkerError(str(exc), "--layers-override") from exc
    names = sorted(Path(d).name for d in drafters)
    unknown = sorted(set(overrides) - set(names))
    if unknown:
        raise WorkerError(f"--layers-override names {unknown}, not among the --drafter directories {names}",
                          "--layers-override")
    return overrides


def soundness_of(out: Path, files: dict[str, Any], layer_ids: list[int], events: EventWriter) -> dict[str, Any]:
    """Per-layer soundness of the written prompt files (after gpu_released, from the saved bf16 states)."""
    from remote.soundness import of_files

    result = of_files(out, list(files), layer_ids)
    for row in result["layers"]:
        if row["flagged"]:
            events.log(f"layer {row['layer']} is unsound: {'; '.join(row['reasons'])} (the evaluator refuses it "
                       "unless --allow-unsound)", level="warning")
    return result


def verify_files(directory: Path, files: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Split a manifest's `files` into those whose size and sha256 match the file on disk now and
    those that do not, each with why: ({name: facts}, {name: why})."""
    good: dict[str, Any] = {}
    bad: dict[str, str] = {}
    for name, facts in files.items():
        file = directory / name
        if Path(name).name != name or name in (".", ".."):
            bad[name] = "not a file name of this directory"
        elif not isinstance(facts, dict) or not isinstance(facts.get("size"), int) \
                or not isinstance(facts.get("sha256"), str):
            bad[name] = "no size and sha256 in the manifest"
        elif not file.is_file():
            bad[name] = "missing"
        elif file.stat().st_size != facts["size"]:
            bad[name] = f"size {file.stat().st_size}, the manifest says {facts['size']}"
        elif sha256_file(file) != facts["sha256"]:
            bad[name] = "does not match its sha256 in the manifest"
        else:
            good[name] = facts
    return good, bad


def read_partial(directory: Path, allowed: bool) -> dict[str, Any]:
    """A partial extraction's manifest (remote.extract --stop-file), every file it lists verified.

    Refused (WorkerError naming the prompts missing and the ways on) unless `allowed`: the drafters
    are compared on the whole prompt set, and a part is evaluated only when the operator asks."""
    path = directory / PARTIAL_MANIFEST
    try:
        manifest = json.loads(path.read_text())
        done, missing, files = manifest["prompts_done"], manifest["prompts_missing"], manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise WorkerError(f"{path}: not a partial extraction's manifest ({exc})", str(directory)) from None
    shown = ", ".join(missing[:5]) + (f" +{len(missing) - 5} more" if len(missing) > 5 else "")
    if not allowed:
        raise WorkerError(f"{directory} is a partial extraction: {len(done)} of {len(done) + len(missing)} prompts "
                          f"(missing {shown}); the evaluation waits for the whole set (dflash-ops run --resume "
                          f"extracts the missing prompts in the next window), or pass --allow-partial to evaluate "
                          f"the {len(done)} extracted", str(directory))
    _, bad = verify_files(directory, files)
    if bad:
        name, why = next(iter(bad.items()))
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        raise WorkerError(f"{directory}: {name}: {why}{more}", str(directory))
    return manifest
