"""`POST /v1/chat/completions` on the rehearsal server, as SGLang 0.5.23 answers it (the route real
clients use most, and the one a load generator sends through the router).

Read from SGLang 0.5.23 (`sglang/srt/entrypoints/openai/`):
- the prompt is the model's chat template over `messages`, with the generation prompt
  (`serving_chat.py`, `_apply_jinja_template`: `apply_chat_template(..., add_generation_prompt=True)`);
  a message's `content` is a string or a list of `{"type": "text", "text"}` parts;
- sampling (`protocol.py`, `ChatCompletionRequest.to_sampling_params`): temperature, top_p, top_k,
  min_p and repetition_penalty from the request, else the model's `generation_config.json`
  (`model_config.get_default_sampling_params`), else OpenAI's defaults (1.0, 1.0, -1, 0.0, 1.0);
  `max_new_tokens` is `max_completion_tokens or max_tokens`; `stop`, `stop_token_ids`, `ignore_eos`,
  `min_tokens`, `seed`, the penalties and `logit_bias` pass through;
- the answer (`ChatCompletionResponse`): `id` "chatcmpl-<hex>", `object` "chat.completion", `created`,
  `model` (the request's, "default" when none), `choices[{index, message {role "assistant", content,
  reasoning_content null}, logprobs null, finish_reason "stop" | "length" | "abort", matched_stop}]`,
  `usage {prompt_tokens, total_tokens, completion_tokens, prompt_tokens_details null,
  reasoning_tokens 0, completion_tokens_details null}`, `metadata` null;
- `stream: true` (`_generate_chat_stream`, `sse_utils.build_sse_content`): Server-Sent Events, each
  `data: {json}\\n\\n` of object "chat.completion.chunk": first the role chunk (`delta {reasoning_content
  null, role "assistant", content ""}`), then one chunk per non-empty text delta, then the finish chunk
  (`delta {reasoning_content null}`, `finish_reason`, `matched_stop`), then with
  `stream_options.include_usage` a chunk with `choices []` and `usage`, and last `data: [DONE]`.

The rehearsal server's own limit: the stream's chunks are written once the generation has ended (one
per token), not as each token is made; `n` > 1, tools, logprobs and response formats are refused as
/generate refuses what it does not do.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0}
DEFAULT_MODEL_NAME = "default"  # protocol.py, DEFAULT_MODEL_NAME
UNSUPPORTED = ("tools", "tool_choice", "response_format", "logprobs", "top_logprobs", "functions", "function_call")


def generation_defaults(model_path: Any) -> dict[str, Any]:
    """The sampling params the model's generation_config.json sets (get_default_sampling_params)."""
    try:
        config = json.loads((model_path / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: config[k] for k in OPENAI_DEFAULTS if config.get(k) is not None} if isinstance(config, dict) else {}


def _messages(body: dict, bad: Any) -> list[dict[str, str]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("messages: Field required (a non-empty list of {role, content})")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]: Input should be an object with a 'role'")
        content = message.get("content")
        if isinstance(content, list):  # content parts: only text here
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad(f"messages[{i}].content: the rehearsal server takes only text parts")
                texts.append(part["text"])
            content = "".join(texts)
        if content is None:
            content = ""
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content: Input should be a valid string or a list of parts")
        out.append({"role": message["role"], "content": content})
    return out


def sampling_request(body: dict, defaults: dict[str, Any]) -> dict[str, Any]:
    """The /generate sampling params a chat request stands for (to_sampling_params), only the keys set."""
    params: dict[str, Any] = {}
    for key, default in OPENAI_DEFAULTS.items():
        params[key] = body[key] if body.get(key) is not None else defaults.get(key, default)
    params["max_new_tokens"] = body.get("max_completion_tokens") or body.get("max_tokens")
    stop = body.get("stop")
    params["stop"] = [stop] if isinstance(stop, str) else stop
    for ours, theirs in (("frequency_penalty", "frequency_penalty"), ("presence_penalty", "presence_penalty"),
                         ("stop_token_ids", "stop_token_ids"), ("ignore_eos", "ignore_eos"),
                         ("logit_bias", "logit_bias"), ("sampling_seed", "seed"), ("min_new_tokens", "min_tokens"),
                         ("skip_special_tokens", "skip_special_tokens"), ("n", "n")):
        if body.get(theirs) is not None:
            params[ours] = body[theirs]
    return {k: v for k, v in params.items() if v is not None}


def text_deltas(decode: Any, ids: list[int], text: str) -> list[str]:
    """The stream's content deltas: the text as it grows token by token (a token that ends inside a
    character is held back until the character is whole), never past the final `text`."""
    deltas, sent = [], ""
    for i in range(1, len(ids) + 1):
        grown = decode(ids[:i])[:len(text)]
        if i < len(ids) and grown.endswith("\ufffd"):
            continue
        if len(grown) > len(sent) and grown.startswith(sent):
            deltas.append(grown[len(sent):])
            sent = grown
    if sent != text and text.startswith(sent):
        deltas.append(text[len(sent):])
    return deltas


def answer(server: Any, body: dict, sampling_params: Any, bad: Any) -> dict | list[str]:
    """One chat completion through `server.run_request` (the standin's model worker): the JSON body
    to send, or with `stream` the Server-Sent Events to send in order. `sampling_params(raw, 1)`
    resolves sampling params as /generate does; `bad(message)` makes the 400 of an unparsable request."""
    unsupported = [key for key in UNSUPPORTED if body.get(key) not in (None, False, [])]
    if unsupported:
        raise bad(f"the rehearsal server does not support {', '.join(unsupported)} on /v1/chat/completions")
    messages = _messages(body, bad)
    ids = server.chat_prompt(messages)
    (params,) = sampling_params(sampling_request(body, generation_defaults(server.model_path)), 1)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    generation, meta = server.run_request(rid, ids, params)
    reason = generation.finish_reason
    text = server.decode(generation.output_ids)[:generation.text_end]
    name = body.get("model") or DEFAULT_MODEL_NAME
    usage = {"prompt_tokens": len(ids), "total_tokens": len(ids) + len(generation.output_ids),
             "completion_tokens": len(generation.output_ids), "prompt_tokens_details": None,
             "reasoning_tokens": 0, "completion_tokens_details": None}
    if not body.get("stream"):
        return {
            "id": rid, "object": "chat.completion", "created": created, "model": name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text, "reasoning_content": None},
                         "logprobs": None, "finish_reason": reason["type"], "matched_stop": reason.get("matched")}],
            "usage": usage, "metadata": None}

    def chunk(delta: dict, finish: str | None = None, matched: Any = None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                "choices": [{"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
                             "finish_reason": finish, "matched_stop": matched}]}

    events = [chunk({"role": "assistant", "content": ""})]
    events += [chunk({"content": d}) for d in text_deltas(server.decode, generation.output_ids, text)]
    events.append(chunk({}, reason["type"], reason.get("matched")))
    options = body.get("stream_options") or {}
    if isinstance(options, dict) and options.get("include_usage"):
        events.append({"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                       "choices": [], "usage": usage})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]
