"""Prompt files: JSONL, one prompt a line, validated with errors that name the file, line and field.

    {"id": "fizzbuzz", "messages": [{"role": "user", "content": "..."}], "max_new_tokens": 1024}
    {"id": "raw_one", "text": "def f(x):", "max_new_tokens": 256}

`id` becomes a file name (`<id>.safetensors`), so it is restricted to letters, digits, `_ . -`.
Exactly one of `messages` (chat template applied) or `text` (tokenised as is). The default set is
the story's ten coding prompts, shipped as `remote/data/prompts.jsonl`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remote.events import WorkerError

DEFAULT_PROMPTS = Path(__file__).with_name("data") / "prompts.jsonl"
ID_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_KEYS = {"id", "messages", "text", "max_new_tokens"}
_ROLES = {"system", "user", "assistant"}


class PromptFileError(WorkerError):
    """A prompt file that cannot be used; the message names file, line and what is wrong."""


@dataclass(frozen=True)
class Prompt:
    id: str
    max_new_tokens: int
    messages: tuple[tuple[str, str], ...] | None = None
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        record: dict[str, Any] = {"id": self.id, "max_new_tokens": self.max_new_tokens}
        if self.messages is not None:
            record["messages"] = [{"role": r, "content": c} for r, c in self.messages]
        else:
            record["text"] = self.text
        return record


@dataclass(frozen=True)
class PromptSet:
    path: str
    prompts: tuple[Prompt, ...]

    @property
    def sha256(self) -> str:
        """Hash of the validated content (not the bytes): reformatting the file keeps the hash."""
        canonical = json.dumps([p.to_json() for p in self.prompts], sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def _fail(path: str, line: int, msg: str) -> PromptFileError:
    return PromptFileError(f"{path}:{line}: {msg}", f"{path}:{line}")


def parse_prompt(record: Any, path: str, line: int) -> Prompt:
    """Validate one decoded JSON line."""
    if not isinstance(record, dict):
        raise _fail(path, line, f"expected a JSON object, found {type(record).__name__}")
    unknown = sorted(set(record) - _KEYS)
    if unknown:
        raise _fail(path, line, f"unknown field(s) {', '.join(unknown)} (allowed: {', '.join(sorted(_KEYS))})")
    pid = record.get("id")
    if not isinstance(pid, str) or not ID_RE.match(pid):
        raise _fail(path, line, f"'id' must be a string of letters, digits, '_', '.', '-' (it names a file), found {pid!r}")
    where = f"prompt {pid!r}"
    mnt = record.get("max_new_tokens")
    if isinstance(mnt, bool) or not isinstance(mnt, int) or mnt < 1:
        raise _fail(path, line, f"{where}: 'max_new_tokens' must be a positive integer, found {mnt!r}")
    has_messages, has_text = "messages" in record, "text" in record
    if has_messages == has_text:
        raise _fail(path, line, f"{where}: give exactly one of 'messages' or 'text'")
    if has_text:
        text = record["text"]
        if not isinstance(text, str) or not text:
            raise _fail(path, line, f"{where}: 'text' must be a non-empty string")
        return Prompt(pid, mnt, text=text)
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise _fail(path, line, f"{where}: 'messages' must be a non-empty list")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise _fail(path, line, f"{where}: messages[{i}] must be an object with exactly 'role' and 'content'")
        role, content = message["role"], message["content"]
        if role not in _ROLES:
            raise _fail(path, line, f"{where}: messages[{i}].role must be one of {sorted(_ROLES)}, found {role!r}")
        if not isinstance(content, str):
            raise _fail(path, line, f"{where}: messages[{i}].content must be a string")
        parsed.append((role, content))
    return Prompt(pid, mnt, messages=tuple(parsed))


def load_prompts(path: str | Path | None = None) -> PromptSet:
    """Read and validate a JSONL prompt file (the shipped default when `path` is None)."""
    file = Path(path) if path is not None else DEFAULT_PROMPTS
    name = str(file)
    if not file.is_file():
        raise PromptFileError(f"prompt file not found: {name}", name)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        raise PromptFileError(f"{name}: not UTF-8 text ({exc})", name) from exc
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise _fail(name, number, f"not valid JSON ({exc.msg} at column {exc.colno})") from exc
        prompt = parse_prompt(record, name, number)
        if prompt.id in seen:
            raise _fail(name, number, f"duplicate id {prompt.id!r} (first on line {seen[prompt.id]})")
        seen[prompt.id] = number
        prompts.append(prompt)
    if not prompts:
        raise PromptFileError(f"{name}: no prompts (the file is empty)", name)
    return PromptSet(name, tuple(prompts))


def prompt_token_ids(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: the target's chat template for `messages`, plain encoding for `text`."""
    if prompt.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise WorkerError(f"prompt {prompt.id!r} has messages but the target's tokenizer has no chat template",
                              "tokenizer")
        messages = [{"role": r, "content": c} for r, c in prompt.messages]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in newer transformers
            ids = ids["input_ids"]
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(prompt.text)["input_ids"]]
