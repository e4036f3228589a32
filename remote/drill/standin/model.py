"""The rehearsal server's model: the tiny target with its tokenizer, and how it generates.

`generate_tokens` is SGLang's decode loop for one request: prefill, then a token a step through the
KV cache, with SGLang's penalties, sampling and finish checks. `generate` is what the server calls:
with a DFLASH speculator loaded (`remote.drill.specdecode`) it hands it the requests it can decode
(greedy, no logit processing, no stop strings), and every other request to `generate_tokens`. A
request's `checkpoint`, set by the server, is asked before each forward pass: there a pause parks
it and `--step-delay` slows it; its `aborted` event ends it with what it has; a stream's `on_token`
is told the tokens so far before each step but the first (the last token comes with the finish).
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

NAN_STOP = "NaN happened"  # schedule_batch.py, Req._check_vocab_boundary_finish


def import_libraries(device: str) -> None:
    """Import torch and transformers (seconds on a CPU) as the model will use them."""
    if device == "cpu":
        # On a CPU: with fla / causal-conv1d installed, transformers would bind kernels that need a GPU.
        for name in ("fla", "causal_conv1d"):
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def import_ahead(device: str) -> None:
    """import_libraries in the background: a failure is left to the model's own import, which names it."""
    with contextlib.suppress(Exception):  # Model() imports again and reports what is missing
        import_libraries(device)


