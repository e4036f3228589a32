"""Cache greedy completions from the live server, as token ids, for the extraction step.

    python -m remote.completions --server http://127.0.0.1:30000 --out completions.json
        [--prompts prompts.jsonl] [--tokenizer DIR] [--timeout 600] [--force]

The prompt is rendered with the target's own chat template and sent as token ids to SGLang's
`/generate`; its `output_ids` are kept as they are (no re-tokenisation drift). A server without
`/generate` (404) is asked through OpenAI `/v1/completions` instead; there the completion ids come
from the answer's token ids when given, else from tokenising its text (logged once as a warning).

Every sampling param greedy decoding depends on is sent explicitly, since SGLang lays the request's
over the server's `--preferred-sampling-params` (`remote.sglang_sampling`); a preference we cannot
undo is refused before any prompt is sent. A server started with `--api-key` gets the key from this
worker's environment (`DFLASH_SGLANG_API_KEY`, never argv) as `Authorization: Bearer`.

Each record keeps its `finish_reason` and `complete` (tokens, and a stop token or length finish); an
aborted, failed or empty generation, or a stop SGLang made on a NaN or out-of-vocabulary token
(`matched: "NaN happened"`), is cached marked incomplete (`incomplete_reason`, and the ids in the
top-level `incomplete` list), never as complete: the extractor refuses it unless told. A 503 (SGLang's
"retry later" aborts: queue full, retracted without a KV backup, timeouts) is asked once more after a
short backoff; a second 503 marks that prompt incomplete and the others are still cached.

`completions.json` is written atomically. A cache made for another prompt set or model is never
overwritten (unless --force): the extraction must match the completions it reads. Run again over a
cache for the same prompts, model and sampling params, the worker keeps its complete records and asks
only the others (--force asks every prompt again).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from remote import http_deadline
from remote.artifacts import write_json_atomic
from remote.events import EventWriter, WorkerError, run_worker
from remote.prompts import Prompt, PromptSet, load_prompts, prompt_token_ids
from remote.sglang_sampling import PreferredParamsRefused, greedy_sampling_params

FORMAT = "dflash-ops.completions/1"
API_KEY_ENV = "DFLASH_SGLANG_API_KEY"  # the server's --api-key, given by the console through the environment
RETRY_BACKOFF_S = 2.0  # before the one retry of a 503 ("retry later"); at most RETRY_BACKOFF_MAX_S
RETRY_BACKOFF_MAX_S = 10.0
UNAUTHORIZED = "the server wants an API key: set [service] api_key_env"


class ServerError(WorkerError):
    """The server could not be reached or answered something unusable."""


class Busy(ServerError):
    """HTTP 503 from /generate: SGLang's "retry later" (queue full, retracted, a timeout abort)."""


def api_headers() -> dict[str, str]:
    """`Authorization: Bearer KEY` when the environment holds the server's API key, else nothing."""
    key = os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


def http_request(url: str, data: bytes | None, timeout: float) -> tuple[int, bytes]:
    """GET (or POST `data` as JSON) with a total deadline of `timeout` seconds: (status, body).

    The deadline covers connecting, the headers and the whole body (`remote.http_deadline`: a
    watchdog shuts the socket down when it passes), so a server that trickles its answer cannot hold
    the worker. A body cut short, an answer that is not HTTP, or none at all raise ServerError with
    the URL and what came; our own deadline is named as ours, apart from the server closing on us.
    """
    try:
        answer = http_deadline.request(url, data, timeout, headers=api_headers())
    except http_deadline.HttpDeadlineError as err:
        exc = err.cause
        if err.kind == "bad_url":
            if exc is not None:
                raise exc from None  # a bad port: as http.client raises it
            raise ServerError(f"{url} is not an http(s) URL", url) from None
        if err.kind == "no_answer":
            if err.expired:
                raise ServerError(f"cannot reach the server at {url}: no answer within {timeout:g} s (our deadline)",
                                  url) from None
            if isinstance(exc, http.client.RemoteDisconnected):
                raise ServerError(f"cannot reach the server at {url}: it closed the connection without answering",
                                  url) from None
            if isinstance(exc, http.client.BadStatusLine):
                line = str(exc.args[0] if exc.args else "")[:120]
                raise ServerError(f"{url} gave not an HTTP answer: {line!r}", url) from None
            raise ServerError(f"cannot reach the server at {url}: {exc}", url) from None
        raise ServerError(f"{url} answered HTTP {err.status}, {err.cut_short(exc_message=False)} after "
                          f"{err.received()}: {err.body[:200]!r}", url) from None
    if answer.status == 401:
        raise ServerError(f"{url} answered HTTP 401 Unauthorized: {UNAUTHORIZED}"
                          + ("" if API_KEY_ENV in os.environ else f" (this worker had no {API_KEY_ENV})")
                          + ("; the key given was refused" if API_KEY_ENV in os.environ else ""), url)
    return answer.status, answer.body


