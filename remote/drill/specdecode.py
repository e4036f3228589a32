"""DFLASH speculative decoding for the rehearsal server: the drafter proposes, the target verifies greedily.

One round at anchor a (x[a] is the last emitted token, the bonus of the round before, or the
prefill's token for the first round):

- the drafter (`remote.drafter.Drafter`, EVAL-SPEC 1) reads the target's hidden states of its
  `target_layer_ids` at every position < a and proposes the block [x[a], d_1 .. d_{B-1}];
- the target runs once over x[0..a] + d_1..d_{B-1}: g[p] = its argmax after position p;
- d_j is accepted while d_j == g[a+j-1] (the leading run, r of them), then the bonus token
  g[a+r] is appended: r + 1 tokens per verify step, exactly what plain greedy decoding gives;
- the next anchor is a + r + 1, whose context (positions <= a + r) that same forward computed.

The per-request facts are SGLang 0.5.23's (`tokenizer_manager._calculate_spec_decoding_metrics`):
`spec_verify_ct` (verify steps), `spec_num_correct_drafts` (accepted drafts, no bonus),
`spec_num_proposed_drafts` (= verify steps * (B - 1)), `spec_accept_rate`, `spec_accept_length`
(= completion_tokens / spec_verify_ct: the prefill's first token and every bonus counted) and
`spec_correct_drafts_histogram` (index r = steps that accepted r drafts). A round cut short by
max_new_tokens or the end-of-sequence token still counts its verify step and its correct drafts,
as SGLang commits the whole accepted run before the output is truncated.

The target is re-run over the whole sequence each step (no KV cache): the tiny target is a hybrid
with linear-attention layers whose recurrent state cannot be rolled back past rejected drafts
without SGLang's state tracking, and at its size a full forward costs milliseconds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from remote.drafter import Drafter, DrafterError, load_drafter
from remote.target_io import read_target_heads

ALGORITHM = "DFLASH"


@dataclass
class SpecOutput:
    """One request's generation and the counts SGLang keeps for it."""

    output_ids: list[int]
    finish: str  # "stop" (a stop token: the end-of-sequence one), "length" or "abort"
    verify_ct: int = 0
    correct_drafts: list[int] = field(default_factory=list)  # per verify step, drafts accepted (no bonus)
    block_size: int = 0

    def meta_info(self) -> dict[str, Any]:
        """SGLang's per-request speculative fields (absent, as in SGLang, when no verify step ran)."""
        if self.verify_ct == 0:
            return {}
        proposed = self.verify_ct * (self.block_size - 1)
        histogram = [0] * (max(self.correct_drafts) + 1)
        for r in self.correct_drafts:
            histogram[r] += 1
        correct = sum(self.correct_drafts)
        return {
            "spec_verify_ct": self.verify_ct,
            "spec_num_correct_drafts": correct,
            "spec_num_proposed_drafts": proposed,
            "spec_accept_rate": correct / proposed,
            "spec_accept_length": len(self.output_ids) / self.verify_ct,
            "spec_correct_drafts_histogram": histogram,
        }


