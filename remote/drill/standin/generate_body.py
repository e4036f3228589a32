"""The rehearsal server's `/generate` and `/v1/completions`: a request body read and checked in SGLang's
order and error shapes, and the answer built from the model worker's generation (`server.Server`).

SGLang checks a `/generate` body in two stages (`entrypoints/http_server.py`, `generate_request`):
first FastAPI's parse into `GenerateReqInput` and the JSON contract on `sampling_params`
(`entrypoints/api_contract.py`, `generate_contract_error`), both answered as HTTP 400 at once, even
for a stream; then the tokenizer manager's own checks (`io_struct.py`, `_validate_inputs`;
`sampling_params.py`, `verify`), ValueErrors, which are a 400 `{"error": {"message"}}` for a plain
request but an SSE error chunk inside a stream. `admit` is the first stage, `Admitted.resolve` the
second, so the front can answer each as SGLang does.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from remote.drill.sglang_contract import ContractError, decode_sampling_params, error_response
from remote.drill.standin.model import Generation


class BadRequest(Exception):
    """An HTTP error answer: `status` and the body in SGLang's shape for it."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body

    @property
    def message(self) -> str:
        """The error's text, whatever its shape (an SSE error chunk carries it)."""
        body = self.body
        if isinstance(body, dict) and isinstance(body.get("error"), dict):
            return str(body["error"].get("message"))
        if isinstance(body, dict):
            return str(body.get("message") or body.get("error") or body)
        return str(body)


def value_error(message: str) -> BadRequest:
    """A ValueError in SGLang's request path: 400 {"error": {"message": ...}} (_create_error_response)."""
    return BadRequest(400, {"error": {"message": message}})


def validation_error(message: str) -> BadRequest:
    """What FastAPI's validation of GenerateReqInput gives: 400 in the ErrorResponse shape."""
    return BadRequest(400, error_response(400, message, "Bad Request"))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


def decode_params(raw: Any, n: int) -> list[dict[str, Any]]:
    """The contract stage of `sampling_params`: each given dict type-checked (ContractError: 400
    {"error": "..."}); one dict for all `n` prompts, or a list, one per prompt."""
    try:
        if isinstance(raw, list):
            return [decode_sampling_params(p) for p in raw]
        return [decode_sampling_params(raw if raw is not None else {})] * n
    except ContractError as exc:
        raise BadRequest(400, {"error": str(exc)}) from None


def resolve_params(server: Any, given: list[dict[str, Any]], n: int) -> list[dict[str, Any]]:
    """The value stage: each request's params laid over the preferred ones and verified (ValueError)."""
    if len(given) != n:
        raise value_error(f"The number of sampling_params ({len(given)}) does not match the batch size ({n}).")
    try:
        return [server.sampling_params(p) for p in given]
    except ValueError as exc:
        raise value_error(str(exc)) from None


def params_of(server: Any) -> Callable[[Any, int], list[dict[str, Any]]]:
    """`raw, n -> params` in both stages, as `remote.drill.chat` resolves a chat request's."""
    return lambda raw, n: resolve_params(server, decode_params(raw, n), n)


@dataclass
class Admitted:
    """A /generate body past FastAPI's parse and the contract: what the tokenizer manager gets."""

    body: dict
    params: list[dict[str, Any]]
    single: bool
    stream: bool

    def resolve(self, server: Any) -> list[tuple[str, list[int], dict[str, Any]]]:
        """(rid, token ids, resolved params) per prompt, or the ValueError SGLang's tokenizer manager raises."""
        batch = self._prompts(server)
        params = resolve_params(server, self.params, len(batch))
        rids = self.body.get("rid")
        rids = [rids] if isinstance(rids, str) else rids if isinstance(rids, list) else [None] * len(batch)
        if len(rids) != len(batch):
            raise value_error(f"The number of rids ({len(rids)}) does not match the batch size ({len(batch)}).")
        return [(rid or uuid.uuid4().hex, ids, p) for ids, p, rid in zip(batch, params, rids, strict=True)]

    def _prompts(self, server: Any) -> list[list[int]]:
        text, ids = self.body.get("text"), self.body.get("input_ids")
        if text is None and ids is None:
            raise value_error("Either text, input_ids or input_embeds should be provided.")
        if text is not None:
            return [server.tokenize(t) for t in ([text] if isinstance(text, str) else text)]
        if not ids:
            raise value_error("input_ids cannot be empty.")
        batch = [ids] if _is_ids(ids) else ids
        vocab_size = server.vocab_size()
        for one in batch:
            if not one:
                raise value_error("input_ids cannot be empty.")
            bad = next((t for t in one if not 0 <= t < vocab_size), None)
            if bad is not None:
                raise value_error(f"The input_ids {bad} is out of the vocabulary (size {vocab_size}).")
        return batch


