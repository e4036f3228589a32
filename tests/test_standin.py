"""The rehearsal server: SGLang's endpoints over real HTTP, and its simulated GPU memory."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from remote.drill import simgpu
from tests.standin_helpers import free_port, start_standin, stop, wait_status


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def standin(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One standin for the HTTP tests, with a load delay so its loading phase can be seen."""
    tmp = tmp_path_factory.mktemp("standin")
    port = free_port()
    proc = start_standin(tiny_target, port, tmp / "log", "--load-delay", "1.5", "--metrics", "--served-name", "qwen-tiny")
    url = f"http://127.0.0.1:{port}"
    try:
        first = wait_status(url + "/model_info", 200, timeout=30)  # listening (answers before the model)
        loading_generate = post(url + "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
        health_seen = wait_status(url + "/health", 200, timeout=60)
        yield {"url": url, "proc": proc, "log": tmp / "log", "health_seen": health_seen,
               "loading_generate": loading_generate, "first": first}
    finally:
        stop(proc)


def test_health_is_503_while_loading_then_200(standin):
    assert 503 in standin["health_seen"] and standin["health_seen"][-1] == 200
    status, body = standin["loading_generate"]
    assert status == 503 and "loading" in body["error"]["message"]


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
    server = get_json(standin["url"] + "/get_server_info")
    assert server["pid"] == standin["proc"].pid and server["ready_at"] >= server["started_at"] + 1.5


def test_generate_is_greedy_and_matches_completions(standin, tiny_target: Path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_target)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Write fizzbuzz in Python."}],
                                        add_generation_prompt=True)["input_ids"]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
    status, first = post(standin["url"] + "/generate", body)
    assert status == 200
    _, again = post(standin["url"] + "/generate", body)
    assert first["output_ids"] == again["output_ids"] and 1 <= len(first["output_ids"]) <= 12
    meta = first["meta_info"]
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(first["output_ids"])
    assert meta["finish_reason"]["type"] in ("stop", "length")
    assert first["text"] == tokenizer.decode(first["output_ids"], skip_special_tokens=True)
    # The OpenAI surface runs the same greedy model: the same tokens come back as text.
    _, completion = post(standin["url"] + "/v1/completions", {"prompt": ids, "max_tokens": 12})
    assert completion["choices"][0]["text"] == first["text"]
    assert completion["usage"]["completion_tokens"] == meta["completion_tokens"]


def test_bad_generate_requests_get_400_with_the_reason(standin):
    assert post(standin["url"] + "/generate", {"input_ids": "abc"}) == (
        400, {"error": {"message": "input_ids: expected a non-empty list of token ids", "code": 400}})
    status, body = post(standin["url"] + "/generate", {"sampling_params": {}})
    assert status == 400 and "`input_ids`" in body["error"]["message"]


def test_metrics_count_generated_tokens(standin):
    post(standin["url"] + "/generate", {"text": "def f():", "sampling_params": {"max_new_tokens": 3}})
    with urllib.request.urlopen(standin["url"] + "/metrics", timeout=10) as response:
        text = response.read().decode()
    assert 'sglang:num_running_reqs{model_name="qwen-tiny"} 0.0' in text
    generated = next(line for line in text.splitlines() if line.startswith("sglang:generation_tokens_total"))
    assert float(generated.split()[-1]) >= 3


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
    proc = start_standin(tiny_target, free_port(), tmp_path / "log", "--gpu-file", str(sim), "--gpu-mib", "40000",
                         "--release-after", "1.5")
    try:
        _wait_used(sim, [40000, 40000])
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
    proc = start_standin(tiny_target, free_port(), tmp_path / "log", "--gpu-file", str(sim), "--gpu-mib", "47179",
                         "--hold-until-killed", "--stubborn-holder")
    holder = None
    try:
        _wait_used(sim, [47179, 47179])
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


def test_health_stays_503_until_the_warm_up_generation_is_done(tmp_path: Path, capsys, monkeypatch):
    """Real SGLang answers /health 200 only after its warm-up (a one-token generation) and logs "fired
    up" first. Here the warm-up is held open: /health and /generate must say 503 until it ends, and the
    first 200 comes after the log line (what made test_startup_log_has_sglangs_lines flaky)."""
    import argparse
    import threading
    from http.server import ThreadingHTTPServer

    from remote.drill import standin as standin_mod

    started, gate = threading.Event(), threading.Event()

    class SlowWarmUp:
        def __init__(self, path, dtype="float32"):
            self.lock, self.model, self.eos_id = threading.Lock(), object(), 0
            self.tokenizer = lambda text: {"input_ids": [1, 2]}

        def generate(self, input_ids, max_new_tokens):
            started.set()
            assert gate.wait(20)
            return [3], "length"

    monkeypatch.setattr(standin_mod, "Model", SlowWarmUp)
    (tmp_path / "config.json").write_text("{}")
    args = argparse.Namespace(model=str(tmp_path), port=0, host="127.0.0.1", load_delay=0.0, gpu_file=None,
                              served_name=None, metrics=False, flap_health=False, dtype="float32")
    state = standin_mod.Server(args)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), standin_mod.make_handler(state))
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        threading.Thread(target=state.load, daemon=True).start()
        assert started.wait(20)  # the weights are in; the warm-up generation runs
        assert wait_status(url + "/health", 503, timeout=5)[-1] == 503
        assert post(url + "/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}})[0] == 503
        before = capsys.readouterr().out
        assert "Load weight end" in before and "fired up" not in before
        gate.set()
        wait_status(url + "/health", 200, timeout=20)
        assert "The server is fired up and ready to roll!" in capsys.readouterr().out
    finally:
        gate.set()
        httpd.shutdown()
        httpd.server_close()