def error_message(text: str) -> str:
    """The message of one of SGLang's error bodies ({"error": "..."}, {"error": {"message": ...}},
    {"object": "error", "message": ...}, {"detail": ...}), or the text itself."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, str):
            return inner
        if isinstance(inner, dict) and isinstance(inner.get("message", inner.get("detail")), str):
            return inner.get("message", inner.get("detail"))
    return text


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> tuple[int, Any]:
    """GET (or POST `body` as JSON) and return (status, decoded JSON). Non-JSON answers raise ServerError;
    an HTTP error status is returned with the error's message, not raised, so callers can fall back on 404."""
    status, raw = http_request(url, json.dumps(body).encode() if body is not None else None, timeout)
    if status >= 400:
        return status, error_message(raw.decode(errors="replace"))[:300]
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


def preferred_sampling_params(server: str, info: dict[str, Any], timeout: float) -> Any:
    """The server's --preferred-sampling-params: /model_info's (0.5.23, http_server.py model_info), else
    /server_info's launch argument (a JSON string), else None (older releases have none)."""
    if "preferred_sampling_params" in info:
        return info["preferred_sampling_params"]
    for route in ("/server_info", "/get_server_info"):
        status, answer = http_json(server + route, timeout=timeout)
        if status == 200 and isinstance(answer, dict):
            value = answer.get("preferred_sampling_params")
            if isinstance(value, str):
                try:
                    return json.loads(value)
                except json.JSONDecodeError:
                    raise ServerError(f"{server}{route}: preferred_sampling_params is not JSON: {value[:120]!r}",
                                      server + route) from None
            return value
    return None


def _int_ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return value
    return None


def _finish(reason: Any) -> dict[str, Any]:
    """A record's finish fields from SGLang's finish_reason object ({"type", "matched" | "length" |
    "message", "status_code"}: schedule_batch.py's FINISH_* to_json) or an OpenAI string."""
    if not isinstance(reason, dict):
        return {"finish_reason": reason}
    found: dict[str, Any] = {"finish_reason": reason.get("type")}
    if reason.get("matched") is not None:
        found["finish_matched"] = reason["matched"]
    if reason.get("message"):
        found["finish_message"] = str(reason["message"])[:200]
    if reason.get("status_code") is not None:
        found["finish_status_code"] = reason["status_code"]
    return found


def ask_generate(server: str, prompt: Prompt, ids: list[int], sampling: dict[str, Any],
                 timeout: float) -> dict[str, Any] | None:
    """One greedy generation through /generate; None when the server has no such route (404)."""
    url = server + "/generate"
    body = {"input_ids": ids, "sampling_params": sampling}
    status, answer = http_json(url, body, timeout)
    if status == 404:
        return None
    if status == 503:
        raise Busy(f"prompt {prompt.id!r}: /generate answered HTTP 503: {answer}", url)
    if status != 200:
        raise ServerError(f"prompt {prompt.id!r}: /generate answered HTTP {status}: {answer}", url)
    if isinstance(answer, list) and len(answer) == 1:
        answer = answer[0]
    output = _int_ids(answer.get("output_ids")) if isinstance(answer, dict) else None
    if output is None:
        found = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        raise ServerError(f"prompt {prompt.id!r}: /generate answer has no list of token ids in 'output_ids' "
                          f"(found {found})", url)
    return {"completion_ids": output, "text": str(answer.get("text", "")),
            **_finish((answer.get("meta_info") or {}).get("finish_reason")), "endpoint": "generate"}


