"""Shared session fixtures: the tiny random hybrid Qwen3.5 target, built once per test session."""

from __future__ import annotations

import io
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from remote.drill.tinymodel import build_tiny_target
from remote.events import EventWriter


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3_5ForCausalLM (4 layers: 3 linear + 1 full, hidden 64) with a real tokenizer."""
    return build_tiny_target(tmp_path_factory.mktemp("models") / "tiny-target", num_layers=4)


def write_completions(target: Path, out: Path, n_prompts: int = 3, completion_len: int = 24,
                      seed: int = 0) -> Path:
    """A completions.json for `target` in the real format: prompt ids from the target's chat template
    over the shipped prompts (repeated when more are asked for), completion ids drawn at random from
    the vocabulary (extraction does not care what the server said, only which tokens)."""
    from transformers import AutoTokenizer

    from remote.prompts import load_prompts, prompt_token_ids

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt_set = load_prompts()
    rng = random.Random(seed)
    vocab = len(tokenizer)
    records = []
    for i in range(n_prompts):
        prompt = prompt_set.prompts[i % len(prompt_set.prompts)]
        ids = prompt_token_ids(tokenizer, prompt)
        completion = [rng.randrange(vocab) for _ in range(completion_len)]
        records.append({"id": f"{prompt.id}_{i}" if i >= len(prompt_set.prompts) else prompt.id,
                        "prompt_ids": ids, "completion_ids": completion,
                        "text": tokenizer.decode(completion), "finish_reason": "length", "endpoint": "generate"})
    data = {"format": "dflash-ops.completions/1", "prompt_set_sha256": prompt_set.sha256,
            "prompt_file": prompt_set.path, "model_path": str(target), "server_url": "http://127.0.0.1:0",
            "sampling": {"temperature": 0, "max_new_tokens": completion_len}, "prompts": records}
    out.write_text(json.dumps(data))
    return out


@pytest.fixture(scope="session")
def tiny_completions(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """completions.json with 3 prompts of the shipped set for the tiny target."""
    return write_completions(tiny_target, tmp_path_factory.mktemp("completions") / "completions.json")


# --- Fake fast-kernel packages -------------------------------------------------------------------
# fla and causal-conv1d need a CUDA GPU (Triton / a CUDA extension), which this machine lacks. These
# FAKE packages export the same names so transformers binds them exactly as it binds the real ones:
# enough to test binding detection, the policies and the host comparison. They must never run.

# Laid out as the real packages are (fla 0.6.0, causal-conv1d 1.7.0): transformers 5.15-5.24 looks the
# functions up as attributes under `fla.ops.gated_delta_rule` from the imported `fla` (which the real
# one imports through fla.layers), and the implementations live in submodules of their own.
_RAISE = "def {name}(*args, **kwargs):\n    raise RuntimeError('FAKE {package} called')\n"
_FAKE_FLA = {
    "fla/__init__.py": '__version__ = "0.0.0+fake"\n\nfrom fla import ops  # noqa: F401 (the real one: via fla.layers)\n',
    "fla/ops/__init__.py": "from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule  # noqa\n",
    "fla/ops/gated_delta_rule/__init__.py": ("from .chunk import chunk_gated_delta_rule  # noqa\n"
                                             "from .fused_recurrent import fused_recurrent_gated_delta_rule  # noqa\n"),
    "fla/ops/gated_delta_rule/chunk.py": _RAISE.format(name="chunk_gated_delta_rule", package="fla"),
    "fla/ops/gated_delta_rule/fused_recurrent.py": _RAISE.format(name="fused_recurrent_gated_delta_rule",
                                                                 package="fla"),
}
_FAKE_CC1D = {
    "causal_conv1d/__init__.py": ('__version__ = "0.0.0+fake"\n\n'
                                  "from causal_conv1d.causal_conv1d_interface import causal_conv1d_fn, "
                                  "causal_conv1d_update  # noqa\n"),
    "causal_conv1d/causal_conv1d_interface.py": (_RAISE.format(name="causal_conv1d_fn", package="causal_conv1d") + "\n\n"
                                                 + _RAISE.format(name="causal_conv1d_update", package="causal_conv1d")),
}


@pytest.fixture(scope="session")
def fake_kernel_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{"fla": dir, "causal_conv1d": dir}: each dir, put on PYTHONPATH, makes one FAKE package importable."""
    root = tmp_path_factory.mktemp("fake-kernels")
    paths = {}
    for name, files in (("fla", _FAKE_FLA), ("causal_conv1d", _FAKE_CC1D)):
        for rel, text in files.items():
            file = root / name / rel
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(text)
        paths[name] = root / name
    return paths


REPO = Path(__file__).resolve().parent.parent


def run_module(module: str, args: list[str], tmp: Path, extra_path: list[Path] = (), timeout: float = 120,
               env: dict[str, str] | None = None) -> tuple[int, list[dict]]:
    """Run `python -m <module> ARGS` as a worker process; return (exit code, its events)."""
    import os
    import subprocess
    import sys

    events_file = tmp / f"{module}.{len(list(tmp.glob('*.events.jsonl')))}.events.jsonl"
    pythonpath = os.pathsep.join([str(p) for p in extra_path] + [str(REPO)])
    full_env = {**os.environ, "DFLASH_EVENTS": str(events_file), "PYTHONPATH": pythonpath, **(env or {})}
    proc = subprocess.run([sys.executable, "-m", module, *args], env=full_env, cwd=REPO, timeout=timeout,
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    if proc.returncode != 0 and not any(e["type"] == "error" for e in events):
        raise AssertionError(f"{module} exited {proc.returncode} without an error event:\n{proc.stderr.decode()[-2000:]}")
    return proc.returncode, events


def run_in_process(main: Callable[..., Any], argv: list[str]) -> tuple[Any, list[dict]]:
    """A worker's `main(events, argv)` run in this process (no interpreter start-up); returns
    (its result, its events)."""
    buf = io.StringIO()
    result = main(EventWriter(stream=buf), argv)
    return result, [json.loads(line) for line in buf.getvalue().splitlines()]


def result_of(events: list[dict]) -> dict:
    """The `result` data of a finished worker's events (AssertionError with its error otherwise)."""
    for event in events:
        if event["type"] == "result":
            return event["data"]
    errors = [e["msg"] for e in events if e["type"] == "error"]
    raise AssertionError(f"no result event; errors: {errors}")


def error_of(events: list[dict]) -> str:
    """The message of the worker's `error` event."""
    errors = [e["msg"] for e in events if e["type"] == "error"]
    assert errors, f"expected an error event, got {[e['type'] for e in events]}"
    return errors[0]


@pytest.fixture(scope="session")
def fake_probes(tmp_path_factory: pytest.TempPathFactory, fake_kernel_paths, tiny_target) -> dict[str, dict]:
    """Real `remote.probe` runs on two simulated hosts: "inference" with (FAKE) fla + causal_conv1d,
    "training" with fla only -- the story's asymmetry."""
    tmp = tmp_path_factory.mktemp("probes")
    probes = {}
    for host, paths in (("inference", list(fake_kernel_paths.values())), ("training", [fake_kernel_paths["fla"]])):
        code, events = run_module("remote.probe", ["--model", str(tiny_target)], tmp, extra_path=paths)
        probes[host] = result_of(events)
    return probes
