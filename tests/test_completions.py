"""Completions from a live server (remote.completions), against the real rehearsal server
(remote.drill.standin: the tiny target behind SGLang's endpoints) and small real HTTP servers in front of it."""

from __future__ import annotations

import io
import json
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from remote import completions, extract
from remote.events import EventWriter, WorkerError
from remote.prompts import load_prompts
from tests.fixtures_models import run_in_process
from tests.standin_helpers import GREEDY_PARAMS, free_port, running_standin


@pytest.fixture(scope="module")
def standin(tiny_target, tmp_path_factory):
    """The rehearsal server on a free port, ready (health 200)."""
    with running_standin(tiny_target, tmp_path_factory.mktemp("standin") / "log.txt") as url:
        yield url


GREEDY = GREEDY_PARAMS
KEY = "completions-test-key"


@pytest.fixture(scope="module")
def guarded(tiny_target, tmp_path_factory):
    """A rehearsal server with --api-key and a preferred logit bias that would make every token 7."""
    with running_standin(tiny_target, tmp_path_factory.mktemp("guarded") / "log.txt", "--api-key", KEY,
                         "--preferred-sampling-params", json.dumps({"logit_bias": {"7": 100.0}, "top_k": 5})) as url:
        yield url


def serve(handler_cls) -> tuple[str, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_cls)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def proxy_without_generate(upstream: str, drop_token_ids: bool = False):
    """A vLLM-like front: everything forwarded to the standin except /generate (404); with
    `drop_token_ids` its completions carry text only (no `token_ids`)."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _forward(self, body: bytes | None):
            req = urllib.request.Request(upstream + self.path, data=body, method=self.command,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req) as r:
                data, status = r.read(), r.status
            if drop_token_ids and self.path == "/v1/completions":
                answer = json.loads(data)
                for choice in answer["choices"]:
                    choice.pop("token_ids", None)
                data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            self._forward(None)

        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/generate":
                self.send_error(404)
                return
            self._forward(body)

    return serve(Handler)


def broken_server(model_path: str, generate_answer: bytes | list[tuple[int, bytes]], server_info: dict | None = None,
                  **model_info):
    """A server whose /model_info is fine (plus `model_info`) and whose /generate answers
    `generate_answer`, or (status, body) from the list in turn (the last one for ever after).
    `server_info`: what /server_info answers (else the same as /model_info). Every /generate body it
    gets is kept in `server.bodies`."""
    answers = [(200, generate_answer)] if isinstance(generate_answer, bytes) else list(generate_answer)
    bodies: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, data: bytes, status: int = 200):
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):  # noqa: N802
            if server_info is not None and self.path == "/server_info":
                self._send(json.dumps(server_info).encode())
                return
            self._send(json.dumps({"model_path": model_path, **model_info}).encode())

        def do_POST(self):  # noqa: N802
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            status, body = answers.pop(0) if len(answers) > 1 else answers[0]
            self._send(body, status)

    url, server = serve(Handler)
    server.bodies = bodies
    return url, server


def prompt_file(tmp_path: Path, n: int = 2, max_new: int = 6) -> Path:
    lines = [json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Write function number {i}."}],
                         "max_new_tokens": max_new}) for i in range(n)]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(argv: list[str]) -> tuple[dict, list[dict]]:
    return run_in_process(completions.main, argv)


def test_generate_caches_token_ids_then_extract_reads_them(standin, tiny_target, tmp_path):
    out = tmp_path / "completions.json"
    prompts = prompt_file(tmp_path)
    result, events = run(["--server", standin, "--prompts", str(prompts), "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["format"] == "dflash-ops.completions/1"
    assert data["model_path"] == str(tiny_target) and data["server_url"] == standin
    assert data["prompt_set_sha256"] == load_prompts(prompts).sha256
    assert data["sampling"] == {**GREEDY, "max_new_tokens": 6} and data["server_preferred_sampling_params"] is None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    for i, record in enumerate(data["prompts"]):
        assert record["id"] == f"p{i}" and record["endpoint"] == "generate"
        assert tokenizer.decode(record["prompt_ids"]).endswith(f"Write function number {i}.<|im_end|>\n<|im_start|>assistant\n")
        # Greedy and deterministic: the server gives the same ids again for the same prompt.
        req = urllib.request.Request(standin + "/generate", method="POST", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"input_ids": record["prompt_ids"],
                                                      "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).encode())
        with urllib.request.urlopen(req) as r:
            assert json.loads(r.read())["output_ids"] == record["completion_ids"]
        assert record["finish_reason"] in ("length", "stop") and 1 <= len(record["completion_ids"]) <= 6
    logs = [e["msg"] for e in events if e["type"] == "log"]
    assert any(m.startswith("[2/2] p1: ") and m.endswith(f"{len(data['prompts'][1]['completion_ids'])} tokens") for m in logs)
    assert result["endpoint"] == "generate"
    # The extractor takes this file as it is.
    buf = io.StringIO()
    extract.main(EventWriter(stream=buf), ["--model", str(tiny_target), "--completions", str(out),
                                           "--out", str(tmp_path / "x"), "--layers", "1"])
    manifest = json.loads((tmp_path / "x" / "manifest.json").read_text())
    assert [p["num_tokens"] for p in manifest["prompts"]] == [
        len(r["prompt_ids"]) + len(r["completion_ids"]) for r in data["prompts"]]


def test_falls_back_to_openai_completions_when_generate_is_404(standin, tmp_path):
    prompts = prompt_file(tmp_path)
    run(["--server", standin, "--prompts", str(prompts), "--out", str(tmp_path / "generate.json")])
    url, server = proxy_without_generate(standin)
    try:
        _, events = run(["--server", url, "--prompts", str(prompts), "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    data = json.loads((tmp_path / "c.json").read_text())
    assert {r["endpoint"] for r in data["prompts"]} == {"v1/completions"}
    # Greedy there too (OpenAI's default temperature is 1.0), with the server's own ids (return_token_ids).
    generated = json.loads((tmp_path / "generate.json").read_text())
    assert [r["completion_ids"] for r in data["prompts"]] == [r["completion_ids"] for r in generated["prompts"]]
    warnings = [e["msg"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert any("/generate is not served (404)" in w for w in warnings)
    assert not any("re-tokenised from text" in w for w in warnings)


def test_completions_without_token_ids_are_re_tokenised_with_a_warning(standin, tmp_path):
    url, server = proxy_without_generate(standin, drop_token_ids=True)
    try:
        _, events = run(["--server", url, "--prompts", str(prompt_file(tmp_path)), "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    data = json.loads((tmp_path / "c.json").read_text())
    assert all(r["completion_ids"] for r in data["prompts"])
    warnings = [e["msg"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert sum("re-tokenised from text" in w for w in warnings) == 1


def test_refuses_to_overwrite_a_cache_for_other_prompts_or_model(standin, tmp_path):
    out = tmp_path / "c.json"
    run(["--server", standin, "--prompts", str(prompt_file(tmp_path, n=1)), "--out", str(out)])
    first = out.read_text()
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(WorkerError, match="different prompt set .*refusing to overwrite"):
        run(["--server", standin, "--prompts", str(prompt_file(other, n=2)), "--out", str(out)])
    data = json.loads(first)
    data["model_path"] = "/models/another-model"
    out.write_text(json.dumps(data))
    with pytest.raises(WorkerError, match="different model /models/another-model vs"):
        run(["--server", standin, "--prompts", str(prompt_file(tmp_path, n=1)), "--out", str(out)])
    assert json.loads(out.read_text())["model_path"] == "/models/another-model"  # untouched
    run(["--server", standin, "--prompts", str(prompt_file(tmp_path, n=1)), "--out", str(out), "--force"])
    assert json.loads(out.read_text()) == json.loads(first)
    (tmp_path / "notes.json").write_text("hello")
    with pytest.raises(WorkerError, match="exists and is not a completions cache"):
        run(["--server", standin, "--prompts", str(prompt_file(tmp_path, n=1)), "--out", str(tmp_path / "notes.json")])


@pytest.mark.parametrize("answer, message", [
    (b'{"text": "hello", "meta_info": {}}', r"prompt 'p0': /generate answer has no list of token ids in 'output_ids' \(found \['meta_info', 'text'\]\)"),
    (b'{"output_ids": [1, "x"]}', r"no list of token ids in 'output_ids'"),
    (b"<html>oops</html>", r"/generate answered 200 with something that is not JSON"),
])
def test_malformed_server_answers_are_clear_errors(tiny_target, tmp_path, answer, message):
    url, server = broken_server(str(tiny_target), answer)
    try:
        with pytest.raises(WorkerError, match=message):
            run(["--server", url, "--prompts", str(prompt_file(tmp_path)), "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    assert not (tmp_path / "c.json").exists()


def test_unreachable_server_and_foreign_tokenizer_path(tmp_path):
    with pytest.raises(WorkerError, match=r"cannot reach the server at http://127.0.0.1:\d+/model_info"):
        run(["--server", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "c.json")])
    url, server = broken_server("/models/on-another-host", b"{}")
    try:
        with pytest.raises(WorkerError, match="tokenizer directory /models/on-another-host is not on this host"):
            run(["--server", url, "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("answer, reason", [
    (b'{"output_ids": [5, 6], "text": "ab", "meta_info": {"finish_reason": {"type": "abort", "message": "client gone"}}}',
     "aborted by the server: client gone; 2 tokens before the abort"),
    (b'{"output_ids": [], "text": "", "meta_info": {"finish_reason": {"type": "abort", "message": "Aborted", '
     b'"status_code": null, "err_type": null}}}', "aborted by the server: Aborted; no tokens"),
    (b'{"output_ids": [5, 2], "text": "a", "meta_info": {"finish_reason": {"type": "stop", "matched": "NaN happened"}}}',
     "the server stopped on a NaN or out-of-vocabulary token (finish_reason stop, matched 'NaN happened'): it "
     "replaced that token by EOS, so the last token is not the model's"),
    (b'{"output_ids": [5, 6], "text": "ab", "meta_info": {"finish_reason": {"type": "stop", "matched": "</s>"}}}',
     "the server stopped on the string '</s>', not on a stop token (we sent no stop strings)"),
    (b'{"output_ids": [], "text": "", "meta_info": {"finish_reason": {"type": "stop"}}}', "empty completion (no tokens)"),
    (b'{"output_ids": [5, 6], "text": "ab", "meta_info": {}}', "finish_reason None"),
])
def test_aborted_or_empty_generations_are_cached_marked_incomplete(tiny_target, tmp_path, answer, reason):
    """Never cached as complete: marked per prompt and listed, and the extractor's check refuses them
    (one line, nothing written) unless --allow-incomplete."""
    url, server = broken_server(str(tiny_target), answer)
    try:
        result, events = run(["--server", url, "--prompts", str(prompt_file(tmp_path)), "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["incomplete"] == ["p0", "p1"] == result["incomplete"]
    assert all(r["complete"] is False and r["incomplete_reason"] == reason for r in data["prompts"])
    assert any(e["type"] == "log" and e["level"] == "warning" and e["msg"].endswith(f"INCOMPLETE: {reason}")
               for e in events)
    argv = ["--model", str(tiny_target), "--completions", str(tmp_path / "c.json"), "--out", str(tmp_path / "x")]
    with pytest.raises(WorkerError) as err:
        run_in_process(extract.main, argv)
    assert "2 of 2 generations are incomplete" in err.value.msg and "--allow-incomplete" in err.value.msg
    assert "\n" not in err.value.msg and not (tmp_path / "x").exists()
    if reason not in ("empty completion (no tokens)", "aborted by the server: Aborted; no tokens"):
        checked, _ = run_in_process(extract.main, [*argv, "--check-only", "--allow-incomplete"])
        assert checked["ok"] and checked["allowed_incomplete"] and [e["id"] for e in checked["incomplete"]] == ["p0", "p1"]


def test_complete_generations_are_marked_complete(standin, tmp_path):
    """The control: a live server's stop/length generations are complete and the list is empty."""
    result, _ = run(["--server", standin, "--prompts", str(prompt_file(tmp_path)), "--out", str(tmp_path / "c.json")])
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["incomplete"] == [] == result["incomplete"]
    assert all(r["complete"] for r in data["prompts"])
    assert completions.completeness({"completion_ids": [1], "finish_reason": "length"}) == (True, None)