class Model:
    """The tiny target with its tokenizer, on `device`; generation under a lock (one at a time)."""

    def __init__(self, path: Path, dtype: str = "float32", device: str = "cpu",
                 region: Any = lambda tag: contextlib.nullcontext()):
        import_libraries(device)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # transformers 5.x renames forward's past_key_values to cache; the old name still works.
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        if device == "cpu":
            torch.set_num_threads(1)
        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # bfloat16 computes as SGLang serves and as the extractor reads; float32 is the default.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        with region("weights"):  # the memory saver's weights region (torch_memory_saver on the GPU)
            self.model = model.to(device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        config_eos = getattr(self.model.config, "eos_token_id", None)
        self.eos_ids = {self.eos_id, *(config_eos if isinstance(config_eos, list) else [config_eos])} - {None}
        self.vocab_size = int(self.model.config.vocab_size)
        self.lock = threading.Lock()
        self.speculator: Any = None  # with --speculative-drafter: remote.drill.specdecode.Speculator
        self.nan_after: int | None = None  # the --nan-after fault

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Generation:
    """One request's output and SGLang's finish reason object (schedule_batch.py, FINISH_*.to_json)."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    text_end: int | None = None  # a stop string's position in the text (the text is cut there)


@dataclass
class Request:
    """One request as the scheduler holds it: its id, prompt ids and resolved sampling params."""

    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    aborted: threading.Event = field(default_factory=threading.Event)
    retractions: int = 0  # times a retract pause gave its KV cache back (meta_info num_retractions)
    checkpoint: Any = None  # before each forward pass: parks while paused; True when retracted
    on_token: Any = None  # with a stream: told the output so far before each step after the first


def _process_logits(torch: Any, logits: Any, tokens: list[int], output: list[int], params: dict[str, Any],
                    eos_ids: set[int]) -> Any:
    """SGLang's penalties and biases on one step's logits (the penalizers, then logit_bias)."""
    logits = logits.float()
    if output and (params["frequency_penalty"] or params["presence_penalty"]):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
        logits = logits - params["frequency_penalty"] * counts - params["presence_penalty"] * (counts > 0)
    if params["repetition_penalty"] != 1.0:
        seen = torch.tensor(sorted(set(tokens)), device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params["repetition_penalty"], picked * params["repetition_penalty"])
    if len(output) < params["min_new_tokens"]:
        for token in eos_ids | set(params["stop_token_ids"] or []):
            logits[token] = float("-inf")
    for token, bias in (params["logit_bias"] or {}).items():
        logits[int(token)] += bias
    return logits


def _choose(torch: Any, logits: Any, params: dict[str, Any], generator: Any) -> int:
    """Greedy when top_k is 1 (what temperature 0 becomes); else top-k / top-p / min-p sampling."""
    if params["top_k"] == 1:
        return int(logits.argmax())
    probs = torch.softmax(logits / params["temperature"], dim=-1)
    if params["top_k"] < probs.shape[-1]:
        kth = torch.topk(probs, params["top_k"]).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params["top_p"] < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        outside = ordered.cumsum(-1) - ordered > params["top_p"] * ordered.sum()
        probs[order[outside]] = 0.0
    if params["min_p"] > 0:
        probs = torch.where(probs < params["min_p"] * probs.max(), torch.zeros_like(probs), probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def _stop_string(text: str, params: dict[str, Any]) -> tuple[str, int] | None:
    """(matched, where) for the first stop string or stop regex in `text`."""
    stops = params["stop"]
    for stop in [stops] if isinstance(stops, str) else stops or []:
        if stop and stop in text:
            return stop, text.index(stop)
    regexes = params["stop_regex"]
    for pattern in [regexes] if isinstance(regexes, str) else regexes or []:
        if (match := re.search(pattern, text)) is not None:
            return pattern, match.start()
    return None


def speculative_request(params: dict[str, Any]) -> bool:
    """A request the DFLASH path serves: greedy, no logit processing, no stop strings (the others
    take generate_tokens, without speculative fields)."""
    return (params["top_k"] == 1 and not params["frequency_penalty"] and not params["presence_penalty"]
            and params["repetition_penalty"] == 1.0 and not params["min_new_tokens"] and not params["logit_bias"]
            and not params["stop"] and not params["stop_regex"])


def generate(model: Model, request: Request) -> tuple[Generation, dict[str, Any]]:
    """The request's generation and the speculative fields of its meta_info: DFLASH speculative
    decoding (--speculative-drafter, `remote.drill.specdecode`) where it serves the request, else
    generate_tokens and none."""
    params = request.params
    if model.speculator is None or not speculative_request(params):
        return generate_tokens(model, request), {}
    max_new = params["max_new_tokens"] if params["max_new_tokens"] is not None else 128
    stops = set(params["stop_token_ids"] or []) | (set() if params["ignore_eos"] else model.eos_ids)
    def aborted() -> bool:  # asked before each step: a pause parks it there (no KV cache to give back)
        if request.checkpoint is not None:
            request.checkpoint()
        return request.aborted.is_set()

    out = model.speculator.generate(request.input_ids, max_new, stops, aborted)
    reason: dict[str, Any] = {"type": "length", "length": max_new}
    if out.finish == "abort":
        reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    elif out.finish == "stop":
        reason = {"type": "stop", "matched": out.output_ids[-1]}
    return Generation(out.output_ids, reason), out.meta_info()


def generate_tokens(model: Model, request: Request) -> Generation:
    """Prefill, then one token per step through the KV cache, until a finish (the caller holds the lock).

    SGLang's finish checks per step (schedule_batch.py, Req.update_finish_state): a token outside the
    vocabulary, or a NaN, is replaced by EOS and ends as stop "NaN happened"; then stop strings and
    regexes; then the EOS / stop tokens (unless ignore_eos); then max_new_tokens. An abort
    (/abort_request) ends it with what it has."""
    torch = model.torch
    params = request.params
    max_new = params["max_new_tokens"] if params["max_new_tokens"] is not None else 128
    output: list[int] = []
    if max_new <= 0:
        return Generation(output, {"type": "length", "length": max_new})
    generator = None
    if params["top_k"] != 1:
        generator = torch.Generator(device=model.device)
        generator.manual_seed(params["sampling_seed"] if params["sampling_seed"] is not None else time.time_ns())
    stop_tokens = set(params["stop_token_ids"] or []) | (set() if params["ignore_eos"] else model.eos_ids)
    tokens = list(request.input_ids)
    with torch.inference_mode():
        step = torch.tensor([tokens], device=model.device)
        cache = None
        while True:
            if request.checkpoint is not None and request.checkpoint():
                # retracted by a pause: its KV cache was given back; recomputed from every token so far
                cache, step = None, torch.tensor([tokens], device=model.device)
            if request.aborted.is_set():
                return Generation(output, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
            if output and request.on_token is not None:  # the tokens so far, none of them the last
                request.on_token(output)
            out = model.model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0, -1]
            if model.nan_after is not None and len(output) >= model.nan_after:
                logits = logits * float("nan")  # the --nan-after fault: a kernel gone bad
            if not bool(torch.isfinite(logits).any()):
                output.append(model.eos_id)
                return Generation(output, {"type": "stop", "matched": NAN_STOP})
            token = _choose(torch, _process_logits(torch, logits, tokens, output, params, model.eos_ids), params,
                            generator)
            if not 0 <= token < model.vocab_size:
                output.append(model.eos_id)
                return Generation(output, {"type": "stop", "matched": NAN_STOP})
            output.append(token)
            tokens.append(token)
            if params["stop"] or params["stop_regex"]:
                found = _stop_string(model.decode(output), params)
                if found is not None:
                    return Generation(output, {"type": "stop", "matched": found[0]}, text_end=found[1])
            if token in stop_tokens:
                return Generation(output, {"type": "stop", "matched": token})
            if len(output) >= max_new:
                return Generation(output, {"type": "length", "length": max_new})
            step = torch.tensor([[token]], device=model.device)

