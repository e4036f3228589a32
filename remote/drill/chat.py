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

The rehearsal server's own limits: with stop strings a stream's content is written once the generation
has ended (cut at the match), else a chunk per token as each is made (`Chat.live_delta`); `n` > 1,
tools, logprobs and response formats are refused as /generate refuses what it does not do.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
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


@dataclass
class Chat:
    """One chat request, checked and tokenized (`prepare`): run it, then answer it whole or as a stream."""

    server: Any
    body: dict
    ids: list[int]
    params: dict[str, Any]
    rid: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def name(self) -> str:
        return self.body.get("model") or DEFAULT_MODEL_NAME

    def usage(self, generation: Any) -> dict[str, Any]:
        return {"prompt_tokens": len(self.ids), "total_tokens": len(self.ids) + len(generation.output_ids),
                "completion_tokens": len(generation.output_ids), "prompt_tokens_details": None,
                "reasoning_tokens": 0, "completion_tokens_details": None}

    def text(self, generation: Any) -> str:
        return self.server.decode(generation.output_ids)[:generation.text_end]

    def response(self, generation: Any) -> dict:
        """The `chat.completion` object of a request without `stream`."""
        reason = generation.finish_reason
        return {
            "id": self.rid, "object": "chat.completion", "created": self.created, "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": self.text(generation),
                                                 "reasoning_content": None},
                         "logprobs": None, "finish_reason": reason["type"], "matched_stop": reason.get("matched")}],
            "usage": self.usage(generation), "metadata": None}

    def chunk(self, delta: dict, finish: str | None = None, matched: Any = None) -> str:
        """One `chat.completion.chunk` event."""
        return _event({"id": self.rid, "object": "chat.completion.chunk", "created": self.created, "model": self.name,
                       "choices": [{"index": 0, "delta": {"reasoning_content": None, **delta}, "logprobs": None,
                                    "finish_reason": finish, "matched_stop": matched}]})

    def first(self) -> str:
        """The role chunk that opens a stream."""
        return self.chunk({"role": "assistant", "content": ""})

    def live_delta(self, sent: str, output_ids: list[int]) -> str | None:
        """The text grown past `sent` while generating (None: nothing to send yet). A token that ends
        inside a character is held back until it is whole; with stop strings nothing is sent before
        the end, where the text is cut at the match."""
        if self.params.get("stop") or self.params.get("stop_regex"):
            return None
        grown = self.server.decode(output_ids)
        if grown.endswith("\ufffd") or len(grown) <= len(sent) or not grown.startswith(sent):
            return None
        return grown

    def last(self, generation: Any, sent: str) -> list[str]:
        """The stream's end after `sent` went out: the rest of the text, the finish chunk, with
        `stream_options.include_usage` the usage chunk (`data: [DONE]` is the front's)."""
        reason = generation.finish_reason
        text = self.text(generation)
        rest = text_deltas(self.server.decode, generation.output_ids, text) if not sent else \
            [text[len(sent):]] if text.startswith(sent) and len(text) > len(sent) else []
        events = [self.chunk({"content": d}) for d in rest]
        events.append(self.chunk({}, reason["type"], reason.get("matched")))
        options = self.body.get("stream_options") or {}
        if isinstance(options, dict) and options.get("include_usage"):
            events.append(_event({"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                                  "model": self.name, "choices": [], "usage": self.usage(generation)}))
        return events


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"  # pydantic's model_dump_json


def prepare(server: Any, body: dict, sampling_params: Any, bad: Any) -> Chat:
    """A chat request checked (what SGLang refuses before it runs: `bad(message)`, the 400 of an
    unparsable request; `sampling_params(raw, 1)` resolves as /generate does) and tokenized."""
    unsupported = [key for key in UNSUPPORTED if body.get(key) not in (None, False, [])]
    if unsupported:
        raise bad(f"the rehearsal server does not support {', '.join(unsupported)} on /v1/chat/completions")
    messages = _messages(body, bad)
    ids = server.chat_prompt(messages)
    (params,) = sampling_params(sampling_request(body, generation_defaults(server.model_path)), 1)
    return Chat(server, body, ids, params)
