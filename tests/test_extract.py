"""Hidden-state extraction (remote.extract) on the tiny random Qwen3.5 target, on CPU."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from remote import extract
from remote.artifacts import read_manifest
from remote.events import EventWriter, WorkerError
from remote.layers import default_target_layers, find_decoder_layers, select_layers
from tests.fixtures_models import REPO, run_in_process, write_completions


def run_inline(argv: list[str]) -> tuple[dict, list[dict]]:
    """extract.main in this process; returns (result, events)."""
    return run_in_process(extract.main, argv)


def load(path: Path) -> tuple[dict, dict]:
    with safe_open(str(path), "pt") as fh:
        return {k: fh.get_tensor(k) for k in fh.keys()}, fh.metadata()  # noqa: SIM118 - not iterable


@pytest.fixture(scope="module")
def extracted(tiny_target, tiny_completions, tmp_path_factory):
    out = tmp_path_factory.mktemp("extract") / "out"
    result, events = run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions),
                                 "--out", str(out), "--layers", "0,1,2", "--kernels", "torch"])
    return out, result, events


def test_hooks_equal_hf_hidden_states(extracted, tiny_target):
    """Layer k = hidden_states[k+1] for every k, the last layer included (HF normalises its last
    entry, and that normed value is what the drafters were trained on)."""
    from transformers import AutoModelForCausalLM

    out, _, _ = extracted
    manifest = read_manifest(out, verify=True)
    assert manifest["layers"] == [0, 1, 2, 3]
    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16).eval()
    for entry in manifest["prompts"]:
        tensors, meta = load(out / entry["file"])
        ids = tensors["input_ids"]
        with torch.no_grad():
            ref = model(ids[None], output_hidden_states=True, use_cache=False)
        hidden = tensors["hidden"]
        assert hidden.dtype == torch.bfloat16 and hidden.shape == (len(ids), 4, 64)
        for i, k in enumerate([0, 1, 2, 3]):
            assert torch.equal(hidden[:, i], ref.hidden_states[k + 1][0]), f"layer {k}"
        # Off by one would be caught: layer 1 is not hidden_states[1].
        assert not torch.equal(hidden[:, 1], ref.hidden_states[1][0])
        logits = ref.logits[0].float()
        assert torch.equal(tensors["g"], logits.argmax(-1))
        top = torch.log_softmax(logits, -1).topk(8, -1)
        assert torch.equal(tensors["topk_ids"], top.indices)
        assert torch.allclose(tensors["topk_logprobs"], top.values, atol=1e-5)
        assert tensors["topk_logprobs"].dtype == torch.float32 and tensors["g"].dtype == torch.int64
        assert meta == {"prompt_id": entry["id"], "prompt_len": str(entry["prompt_len"]), "layers": "[0, 1, 2, 3]"}


def test_input_ids_are_prompt_plus_completion_and_manifest_says_what_ran(extracted, tiny_completions):
    out, result, _ = extracted
    completions = json.loads(tiny_completions.read_text())
    manifest = read_manifest(out)
    assert [p["id"] for p in manifest["prompts"]] == [p["id"] for p in completions["prompts"]]
    for entry, source in zip(manifest["prompts"], completions["prompts"], strict=True):
        tensors, _ = load(out / entry["file"])
        assert tensors["input_ids"].tolist() == source["prompt_ids"] + source["completion_ids"]
        # What the staged worker pins ahead of the window is what each prompt's copies take.
        copied = [tensors[k].numel() * tensors[k].element_size() for k in ("hidden", "g", "topk_ids", "topk_logprobs")]
        assert copied == extract.host_bytes(len(tensors["input_ids"]), 4, 64)
        assert entry["prompt_len"] == len(source["prompt_ids"])
    assert manifest["hidden_size"] == 64 and manifest["dtype"] == "bfloat16"
    assert manifest["kernel_policy"] == "torch" and manifest["kernels_fast"] is False
    assert manifest["topk_pass"] == "torch"  # no Triton where the fast kernels do not run
    assert manifest["kernel_calls"]["torch_chunk_gated_delta_rule"] == 3 * len(manifest["prompts"])
    assert manifest["versions"]["transformers"] and manifest["device_map"] == {"": "cpu"}
    assert result["kernels"] == manifest["kernels"]


def test_gpu_released_comes_before_the_manifest(extracted):
    _, _, events = extracted
    kinds = [(e["type"], e.get("kind")) for e in events]
    released = kinds.index(("gpu_released", None))
    assert released < kinds.index(("artifact", "extract"))
    window = events[released]
    assert {"copy_s", "forward_s", "release_s", "window_s", "tokens"} <= set(window)
    prompts = [e for e in events if e["type"] == "progress" and e["key"] == "prompts"]
    assert prompts[-1]["done"] == prompts[-1]["total"] == 3
    weights = [e for e in events if e["type"] == "progress" and e["key"] == "weights"]
    assert weights[-1]["done"] == weights[-1]["total"] > 50
    weight_bytes = [e for e in events if e["type"] == "progress" and e["key"] == "weights_bytes"]
    assert weight_bytes[-1]["done"] == weight_bytes[-1]["total"] == window["bytes"] > 500_000


def test_layers_beyond_the_model_are_a_clear_error(tiny_target, tiny_completions, tmp_path):
    with pytest.raises(WorkerError, match=r"layer 7 \(from --layers\) is beyond the model: it has 4 decoder layers"):
        run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions),
                    "--out", str(tmp_path / "o"), "--layers", "1,7"])
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(json.dumps({"dflash_config": {"target_layer_ids": [1, 4]}}))
    with pytest.raises(WorkerError, match=r"layer 4 \(from drafter .*drafter\) is beyond the model"):
        select_layers(4, [], [drafter])


def test_missing_model_and_bad_completions_are_clear_errors(tiny_target, tiny_completions, tmp_path):
    with pytest.raises(WorkerError, match="model path does not exist"):
        run_inline(["--model", str(tmp_path / "nope"), "--completions", str(tiny_completions), "--out", str(tmp_path)])
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"format": "something-else", "prompts": []}))
    with pytest.raises(WorkerError, match="expected format 'dflash-ops.completions/1', found 'something-else'"):
        run_inline(["--model", str(tiny_target), "--completions", str(bad), "--out", str(tmp_path / "o")])
    data = json.loads(tiny_completions.read_text())
    data["prompts"][2]["id"] = data["prompts"][0]["id"]
    bad.write_text(json.dumps(data))
    with pytest.raises(WorkerError, match=r"prompts\[2\].id must be a unique name .* found 'fizzbuzz'"):
        run_inline(["--model", str(tiny_target), "--completions", str(bad), "--out", str(tmp_path / "o")])
    data = json.loads(tiny_completions.read_text())
    data["prompts"][1]["completion_ids"] = [1, "two"]
    bad.write_text(json.dumps(data))
    with pytest.raises(WorkerError, match=r"prompts\[1\].completion_ids must be a list of token ids"):
        run_inline(["--model", str(tiny_target), "--completions", str(bad), "--out", str(tmp_path / "o")])


def test_drafter_layers_and_default_ids(tmp_path):
    drafter = tmp_path / "d"
    drafter.mkdir()
    # target_layer_ids is required (z-lab/dflash PR #157): the formula's answer is only offered as a guess.
    (drafter / "config.json").write_text(json.dumps({"num_target_layers": 64, "num_hidden_layers": 5}))
    with pytest.raises(WorkerError, match=r"target_layer_ids' is missing and required .* guess \[1, 16, 31, 46, 61\]"):
        select_layers(64, [], [drafter])
    assert select_layers(64, [], [drafter], {"d": [1, 16, 31, 46, 61]}) == [1, 16, 31, 46, 61, 63]
    assert default_target_layers(64, 1) == [32]
    # A top-level target_layer_ids is read as the evaluator's loader reads it.
    (drafter / "config.json").write_text(json.dumps({"target_layer_ids": [2, 7], "num_target_layers": 64}))
    assert select_layers(64, [], [drafter]) == [2, 7, 63]
    (drafter / "config.json").write_text("{not json")
    with pytest.raises(WorkerError, match="not valid JSON"):
        select_layers(64, [], [drafter])


@settings(max_examples=50, deadline=None)
@given(num_layers=st.integers(1, 80), data=st.data())
def test_select_layers_is_sorted_union_with_last(num_layers, data):
    explicit = data.draw(st.lists(st.integers(0, num_layers - 1), max_size=8))
    layers = select_layers(num_layers, explicit, [])
    assert layers == sorted(set(explicit) | {num_layers - 1})


def test_decoder_layers_found_in_multimodal_tree():
    """Qwen3_5ForConditionalGeneration keeps them at model.language_model.layers, beside vision blocks."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from remote.drill.tinymodel import tiny_config

    text = tiny_config(num_layers=4).to_dict()
    vision = {"depth": 6, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision))
    path, layers = find_decoder_layers(model)
    assert path == "model.language_model.layers" and len(layers) == 4