class Speculator:
    """A target model (transformers, loaded by the caller) with a DFlash drafter checkpoint beside it."""

    def __init__(self, target_model: Any, target_dir: str | os.PathLike, drafter_dir: str | os.PathLike):
        self.target = target_model
        self.drafter_dir = str(drafter_dir)
        # As the evaluator computes on a CPU: float32 drafter, the target's embed as stored, lm_head in float32.
        self.device = next(target_model.parameters()).device
        self.drafter: Drafter = load_drafter(drafter_dir, self.device, torch.float32)
        heads = read_target_heads(target_dir)
        spec = self.drafter.spec
        if heads.hidden_size != spec.hidden_size:
            raise DrafterError(f"{drafter_dir}: hidden_size {spec.hidden_size}, the target {target_dir} has "
                               f"{heads.hidden_size}")
        if not 0 <= spec.mask_token_id < heads.vocab_size:
            raise DrafterError(f"{drafter_dir}: mask_token_id {spec.mask_token_id} is outside the target "
                               f"vocabulary ({heads.vocab_size})")
        layers = int(getattr(target_model.config, "num_hidden_layers", 0) or 0)
        beyond = [k for k in spec.target_layer_ids if layers and k >= layers]
        if beyond:
            raise DrafterError(f"{drafter_dir}: target_layer_ids {beyond} beyond the target's {layers} layers")
        self.embed = heads.embed.to(self.device)
        self.lm_head = heads.lm_head.to(self.device, torch.float32)

    @property
    def block_size(self) -> int:
        return self.drafter.spec.block_size

    def server_args(self) -> dict[str, Any]:
        """The speculative settings /server_info reports, under SGLang's names (DFLASH: one step, top-1,
        as many draft tokens as the block)."""
        return {
            "speculative_algorithm": ALGORITHM,
            "speculative_draft_model_path": self.drafter_dir,
            "speculative_num_draft_tokens": self.block_size,
            "speculative_dflash_block_size": self.block_size,
            "speculative_num_steps": 1,
            "speculative_eagle_topk": 1,
        }

    def _target_pass(self, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(argmax next token after each position [T], the drafter's layers concatenated [T, n*H])."""
        out = self.target(input_ids=torch.tensor([tokens], device=self.device), output_hidden_states=True,
                          use_cache=False)
        # Layer k is the output of decoder layer k: hidden_states[k + 1] (EVAL-SPEC 1).
        feats = torch.cat([out.hidden_states[k + 1][0] for k in self.drafter.spec.target_layer_ids], dim=-1)
        return out.logits[0].argmax(-1), feats

    def _draft(self, feats: torch.Tensor, tokens: list[int], anchor: int) -> list[int]:
        """The drafter's greedy block after x[anchor], from the states of positions < anchor: B-1 ids."""
        d = self.drafter
        ids = torch.tensor(tokens[:anchor + 1], device=self.device)
        anchors = torch.tensor([anchor], device=self.device)
        hidden = d.block_hidden(d.context_kv(feats[:anchor]), self.embed, ids, anchors)
        return d.logits(hidden, self.lm_head)[0].argmax(-1).tolist()

    @torch.inference_mode()
    def generate(self, input_ids: list[int], max_new_tokens: int, stop_ids: Collection[int],
                 aborted: Callable[[], bool] = lambda: False) -> SpecOutput:
        """Greedy continuation of `input_ids` until a token of `stop_ids` (kept) or `max_new_tokens`,
        drafted and verified: the same tokens as plain greedy. `aborted` is asked before each step."""
        result = SpecOutput([], "length", block_size=self.block_size)
        if max_new_tokens <= 0:
            return result
        stop_ids = set(stop_ids)
        tokens = list(input_ids)
        g, feats = self._target_pass(tokens)  # the prefill: its last argmax is the first token
        tokens.append(int(g[-1]))
        emitted = [tokens[-1]]
        while emitted[-1] not in stop_ids and len(emitted) < max_new_tokens:
            if aborted():
                result.output_ids, result.finish = emitted, "abort"
                return result
            anchor = len(tokens) - 1
            drafts = self._draft(feats, tokens, anchor)
            g, feats = self._target_pass(tokens + drafts)
            verdict = g[anchor:].tolist()  # verdict[j] is the target's token after position anchor + j
            r = 0
            while r < len(drafts) and drafts[r] == verdict[r]:
                r += 1
            result.verify_ct += 1
            result.correct_drafts.append(r)
            new = [*drafts[:r], verdict[r]]
            tokens += new
            feats = feats[:len(tokens) - 1]  # positions <= the bonus's predecessor are the accepted ones
            for token in new:
                if len(emitted) == max_new_tokens or emitted[-1] in stop_ids:
                    break
                emitted.append(token)
        result.output_ids = emitted
        result.finish = "stop" if emitted[-1] in stop_ids else "length"
        return result


def load_speculator(target_model: Any, target_dir: str | os.PathLike, drafter_dir: str | os.PathLike) -> Speculator:
    """A Speculator, or DrafterError naming the checkpoint when it cannot draft for this target."""
    if not Path(drafter_dir).is_dir():
        raise DrafterError(f"--speculative-drafter {drafter_dir}: not a directory")
    return Speculator(target_model, target_dir, drafter_dir)
