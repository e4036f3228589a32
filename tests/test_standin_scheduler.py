"""The rehearsal server runs every forward pass on one scheduler thread, as SGLang's scheduler does.

CUDA libraries keep state per thread (cuBLAS a handle and a workspace each): forwards run on the
HTTP front's worker threads grew the GPU server's memory with every thread a load woke, and the
crowded card's staged extraction ran out of room on the H100 (docs/gpu-results). On the CPU the
memory cannot be seen; which thread runs each forward can, and it is what decides the memory."""

from __future__ import annotations

import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.standin_helpers import standin_in_process


@pytest.fixture
def front(tiny_target: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, list[str]]]:
    """The front and the model worker in this process, each forward's thread recorded."""
    from remote.drill.standin import server as server_module

    threads: list[str] = []
    real_generate, real_tokens = server_module.generate, server_module.generate_tokens

    def generate(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_generate(*args)

    def generate_tokens(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return real_tokens(*args)

    monkeypatch.setattr(server_module, "generate", generate)
    monkeypatch.setattr(server_module, "generate_tokens", generate_tokens)
    with standin_in_process(tiny_target) as (url, server):
        server.up()
        yield url, threads


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return answer.status, json.loads(answer.read())


def test_concurrent_requests_and_health_checks_all_run_on_the_one_scheduler_thread(front) -> None:
    url, threads = front
    answers: list[tuple[int, dict]] = []

    def one(i: int) -> None:
        answers.append(post(url + "/generate", {"text": f"prompt {i}", "sampling_params": {
            "temperature": 0, "max_new_tokens": 4}}))

    clients = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for client in clients:
        client.start()
    for client in clients:
        client.join(60)
    with urllib.request.urlopen(url + "/health_generate", timeout=60) as answer:
        assert answer.status == 200
    assert [status for status, _ in answers] == [200] * 8
    assert all(body["meta_info"]["completion_tokens"] == 4 for _, body in answers)
    # eight requests from eight front threads, and the health check's own one-token generation
    assert len(threads) >= 9 and len(set(threads)) == 1 and threads[0].startswith("scheduler"), threads
