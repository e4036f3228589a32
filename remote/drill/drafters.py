"""The drill's two DFlash drafters, fitted in seconds on CPU to the tiny target: one right, one with the story's bug.

    python -m remote.drill.drafters TARGET_DIR OUT_DIR [--steps 400]

Both read `target_layer_ids` [1, 2, 3] of the 4-layer tiny target (`remote.drill.tinymodel`) and are
trained with the real DFlash forward (`remote.drafter.Drafter`, batched anchors) to predict the target's
greedy next tokens g on the shipped prompts' greedy completions (generated in bf16 as the drill's
rehearsal server generates them, `--dtype bfloat16`; hidden states and g in bf16, as the extractor
computes them):

- `reference`: trained on the layers its config names (layer k = `hidden_states[k+1]`, EVAL-SPEC 1);
- `candidate`: trained on `hidden_states[k]` instead, i.e. the outputs of layers [0, 1, 2], while its
  config says [1, 2, 3]: the off-by-one that no shape check catches. Evaluated on the layers it
  names, its fc reads states it never saw and its tau is far lower.

The fit memorises a few hundred (anchor, slot) targets, which is all a drill needs: two checkpoints
in the z-lab format whose taus differ visibly. `fit_check` in the result is the vanilla tau of each on
the drill's prompts, computed here with the evaluation's walk (EVAL-SPEC 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

LAYER_IDS = [1, 2, 3]  # what both configs say
CANDIDATE_TRAINED_ON = [0, 1, 2]  # hidden_states[k] for k in LAYER_IDS: the off-by-one
BLOCK_SIZE = 8
COMPLETION_TOKENS = 32  # trained on; the drill asks for fewer (a prefix of the same greedy text)
STEPS = 400
PROGRESS_EVERY = 20  # Adam steps between two progress lines of the build
LEARNING_RATE = 3e-3
SEEDS = {"reference": 0, "candidate": 1}
SERVING_DTYPE = "bfloat16"  # the drill's rehearsal server generates with it (`standin --dtype`)
NORM_INIT = 10.0


def quiet_transformers() -> None:
    """No progress bars or kernel fallback warnings; the fla / causal-conv1d kernels kept out (CPU)."""
    # CPU only: with fla / causal-conv1d installed, transformers would bind kernels that need a GPU.
    for name in ("fla", "causal_conv1d"):
        sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def training_sequences(target: Path, completion_tokens: int = COMPLETION_TOKENS) -> list[dict[str, Any]]:
    """Per shipped prompt: tokens x (prompt + greedy completion), bf16 states of every layer, g."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from remote.prompts import load_prompts, prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(target)
    serving = AutoModelForCausalLM.from_pretrained(target, dtype=getattr(torch, SERVING_DTYPE)).eval()
    extracting = AutoModelForCausalLM.from_pretrained(target, dtype=torch.bfloat16).eval()
    out = []
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for prompt in load_prompts().prompts:
            ids = prompt_token_ids(tokenizer, prompt)
            x = torch.tensor([ids])
            # As the rehearsal server generates (remote.drill.standin.model: one thread).
            torch.set_num_threads(1)
            tokens = serving.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=completion_tokens,
                                      do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.pad_token_id)[0]
            torch.set_num_threads(threads)
            result = extracting(input_ids=tokens[None], output_hidden_states=True)
            layers = len(result.hidden_states) - 1
            # Layer k = hidden_states[k+1]; the last entry has the final norm applied, as the extractor stores it.
            hidden = torch.stack([result.hidden_states[k + 1][0] for k in range(layers)], dim=1).float()
            out.append({"id": prompt.id, "prompt_len": len(ids), "x": tokens, "hidden": hidden,
                        "g": result.logits[0].float().argmax(-1)})
    return out