def test_warm_up_model_builds_from_text_and_multimodal_configs(tiny_target):
    config = json.loads((tiny_target / "config.json").read_text())
    buf = io.StringIO()
    assert extract.warm_kernels(config, "cpu", EventWriter(stream=buf)) > 0
    assert "kernels warmed with a 2-layer model" in buf.getvalue()
    nested = {"model_type": "qwen3_5", "text_config": {**config, "model_type": "qwen3_5_text"}}
    assert extract.warm_kernels(nested, "cpu", EventWriter(stream=io.StringIO())) > 0


def test_killed_worker_leaves_nothing_that_looks_complete(tiny_target, tmp_path):
    completions = write_completions(tiny_target, tmp_path / "long.json", n_prompts=40, completion_len=700)
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # a previous run's: a killed re-run leaves it as it was
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_EVENTS": str(tmp_path / "ev.jsonl")}
    proc = subprocess.Popen([sys.executable, "-m", "remote.extract", "--model", str(tiny_target),
                             "--completions", str(completions), "--out", str(out), "--layers", "0,1,2"],
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".out.attempt-*/*.safetensors")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # The attempt writes beside --out, in its own directory, moved into place only when complete.
    finals = list(tmp_path.glob(".out.attempt-*/*.safetensors"))
    assert finals, "no prompt file appeared before the kill"
    assert (out / "manifest.json").read_text() == "{}" and not list(out.glob("*.safetensors"))
    (attempt,) = {file.parent for file in finals}
    with pytest.raises(ValueError, match="incomplete"):
        read_manifest(attempt)
    for file in finals:  # every file under a final name is complete
        tensors, meta = load(file)
        assert tensors["hidden"].shape[0] == tensors["input_ids"].shape[0] == int(meta["prompt_len"]) + 700
    assert len(finals) < 40