def ask_openai(server: str, model: str, prompt: Prompt, ids: list[int], sampling: dict[str, Any], tokenizer: Any,
               timeout: float, events: EventWriter, warned: list[bool]) -> dict[str, Any]:
    """One greedy completion through OpenAI /v1/completions (prompt given as token ids)."""
    url = server + "/v1/completions"
    # OpenAI's names: max_tokens, min_tokens (serving_completions.py builds SGLang's params from them).
    params = {("min_tokens" if k == "min_new_tokens" else k): v for k, v in sampling.items() if k != "max_new_tokens"}
    # return_token_ids: SGLang's choices then carry the generated ids (protocol.py, CompletionRequest).
    body = {"model": model, "prompt": ids, "max_tokens": prompt.max_new_tokens, "return_token_ids": True, **params}
    status, answer = http_json(url, body, timeout)
    if status == 503:
        raise Busy(f"prompt {prompt.id!r}: /v1/completions answered HTTP 503: {answer}", url)
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
    found = {"completion_ids": output, "text": choice["text"], "finish_reason": choice.get("finish_reason"),
             "endpoint": "v1/completions"}
    if choice.get("matched_stop") is not None:
        found["finish_matched"] = choice["matched_stop"]
    return found


def ask_with_one_retry(ask: Callable[[], dict[str, Any] | None], prompt: Prompt, events: EventWriter,
                       backoff_s: float, endpoint: str) -> dict[str, Any] | None:
    """`ask()`, asked once more after `backoff_s` (at most RETRY_BACKOFF_MAX_S) when the server answers
    503; a second 503 becomes an incomplete record, so the prompts already answered are still cached."""
    try:
        return ask()
    except Busy as first:
        wait = min(max(backoff_s, 0.0), RETRY_BACKOFF_MAX_S)
        events.log(f"{prompt.id}: {first} (SGLang's retry later): asking once more in {wait:g} s", level="warning")
        time.sleep(wait)
        try:
            return ask()
        except Busy as again:
            return {"completion_ids": [], "text": "", "finish_reason": "abort", "finish_status_code": 503,
                    "finish_message": f"HTTP 503 twice: {again}"[:200], "endpoint": endpoint}


NAN_STOP = "NaN happened"  # schedule_batch.py, Req._check_vocab_boundary_finish


def completeness(record: dict[str, Any]) -> tuple[bool, str | None]:
    """(complete, why not) of one cached generation: complete iff it has tokens and ended on a stop
    token (or no matched string) or the length limit. An aborted, failed, unexplained or empty
    generation, or a stop SGLang made on a bad token, is not."""
    reason = record.get("finish_reason")
    message = record.get("finish_message")
    tokens = len(record.get("completion_ids") or [])
    if reason == "abort":
        code = record.get("finish_status_code")
        return False, (f"aborted by the server{f' (HTTP {code})' if code else ''}: {message or 'no message'}"
                       + ("; no tokens" if not tokens else f"; {tokens} tokens before the abort"))
    matched = record.get("finish_matched")
    if reason == "stop" and matched == NAN_STOP:
        return False, ("the server stopped on a NaN or out-of-vocabulary token (finish_reason stop, matched "
                       f"{NAN_STOP!r}): it replaced that token by EOS, so the last token is not the model's")
    if reason == "stop" and isinstance(matched, str):
        return False, f"the server stopped on the string {matched!r}, not on a stop token (we sent no stop strings)"
    if not tokens:
        return False, "empty completion (no tokens)"
    if reason not in COMPLETE_REASONS:
        return False, f"finish_reason {reason!r}" + (f" ({message})" if message else "")
    return True, None


COMPLETE_REASONS = ("stop", "length")


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


