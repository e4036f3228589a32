"""Prompt files (remote.prompts): the shipped set, validation errors, hashing, rendering."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote.prompts import PromptFileError, load_prompts, prompt_token_ids

STORY_IDS = ["fizzbuzz", "binary_search", "linked_list_reverse", "json_parser", "async_rate_limiter",
             "trie_autocomplete", "merge_sort", "lru_cache", "graph_bfs", "matrix_multiply"]


def write(tmp_path, *lines: str):
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_default_set_is_the_story_ten():
    prompts = load_prompts()
    assert [p.id for p in prompts.prompts] == STORY_IDS
    assert all(p.messages and p.max_new_tokens > 0 for p in prompts.prompts)


GOOD = '{"id": "a", "text": "def f():", "max_new_tokens": 8}'


@pytest.mark.parametrize("line, message", [
    ('{"id": "a", "text": "x", "max_new_tokens": 8', r"prompts.jsonl:2: not valid JSON"),
    ('["a"]', r":2: expected a JSON object, found list"),
    ('{"text": "x", "max_new_tokens": 8}', r":2: 'id' must be a string .* found None"),
    ('{"id": "../etc", "text": "x", "max_new_tokens": 8}', r"'id' must be .*it names a file.*'\.\./etc'"),
    ('{"id": "b", "text": "x", "max_new_tokens": 0}', r"prompt 'b': 'max_new_tokens' must be a positive integer, found 0"),
    ('{"id": "b", "text": "x", "max_new_tokens": true}', r"'max_new_tokens' must be a positive integer, found True"),
    ('{"id": "b", "max_new_tokens": 4}', r"prompt 'b': give exactly one of 'messages' or 'text'"),
    ('{"id": "b", "text": "x", "messages": [], "max_new_tokens": 4}', r"give exactly one of"),
    ('{"id": "b", "messages": [{"role": "user"}], "max_new_tokens": 4}', r"messages\[0\] must be an object with exactly 'role' and 'content'"),
    ('{"id": "b", "messages": [{"role": "robot", "content": "x"}], "max_new_tokens": 4}', r"messages\[0\].role must be one of"),
    ('{"id": "b", "text": "x", "max_new_tokens": 4, "temperature": 1}', r"unknown field\(s\) temperature"),
    ('{"id": "a", "text": "y", "max_new_tokens": 4}', r":2: duplicate id 'a' \(first on line 1\)"),
])
def test_bad_lines_name_file_line_and_field(tmp_path, line, message):
    with pytest.raises(PromptFileError, match=message) as info:
        load_prompts(write(tmp_path, GOOD, line))
    assert info.value.where.endswith("prompts.jsonl:2")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(PromptFileError, match="prompt file not found: .*nope.jsonl"):
        load_prompts(tmp_path / "nope.jsonl")
    with pytest.raises(PromptFileError, match="no prompts"):
        load_prompts(write(tmp_path, "", "  "))


ids = st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,20}", fullmatch=True)
records = st.lists(
    st.fixed_dictionaries({
        "id": ids,
        "max_new_tokens": st.integers(1, 4096),
        "body": st.one_of(
            st.text(min_size=1).map(lambda t: {"text": t}),
            st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), st.text()), min_size=1, max_size=3)
            .map(lambda ms: {"messages": [{"role": r, "content": c} for r, c in ms]}),
        ),
    }),
    min_size=1, max_size=6, unique_by=lambda r: r["id"],
)


@settings(max_examples=60, deadline=None)
@given(records=records, indent=st.sampled_from([None, 0]))
def test_round_trip_and_hash_ignores_formatting(tmp_path_factory, records, indent):
    tmp = tmp_path_factory.mktemp("p")
    lines = [{"id": r["id"], "max_new_tokens": r["max_new_tokens"], **r["body"]} for r in records]
    compact = load_prompts(write(tmp, *(json.dumps(x, separators=(",", ":")) for x in lines)))
    spaced = load_prompts(write(tmp, *(json.dumps(dict(reversed(list(x.items())))) for x in lines)))
    assert [p.to_json() for p in compact.prompts] == lines
    assert compact.sha256 == spaced.sha256
    changed = [dict(lines[0], max_new_tokens=lines[0]["max_new_tokens"] + 1), *lines[1:]]
    assert load_prompts(write(tmp, *(json.dumps(x) for x in changed))).sha256 != compact.sha256


def test_rendering_uses_the_targets_chat_template(tiny_target, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    prompts = load_prompts(write(tmp_path, '{"id": "m", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 4}',
                                 '{"id": "t", "text": "def f(x):", "max_new_tokens": 4}'))
    chat, raw = (prompt_token_ids(tokenizer, p) for p in prompts.prompts)
    assert tokenizer.decode(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(raw) == "def f(x):"