def test_every_greedy_param_is_sent_over_the_servers_preferred_ones(standin, guarded, tmp_path, monkeypatch):
    """A server preferring a logit bias (every token 7) and top_k 5 gives the same completions as one
    with no preference: each preferred param is sent with its greedy value, and the warning says so."""
    prompts = prompt_file(tmp_path)
    run(["--server", standin, "--prompts", str(prompts), "--out", str(tmp_path / "plain.json")])
    monkeypatch.setenv(completions.API_KEY_ENV, KEY)
    _, events = run(["--server", guarded, "--prompts", str(prompts), "--out", str(tmp_path / "preferred.json")])
    plain, preferred = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("plain", "preferred"))
    assert [r["completion_ids"] for r in preferred["prompts"]] == [r["completion_ids"] for r in plain["prompts"]]
    assert all(r["complete"] for r in preferred["prompts"])
    assert preferred["server_preferred_sampling_params"] == {"logit_bias": {"7": 100.0}, "top_k": 5}
    assert preferred["sampling"] == {**GREEDY, "max_new_tokens": 6, "logit_bias": None}
    warnings = [e["msg"] for e in events if e["type"] == "log" and e["level"] == "warning"]
    assert 'the server prefers logit_bias={"7": 100.0}, top_k=5 (--preferred-sampling-params): sent logit_bias=null, ' \
           "top_k=-1 instead, as greedy decoding needs" in warnings