def test_staged_mode_waits_for_go_and_reports_the_window(tiny_target, tiny_completions, tmp_path, extracted):
    out, go = tmp_path / "staged", tmp_path / "go"
    buf = io.StringIO()
    argv = ["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(out),
            "--layers", "0,1,2", "--staged", "--go-file", str(go)]
    worker = threading.Thread(target=extract.main, args=(EventWriter(stream=buf), argv), daemon=True)
    worker.start()

    def events() -> list[dict]:
        return [json.loads(line) for line in buf.getvalue().splitlines()]

    deadline = time.time() + 60
    while not any(e["type"] == "staged" for e in events()) and time.time() < deadline:
        assert worker.is_alive()
        time.sleep(0.02)
    time.sleep(0.3)
    seen = events()
    assert not any(e["type"] == "progress" and e["key"] == "prompts" for e in seen), "ran before the go signal"
    assert seen[-1]["type"] == "log" and "waiting for the go signal" in seen[-1]["msg"]
    staged = next(e for e in seen if e["type"] == "staged")
    assert staged["tensors"] > 50 and staged["bytes"] > 0 and staged["go_file"] == str(go)
    # The forward rate for the window's forecast, measured before the stop, with what it is based on.
    assert staged["forward_tokens_per_s"] > 0 and "at stage warm-up" in staged["forward_rate_basis"]
    assert staged["tokens"] == staged["tokens_to_extract"] == extract.prompt_tokens(
        json.loads(tiny_completions.read_text())["prompts"])
    go.touch()
    worker.join(timeout=60)
    assert not worker.is_alive() and (out / "manifest.json").is_file()
    released = next(e for e in events() if e["type"] == "gpu_released")
    assert released["staged"] is True and released["waited_s"] >= 0.3
    assert released["window_s"] >= released["copy_s"] + released["forward_s"] - 0.01
    # Staging changes nothing in the numbers.
    cold_out = extracted[0]
    for file in sorted(cold_out.glob("*.safetensors")):
        assert torch.equal(load(file)[0]["hidden"], load(out / file.name)[0]["hidden"])


def test_device_and_memory_options_are_checked(tiny_target, tiny_completions, tmp_path):
    stale = tmp_path / "go"
    stale.touch()
    with pytest.raises(WorkerError, match="the go file .* already exists"):
        run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(tmp_path / "o"),
                    "--staged", "--go-file", str(stale)])
    with pytest.raises(WorkerError, match="--device cuda but torch sees no CUDA GPU"):
        run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(tmp_path / "o"),
                    "--device", "cuda"])
    with pytest.raises(WorkerError, match="--max-memory entries look like"):
        run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(tmp_path / "o"),
                    "--max-memory", "0:40GiB"])


