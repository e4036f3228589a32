"""Cache greedy completions from the live server, as token ids, for the extraction step.

    python -m remote.completions --server http://127.0.0.1:30000 --out completions.json
        [--prompts prompts.jsonl] [--tokenizer DIR] [--timeout 600] [--force]

The prompt is rendered with the target's own chat template and sent as token ids to SGLang's
`/generate`; its `output_ids` are kept as they are (no re-tokenisation drift). A server without
`/generate` (404) is asked through OpenAI `/v1/completions` instead; there the completion ids come
from the answer's token ids when given, else from tokenising its text (logged once as a warning).

Each record keeps its `finish_reason` and `complete` (tokens, and a stop or length finish); an
aborted, failed or empty generation is cached marked incomplete (`incomplete_reason`, and the ids in
the top-level `incomplete` list), never as complete: the extractor refuses it unless told.

`completions.json` is written atomically. A cache made for another prompt set or model is never
overwritten (unless --force): the extraction must match the completions it reads.
"""

from __future__ import annotations

import argparse
import http.client
import json
from pathlib import Path
from typing import Any

from remote import http_deadline
from remote.artifacts import write_json_atomic
from remote.events import EventWriter, WorkerError, run_worker
from remote.prompts import Prompt, PromptSet, load_prompts, prompt_token_ids

FORMAT = "dflash-ops.completions/1"


class ServerError(WorkerError):
    """The server could not be reached or answered something unusable."""


def http_request(url: str, data: bytes | None, timeout: float) -> tuple[int, bytes]:
    """GET (or POST `data` as JSON) with a total deadline of `timeout` seconds: (status, body).

    The deadline covers connecting, the headers and the whole body (`remote.http_deadline`: a
    watchdog shuts the socket down when it passes), so a server that trickles its answer cannot hold
    the worker. A body cut short, an answer that is not HTTP, or none at all raise ServerError with
    the URL and what came.
    """
    try:
        answer = http_deadline.request(url, data, timeout)
    except http_deadline.HttpDeadlineError as err:
        exc = err.cause
        if err.kind == "bad_url":
            if exc is not None:
                raise exc from None  # a bad port: as http.client raises it
            raise ServerError(f"{url} is not an http(s) URL", url) from None
        if err.kind == "no_answer":
            if err.expired:
                raise ServerError(f"cannot reach the server at {url}: no answer within {timeout:g} s", url) from None
            if isinstance(exc, http.client.RemoteDisconnected):
                raise ServerError(f"cannot reach the server at {url}: it closed the connection without answering",
                                  url) from None
            if isinstance(exc, http.client.BadStatusLine):
                line = str(exc.args[0] if exc.args else "")[:120]
                raise ServerError(f"{url} gave not an HTTP answer: {line!r}", url) from None
            raise ServerError(f"cannot reach the server at {url}: {exc}", url) from None
        raise ServerError(f"{url} answered HTTP {err.status}, {err.cut_short(exc_message=False)} after "
                          f"{err.received()}: {err.body[:200]!r}", url) from None
    return answer.status, answer.body


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> tuple[int, Any]:
    """GET (or POST `body` as JSON) and return (status, decoded JSON). Non-JSON answers raise ServerError;
    an HTTP error status is returned, not raised, so callers can fall back on 404."""
    status, raw = http_request(url, json.dumps(body).encode() if body is not None else None, timeout)
    if status >= 400:
        return status, raw.decode(errors="replace")[:300]
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ServerError(f"{url} answered {status} with something that is not JSON: {raw[:200]!r}", url) from exc


def model_info(server: str, timeout: float) -> dict[str, Any]:
    """The server's /model_info (SGLang's newer name first, then the deprecated alias)."""
    last = ""
    for route in ("/model_info", "/get_model_info"):
        status, answer = http_json(server + route, timeout=timeout)
        if status == 200 and isinstance(answer, dict) and isinstance(answer.get("model_path"), str):
            return answer
        last = f"{route}: HTTP {status} {str(answer)[:120]}"
    raise ServerError(f"{server} gives no usable /model_info (need model_path): {last}", server)