def test_a_preference_that_cannot_be_undone_is_refused_before_any_prompt(tiny_target, tmp_path):
    url, server = broken_server(str(tiny_target), b"{}", preferred_sampling_params={"dry_multiplier": 0.8})
    try:
        with pytest.raises(WorkerError, match=r"sets dry_multiplier=0.8, which may change greedy output and which "
                                              r"dflash-ops cannot undo"):
            run(["--server", url, "--prompts", str(prompt_file(tmp_path)), "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    assert server.bodies == [] and not (tmp_path / "c.json").exists()


def test_the_api_key_comes_from_the_environment_and_a_401_says_what_to_set(guarded, tmp_path, monkeypatch):
    argv = ["--server", guarded, "--prompts", str(prompt_file(tmp_path, n=1)), "--out", str(tmp_path / "c.json")]
    monkeypatch.delenv(completions.API_KEY_ENV, raising=False)
    with pytest.raises(WorkerError) as err:
        run(argv)
    assert "answered HTTP 401 Unauthorized: the server wants an API key: set [service] api_key_env" in err.value.msg
    assert f"this worker had no {completions.API_KEY_ENV}" in err.value.msg
    monkeypatch.setenv(completions.API_KEY_ENV, "not-the-key")
    with pytest.raises(WorkerError, match="the key given was refused") as err:
        run(argv)
    assert "not-the-key" not in err.value.msg
    monkeypatch.setenv(completions.API_KEY_ENV, KEY)
    result, events = run(argv)
    assert result["prompts"] == 1 and not any(KEY in json.dumps(e) for e in events)


SERVICE_UNAVAILABLE = json.dumps({"object": "error", "message": "The request queue is full.", "type": "503",
                                  "param": None, "code": 503}).encode()


def test_a_503_is_asked_once_more_and_a_second_keeps_the_others_cached(tiny_target, tmp_path):
    ok = json.dumps({"output_ids": [5, 6], "text": "ab", "meta_info": {"finish_reason": {"type": "length",
                                                                                     "length": 2}}}).encode()
    argv = ["--prompts", str(prompt_file(tmp_path, n=3)), "--retry-backoff", "0"]
    # p0 fine; p1 busy once, then fine; p2 busy twice: cached incomplete, p0 and p1 kept.
    url, server = broken_server(str(tiny_target), [(200, ok), (503, SERVICE_UNAVAILABLE), (200, ok),
                                                   (503, SERVICE_UNAVAILABLE), (503, SERVICE_UNAVAILABLE)])
    try:
        result, events = run(["--server", url, *argv, "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    assert len(server.bodies) == 5
    data = json.loads((tmp_path / "c.json").read_text())
    assert [r["complete"] for r in data["prompts"]] == [True, True, False] and result["incomplete"] == ["p2"]
    assert data["prompts"][2]["incomplete_reason"].startswith(
        "aborted by the server (HTTP 503): HTTP 503 twice: prompt 'p2': /generate answered HTTP 503: "
        "The request queue is full.")
    retries = [e["msg"] for e in events if e["type"] == "log" and "asking once more in 0 s" in e["msg"]]
    assert len(retries) == 2 and retries[0].startswith("p1: ")


def test_the_retry_backoff_is_bounded(monkeypatch):
    from remote.prompts import Prompt

    slept: list[float] = []
    calls = iter([completions.Busy("busy", "u"), {"completion_ids": [1]}])

    def ask():
        outcome = next(calls)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    monkeypatch.setattr(completions.time, "sleep", slept.append)
    answer = completions.ask_with_one_retry(ask, Prompt("p", 4), EventWriter(stream=io.StringIO()), 3600, "generate")
    assert answer == {"completion_ids": [1]} and slept == [completions.RETRY_BACKOFF_MAX_S]


def test_a_run_again_keeps_the_complete_prompts_and_asks_only_the_rest(tiny_target, tmp_path):
    """After a second 503 left p1 incomplete, running the worker again asks only p1: the complete
    prompts are kept from the cache (same prompt set, model and sampling), never asked twice."""
    ok = json.dumps({"output_ids": [5, 6], "text": "ab", "meta_info": {"finish_reason": {"type": "length",
                                                                                     "length": 2}}}).encode()
    argv = ["--prompts", str(prompt_file(tmp_path, n=2)), "--retry-backoff", "0", "--out", str(tmp_path / "c.json")]
    url, server = broken_server(str(tiny_target), [(200, ok), (503, SERVICE_UNAVAILABLE)])
    try:
        run(["--server", url, *argv])
    finally:
        server.shutdown()
        server.server_close()
    first = json.loads((tmp_path / "c.json").read_text())
    assert first["incomplete"] == ["p1"]
    again = json.dumps({"output_ids": [7, 2], "text": "c", "meta_info": {"finish_reason": {"type": "stop",
                                                                                       "matched": 2}}}).encode()
    url, server = broken_server(str(tiny_target), again)
    try:
        result, events = run(["--server", url, *argv])
    finally:
        server.shutdown()
        server.server_close()
    assert len(server.bodies) == 1 and server.bodies[0]["input_ids"] == first["prompts"][1]["prompt_ids"]
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["incomplete"] == [] == result["incomplete"]
    assert data["prompts"][0] == first["prompts"][0] and data["prompts"][1]["completion_ids"] == [7, 2]
    assert any(e["type"] == "log" and e["msg"] == "[1/2] p0: kept from the earlier cache (complete)" for e in events)
    # --force asks every prompt again.
    url, server = broken_server(str(tiny_target), again)
    try:
        run(["--server", url, *argv, "--force"])
    finally:
        server.shutdown()
        server.server_close()
    assert len(server.bodies) == 2


def test_preferred_params_are_read_from_server_info_where_model_info_has_none(tiny_target, tmp_path):
    """A release whose /model_info does not report them: /server_info's preferred_sampling_params
    (the launch argument, a JSON string) is read instead, and sent back as greedy needs."""
    ok = json.dumps({"output_ids": [5, 2], "text": "a", "meta_info": {"finish_reason": {"type": "stop",
                                                                                     "matched": 2}}}).encode()
    url, server = broken_server(str(tiny_target), ok,
                                server_info={"version": "0.5.0", "preferred_sampling_params": '{"ignore_eos": true}'})
    try:
        _, events = run(["--server", url, "--prompts", str(prompt_file(tmp_path, n=1)), "--out", str(tmp_path / "c.json")])
    finally:
        server.shutdown()
        server.server_close()
    assert server.bodies[0]["sampling_params"]["ignore_eos"] is False
    assert any("the server prefers ignore_eos=true" in e["msg"] for e in events if e["type"] == "log")


def test_the_worker_keeps_torch_out_and_tokenises_as_transformers_with_torch(tiny_target):
    """`python -m remote.completions` blocks torch (over half its start); the prompt ids it sends are
    those of the same tokenizer loaded beside torch (the shipped chat prompts)."""
    import subprocess
    import sys

    from remote.prompts import prompt_token_ids

    code = ("import json, sys; from remote import completions as c; from remote.prompts import load_prompts, "
            "prompt_token_ids; c.without_torch(); tok = c.load_tokenizer(sys.argv[1]); "
            "print(json.dumps({'ids': [prompt_token_ids(tok, p) for p in load_prompts().prompts], "
            "'torch': 'torch' in sys.modules and sys.modules['torch'] is not None}))")
    done = subprocess.run([sys.executable, "-c", code, str(tiny_target)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "PyTorch was not found" not in done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    with_torch = completions.load_tokenizer(str(tiny_target))
    assert "torch" in sys.modules and sys.modules["torch"] is not None  # this process: transformers with torch
    assert seen == {"torch": False, "ids": [prompt_token_ids(with_torch, p) for p in load_prompts().prompts]}
