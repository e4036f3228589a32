"""SGLang 0.5.23's `/generate` request contract and error bodies, for the rehearsal server (stdlib only).

Read from SGLang's source (facts and paths in docs/sglang.md); written here, not copied:
- `sampling_params` is a JSON object whose unknown keys are rejected and whose values are typed
  (sglang/api/v1/api_types.py, `decode_SamplingParams`); a violation is HTTP 400 with the schema's own
  text as a string: `{"error": "unknown field `x`, expected one of ..."}` (http_server.py,
  `generate_request`, via api_contract.py `generate_contract_error`);
- the request's params are laid over the server's preferred ones, then checked for range
  (sampling/sampling_params.py, `SamplingParams.verify`): a ValueError is HTTP 400
  `{"error": {"message": ...}}` (http_server.py, `_create_error_response`);
- a body FastAPI cannot parse into `GenerateReqInput` is HTTP 400 in the `ErrorResponse` shape
  (http_server.py, the `RequestValidationError` handler), and so is any HTTPException, e.g. a 503
  abort: `{"object": "error", "message", "type", "param": null, "code"}`;
- `--api-key`: 401 `{"error": "Unauthorized"}` except on /health*, /ready*, /metrics*; the admin
  routes (ADMIN_OPTIONAL) want `--admin-api-key` instead when it is set (utils/auth.py, `decide_request_auth`).
"""

from __future__ import annotations

import math
from typing import Any

TOP_K_ALL = 1 << 30  # sampling_params.py: top_k -1 ("no top-k") becomes the whole vocabulary
SAMPLING_EPS = 1e-6

# name: (kind, default) in api_types.SamplingParams' order; None for the defaults that are None.
SAMPLING_FIELDS: dict[str, tuple[str, Any]] = {
    "max_new_tokens": ("i64", 128),
    "stop": ("str_or_list", None),
    "stop_token_ids": ("int_list", None),
    "stop_regex": ("str_or_list", None),
    "temperature": ("f64", 1.0),
    "top_p": ("f64", 1.0),
    "top_k": ("i64", TOP_K_ALL),
    "min_p": ("f64", 0.0),
    "frequency_penalty": ("f64", 0.0),
    "presence_penalty": ("f64", 0.0),
    "repetition_penalty": ("f64", 1.0),
    "min_new_tokens": ("i64", 0),
    "n": ("i64", 1),
    "json_schema": ("str", None),
    "regex": ("str", None),
    "ebnf": ("str", None),
    "structural_tag": ("str", None),
    "ignore_eos": ("bool", False),
    "skip_special_tokens": ("bool", True),
    "spaces_between_special_tokens": ("bool", True),
    "no_stop_trim": ("bool", False),
    "stream_interval": ("i64", None),
    "logit_bias": ("f64_map", None),
    "sampling_seed": ("i64", None),
    "custom_params": ("any", None),
    "beam_width": ("i64", None),
    "watermark": ("any", None),
    "choice": ("str_list", None),
}
# Keys whose values null means "the default" (api_types: `1.0 if x is None else ...`).
_NULL_IS_DEFAULT = {"temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                    "repetition_penalty", "min_new_tokens", "n", "ignore_eos", "skip_special_tokens",
                    "spaces_between_special_tokens", "no_stop_trim", "logit_bias", "choice"}


class ContractError(ValueError):
    """The body breaks the JSON contract: HTTP 400 `{"error": "<this text>"}`."""