def test_place_weights_keeps_ties_and_reports_every_tensor():
    from transformers import Qwen3_5ForCausalLM

    from remote.drill.tinymodel import tiny_config
    from remote.weights import model_bytes, place_weights

    config = tiny_config()
    config.tie_word_embeddings = True
    model = Qwen3_5ForCausalLM(config).to(torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    count, size = model_bytes(model)
    seen = []
    facts = place_weights(model, {"": "cpu"}, on_tensor=lambda n, b: seen.append((n, b)))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert facts == {"tensors": count, "bytes": size} and seen[-1] == (count, size)
    assert [n for n, _ in seen] == list(range(1, count + 1))


@given(st.lists(st.sampled_from(["model", "model.layers", "model.layers.1", "model.layers.10", "lm_head"]),
                unique=True, min_size=1), st.sampled_from(["model.layers.1.mlp.weight", "model.layers.10.x",
                                                           "model.norm.weight", "lm_head.weight"]))
def test_device_for_takes_the_longest_matching_prefix(prefixes, name):
    from remote.weights import device_for

    device_map = {p: i for i, p in enumerate(prefixes)}
    matches = [p for p in prefixes if name == p or name.startswith(p + ".")]
    if not matches:
        with pytest.raises(KeyError):
            device_for(name, device_map)
    else:
        assert device_for(name, device_map) == device_map[max(matches, key=len)]


def test_files_are_synced_after_gpu_released_and_before_the_manifest(tiny_target, tiny_completions, tmp_path,
                                                                     monkeypatch):
    """The fsync of each prompt file waits until the GPU is free (it is disk time, not window time):
    the writer thread never waits for the disk, which would back up the forward loop; but every
    file is durable before the manifest that marks the directory complete."""
    from remote import artifacts

    order: list[str] = []
    real_fsync = os.fsync

    writer_fsyncs: list[str] = []

    def recording_fsync(fd: int) -> None:
        name = Path(os.readlink(f"/proc/self/fd/{fd}")).name
        order.append("fsync:" + name)
        if threading.current_thread().name == "extract-writer":
            writer_fsyncs.append(name)
        real_fsync(fd)

    real_emit = EventWriter.emit

    def recording_emit(self, type_, **fields):
        if type_ == "gpu_released":
            order.append("gpu_released")
        return real_emit(self, type_, **fields)

    monkeypatch.setattr(artifacts.os, "fsync", recording_fsync)
    monkeypatch.setattr(EventWriter, "emit", recording_emit)
    out = tmp_path / "out"
    run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(out),
                "--layers", "1", "--kernels", "torch"])
    prompt_files = {e["file"] for e in read_manifest(out)["prompts"]}
    assert writer_fsyncs == []
    released = order.index("gpu_released")
    synced = [name.removeprefix("fsync:") for name in order if name.startswith("fsync:")]
    assert prompt_files <= set(synced), order
    assert all(order.index(f"fsync:{name}") > released for name in prompt_files), order
    # The manifest is written (through a temporary file, then renamed) after the last prompt file
    # and the directory itself are synced.
    last_prompt = max(order.index(f"fsync:{name}") for name in prompt_files)
    manifest_sync = next(i for i, name in enumerate(order) if name.startswith("fsync:.manifest.json"))
    attempt = extract.ATTEMPT.format(name=out.name, pid=os.getpid())  # moved into `out` once complete
    assert order.index(f"fsync:{attempt}") < manifest_sync and last_prompt < manifest_sync
    assert order[-1] == f"fsync:{out.name}"  # the manifest's rename into `out`, last


