"""Issue 40, section 1: SGLang 0.5.23's edges around a pause, on the rehearsal server over real HTTP
(docs/sglang.md, "Pause and release"): a release answered before its memory leaves the GPU
(`--release-frees-after`, slime PR #579), `/flush_cache` while the KV cache is released (sglang
#19029) and while requests run, `/health` and `/ready` through a pause, and a release with no pause
while a request runs (the idle assertion: the server dies). One server for the module (the last test
ends it), its health check shortened to HEALTH_S through SGLang's own SGLANG_HEALTH_CHECK_TIMEOUT."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.service.sglang_api import SglangClient
from tests.standin_helpers import running_standin
from tests.test_standin_memory_saver import (
    GPU_MIB,
    GRAPH_MIB,
    KEY,
    KV_MIB,
    InFlight,
    call,
    generate,
    requests_of,
    server_args,
    until,
    used_mib,
)

FREES_AFTER_S = 1.5  # --release-frees-after
HEALTH_S = 1.0  # SGLANG_HEALTH_CHECK_TIMEOUT, for the server and the console's client alike
FLUSHED = "Cache flushed.\n"


@pytest.fixture(scope="module")
def edges(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("edges")
    gpu_file = tmp / "gpus.json"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", str(HEALTH_S))
        with running_standin(tiny_target, tmp / "log", *server_args(
                gpu_file, "--enable-memory-saver", "--enable-weights-cpu-backup",
                "--release-frees-after", str(FREES_AFTER_S))) as url:
            until(lambda: gpu_file.exists() and used_mib(gpu_file) == GPU_MIB)
            yield {"url": url, "gpu_file": gpu_file, "log": tmp / "log", "reference": generate(url)["output_ids"]}


def flush(url: str, query: str = "", method: str = "GET") -> tuple[int, str]:
    request = urllib.request.Request(url + "/flush_cache" + query, b"" if method == "POST" else None,
                                     {"Authorization": f"Bearer {KEY}"}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_release_answers_before_its_memory_leaves_and_a_flush_while_released_is_harmless(edges) -> None:
    url, gpu_file = edges["url"], edges["gpu_file"]
    assert call(url, "/pause_generation", {"mode": "retract"}, KEY)[0] == 200
    sent = time.monotonic()
    assert call(url, "/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, KEY) == (200, None)
    assert used_mib(gpu_file) == GPU_MIB  # answered: the memory is still on the GPU
    until(lambda: used_mib(gpu_file) == GPU_MIB - KV_MIB - GRAPH_MIB)  # it leaves FREES_AFTER_S later
    assert time.monotonic() - sent >= FREES_AFTER_S - 0.2
    # sglang #19029: 0.5.23's flush reads no released tag and writes no released pool: answered, harmless
    status, text = flush(url, method="POST")
    assert status == 200 and text.startswith(FLUSHED), text
    assert "POST /flush_cache timeout=None" in edges["log"].read_text()
    assert call(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}, KEY) == (200, None)
    assert used_mib(gpu_file) == GPU_MIB  # a resume is seen at once
    assert call(url, "/continue_generation", {}, KEY)[0] == 200
    assert generate(url)["output_ids"] == edges["reference"]  # serving, the same greedy tokens


def test_a_flush_is_refused_while_a_request_runs_and_a_timeout_waits_for_idle(edges) -> None:
    url = edges["url"]
    running = InFlight(url)
    until(lambda: requests_of(url)["running"] == 1)
    assert flush(url) == (400, "Flush cache failed.\n")
    assert flush(url, "?timeout=-1")[0] == 400  # Query(0.0, ge=0.0)
    status, text = flush(url, "?timeout=60")  # deferred until the request has ended
    assert status == 200 and text.startswith(FLUSHED)
    assert running.result()["output_ids"] == edges["reference"]


async def test_health_is_503_for_the_whole_pause_and_ready_follows_the_source(edges) -> None:
    """A paused front holds /health's own one-token request: 503 after SGLANG_HEALTH_CHECK_TIMEOUT, and
    the server is UnHealthy, so /ready stays 503 after the continue until a /health check passes."""
    url = edges["url"]
    client = SglangClient(url, api_key=KEY)
    assert await client.ready() == 200
    assert call(url, "/pause_generation", {"mode": "retract"}, KEY)[0] == 200
    asked = time.monotonic()
    assert await client.health() == 503  # an answer (the server's verdict), not "unreachable"
    assert time.monotonic() - asked >= HEALTH_S - 0.1
    assert await client.ready() == 503
    assert call(url, "/continue_generation", {}, KEY)[0] == 200
    assert await client.ready() == 503  # UnHealthy: not ready until a health check passes
    assert await client.health() == 200
    assert await client.ready() == 200


def test_a_release_with_no_pause_while_a_request_runs_ends_the_server(edges) -> None:
    """Last: weight_updater.py's idle assertion, raised in the scheduler's loop: no answer, server gone."""
    url = edges["url"]
    running = InFlight(url)
    until(lambda: requests_of(url)["running"] == 1)
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        call(url, "/release_memory_occupation", {"tags": ["kv_cache"]}, KEY)
    running.thread.join(30)
    assert running.error is not None
    assert "AssertionError: release_memory_occupation should be called only when server is idle." in \
        edges["log"].read_text()
    until(lambda: used_mib(edges["gpu_file"]) == 0)