def _int_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def ask_generate(server: str, prompt: Prompt, ids: list[int], timeout: float) -> dict[str, Any] | None:
    """One greedy generation through /generate; None when the server has no such route (404)."""
    url = server + "/generate"
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": prompt.max_new_tokens}}
    status, answer = http_json(url, body, timeout)
    if status == 404:
        return None
    if status != 200:
        raise ServerError(f"prompt {prompt.id!r}: /generate answered HTTP {status}: {answer}", url)
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    output = _int_ids(answer.get("output_ids")) if isinstance(answer, dict) else None
    if output is None:
        found = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        raise ServerError(f"prompt {prompt.id!r}: /generate answer has no list of token ids in 'output_ids' "
                          f"(found {found})", url)
    reason = (answer.get("meta_info") or {}).get("finish_reason")
    message = None
    if isinstance(reason, dict):
        message = reason.get("message")
        reason = reason.get("type")
    found = {"completion_ids": output, "text": str(answer.get("text", "")), "finish_reason": reason,
             "endpoint": "generate"}
    if message:
        found["finish_message"] = str(message)[:200]
    return found


def ask_openai(server: str, model: str, prompt: Prompt, ids: list[int], tokenizer: Any, timeout: float,
               events: EventWriter, warned: list[bool]) -> dict[str, Any]:
    """One greedy completion through OpenAI /v1/completions (prompt given as token ids)."""
    url = server + "/v1/completions"
    body = {"model": model, "prompt": ids, "max_tokens": prompt.max_new_tokens, "temperature": 0}
    status, answer = http_json(url, body, timeout)
    if status != 200:
        raise ServerError(f"prompt {prompt.id!r}: /v1/completions answered HTTP {status}: {answer}", url)
    choices = answer.get("choices") if isinstance(answer, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict) \
            or not isinstance(choices[0].get("text"), str):
        raise ServerError(f"prompt {prompt.id!r}: /v1/completions answer has no choices[0].text", url)
    choice = choices[0]
    output = _int_ids(choice.get("token_ids")) or _int_ids(choice.get("output_ids"))
    if output is None:
        if not warned[0]:
            events.log("/v1/completions gives no token ids: completion ids re-tokenised from text "
                       "(may differ slightly from what the server generated)", level="warning")
            warned[0] = True
        output = [int(t) for t in tokenizer(choice["text"], add_special_tokens=False)["input_ids"]]
    return {"completion_ids": output, "text": choice["text"], "finish_reason": choice.get("finish_reason"),
            "endpoint": "v1/completions"}


COMPLETE_REASONS = ("stop", "length")


def completeness(record: dict[str, Any]) -> tuple[bool, str | None]:
    """(complete, why not) of one cached generation: complete iff it has tokens and ended by a stop
    token or the length limit. An aborted, failed, unexplained or empty generation is not."""
    if not record.get("completion_ids"):
        return False, "empty completion (no tokens)"
    reason = record.get("finish_reason")
    if reason not in COMPLETE_REASONS:
        message = record.get("finish_message")
        return False, f"finish_reason {reason!r}" + (f" ({message})" if message else "")
    return True, None