def test_release_drops_every_weight_without_the_garbage_collector(tiny_target):
    """What `gpu_released` promises: no tensor of the model keeps its storage, tied weights and
    buffers (rotary frequencies) included, even while the model object is still referenced."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16).eval()
    tensors = list(model.parameters()) + list(model.buffers())
    assert sum(t.numel() for t in tensors) > 100_000
    extract.release_gpu(model)
    assert [t.numel() for t in tensors] == [0] * len(tensors)
    assert all(t.numel() == 0 for t in model.state_dict().values())


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(1, 5000), min_size=1, max_size=30))
def test_host_buffer_reservation_covers_every_size_class(tokens):
    """The classes reserved before the go are those the window's copies ask for (torch's pinned
    allocator rounds up to a power of two), each as many times as prompts need, capped."""
    import collections

    sizes = [n for t in tokens for n in extract.host_bytes(t, 3, 64)]
    wanted = collections.Counter(1 << (n - 1).bit_length() for n in sizes)
    reserved: list[int] = []
    real_empty = torch.empty

    def recording_empty(size, **kw):
        reserved.append(size)
        return real_empty(size, dtype=kw["dtype"])  # no GPU here: unpinned, same sizes

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch, "empty", recording_empty)
        total = extract.reserve_host_buffers(sizes, per_class=4)
    assert collections.Counter(reserved) == {size: min(n, 4) for size, n in wanted.items()}
    assert total == sum(reserved)
    assert extract.host_bytes(1500, 6, 2048)[0] == 1500 * 6 * 2048 * 2  # bf16 hidden


def test_release_skips_offloaded_and_meta_weights(tiny_target):
    """`--device-map auto` with cpu entries: accelerate's `dispatch_model` leaves the offloaded layers'
    parameters on the meta device (their values live in its hooks' weights map, in host RAM), and
    `tensor.data = <cpu tensor>` on a meta parameter raises "incompatible tensor type" (the GPU
    regression of test_split_gpu_and_cpu_matches_one_gpu). The worker's own sequence, on CPU: place,
    dispatch with offload, forward, release."""
    from accelerate import dispatch_model
    from transformers import AutoModelForCausalLM

    from remote.weights import place_weights

    model = AutoModelForCausalLM.from_pretrained(tiny_target, dtype=torch.bfloat16, device_map="cpu").eval()
    _, layers = find_decoder_layers(model)
    main = torch.device("cpu")  # accelerate offloads the "cpu" entries whenever the main device is not "cpu"
    device_map = {"model.embed_tokens": main, "model.rotary_emb": main, "model.layers.0": main,
                  "model.layers.1": "cpu", "model.layers.2": "cpu", "model.layers.3": "cpu",
                  "model.norm": main, "lm_head": main}
    place_weights(model, device_map)
    model = dispatch_model(model, device_map=device_map, main_device=main)
    assert {p.device.type for p in layers[2].parameters()} == {"meta"}
    before = extract.forward_one(model, layers, [0, 2], list(range(1, 30))).wait()["hidden"]
    extract.release_gpu(model)
    kept = [t for t in list(model.parameters()) + list(model.buffers()) if t.device.type != "meta"]
    assert kept and all(t.numel() == 0 for t in kept)
    assert before.shape == (29, 2, 64)


def _digests(directory: Path) -> dict[str, str]:
    from remote.artifacts import sha256_file

    return {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file()}


def test_a_failed_rerun_leaves_the_good_extraction_complete(tiny_target, tiny_completions, tmp_path, monkeypatch):
    """A re-run into the same --out that fails after its checks (here: in the forward of its second
    prompt) must not take the completeness mark, nor any file, from the earlier good extraction."""
    out = tmp_path / "out"
    argv = ["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(out),
            "--layers", "1", "--kernels", "torch"]
    run_inline(argv)
    good = _digests(out)
    read_manifest(out, verify=True)
    real_forward, calls = extract.forward_one, []

    def failing_forward(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(extract, "forward_one", failing_forward)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        run_inline(argv + ["--layers", "1,2"])
    assert _digests(out) == good
    assert read_manifest(out, verify=True)["layers"] == [1, 3]
    # The failed attempt's directory is cleared by the next run, which replaces the old output whole:
    # files only the old manifest listed go, files it never listed stay.
    monkeypatch.setattr(extract, "forward_one", real_forward)
    (out / "notes.txt").write_text("mine")
    result, _ = run_inline(argv + ["--limit", "1"])
    manifest = read_manifest(out, verify=True)
    assert result["out"] == str(out) and len(manifest["files"]) == 1
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], "manifest.json", "notes.txt"])
    assert not list(tmp_path.glob(".out.attempt-*"))


def test_a_failed_worker_leaves_no_attempt_directory(tiny_target, tiny_completions, tmp_path):
    """The worker fails after it made its attempt directory (here: a broken weights file): the
    directory goes with it, and an earlier output in --out is untouched."""
    import shutil

    from tests.fixtures_models import run_module

    model = tmp_path / "model"
    shutil.copytree(tiny_target, model)
    (model / "model.safetensors").write_bytes(b"\xff" * 64)
    out = tmp_path / "out"
    out.mkdir()
    (out / "manifest.json").write_text("{}")
    code, events = run_module("remote.extract", ["--model", str(model), "--completions", str(tiny_completions),
                                                 "--out", str(out), "--kernels", "torch"], tmp_path)
    assert code != 0 and any(e["type"] == "error" for e in events)
    assert not list(tmp_path.glob(".out.attempt-*"))
    assert sorted(p.name for p in out.iterdir()) == ["manifest.json"]


# --- keeping to the budget: --stop-file, a partial extraction, a re-run that completes it ----------

class StopAfter(io.StringIO):
    """The worker's event stream; creates the stop file once `after` prompts are reported done, as
    the console does when the window's projection passes the budget (the next check sees it)."""

    def __init__(self, stop_file: Path, after: int):
        super().__init__()
        self.stop_file, self.after = stop_file, after

    def write(self, text: str) -> int:
        for line in text.splitlines():
            event = json.loads(line)
            if event["type"] == "progress" and event["key"] == "prompts" and event["done"] >= self.after:
                self.stop_file.touch()
        return super().write(text)

    def events(self) -> list[dict]:
        return [json.loads(line) for line in self.getvalue().splitlines()]


def run_stopped(argv: list[str], stop_file: Path, after: int) -> tuple[dict, list[dict]]:
    stream = StopAfter(stop_file, after)
    result = extract.main(EventWriter(stream=stream), [*argv, "--stop-file", str(stop_file)])
    return result, stream.events()


def partial_manifest(out: Path) -> dict:
    return json.loads((out / extract.PARTIAL_MANIFEST).read_text())


class ForwardCount:
    """Counts the real forward passes (by prompt length) while running them unchanged."""

    def __init__(self):
        self.real, self.lengths = extract.forward_one, []

    def __call__(self, model, decoder_layers, layer_ids, ids, **kwargs):
        self.lengths.append(len(ids))
        return self.real(model, decoder_layers, layer_ids, ids, **kwargs)


def test_a_stop_file_ends_with_a_partial_extraction_never_taken_as_complete(tiny_target, tmp_path, extracted):
    """The stop file appears after the first of three prompts: the prompt in hand is finished, the
    GPU released as usual, and the output is a partial extraction: its files complete and verified,
    its manifest `complete: false` with the prompts done and missing, and no `manifest.json`, so
    every completeness check (read_manifest, the engine's manifest_complete) refuses it."""
    out, stop = tmp_path / "out", tmp_path / "stop"
    completions = write_completions(tiny_target, tmp_path / "c.json", n_prompts=3)
    argv = ["--model", str(tiny_target), "--completions", str(completions), "--out", str(out),
            "--layers", "0,1,2", "--kernels", "torch"]
    result, events = run_stopped(argv, stop, after=1)
    ids = [p["id"] for p in json.loads(completions.read_text())["prompts"]]
    assert result["complete"] is False and result["prompts"] == 1 and result["prompts_missing"] == ids[1:]
    kinds = [(e["type"], e.get("kind")) for e in events]
    released = events[kinds.index(("gpu_released", None))]
    assert released["stopped_early"] is True and released["prompts_done"] == 1 and released["prompts_missing"] == 2
    assert kinds.index(("gpu_released", None)) < kinds.index(("artifact", "extract-partial"))
    assert ("artifact", "extract") not in kinds
    assert any(e["type"] == "log" and "stop file" in e["msg"] for e in events)
    with pytest.raises(ValueError, match="incomplete"):
        read_manifest(out, verify=True)  # what manifest_complete and the evaluator run
    manifest = partial_manifest(out)
    assert manifest["complete"] is False
    assert manifest["prompts_done"] == ids[:1] and manifest["prompts_missing"] == ids[1:]
    assert [p["id"] for p in manifest["prompts"]] == ids[:1] and list(manifest["files"]) == [f"{ids[0]}.safetensors"]
    from remote.artifacts import sha256_file

    for name, facts in manifest["files"].items():
        assert sha256_file(out / name) == facts["sha256"]
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], extract.PARTIAL_MANIFEST])
    # The finished prompt is exactly what a whole extraction gives for it.
    cold = extracted[0] / f"{ids[0]}.safetensors"
    assert torch.equal(load(out / f"{ids[0]}.safetensors")[0]["hidden"], load(cold)[0]["hidden"])


