"""Greedy sampling params for SGLang's `/generate`, laid over the server's preferred ones (stdlib only).

SGLang builds each request's sampling params as `{**preferred_sampling_params, **request's}`
(`sglang/srt/managers/tokenizer_manager.py`, `TokenizerManager._create_tokenized_object`), where the
preferred ones are the server's `--preferred-sampling-params`, reported by `/model_info`. So a
request that leaves a parameter out gets the server's preference, not SGLang's default: a server
preferring `repetition_penalty` 1.1 would give penalised completions that we would cache as greedy.

Every parameter greedy decoding depends on is therefore sent explicitly (`GREEDY`), and each one the
server prefers is handled by what it does to greedy output: known ones are sent with their neutral
value (`NEUTRAL`), ones that change only the text or the seed are left (`TEXT_ONLY`), and any other
is refused: we cannot tell what it does, nor send a value that undoes it. See docs/sglang.md.
"""

from __future__ import annotations

import json
from typing import Any

# Always sent. `top_k` -1 is "no top-k" in every release (0.5.23's SamplingParams.__post_init__ maps
# it to TOP_K_ALL; temperature 0 sets top_k 1 there anyway); each key exists in 0.4.6's SamplingParams.
GREEDY: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
}

# Sent only when the server prefers them (an older release may not know the key): their neutral value.
NEUTRAL: dict[str, Any] = {
    "n": 1,
    "ignore_eos": False,
    "stop": None,
    "stop_token_ids": None,
    "stop_regex": None,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "beam_width": None,
    "no_stop_trim": False,
}

# Change the decoded text, the streaming or the seed, never greedy output ids.
TEXT_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "stream_interval", "sampling_seed")


class PreferredParamsRefused(ValueError):
    """The server prefers a sampling param that may change greedy output and that we cannot undo."""


def _shown(params: dict[str, Any]) -> str:
    return ", ".join(f"{key}={json.dumps(value)}" for key, value in params.items())


def greedy_sampling_params(max_new_tokens: int, preferred: Any = None) -> tuple[dict[str, Any], list[str]]:
    """(the sampling params to send, warnings) for a greedy generation of up to `max_new_tokens`.

    `preferred` is `/model_info`'s `preferred_sampling_params` (None or {} when the server has none).
    Raises PreferredParamsRefused for a preference we cannot undo, or one that is not an object."""
    params: dict[str, Any] = {**GREEDY, "max_new_tokens": max_new_tokens}
    if not preferred:
        return params, []
    if not isinstance(preferred, dict):
        raise PreferredParamsRefused(f"/model_info's preferred_sampling_params should be an object, found "
                                     f"{json.dumps(preferred)[:120]}")
    unknown = {k: v for k, v in preferred.items() if k not in GREEDY and k not in NEUTRAL
               and k not in TEXT_ONLY and k != "max_new_tokens"}
    if unknown:
        raise PreferredParamsRefused(
            f"the server's --preferred-sampling-params sets {_shown(unknown)}, which may change greedy output "
            f"and which dflash-ops cannot undo: completions cached from it might not be the target's greedy "
            f"ones; restart the server without it")
    overridden = {k: v for k, v in preferred.items() if (k in GREEDY or k in NEUTRAL or k == "max_new_tokens")
                  and v != {**GREEDY, **NEUTRAL, "max_new_tokens": max_new_tokens}.get(k)}
    params.update({k: NEUTRAL[k] for k in preferred if k in NEUTRAL})
    warnings = []
    if overridden:
        sent = {k: params[k] for k in overridden}
        warnings.append(f"the server prefers {_shown(overridden)} (--preferred-sampling-params): sent "
                        f"{_shown(sent)} instead, as greedy decoding needs")
    return params, warnings
