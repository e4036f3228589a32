"""The rehearsal server against SGLang 0.5.23's behaviour (docs/sglang.md), over real HTTP to a real
process: start-up, the /generate contract and its errors, batches, --api-key, preferred sampling
params, the queue limit's 503 and aborts; and its simulated GPU memory."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from remote.drill import simgpu
from tests.standin_helpers import (
    GREEDY_PARAMS,
    free_port,
    running_standin,
    start_standin,
    stop,
    wait_status,
    watch_start,
)

KEY = "standin-test-key"


def call(url: str, body: dict | None = None, key: str | None = None, method: str | None = None) -> tuple[int, object]:
    """(status, decoded JSON or the raw text) of GET url, or POST `body`."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode()


def post(url: str, body: dict, key: str | None = None) -> tuple[int, object]:
    return call(url, body, key)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def standin(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One standin for the HTTP tests, watched from its first moment: loading, warming up, up."""
    tmp = tmp_path_factory.mktemp("standin")
    port = free_port()
    proc = start_standin(tiny_target, port, tmp / "log", "--load-delay", "1.5", "--metrics", "--served-name", "qwen-tiny")
    url = f"http://127.0.0.1:{port}"
    try:
        looks = watch_start(url, tmp / "log", proc)
        yield {"url": url, "proc": proc, "log": tmp / "log", "looks": looks}
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def guarded(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standin with --api-key, --preferred-sampling-params and --max-queued-requests 1."""
    preferred = json.dumps({"logit_bias": {"7": 100.0}, "repetition_penalty": 1.3})
    with running_standin(tiny_target, tmp_path_factory.mktemp("guarded") / "log", "--metrics", "--api-key", KEY,
                         "--max-queued-requests", "1", "--preferred-sampling-params", preferred) as url:
        yield url


def test_the_port_is_closed_while_the_weights_load_then_health_is_503_until_warmed_up(standin):
    looks = standin["looks"]
    assert any(look["loading"] and look["model_info"] is None for look in looks)  # closed while loading
    listening = [look for look in looks if look["model_info"] == 200]
    assert listening and all(look["weights_loaded"] for look in listening)
    warming = [look for look in listening if look["health"] == 503]
    assert warming and all(look["ready"] == 503 for look in warming)
    assert not any(look["health"] == 200 and not look["fired_up"] for look in looks)  # logged before the first 200
    assert looks[-1]["health"] == 200
    assert call(standin["url"] + "/ready") == (200, None)


def test_startup_log_has_sglangs_lines(standin):
    log = standin["log"].read_text()
    for line in ("Load weight begin", "Loading safetensors checkpoint shards: 100% Completed | 4/4",
                 "Load weight end. elapsed=", "The server is fired up and ready to roll!"):
        assert line in log
    assert log.index("Load weight end") < log.index("fired up")


def test_model_and_server_info(standin, tiny_target: Path):
    for path in ("/model_info", "/get_model_info"):
        info = get_json(standin["url"] + path)
        assert info["model_path"] == str(tiny_target) and info["served_model_name"] == "qwen-tiny"
        assert info["architectures"] == ["Qwen3_5ForCausalLM"] and info["is_generation"] is True
        assert info["preferred_sampling_params"] is None and info["tokenizer_path"] == str(tiny_target)
    for path in ("/server_info", "/get_server_info"):
        server = get_json(standin["url"] + path)
        assert server["version"] == "0.5.23-standin" and server["pid"] == standin["proc"].pid
        assert server["ready_at"] >= server["started_at"] + 1.5


GREEDY = GREEDY_PARAMS


def _chat_ids(tiny_target: Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)["input_ids"]


def test_generate_is_greedy_with_sglangs_meta_info_and_matches_completions(standin, tiny_target: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    ids = _chat_ids(tiny_target, "Write fizzbuzz in Python.")
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    status, first = post(standin["url"] + "/generate", body)
    assert status == 200
    _, again = post(standin["url"] + "/generate", {**body, "rid": "mine-1"})
    assert first["output_ids"] == again["output_ids"] and 1 <= len(first["output_ids"]) <= 12
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(first["output_ids"])
    assert {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"} <= meta.keys()
    assert again["meta_info"]["id"] == "mine-1" and again["meta_info"]["cached_tokens"] == len(ids) - 1
    reason = meta["finish_reason"]
    assert reason == {"type": "length", "length": 12} or (
        reason == {"type": "stop", "matched": first["output_ids"][-1]} and first["output_ids"][-1] == tokenizer.eos_token_id)
    assert first["text"] == tokenizer.decode(first["output_ids"], skip_special_tokens=True)
    # The OpenAI surface runs the same greedy model when asked for temperature 0 (its default is 1.0).
    _, completion = post(standin["url"] + "/v1/completions",
                         {"prompt": ids, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    choice = completion["choices"][0]
    assert choice["token_ids"] == first["output_ids"] and choice["text"] == first["text"]
    assert completion["usage"]["completion_tokens"] == meta["completion_tokens"]


def test_a_batch_is_answered_by_a_list_in_order(standin, tiny_target: Path):
    prompts = [_chat_ids(tiny_target, "Sort a list."), _chat_ids(tiny_target, "Reverse a string.")]
    singles = [post(standin["url"] + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 5,
                                                                                        "temperature": 0}})[1]
               for ids in prompts]
    status, batch = post(standin["url"] + "/generate", {"input_ids": prompts, "sampling_params": {"max_new_tokens": 5,
                                                                                               "temperature": 0}})
    assert status == 200 and isinstance(batch, list)
    assert [a["output_ids"] for a in batch] == [a["output_ids"] for a in singles]
    status, texts = post(standin["url"] + "/generate", {"text": ["def f():", "class A:"],
                                                      "sampling_params": [{"max_new_tokens": 2, "ignore_eos": True},
                                                                              {"max_new_tokens": 3, "ignore_eos": True}]})
    assert status == 200 and [a["meta_info"]["completion_tokens"] for a in texts] == [2, 3]


@pytest.mark.parametrize("body, status, shape", [
    ({"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2, "temprature": 0}}, 400, "contract"),
    ({"input_ids": [1, 2], "sampling_params": {"temperature": "cold"}}, 400, "contract"),
    ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, 400, "value"),
    ({"input_ids": [1, 2], "sampling_params": {"repetition_penalty": 3}}, 400, "value"),
    ({"sampling_params": {}}, 400, "value"),
    ({"input_ids": [[1, 2], [3, 4]], "rid": ["only-one"]}, 400, "value"),
    ({"input_ids": "abc"}, 400, "validation"),
])
def test_bad_generate_requests_get_sglangs_400s(standin, body, status, shape):
    got, answer = post(standin["url"] + "/generate", body)
    assert got == status
    if shape == "contract":  # api_types' serde text, as a string
        assert isinstance(answer["error"], str) and answer["error"].startswith(("unknown field `temprature`, expected one of `max_new_tokens`",
                                                                                'invalid type: string "cold", expected f64'))
    elif shape == "value":
        assert set(answer) == {"error"} and isinstance(answer["error"]["message"], str)
    else:
        assert answer["object"] == "error" and answer["code"] == 400 and answer["type"] == "Bad Request"


def test_unknown_routes_and_methods_are_fastapis_answers(standin):
    assert call(standin["url"] + "/nothing") == (404, {"detail": "Not Found"})
    assert call(standin["url"] + "/generate") == (405, {"detail": "Method Not Allowed"})


def test_metrics_count_generated_tokens_under_sglangs_labels(standin):
    post(standin["url"] + "/generate", {"text": "def f():", "sampling_params": {"max_new_tokens": 3}})
    with urllib.request.urlopen(standin["url"] + "/metrics", timeout=10) as response:
        text = response.read().decode()
    labels = '{model_name="qwen-tiny",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"}'
    assert f"sglang:num_running_reqs{labels} 0.0" in text
    generated = next(line for line in text.splitlines() if line.startswith("sglang:generation_tokens_total"))
    assert float(generated.split()[-1]) >= 3


def test_api_key_guards_all_but_health_ready_and_metrics(guarded):
    for path in ("/health", "/health_generate", "/ready", "/metrics"):
        assert call(guarded + path)[0] == 200, path
    for path in ("/model_info", "/get_model_info", "/server_info", "/v1/models"):
        assert call(guarded + path) == (401, {"error": "Unauthorized"}), path
        assert call(guarded + path, key="wrong") == (401, {"error": "Unauthorized"}), path
        assert call(guarded + path, key=KEY)[0] == 200, path
    assert post(guarded + "/generate", {"input_ids": [1, 2]}) == (401, {"error": "Unauthorized"})
    assert call(guarded + "/server_info", key=KEY)[1]["api_key"] == "<redacted>"


def test_preferred_sampling_params_lie_under_the_requests(guarded):
    info = call(guarded + "/model_info", key=KEY)[1]
    assert info["preferred_sampling_params"] == {"logit_bias": {"7": 100.0}, "repetition_penalty": 1.3}
    ids = [11, 12, 13, 14]
    _, bare = post(guarded + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
                   key=KEY)
    assert bare["output_ids"] == [7, 7, 7, 7]  # the preferred bias wins where the request says nothing
    explicit = {**GREEDY, "max_new_tokens": 4, "logit_bias": None}
    _, greedy = post(guarded + "/generate", {"input_ids": ids, "sampling_params": explicit}, key=KEY)
    assert greedy["output_ids"] != [7, 7, 7, 7]


def _metric(url: str, name: str) -> float:
    text = call(url + "/metrics")[1]
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + "{")))


def _wait_metric(url: str, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while _metric(url, name) != value:
        assert time.monotonic() < deadline, f"{name} never read {value}"
        time.sleep(0.05)


def test_a_full_queue_is_a_503_abort_and_aborted_requests_end_as_aborts(guarded):
    """--max-queued-requests 1: with one running and one waiting, the next is refused with SGLang's
    503; /abort_request then ends the running one with what it has and the waiting one with nothing."""
    answers: dict[str, tuple[int, object]] = {}
    long = {**GREEDY, "max_new_tokens": 100000, "ignore_eos": True, "logit_bias": None}

    def ask(name: str) -> None:
        answers[name] = post(guarded + "/generate", {"input_ids": [5, 6], "sampling_params": long, "rid": name}, key=KEY)

    running = threading.Thread(target=ask, args=("running",))
    running.start()
    _wait_metric(guarded, "sglang:num_running_reqs", 1)
    waiting = threading.Thread(target=ask, args=("waiting",))
    waiting.start()
    _wait_metric(guarded, "sglang:num_queue_reqs", 1)
    status, body = post(guarded + "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}, key=KEY)
    assert (status, body) == (503, {"object": "error", "message": "The request queue is full.", "type": "503",
                                    "param": None, "code": 503})
    assert call(guarded + "/abort_request", {"abort_all": True}, key=KEY)[0] == 200
    running.join(60)
    waiting.join(60)
    (s1, first), (s2, second) = answers["running"], answers["waiting"]
    assert s1 == s2 == 200
    assert first["meta_info"]["finish_reason"]["type"] == "abort" and first["output_ids"]
    assert second["meta_info"]["finish_reason"] == {"type": "abort", "message": "Aborted", "status_code": None,
                                                    "err_type": None}
    assert second["output_ids"] == [] and second["meta_info"]["id"] == "waiting"


def _used(sim: Path) -> list[int]:
    return [g["used_mib"] for g in simgpu.live_view(simgpu.read(sim))["gpus"]]


def _wait_used(sim: Path, want: list[int], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sim.exists() and _used(sim) == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"simulated GPUs read {_used(sim) if sim.exists() else 'no file'}, expected {want}")


def test_gpu_memory_is_held_while_up_and_released_some_seconds_after_a_stop(tiny_target: Path, tmp_path: Path):
    sim = tmp_path / "gpu.json"
    port = free_port()
    proc = start_standin(tiny_target, port, tmp_path / "log", "--gpu-file", str(sim), "--gpu-mib", "40000",
                         "--release-after", "1.5")
    try:
        _wait_used(sim, [40000, 40000])
        wait_status(f"http://127.0.0.1:{port}/health", 200)  # up: serving, not still loading its weights
        (holder,) = {p["pid"] for p in simgpu.read(sim)["processes"]}
        assert holder != proc.pid  # a child holds it, as SGLang's scheduler process does
        proc.terminate()
        assert proc.wait(10) == 0
        stopped = time.monotonic()
        assert _used(sim) == [40000, 40000]  # the stop returned; the memory is not free yet
        _wait_used(sim, [0, 0])
        assert time.monotonic() - stopped >= 1.0
    finally:
        stop(proc)


def test_hold_until_killed_keeps_memory_until_the_holder_is_killed(tiny_target: Path, tmp_path: Path):
    sim = tmp_path / "gpu.json"
    port = free_port()
    proc = start_standin(tiny_target, port, tmp_path / "log", "--gpu-file", str(sim), "--gpu-mib", "47179",
                         "--hold-until-killed", "--stubborn-holder")
    holder = None
    try:
        _wait_used(sim, [47179, 47179])
        wait_status(f"http://127.0.0.1:{port}/health", 200)  # up: serving, not still loading its weights
        holder = simgpu.read(sim)["processes"][0]["pid"]
        proc.terminate()
        proc.wait(10)
        os.kill(holder, signal.SIGTERM)  # stubborn: ignored, like the story's leftover
        time.sleep(2.0)
        assert _used(sim) == [47179, 47179]
        os.kill(holder, signal.SIGKILL)
        _wait_used(sim, [0, 0], timeout=5)
    finally:
        stop(proc)
        if holder and simgpu.pid_alive(holder):
            os.kill(holder, signal.SIGKILL)


def test_a_model_directory_without_config_is_a_clear_error(tmp_path: Path):
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "remote.drill.standin", "--model", str(tmp_path), "--port", "0"],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=30)
    assert done.returncode == 1
    assert done.stderr.strip() == f"standin: --model {tmp_path}: no config.json there (build it with remote.drill.tinymodel)"