def test_a_rerun_extracts_only_the_missing_prompts_and_ends_complete(tiny_target, tmp_path, monkeypatch):
    out, stop = tmp_path / "out", tmp_path / "stop"
    completions = write_completions(tiny_target, tmp_path / "c.json", n_prompts=4)
    source = json.loads(completions.read_text())["prompts"]
    argv = ["--model", str(tiny_target), "--completions", str(completions), "--out", str(out),
            "--layers", "1", "--kernels", "torch"]
    run_stopped(argv, stop, after=2)
    kept = {name: (out / name).stat().st_ino for name in partial_manifest(out)["files"]}
    assert len(kept) == 2
    stop.unlink()
    count = ForwardCount()
    monkeypatch.setattr(extract, "forward_one", count)
    result, events = run_inline([*argv, "--stop-file", str(stop)])
    missing = source[2:]
    assert count.lengths == [len(p["prompt_ids"]) + len(p["completion_ids"]) for p in missing]
    assert result["complete"] is True and result["prompts"] == 4 and result["prompts_kept"] == [p["id"] for p in source[:2]]
    manifest = read_manifest(out, verify=True)
    assert manifest["complete"] is True and [p["id"] for p in manifest["prompts"]] == [p["id"] for p in source]
    assert manifest["prompts_kept"] == [p["id"] for p in source[:2]]
    assert not (out / extract.PARTIAL_MANIFEST).exists()
    assert {name: (out / name).stat().st_ino for name in kept} == kept  # the verified files themselves kept
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], "manifest.json"])
    assert not list(tmp_path.glob(".out.attempt-*"))
    prompts = [e for e in events if e["type"] == "progress" and e["key"] == "prompts"]
    assert prompts[-1]["done"] == prompts[-1]["total"] == 2
    # A whole extraction from scratch gives the same files.
    whole = tmp_path / "whole"
    run_inline(["--model", str(tiny_target), "--completions", str(completions), "--out", str(whole),
                "--layers", "1", "--kernels", "torch"])
    for name in manifest["files"]:
        assert torch.equal(load(out / name)[0]["hidden"], load(whole / name)[0]["hidden"])