def _unexpected(value: Any) -> str:
    """serde's `Unexpected` wording, as api_types._unexpected writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"boolean `{'true' if value else 'false'}`"
    if isinstance(value, int):
        return f"integer `{value}`"
    if isinstance(value, float):
        return f"floating point `{value}`"
    if isinstance(value, str):
        return f'string "{value}"'
    return "sequence" if isinstance(value, list) else "map" if isinstance(value, dict) else type(value).__name__


def _invalid(value: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(value)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(kind: str, value: Any) -> Any:
    if kind == "i64":
        if not _is_int(value):
            raise _invalid(value, "i64")
        return value
    if kind == "f64":
        if not (_is_int(value) or isinstance(value, float)):
            raise _invalid(value, "f64")
        return float(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _invalid(value, "a boolean")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise _invalid(value, "a string")
        return value
    if kind == "str_or_list":
        if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return value
        raise _invalid(value, "a string or a list of strings")
    if kind == "int_list":
        if not isinstance(value, list) or not all(_is_int(v) for v in value):
            raise _invalid(value, "a sequence of i64")
        return value
    if kind == "str_list":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise _invalid(value, "a sequence")
        return value
    if kind == "f64_map":
        if not isinstance(value, dict):
            raise _invalid(value, "a map")
        return {k: _check("f64", v) for k, v in value.items()}
    return value


def decode_sampling_params(value: Any) -> dict[str, Any]:
    """The keys the request gave, type-checked as the contract does (ContractError otherwise)."""
    if not isinstance(value, dict):
        raise _invalid(value, "struct SamplingParams")
    out: dict[str, Any] = {}
    for key, x in value.items():
        if key not in SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
            raise ContractError(f"unknown field `{key}`, expected one of {listed}")
        kind, default = SAMPLING_FIELDS[key]
        out[key] = (default if key in _NULL_IS_DEFAULT else None) if x is None else _check(kind, x)
    return out


def resolve_sampling_params(request: dict[str, Any], preferred: dict[str, Any] | None) -> dict[str, Any]:
    """Every param's value: defaults, then the server's preferred ones, then the request's
    (tokenizer_manager._create_tokenized_object), with SamplingParams.__post_init__'s special cases:
    a temperature below 1e-6 is greedy (top_k 1), top_k -1 is the whole vocabulary."""
    params = {key: default for key, (_, default) in SAMPLING_FIELDS.items()}
    params.update(preferred or {})
    params.update(request)
    for key in _NULL_IS_DEFAULT:
        if params[key] is None:
            params[key] = SAMPLING_FIELDS[key][1]
    if 0 <= params["temperature"] < SAMPLING_EPS:
        params["temperature"], params["top_k"] = 1.0, 1
    if params["top_k"] == -1:
        params["top_k"] = TOP_K_ALL
    return params


def verify_sampling_params(params: dict[str, Any], vocab_size: int) -> None:
    """SamplingParams.verify's range checks (ValueError: HTTP 400 {"error": {"message": ...}})."""
    if not math.isfinite(params["temperature"]) or params["temperature"] < 0:
        raise ValueError(f"temperature must be a non-negative finite number, got {params['temperature']}.")
    if not 0.0 < params["top_p"] <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {params['top_p']}.")
    if not 0.0 <= params["min_p"] <= 1.0:
        raise ValueError(f"min_p must be in [0, 1], got {params['min_p']}.")
    if params["top_k"] < 1:
        raise ValueError(f"top_k must be -1 (disable) or at least 1, got {params['top_k']}.")
    for key in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= params[key] <= 2.0:
            raise ValueError(f"{key} must be in [-2, 2], got {params[key]}.")
    if not 0.0 < params["repetition_penalty"] <= 2.0:
        raise ValueError(f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {params['repetition_penalty']}.")
    max_new = params["max_new_tokens"]
    if max_new is not None and max_new < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
    if params["min_new_tokens"] < 0 or (max_new is not None and params["min_new_tokens"] > max_new):
        raise ValueError(f"min_new_tokens must be in [0, max_new_tokens({max_new})], got {params['min_new_tokens']}.")
    for token_id in params["logit_bias"] or {}:
        if not 0 <= int(token_id) < vocab_size:
            raise ValueError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {token_id}.")
    unsupported = [k for k in ("json_schema", "regex", "ebnf", "structural_tag", "beam_width", "watermark")
                   if params[k] is not None] + (["n"] if params["n"] != 1 else []) + (
                   ["choice"] if params["choice"] else [])
    if unsupported:  # the rehearsal server's limit, not SGLang's: said as plainly as SGLang's own checks
        raise ValueError(f"the rehearsal server does not support {', '.join(unsupported)}")


def error_response(status: int, message: str, kind: str | None = None) -> dict[str, Any]:
    """The ErrorResponse body of an HTTPException or a validation error (entrypoints/openai/protocol.py)."""
    return {"object": "error", "message": message, "type": kind or str(status), "param": None, "code": status}


PUBLIC_PREFIXES = ("/health", "/ready", "/metrics")


def _bearer(authorization: str | None, key: str) -> bool:
    scheme, _, token = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and token == key


def allowed(path: str, method: str, authorization: str | None, api_key: str | None,
            admin_api_key: str | None = None, level: str = "normal") -> bool:
    """utils/auth.py's decision (decide_request_auth) for a NORMAL or an ADMIN_OPTIONAL endpoint: the
    public prefixes always pass; ADMIN_OPTIONAL wants the admin key when one is set, else the API key
    when one is set, else nothing; NORMAL wants the API key when one is set (not the admin key)."""
    if method == "OPTIONS" or path.startswith(PUBLIC_PREFIXES):
        return True
    if level == "admin_optional" and admin_api_key:
        return _bearer(authorization, admin_api_key)
    return not api_key or _bearer(authorization, api_key)