def check_existing(out: Path, prompt_set: PromptSet, model_path: str, force: bool) -> None:
    """Refuse to overwrite a cache made for another prompt set or model (or not a cache at all)."""
    if not out.exists() or force:
        return
    try:
        old = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        old = None
    if not isinstance(old, dict) or old.get("format") != FORMAT:
        raise WorkerError(f"{out} exists and is not a completions cache: refusing to overwrite (use --force)", str(out))
    differences = []
    if old.get("prompt_set_sha256") != prompt_set.sha256:
        differences.append(f"prompt set {str(old.get('prompt_set_sha256'))[:12]} ({old.get('prompt_file')}) "
                           f"vs {prompt_set.sha256[:12]} ({prompt_set.path})")
    if old.get("model_path") != model_path:
        differences.append(f"model {old.get('model_path')} vs {model_path}")
    if differences:
        raise WorkerError(f"{out} holds completions for a different " + "; ".join(differences)
                          + ": refusing to overwrite (use another --out, or --force)", str(out))


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    if not Path(path).is_dir():
        raise WorkerError(f"the target's tokenizer directory {path} is not on this host (give --tokenizer DIR)",
                          "--tokenizer")
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - any load failure is the same operator problem
        raise WorkerError(f"cannot load the tokenizer from {path}: {type(exc).__name__}: {exc}", "--tokenizer") from exc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m remote.completions", description=__doc__.splitlines()[0])
    p.add_argument("--server", required=True, help="the server's URL as seen from this host")
    p.add_argument("--out", required=True, help="completions.json to write")
    p.add_argument("--prompts", default=None, help="JSONL prompt file (default: the shipped ten coding prompts)")
    p.add_argument("--tokenizer", default=None, help="target tokenizer dir (default: the server's model path)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--force", action="store_true", help="overwrite a cache made for other prompts or model")
    return p.parse_args(argv)


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    server = args.server.rstrip("/")
    out = Path(args.out)
    events.phase("prompts")
    prompt_set = load_prompts(args.prompts)
    info = model_info(server, min(args.timeout, 30.0))
    model_path = info["model_path"]
    check_existing(out, prompt_set, model_path, args.force)
    tokenizer = load_tokenizer(args.tokenizer or info.get("tokenizer_path") or model_path)
    served_name = str(info.get("served_model_name") or model_path)

    events.phase("generate")
    use_generate = True
    warned = [False]
    records = []
    total = len(prompt_set.prompts)
    for i, prompt in enumerate(prompt_set.prompts, start=1):
        ids = prompt_token_ids(tokenizer, prompt)
        answer = ask_generate(server, prompt, ids, args.timeout) if use_generate else None
        if answer is None:
            if use_generate:
                events.log("/generate is not served (404): using OpenAI /v1/completions", level="warning")
                use_generate = False
            answer = ask_openai(server, served_name, prompt, ids, tokenizer, args.timeout, events, warned)
        record = {"id": prompt.id, "prompt_ids": ids, "max_new_tokens": prompt.max_new_tokens, **answer}
        complete, why = completeness(record)
        record["complete"] = complete
        if not complete:
            # Kept, never as complete: the extractor refuses it unless told (--allow-incomplete).
            record["incomplete_reason"] = why
        records.append(record)
        n_chars, n_tokens = len(answer["text"]), len(answer["completion_ids"])
        events.progress("prompts", i, total, "prompts", label=prompt.id)
        events.log(f"[{i}/{total}] {prompt.id}: {n_chars} chars, {n_tokens} tokens"
                   + ("" if complete else f" INCOMPLETE: {why}"), level="info" if complete else "warning")

    data = {
        "format": FORMAT,
        "prompt_set_sha256": prompt_set.sha256,
        "prompt_file": prompt_set.path,
        "model_path": model_path,
        "served_model_name": served_name,
        "server_url": server,
        "sampling": {"temperature": 0, "max_new_tokens": max(p.max_new_tokens for p in prompt_set.prompts)},
        "prompts": records,
        "incomplete": [r["id"] for r in records if not r["complete"]],
    }
    write_json_atomic(out, data)
    events.artifact(str(out), "completions", prompts=len(records))
    return {"out": str(out), "prompts": len(records), "model_path": model_path,
            "endpoint": "generate" if use_generate else "v1/completions",
            "completion_tokens": sum(len(r["completion_ids"]) for r in records),
            "incomplete": data["incomplete"]}


if __name__ == "__main__":
    run_worker(main)