def test_a_kept_file_that_fails_its_sha256_is_extracted_again(tiny_target, tmp_path, monkeypatch):
    out, stop = tmp_path / "out", tmp_path / "stop"
    completions = write_completions(tiny_target, tmp_path / "c.json", n_prompts=3)
    argv = ["--model", str(tiny_target), "--completions", str(completions), "--out", str(out),
            "--layers", "1", "--kernels", "torch"]
    run_stopped(argv, stop, after=2)
    damaged = sorted(partial_manifest(out)["files"])[0]
    data = bytearray((out / damaged).read_bytes())
    data[-1] ^= 0xFF  # same size, other content: only the sha256 can tell
    (out / damaged).write_bytes(bytes(data))
    stop.unlink()
    count = ForwardCount()
    monkeypatch.setattr(extract, "forward_one", count)
    _, events = run_inline(argv)
    assert len(count.lengths) == 2  # the damaged prompt and the missing one
    assert any(e["type"] == "log" and damaged in e["msg"] and "sha256" in e["msg"] for e in events)
    read_manifest(out, verify=True)


def test_a_partial_extraction_of_other_layers_is_not_kept(tiny_target, tmp_path, monkeypatch):
    out, stop = tmp_path / "out", tmp_path / "stop"
    completions = write_completions(tiny_target, tmp_path / "c.json", n_prompts=3)
    argv = ["--model", str(tiny_target), "--completions", str(completions), "--out", str(out), "--kernels", "torch"]
    run_stopped([*argv, "--layers", "1"], stop, after=1)
    stop.unlink()
    count = ForwardCount()
    monkeypatch.setattr(extract, "forward_one", count)
    _, events = run_inline([*argv, "--layers", "2"])
    assert len(count.lengths) == 3
    assert any(e["type"] == "log" and "not kept" in e["msg"] and "layers" in e["msg"] for e in events)
    assert read_manifest(out, verify=True)["layers"] == [2, 3]


def test_a_stop_file_left_before_the_run_is_a_clear_error(tiny_target, tiny_completions, tmp_path):
    stale = tmp_path / "stop"
    stale.touch()
    with pytest.raises(WorkerError, match="the stop file .* already exists"):
        run_inline(["--model", str(tiny_target), "--completions", str(tiny_completions), "--out", str(tmp_path / "o"),
                    "--stop-file", str(stale)])