class _Fit:
    """Shared pieces of the fit: the target's heads and the batched loss over a prompt's anchors."""

    def __init__(self, target: Path, sequences: list[dict[str, Any]]):
        import torch
        from transformers import AutoTokenizer

        from remote.target_io import read_target_heads

        heads = read_target_heads(target)
        self.embed = heads.embed.float()
        self.lm_head = heads.lm_head.float()
        self.sequences = sequences
        self.mask_token_id = int(AutoTokenizer.from_pretrained(target).convert_tokens_to_ids("<|mask|>"))
        self.num_layers = sequences[0]["hidden"].shape[1]
        self.torch = torch

    def config(self) -> dict[str, Any]:
        from remote.drafter import drafter_config

        return drafter_config(self.embed.shape[1], LAYER_IDS, self.num_layers, BLOCK_SIZE, num_layers=1,
                              mask_token_id=self.mask_token_id, vocab_size=self.embed.shape[0], num_heads=4,
                              num_kv_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0)

    def slots(self, drafter: Any, seq: dict[str, Any], layers: list[int], anchors: Any) -> tuple[Any, Any, Any]:
        """(logits [C, B-1, V], truth g[a+j-1] [C, B-1], valid [C, B-1]) at `anchors`."""
        torch = self.torch
        n = seq["x"].shape[0]
        feats = seq["hidden"][:, layers].flatten(1)
        hidden = drafter.block_hidden(drafter.context_kv(feats), self.embed, seq["x"], anchors)
        logits = drafter.logits(hidden, self.lm_head)
        pos = anchors[:, None] + torch.arange(BLOCK_SIZE - 1)[None]  # slot j's truth: g[a+j-1]
        return logits, seq["g"][pos.clamp(max=n - 1)], pos <= n - 2

    def train(self, trained_on: list[int], seed: int, steps: int,
              on_step: Callable[[int], None] = lambda done: None) -> tuple[dict[str, Any], dict[str, Any], list[float]]:
        """Adam on the cross-entropy of every slot at every anchor past the first few tokens;
        `on_step(done)` after every PROGRESS_EVERY steps (the build's progress bar)."""
        torch = self.torch
        import torch.nn.functional as F

        from remote.drafter import Drafter, random_weights, read_spec_from_config

        torch.manual_seed(seed)
        config = self.config()
        weights = random_weights(config, seed=seed, dtype=torch.float32)
        # The target's lm_head is small (random init): a larger output norm gives confident drafts,
        # without which DDTree spends its budget on siblings of a flat first slot.
        weights["norm.weight"].fill_(NORM_INIT)
        for tensor in weights.values():
            tensor.requires_grad_(True)
        drafter = Drafter(read_spec_from_config(config), weights, "cpu", torch.float32)
        drafter.w = weights  # train these very tensors
        opt = torch.optim.Adam(weights.values(), lr=LEARNING_RATE)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=LEARNING_RATE, total_steps=steps)
        losses = []
        for step in range(steps):
            seq = self.sequences[step % len(self.sequences)]
            n = seq["x"].shape[0]
            # Anchors in the prompt's tail too: more (context, block) pairs than the completion alone.
            anchors = torch.arange(max(BLOCK_SIZE, seq["prompt_len"] - 16), n - 1)
            logits, truth, valid = self.slots(drafter, seq, trained_on, anchors)
            loss = F.cross_entropy(logits[valid], truth[valid])
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            if step % 50 == 0 or step == steps - 1:
                losses.append(round(float(loss.detach()), 4))
            if (step + 1) % PROGRESS_EVERY == 0 or step == steps - 1:
                on_step(step + 1)
        return config, {name: t.detach() for name, t in weights.items()}, losses

    def vanilla_tau(self, config: dict[str, Any], weights: dict[str, Any], prompt_ids: list[str],
                    completion_tokens: int) -> float:
        """Macro vanilla tau on the named prompts, completions cut to `completion_tokens` (EVAL-SPEC 3's walk)."""
        torch = self.torch
        from remote.drafter import Drafter, read_spec_from_config

        drafter = Drafter(read_spec_from_config(config), weights, "cpu", torch.float32)
        span = BLOCK_SIZE - 1
        taus = []
        with torch.inference_mode():
            for seq in self.sequences:
                if seq["id"] not in prompt_ids:
                    continue
                p = seq["prompt_len"]
                n = p + completion_tokens
                cut = {**seq, "x": seq["x"][:n], "hidden": seq["hidden"][:n], "g": seq["g"][:n]}
                anchors = torch.arange(p, n - 1)
                logits, truth, valid = self.slots(drafter, cut, LAYER_IDS, anchors)
                right = (logits.argmax(-1) == truth) & valid
                accepted = {}
                for i, a in enumerate(anchors.tolist()):
                    r = 0
                    while r < span and right[i, r]:
                        r += 1
                    accepted[a] = r
                a, rounds = p, []
                while a + span <= n - 1:
                    rounds.append(accepted[a] + 1)
                    a += accepted[a] + 1
                taus.append(sum(rounds) / len(rounds))
        return round(sum(taus) / len(taus), 3)


def fit_drafters(target: str | os.PathLike, out: str | os.PathLike, check_prompts: list[str],
                 check_tokens: int, steps: int = STEPS,
                 progress: Callable[[int, int, str], None] = lambda done, total, what: None) -> dict[str, Any]:
    """Fit and save `out/reference` and `out/candidate`; return what was done and the fit check.
    `progress(done, total, what)`: the Adam steps of both drafters, done of all of them."""
    import torch

    from remote.drafter import save_drafter

    quiet_transformers()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    began = time.perf_counter()
    target, out = Path(target), Path(out)
    fit = _Fit(target, training_sequences(target))
    facts: dict[str, Any] = {"block_size": BLOCK_SIZE, "target_layer_ids": LAYER_IDS, "steps": steps, "drafters": {}}
    fitted = (("reference", LAYER_IDS), ("candidate", CANDIDATE_TRAINED_ON))
    for i, (name, trained_on) in enumerate(fitted):
        t0 = time.perf_counter()
        config, weights, losses = fit.train(
            trained_on, SEEDS[name], steps,
            lambda done, i=i, name=name: progress(i * steps + done, len(fitted) * steps, f"fitting the {name} drafter"))
        path = save_drafter(out / name, config, {k: v.to(torch.bfloat16) for k, v in weights.items()})
        stored = {k: v.to(torch.bfloat16).float() for k, v in weights.items()}  # as the evaluator will read them
        facts["drafters"][name] = {
            "path": str(path), "trained_on_layers": trained_on, "target_layer_ids": LAYER_IDS,
            "losses": losses, "fit_s": round(time.perf_counter() - t0, 2),
            "fit_check_tau": fit.vanilla_tau(config, stored, check_prompts, check_tokens),
        }
    facts["fit_s"] = round(time.perf_counter() - began, 2)
    return facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target")
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--check-tokens", type=int, default=24)
    args = parser.parse_args()
    ids = ["fizzbuzz", "binary_search", "linked_list_reverse", "json_parser"]
    print(json.dumps(fit_drafters(args.target, args.out, ids, args.check_tokens, args.steps), indent=1))


if __name__ == "__main__":
    main()