def admit(body: dict) -> Admitted:
    """FastAPI's parse of GenerateReqInput (validation_error) and the JSON contract (400 {"error": "..."})."""
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None and not (isinstance(text, str) or (isinstance(text, list)
                                                           and all(isinstance(t, str) for t in text))):
        raise validation_error("text: Input should be a valid string or a list of strings")
    if ids is not None and not (_is_ids(ids) or (isinstance(ids, list) and all(_is_ids(i) for i in ids))):
        raise validation_error("input_ids: Input should be a valid list of integers or a list of lists")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise validation_error("stream: Input should be a valid boolean")
    single = isinstance(text, str) if text is not None else _is_ids(ids) if ids is not None else True
    n = 1 if single else len(text if text is not None else ids)
    return Admitted(body, decode_params(body.get("sampling_params"), n), single, stream)


def generation_answer(server: Any, generation: Generation, meta: dict[str, Any]) -> dict[str, Any]:
    """One prompt's /generate answer; an abort that carries an HTTP status is that HTTP error
    (tokenizer_manager.py, _handle_abort_finish_reason)."""
    reason = generation.finish_reason
    if reason.get("type") == "abort" and reason.get("status_code"):
        raise BadRequest(reason["status_code"], error_response(reason["status_code"], reason["message"]))
    text = server.decode(generation.output_ids)
    if generation.text_end is not None:
        text = text[:generation.text_end]
    return {"text": text, "output_ids": generation.output_ids, "meta_info": meta}


def partial_answer(server: Any, rid: str, prompt_len: int, output_ids: list[int]) -> dict[str, Any]:
    """A stream's chunk before the last (stream_interval 1, not incremental): the text and ids so far,
    no finish reason yet (tokenizer_manager.py, _handle_batch_output)."""
    return {"text": server.decode(output_ids), "output_ids": list(output_ids),
            "meta_info": {"id": rid, "finish_reason": None, "prompt_tokens": prompt_len,
                          "weight_version": "default", "completion_tokens": len(output_ids)}}


def completions_request(server: Any, body: dict) -> tuple[list[int], dict[str, Any]]:
    """/v1/completions: the prompt's ids and its resolved params, under OpenAI's names and defaults
    (serving_completions.py; protocol.py CompletionRequest: temperature 1.0)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        ids = server.tokenize(prompt)
    elif _is_ids(prompt) and prompt:
        ids = prompt
    else:
        raise validation_error("prompt: Input should be a valid string or a list of integers")
    fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
              "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop": None, "stop_token_ids": None,
              "ignore_eos": False, "logit_bias": None}
    request = {k: body.get(k, v) for k, v in fields.items()}
    request["max_new_tokens"] = body.get("max_tokens", 16)
    request["min_new_tokens"] = body.get("min_tokens", 0)
    if body.get("seed") is not None:
        request["sampling_seed"] = body["seed"]
    (params,) = params_of(server)(request, 1)
    return ids, params


def completions_answer(server: Any, body: dict, ids: list[int], generation: Generation, meta: dict) -> dict:
    reason = generation.finish_reason
    choice = {"index": 0, "text": server.decode(generation.output_ids)[:generation.text_end],
              "logprobs": None, "finish_reason": reason["type"], "matched_stop": reason.get("matched")}
    if body.get("return_token_ids"):
        choice["token_ids"] = generation.output_ids
        choice["prompt_token_ids"] = ids
    return {"id": meta["id"], "object": "text_completion", "created": int(time.time()),
            "model": server.served_name, "choices": [choice],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(generation.output_ids),
                      "total_tokens": len(ids) + len(generation.output_ids)}}