@settings(max_examples=6, deadline=None)
@given(stops=st.lists(st.integers(0, 3), min_size=1, max_size=3))
def test_stopped_runs_then_a_whole_one_never_leave_both_manifests(tiny_target, tmp_path_factory, stops):
    """However many windows are cut short (a stop after k prompts, 0 included), each run leaves
    either a complete manifest or a partial one, never both; the partial's done and missing are the
    prompt set, every file it lists verifies, and a partial that follows a partial holds all it held;
    and the run that is not stopped ends complete."""
    from remote.artifacts import sha256_file

    root = tmp_path_factory.mktemp("stops")
    completions = write_completions(tiny_target, root / "c.json", n_prompts=3)
    ids = [p["id"] for p in json.loads(completions.read_text())["prompts"]]
    out, stop = root / "out", root / "stop"
    argv = ["--model", str(tiny_target), "--completions", str(completions), "--out", str(out),
            "--layers", "1", "--kernels", "torch"]
    done: list[str] = []
    for after in stops:
        stop.unlink(missing_ok=True)  # the console removes it before each window
        stream = StopAfterWeights(stop) if after == 0 else StopAfter(stop, after)
        result = extract.main(EventWriter(stream=stream), [*argv, "--stop-file", str(stop)])
        has_whole, has_partial = (out / "manifest.json").exists(), (out / extract.PARTIAL_MANIFEST).exists()
        assert has_whole != has_partial
        if has_partial:
            manifest = partial_manifest(out)
            assert manifest["prompts_done"] + manifest["prompts_missing"] == ids
            assert set(manifest["prompts_done"]) >= set(done)  # nothing verified is ever lost
            done = manifest["prompts_done"]
            for name, facts in manifest["files"].items():
                assert sha256_file(out / name) == facts["sha256"]
            assert result["complete"] is False
        else:
            done = []  # a run over a whole extraction extracts everything again
    result, _ = run_inline(argv)
    assert result["complete"] is True and read_manifest(out, verify=True)["prompts_done"] == ids
    assert not (out / extract.PARTIAL_MANIFEST).exists()


class StopAfterWeights(StopAfter):
    """Creates the stop file once the weights are placed, before the first prompt's check."""

    def __init__(self, stop_file: Path):
        super().__init__(stop_file, 0)

    def write(self, text: str) -> int:
        for line in text.splitlines():
            event = json.loads(line)
            if event["type"] == "phase" and event["name"] == "forward":
                self.stop_file.touch()
        return io.StringIO.write(self, text)


def test_the_evaluation_of_a_partial_extraction_is_refused_unless_asked(tiny_target, tmp_path):
    """A partial set is not the set the drafters are compared on: the evaluator refuses it, naming
    the prompts missing and the two ways on; with --allow-partial it evaluates the part and says so
    in its results and its manifest."""
    from transformers import AutoTokenizer

    from remote.drafter import save_random_drafter
    from remote.evaluate import main as evaluate_main

    states, stop = tmp_path / "states", tmp_path / "stop"
    completions = write_completions(tiny_target, tmp_path / "c.json", n_prompts=3)
    ids = [p["id"] for p in json.loads(completions.read_text())["prompts"]]
    run_stopped(["--model", str(tiny_target), "--completions", str(completions), "--out", str(states),
                 "--layers", "1,2", "--kernels", "torch"], stop, after=2)
    mask = AutoTokenizer.from_pretrained(tiny_target).convert_tokens_to_ids("<|mask|>")
    drafter = save_random_drafter(tmp_path / "d", 64, 799, [1, 2], 4, block_size=4, mask_token_id=mask, seed=2)
    argv = ["--states", str(states), "--target", str(tiny_target), "--drafter", f"d={drafter}",
            "--out", str(tmp_path / "eval"), "--device", "cpu", "--budgets", "2", "--topk", "2"]
    with pytest.raises(WorkerError) as refused:
        run_in_process(evaluate_main, argv)
    assert f"{states} is a partial extraction: 2 of 3 prompts (missing {ids[2]})" in refused.value.msg
    assert "--allow-partial" in refused.value.msg and "run --resume" in refused.value.msg
    assert not (tmp_path / "eval").exists()
    results, events = run_in_process(evaluate_main, [*argv, "--allow-partial"])
    written = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert written["states_partial"] == {"prompts_done": ids[:2], "prompts_missing": ids[2:]}
    assert written["drafters"]["d"]["prompts"] == 2
    assert read_manifest(tmp_path / "eval", verify=True)["states_partial"] == written["states_partial"]
    assert any(e["type"] == "log" and e["level"] == "warning" and "partial" in e["msg"] for e in events)
    # A file of the part that no longer matches its sha256 is refused even when the part is allowed.
    name = f"{ids[0]}.safetensors"
    data = bytearray((states / name).read_bytes())
    data[-1] ^= 0xFF
    (states / name).write_bytes(bytes(data))
    with pytest.raises(WorkerError, match=f"{name}: does not match its sha256"):
        run_in_process(evaluate_main, [*argv, "--allow-partial", "--out", str(tmp_path / "eval2")])
