"""Read only `embed_tokens` and `lm_head` from a target checkpoint (never the whole model).

The drafter has neither; EVAL-SPEC 1 takes both from the target. The tensors are located through
`model.safetensors.index.json` (or the single `model.safetensors`) and read one by one with
`safe_open`, so a 54 GB target costs two tensors' worth of I/O. Tied embeddings (no `lm_head`
stored, or `tie_word_embeddings` true) give lm_head = embed_tokens.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from remote.weights import tensor_files


class TargetError(ValueError):
    """The target checkpoint lacks what the evaluation needs; the message names what and where."""


@dataclass
class TargetHeads:
    """The target's input embedding and output head, [vocab, hidden] each."""

    embed: torch.Tensor
    lm_head: torch.Tensor
    tied: bool
    source: str

    @property
    def vocab_size(self) -> int:
        return self.embed.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.embed.shape[1]


def _pick(names: dict[str, Path], suffix: str) -> str | None:
    # Text decoder first: multimodal checkpoints also hold e.g. a vision tower's embeddings.
    found = sorted((n for n in names if n == suffix or n.endswith("." + suffix)),
                   key=lambda n: ("language_model" not in n, "visual" in n or "vision" in n, len(n)))
    return found[0] if found else None


def _tied(model_dir: Path) -> bool:
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return False
    config = json.loads(config_path.read_text())
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def read_target_heads(model_dir: str | os.PathLike) -> TargetHeads:
    """Read the target's embed_tokens and lm_head (only those two tensors)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise TargetError(f"{model_dir}: target model directory not found")
    names = tensor_files(model_dir, TargetError)
    embed_name = _pick(names, "embed_tokens.weight")
    if embed_name is None:
        raise TargetError(f"{model_dir}: no embed_tokens.weight among its {len(names)} tensors")
    head_name = _pick(names, "lm_head.weight")
    tied = head_name is None or _tied(model_dir)

    def read(name: str) -> torch.Tensor:
        file = names[name]
        if not file.is_file():
            raise TargetError(f"{model_dir}: {file.name} (holding {name}) is missing")
        with safe_open(str(file), "pt") as fh:
            return fh.get_tensor(name)

    embed = read(embed_name)
    lm_head = embed if tied else read(head_name)
    if lm_head.shape != embed.shape:
        raise TargetError(f"{model_dir}: lm_head {list(lm_head.shape)} and embed_tokens {list(embed.shape)} differ")
    return TargetHeads(embed=embed, lm_head=lm_head, tied=tied, source=str(model_dir))


def save_target_heads(model_dir: str | os.PathLike, embed: torch.Tensor, lm_head: torch.Tensor | None,
                      shard: bool = True) -> Path:
    """Write a minimal target checkpoint holding only the heads (tests and benchmarks).

    With `shard`, the two tensors go to two files named by a `model.safetensors.index.json`, as in
    real multi-shard checkpoints; `lm_head=None` writes a tied checkpoint.
    """
    from safetensors.torch import save_file

    from remote.artifacts import atomic_path, write_json_atomic

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    tensors = {"model.embed_tokens.weight": embed.contiguous()}
    if lm_head is not None:
        tensors["lm_head.weight"] = lm_head.contiguous()
    if shard:
        weight_map = {}
        for i, (name, tensor) in enumerate(tensors.items()):
            file = f"model-{i + 1:05d}-of-{len(tensors):05d}.safetensors"
            with atomic_path(model_dir / file) as tmp:
                save_file({name: tensor}, str(tmp), metadata={"format": "pt"})
            weight_map[name] = file
        write_json_atomic(model_dir / "model.safetensors.index.json", {"metadata": {}, "weight_map": weight_map})
    else:
        with atomic_path(model_dir / "model.safetensors") as tmp:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
    write_json_atomic(model_dir / "config.json", {
        "vocab_size": embed.shape[0], "hidden_size": embed.shape[1], "tie_word_embeddings": lm_head is None,
    })
    return model_dir