def kept_records(out: Path, prompt_set: PromptSet, model_path: str, sampling: dict[str, Any]) -> dict[str, dict]:
    """The complete records of an earlier cache at `out` for the same prompt set, model and sampling
    params, by prompt id: a run again asks only the prompts it has not answered in full."""
    try:
        old = json.loads(out.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(old, dict) or old.get("format") != FORMAT or old.get("prompt_set_sha256") != prompt_set.sha256 \
            or old.get("model_path") != model_path or old.get("sampling") != sampling:
        return {}
    return {r["id"]: r for r in old.get("prompts", []) if isinstance(r, dict) and r.get("complete") is True
            and completeness(r) == (True, None)}


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
    p.add_argument("--retry-backoff", type=float, default=RETRY_BACKOFF_S,
                   help=f"seconds before the one retry of a 503 (at most {RETRY_BACKOFF_MAX_S:g})")
    return p.parse_args(argv)


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    server = args.server.rstrip("/")
    out = Path(args.out)
    events.phase("prompts")
    prompt_set = load_prompts(args.prompts)
    info = model_info(server, min(args.timeout, 30.0))
    model_path = info["model_path"]
    preferred = preferred_sampling_params(server, info, min(args.timeout, 30.0))
    try:
        sampling, warnings = greedy_sampling_params(max(p.max_new_tokens for p in prompt_set.prompts), preferred)
    except PreferredParamsRefused as exc:
        raise ServerError(f"{server}: {exc}", f"{server}/model_info") from None
    for warning in warnings:
        events.log(warning, level="warning")
    check_existing(out, prompt_set, model_path, args.force)
    tokenizer = load_tokenizer(args.tokenizer or info.get("tokenizer_path") or model_path)
    served_name = str(info.get("served_model_name") or model_path)

    kept = {} if args.force else kept_records(out, prompt_set, model_path, sampling)
    events.phase("generate")
    use_generate = True
    warned = [False]
    records = []
    total = len(prompt_set.prompts)
    for i, prompt in enumerate(prompt_set.prompts, start=1):
        ids = prompt_token_ids(tokenizer, prompt)
        earlier = kept.get(prompt.id)
        if earlier is not None and earlier.get("prompt_ids") == ids and earlier.get("max_new_tokens") == prompt.max_new_tokens:
            records.append(earlier)
            events.progress("prompts", i, total, "prompts", label=prompt.id)
            events.log(f"[{i}/{total}] {prompt.id}: kept from the earlier cache (complete)")
            continue
        params = {**sampling, "max_new_tokens": prompt.max_new_tokens}
        answer = None
        if use_generate:
            answer = ask_with_one_retry(partial(ask_generate, server, prompt, ids, params, args.timeout),
                                        prompt, events, args.retry_backoff, "generate")
        if answer is None:
            if use_generate:
                events.log("/generate is not served (404): using OpenAI /v1/completions", level="warning")
                use_generate = False
            answer = ask_with_one_retry(
                partial(ask_openai, server, served_name, prompt, ids, params, tokenizer, args.timeout, events, warned),
                prompt, events, args.retry_backoff, "v1/completions")
            assert answer is not None
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
        "sampling": sampling,
        "server_preferred_sampling_params": preferred or None,
        "prompts": records,
        "incomplete": [r["id"] for r in records if not r["complete"]],
    }
    write_json_atomic(out, data)
    events.artifact(str(out), "completions", prompts=len(records))
    return {"out": str(out), "prompts": len(records), "model_path": model_path,
            "endpoint": "generate" if use_generate else "v1/completions",
            "completion_tokens": sum(len(r["completion_ids"]) for r in records),
            "incomplete": data["incomplete"]}


def without_torch() -> None:
    """Keep torch out of this process: the tokenizer is all it needs of transformers, which imports
    torch whenever torch is installed (over half of this worker's start, 2-3 CPU-seconds). Without it
    transformers runs as where torch is absent ("only tokenizers, configuration and file/data
    utilities"): the same tokenizer class and the same ids (tests/test_completions.py compares them)."""
    sys.modules.setdefault("torch", None)  # type: ignore[arg-type]  # an import of it fails, as if absent
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")  # its "PyTorch was not found" notice


if __name__ == "__main__":
    without_torch()
    run_worker(main)
