"""On the GPU machine: SGLang's memory saver as the rehearsal server runs it on `--device cuda`
(torch_memory_saver), with NVML watching. The KV and graph pools leave the GPU on a release and come
back on a resume; the weights with a CPU backup come back as they were (the same greedy tokens),
without one they are lost; and torch_memory_saver's own answers to the repeated calls the rehearsal
server copies (a second pause or resume of a region ends the process, as does touching released
memory). Its first run is docs/gpu-results/memory-saver-gpu.txt (the same steps as a script).

    python -m pytest tests/gpu/test_memory_saver_gpu.py -v
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

pytest.importorskip("torch_memory_saver", reason="the 'gpu' extra (../shared/device/setup-device.sh installs it)")

from remote.drill.tinymodel import build_tiny_target  # noqa: E402
from tests.standin_helpers import free_port  # noqa: E402

KV_MIB, GRAPH_MIB = 8192, 512
PROMPT = [11, 22, 33, 44]


def used_mib() -> int:
    import pynvml

    pynvml.nvmlInit()
    return pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used >> 20


def post(url: str, path: str, body: dict) -> object:
    request = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read() or b"null")


def greedy(url: str) -> list[int]:
    answer = post(url, "/generate", {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                                               "ignore_eos": True}})
    assert isinstance(answer, dict)
    return answer["output_ids"]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("models") / "tiny", num_layers=4)


@contextlib.contextmanager
def serve(target: Path, log: Path, *extra: str) -> Iterator[str]:
    """The rehearsal server on the GPU with the memory saver, up (/health 200), as its URL."""
    port = free_port()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "remote.drill.standin", "--model", str(target), "--port", str(port),
                                 "--device", "cuda", "--dtype", "bfloat16", "--skip-server-warmup",
                                 "--enable-memory-saver", "--kv-cache-mib", str(KV_MIB), "--cuda-graph-mib",
                                 str(GRAPH_MIB), *extra], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server never answered /health"
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.parametrize("backup", [True, False], ids=["weights-cpu-backup", "no-backup"])
def test_release_gives_real_memory_back_and_resume_takes_it_again(target: Path, tmp_path: Path, backup: bool) -> None:
    with serve(target, tmp_path / "log", *(["--enable-weights-cpu-backup"] if backup else [])) as url:
        before, held = greedy(url), used_mib()
        post(url, "/pause_generation", {"mode": "retract"})
        post(url, "/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        released = used_mib()
        assert held - released >= KV_MIB + GRAPH_MIB - 64  # NVML sees the pools leave
        post(url, "/release_memory_occupation", {"tags": ["weights"]})
        post(url, "/resume_memory_occupation", {"tags": ["weights"]})
        post(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
        assert used_mib() >= held - 64  # and come back
        post(url, "/continue_generation", {})
        after = greedy(url)
        assert (after == before) is backup  # without a backup the weights come back as fresh memory


PROBE = textwrap.dedent('''
    import sys, torch
    from torch_memory_saver import torch_memory_saver as saver
    saver.hook_mode = "torch"
    with saver.region(tag="kv_cache"):
        kv = torch.ones(256 << 20, dtype=torch.uint8, device="cuda")
    saver.pause("kv_cache")
    if sys.argv[1] == "pause":
        saver.pause("kv_cache")
    elif sys.argv[1] == "resume":
        saver.resume("kv_cache"); saver.resume("kv_cache")
    else:
        kv.add_(1); torch.cuda.synchronize()
    print("survived", flush=True)
''')


@pytest.mark.parametrize("call,message", [("pause", "Cannot pause allocation that is not active"),
                                          ("resume", "Cannot resume allocation that is not paused"),
                                          ("touch", "illegal memory access")])
def test_torch_memory_saver_ends_the_process_on_a_repeated_call(call: str, message: str) -> None:
    """What the rehearsal server's die() copies for a second release, a second resume, a forward pass
    over released memory."""
    done = subprocess.run([sys.executable, "-c", PROBE, call], capture_output=True, text=True, timeout=180)
    assert done.returncode != 0 and "survived" not in done.stdout
    assert message in done.stdout + done.stderr
