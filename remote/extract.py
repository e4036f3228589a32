"""Extract the target's hidden states for prompt + cached completion, one prompt at a time.

    python -m remote.extract --model DIR --completions completions.json --out DIR
        [--layers 1,8,15] [--drafter DIR ...] [--kernels fast|torch|any] [--device cpu|cuda|auto]
        [--device-map auto] [--max-memory 0=40GiB,1=40GiB,cpu=200GiB] [--staged --go-file PATH]
        [--layers-override NAME=1,2,3] [--allow-incomplete] [--check-only] [--stop-file PATH]

`--check-only` runs only the check phase (remote.extract_check: token ids inside the vocabulary,
lengths within the context, finish reasons, drafter provenance), needs no GPU, writes nothing, and
ends in a result event: what the console's preflight runs before the server stops.

Order of work, so that the GPU is held as briefly as possible:
  1. inputs checked (model dir, completions, layers) and the kernel policy applied, in this fresh
     process before transformers imports the modeling code and before any GPU allocation;
  2. weights placed tensor by tensor with progress; staged: into pinned host RAM, kernels warmed by a
     two-layer model on the GPU, a `staged` event, then a wait for the go file (the server still
     serves until then);
  3. forward passes with hooks on the chosen layers; each prompt's tensors go to a writer thread;
  4. the model leaves the GPU -> `gpu_released` event (the server can restart now), then the writer
     finishes, per-layer soundness is computed from the saved bf16 states (remote.soundness), then
     `manifest.json` is written last. All of it goes to an attempt directory
     beside --out (`.NAME.attempt-PID`), moved into --out only once complete (`publish`): a killed
     or failed run leaves no manifest and no file under a final name that is not complete, and an
     earlier complete extraction in --out stays as it was.

Keeping to the window's budget: `--stop-file PATH` is checked before each prompt; once it exists
the prompt in hand is finished, the GPU released (`gpu_released`, with `stopped_early`) and the
output published as a PARTIAL extraction: every finished prompt's file complete and in the manifest
with its sha256, but the manifest is `manifest.partial.json` (`complete: false`, `prompts_done`,
`prompts_missing`), never `manifest.json`, so no completeness check takes it for a whole one. A
re-run into the same --out keeps every prompt file of the partial manifest that its sha256 still
verifies, when it was made from the same model, completions, layers and kernels, and extracts only
the others; it ends with `manifest.json` (`complete: true`, `prompts_kept`). (A re-run over a whole
extraction extracts everything again, as before: benchmarks and checks re-run into one --out.)

Output per prompt `<id>.safetensors`: `hidden` bf16 [T, n_layers, H] (layer order as manifest
"layers"), `input_ids` int64 [T], `g` int64 [T] (target argmax after each position), `topk_ids`
int64 [T, 8], `topk_logprobs` float32 [T, 8]; metadata `prompt_id`, `prompt_len`, `layers`.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import queue
import shutil
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from remote import extract_check, kernels
from remote.artifacts import MANIFEST, atomic_path, sha256_file, sync_file, write_manifest
from remote.events import EventWriter, WorkerError, run_worker
from remote.extract_check import PARTIAL_MANIFEST
from remote.layers import LayerCapture, find_decoder_layers, parse_layer_list, select_layers, text_config
from remote.prompts import ID_RE
from remote.topk import topk_logprobs
from remote.weights import (
    checkpoint_facts,
    devices_used,
    model_bytes,
    parse_max_memory,
    place_weights,
    plan_device_map,
    read_model_config,
)

COMPLETIONS_FORMAT = "dflash-ops.completions/1"
EXTRACT_FORMAT = "dflash-ops.extract/1"
TOPK = 8
# What an earlier extraction must share with this run for its prompt files to be kept.
SAME_TO_KEEP = ("model_path", "completions_sha256", "layers", "hidden_size", "dtype", "kernels", "topk_pass")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m remote.extract", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="target model directory (config.json + safetensors)")
    p.add_argument("--completions", required=True, help="completions.json from remote.completions")
    p.add_argument("--out", default=None, help="output directory (required unless --check-only)")
    p.add_argument("--layers", default="", help="comma-separated layer ids (output of decoder layer k)")
    p.add_argument("--drafter", action="append", default=[], help="drafter dir: adds its target_layer_ids")
    p.add_argument("--kernels", default="any", choices=kernels.POLICIES)
    p.add_argument("--device", default="auto", choices=("cpu", "cuda", "auto"))
    p.add_argument("--device-map", default=None, help="'auto' to split across GPUs (accelerate)")
    p.add_argument("--max-memory", default=None, help="per-device caps, e.g. 0=40GiB,1=40GiB,cpu=200GiB")
    p.add_argument("--allow-offload", action="store_true",
                   help="let --device-map auto put modules on the CPU (slow; implied by a cpu entry in --max-memory)")
    p.add_argument("--staged", action="store_true", help="stage weights in host RAM and wait for --go-file")
    p.add_argument("--go-file", default=None, help="staged mode: start the window when this file appears")
    p.add_argument("--lease-file", default=None,
                   help="staged mode: the console renews this file while it runs (its mtime); see --lease-s")
    p.add_argument("--lease-s", type=float, default=0.0,
                   help="staged mode: end (freeing the weights) when --lease-file has not been renewed for this "
                        "long before the go: the console is gone (0: no lease)")
    p.add_argument("--stop-file", default=None,
                   help="when this file appears, finish the prompt in hand and publish a partial extraction")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts")
    p.add_argument("--check-only", action="store_true",
                   help="only the check phase (no GPU, no output): a result event (remote.extract_check)")
    p.add_argument("--allow-incomplete", action="store_true", help="extract generations cached as incomplete")
    p.add_argument("--layers-override", action="append", default=[], metavar="NAME=1,2,3",
                   help="a drafter's layer ids, replacing its target_layer_ids (NAME = its directory's name)")
    args = p.parse_args(argv)
    if not args.out and not args.check_only:
        p.error("--out is required (unless --check-only)")
    if args.staged and not args.go_file:
        p.error("--staged needs --go-file")
    return args


def load_completions(path: str | Path) -> dict[str, Any]:
    """Read and check a completions.json (format, prompts with integer token ids)."""
    file = Path(path)
    if not file.is_file():
        raise WorkerError(f"completions file not found: {file}", "--completions")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise WorkerError(f"{file}: not valid JSON ({exc})", str(file)) from exc
    if not isinstance(data, dict) or data.get("format") != COMPLETIONS_FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise WorkerError(f"{file}: expected format {COMPLETIONS_FORMAT!r}, found {found!r}", str(file))
    prompts = data.get("prompts")
    if not isinstance(prompts, list) or not prompts:
        raise WorkerError(f"{file}: no prompts", str(file))
    seen: set[str] = set()
    for i, entry in enumerate(prompts):
        pid = entry.get("id") if isinstance(entry, dict) else None
        # The id names the output file: it must be a safe, unique file name.
        if not isinstance(pid, str) or not ID_RE.match(pid) or pid in seen:
            raise WorkerError(f"{file}: prompts[{i}].id must be a unique name of letters, digits, '_', '.', '-'; "
                              f"found {pid!r}", str(file))
        seen.add(pid)
        for key in ("prompt_ids", "completion_ids"):
            ids = entry.get(key) if isinstance(entry, dict) else None
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise WorkerError(f"{file}: prompts[{i}].{key} must be a list of token ids", str(file))
        if not entry["prompt_ids"]:
            raise WorkerError(f"{file}: prompts[{i}] ({entry.get('id')}) has no prompt tokens", str(file))
    return data


def resolve_device(choice: str) -> str:
    """'auto' -> 'cuda' when a GPU is visible, else 'cpu'; 'cuda' without a GPU is a clear error."""
    has_cuda = kernels.cuda_available()
    if choice == "auto":
        return "cuda" if has_cuda else "cpu"
    if choice == "cuda" and not has_cuda:
        raise WorkerError("--device cuda but torch sees no CUDA GPU on this host", "--device")
    return choice


ATTEMPT = ".{name}.attempt-{pid}"  # beside --out, on its filesystem: the files are renamed into place


def prepare_out(out: str | Path) -> Path:
    """A fresh directory for this attempt beside `out`, which is left as it is until `publish`.

    A complete earlier extraction in `out` stays complete (its manifest and files untouched) through
    a re-run that fails its checks, its load or its forward, or is killed: the attempt writes only
    into its own directory. Attempts left by killed runs (their pid gone) are removed here.
    """
    from remote.procstat import pid_alive

    final = Path(out)
    if final.exists() and not final.is_dir():
        raise WorkerError(f"--out {final} exists and is not a directory", "--out")
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in final.parent.glob(ATTEMPT.format(name=final.name, pid="*")):
        pid = stale.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    if final.is_dir():
        for partial in final.glob(".*.partial"):  # left in place by a killed run of an older version
            partial.unlink(missing_ok=True)
    attempt = final.parent / ATTEMPT.format(name=final.name, pid=os.getpid())
    # An earlier failed attempt of this process (main called twice) may have its writer thread still
    # renaming a file into the old directory for a moment: clear it until it is gone.
    deadline = time.monotonic() + 10.0
    while True:
        shutil.rmtree(attempt, ignore_errors=True)
        try:
            attempt.mkdir()
            break
        except FileExistsError:
            if time.monotonic() > deadline:
                raise WorkerError(f"cannot clear the earlier attempt {attempt}", "--out") from None
            time.sleep(0.05)
    import atexit

    # A run that fails leaves no attempt behind (after `publish` there is nothing left to remove);
    # one that is killed leaves it to the next run's clean-up above.
    atexit.register(shutil.rmtree, attempt, True)
    return attempt


def publish(attempt: Path, out: str | Path, partial: bool = False) -> Path:
    """Move a finished attempt into `out`, its manifest last; returns the manifest's final path.

    The old manifests (whole and partial) go first (from then on `out` is not complete), then every
    new file replaces its namesake, then files that only the old manifests listed are removed, then
    the new manifest lands: `manifest.json`, or `manifest.partial.json` when `partial`. Other files
    in `out` are left alone; a kept file (linked into the attempt from `out`) stays where it is.
    """
    final = Path(out)
    final.mkdir(parents=True, exist_ok=True)
    old_files: set[str] = set()
    for name in (MANIFEST, PARTIAL_MANIFEST):
        with contextlib.suppress(FileNotFoundError, ValueError, AttributeError):
            old_files |= set(json.loads((final / name).read_text()).get("files", {}))
    for name in (MANIFEST, PARTIAL_MANIFEST):
        with contextlib.suppress(FileNotFoundError):
            (final / name).unlink()
    sync_file(final)
    moved = set()
    for path in sorted(attempt.iterdir()):
        if path.name == MANIFEST:
            continue
        target = final / path.name
        if path.is_dir() and target.is_dir():
            shutil.rmtree(target)
        if target.is_file() and os.path.samefile(path, target):
            path.unlink()  # a kept file: renaming a link onto itself would leave the attempt's link behind
        else:
            os.replace(path, target)
        moved.add(path.name)
    for name in old_files - moved:
        if name and "/" not in name and name not in (".", ".."):
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                (final / name).unlink()
    sync_file(final)
    manifest = final / (PARTIAL_MANIFEST if partial else MANIFEST)
    os.replace(attempt / MANIFEST, manifest)
    sync_file(final)
    attempt.rmdir()
    return manifest


def keep_verified(out: str | Path, attempt: Path, this_run: dict[str, Any], prompt_ids: list[str],
                  events: EventWriter) -> dict[str, dict[str, Any]]:
    """The prompt files of the partial extraction in `out` (a stopped run's) that this run keeps: made by the same model, completions, layers and kernels (`this_run`, SAME_TO_KEEP),
    among `prompt_ids`, and matching their size and sha256 now. Each is linked into `attempt` (the
    manifest is written over the attempt's files); returns {file name: its manifest facts}."""
    final = Path(out)
    source = final / PARTIAL_MANIFEST
    if not source.is_file():
        return {}
    try:
        earlier = json.loads(source.read_text())
        files = earlier["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        events.log(f"{source}: unreadable ({exc}): every prompt is extracted again", level="warning")
        return {}
    differs = [key for key in SAME_TO_KEEP if earlier.get(key) != this_run[key]]
    if differs:
        events.log(f"{source}: not kept ({', '.join(differs)} differ from this run's): every prompt is "
                   f"extracted again", level="warning")
        return {}
    wanted = {f"{pid}.safetensors" for pid in prompt_ids}
    good, bad = extract_check.verify_files(final, {n: f for n, f in files.items() if n in wanted})
    for name, why in bad.items():
        events.log(f"{final / name}: not kept ({why}): extracted again", level="warning")
    kept = {}
    for name, facts in good.items():
        try:
            os.link(final / name, attempt / name)
        except OSError:  # a filesystem without hard links: a copy, still outside the GPU's time
            shutil.copy2(final / name, attempt / name)
        kept[name] = {k: v for k, v in facts.items() if k not in ("size", "sha256")}
    if kept:
        events.log(f"kept {len(kept)} verified prompt files of the partial extraction ({source.name}); "
                   f"{len(prompt_ids) - len(kept)} to extract")
    return kept


def versions() -> dict[str, str | None]:
    import torch
    import transformers

    found: dict[str, str | None] = {"python": sys.version.split()[0], "torch": torch.__version__,
                                    "transformers": transformers.__version__, "cuda": torch.version.cuda}
    for name in kernels.FAST_PACKAGES:
        module = sys.modules.get(name)
        found[name] = str(getattr(module, "__version__", "unknown")) if module is not None else None
    return found


class Writer:
    """Writes prompt files on a background thread so saving overlaps the next forward pass.

    Files are written and renamed without fsync; `finish()` (after `gpu_released`) syncs them all
    before the manifest is written, so waiting for the disk stays out of the downtime window.
    """

    QUEUED = 8  # prompts waiting for the disk: a few GB of pinned memory for the largest targets

    def __init__(self, out: Path, layers: list[int], events: EventWriter, total: int):
        self.out, self.layers, self.events, self.total = out, layers, events, total
        self.files: dict[str, dict[str, Any]] = {}
        self.bytes_written = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=self.QUEUED)
        self._thread = threading.Thread(target=self._run, name="extract-writer", daemon=True)
        self._thread.start()

    def put(self, prompt_id: str, prompt_len: int, outputs: HostTensors) -> None:
        """Queue a prompt's outputs; blocks while `QUEUED` prompts wait, which bounds the pinned
        memory in flight and how far the forward runs ahead of the disk."""
        if self.error is not None:
            raise WorkerError(f"writing outputs failed: {self.error}", str(self.out))
        self._queue.put((prompt_id, prompt_len, outputs))

    def _run(self) -> None:
        from safetensors.torch import save_file

        while (item := self._queue.get()) is not None:
            if self.error is not None:
                continue
            prompt_id, prompt_len, outputs = item
            name = f"{prompt_id}.safetensors"
            try:
                tensors = outputs.wait()
                meta = {"prompt_id": prompt_id, "prompt_len": str(prompt_len), "layers": json.dumps(self.layers)}
                with atomic_path(self.out / name, fsync=False) as tmp:
                    save_file(tensors, str(tmp), metadata=meta)
                size = (self.out / name).stat().st_size
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                self.error = exc
                continue
            self.bytes_written += size
            self.files[name] = {"prompt_id": prompt_id, "prompt_len": prompt_len,
                                "shape": list(tensors["hidden"].shape)}
            self.events.artifact(str(self.out / name), "hidden_states", prompt_id=prompt_id, bytes=size)
            self.events.progress("files", len(self.files), self.total, "files")
            self.events.progress("bytes_written", self.bytes_written, None, "bytes")

    def finish(self) -> None:
        """Wait for the queue to drain, then make every file and the renames durable."""
        self._queue.put(None)
        self._thread.join()
        if self.error is not None:
            raise WorkerError(f"writing outputs failed: {self.error}", str(self.out))
        for name in self.files:
            sync_file(self.out / name)
        sync_file(self.out)


class HostTensors:
    """One prompt's outputs in pinned host memory, copied there without waiting for the GPU.

    The copies run on a side stream (`copy_to_host`), so the main thread goes straight on to launch
    the next prompt and the GPU computes it while the copy engine moves this one; a sync per prompt
    would leave the GPU idle while the CPU launches (the 2 B forward is launch-bound). Nothing may
    read or convert the values before `wait()`, which blocks on CUDA events without the GIL.
    """

    def __init__(self, tensors: dict[str, Any], events: list[Any]):
        self.tensors, self._events = tensors, events

    def wait(self) -> dict[str, Any]:
        for event in self._events:
            event.synchronize()
        self._events = []
        return self.tensors


def forward_one(model: Any, decoder_layers: Any, layer_ids: list[int], ids: list[int],
                triton_topk: bool = False) -> HostTensors:
    """One prompt + completion through the target: hooked hidden states, argmax g, top-8 log-probs.

    `triton_topk`: the top-8's log-sum-exp and block maxima in one Triton pass (`remote.topk`);
    the worker sets it when the fast kernels are bound on a GPU (Triton is known to work there).
    """
    import torch

    base = model.get_decoder()
    lm_head = model.get_output_embeddings()
    first = base.get_input_embeddings().weight.device
    input_ids = torch.tensor([ids], dtype=torch.long, device=first if first.type != "meta" else "cpu")
    with torch.inference_mode(), LayerCapture(decoder_layers, layer_ids) as capture:
        last = base(input_ids=input_ids, use_cache=False).last_hidden_state[0]
        hidden = capture.take(device=last.device)
        # Layer k is Hugging Face's hidden_states[k+1] (EVAL-SPEC 1), which z-lab's training reads;
        # for the last layer that entry has the final norm applied, which the hook does not see.
        final = len(decoder_layers) - 1
        if final in layer_ids:
            hidden[:, layer_ids.index(final)] = last
        head_device = lm_head.weight.device if lm_head.weight.device.type != "meta" else last.device
        vocab = lm_head.weight.shape[0]
        # Logits in slices of at most 2^27 entries, so a long prompt's [T, V] never exists at once.
        step = max(1, (1 << 27) // max(vocab, 1))
        g, top_ids, top_lp = [], [], []
        for start in range(0, last.shape[0], step):
            ids_k, logprobs_k, argmax = topk_logprobs(lm_head(last[start:start + step].to(head_device)), TOPK,
                                                       triton=triton_topk)
            top_ids.append(ids_k)
            top_lp.append(logprobs_k)
            g.append(argmax)
        # Dtypes are settled on the device: the host copies must not be touched before they land.
        on_device = {"hidden": hidden.to(torch.bfloat16), "g": torch.cat(g).to(torch.int64),
                     "topk_ids": torch.cat(top_ids).to(torch.int64),
                     "topk_logprobs": torch.cat(top_lp).to(torch.float32)}
        host, events = copy_to_host(on_device)
    host["input_ids"] = torch.tensor(ids, dtype=torch.int64)
    return HostTensors(host, events)


_COPY_STREAMS: dict[Any, Any] = {}


def copy_to_host(tensors: dict[str, Any]) -> tuple[dict[str, Any], list[Any]]:
    """Pinned host copies of `tensors`, queued on a side stream per GPU; returns (copies, events).

    The side stream waits for the work that produced the tensors, then copies while the next
    prompt's forward runs on the main stream; the events mark the copies done. CPU tensors are
    returned as they are (nothing to wait for).
    """
    import torch

    host: dict[str, Any] = {}
    events = []
    for device in {t.device for t in tensors.values()}:
        names = [name for name, t in tensors.items() if t.device == device]
        if device.type != "cuda":
            host.update((name, tensors[name].contiguous()) for name in names)
            continue
        stream = _COPY_STREAMS.get(device)
        if stream is None:
            stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for name in names:
                source = tensors[name].contiguous()
                buffer = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
                buffer.copy_(source, non_blocking=True)
                # The source was allocated on the main stream: without this its memory could be
                # handed to the next prompt's kernels before the copy has read it.
                source.record_stream(stream)
                host[name] = buffer
            events.append(stream.record_event())
    return host, events


def warm_kernels(model_config: dict[str, Any], device: str, events: EventWriter, tokens: int = 64) -> float:
    """Compile and autotune the linear-attention kernels with a two-layer copy of the target's shape.

    fla's Triton kernels specialise on head counts and dims, not on sequence length, so a forward
    of one linear and one full layer with the real dims compiles what the real forward needs (into
    TRITON_CACHE_DIR and this process's memory) while the server still holds the GPU. The autotuner
    times its configs on these inputs and keeps the winner for every length (its keys hold no
    length): `tokens` is the longest prompt's length, so it tunes for the shapes the window runs, as
    a cold run does. A small vocabulary keeps the embedding tiny. Returns seconds spent.
    """
    import torch

    start = time.perf_counter()
    vocab = int(text_config(model_config).get("vocab_size") or 256)
    small, layers = small_model(model_config, device)
    ids = torch.randint(0, 256, (1, max(16, min(int(tokens), 16384))), device=device)
    with torch.inference_mode():
        small(input_ids=ids, use_cache=False)
        # The top-8 pass over the real vocabulary compiles its own Triton kernel (per row width).
        topk_logprobs(torch.zeros(2, vocab, dtype=torch.bfloat16, device=device), TOPK, triton=True)
    if device == "cuda":
        torch.cuda.synchronize()
    del small
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    seconds = time.perf_counter() - start
    events.log(f"kernels warmed with a {layers}-layer model: {seconds:.1f} s")
    return seconds


def small_model(model_config: dict[str, Any], device: str) -> tuple[Any, int]:
    """A random copy of the target's shape with one layer of each kind it has (linear attention, full
    attention) and a 256-token vocabulary, on `device`; returns (model, its layer count)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tcfg = dict(text_config(model_config))
    layer_types = tcfg.get("layer_types") or []
    keep = []
    for kind in ("linear_attention", "full_attention"):
        if kind in layer_types:
            keep.append(kind)
    tcfg.update(num_hidden_layers=max(1, len(keep)), vocab_size=256, pad_token_id=None,
                bos_token_id=None, eos_token_id=None)
    if keep:
        tcfg["layer_types"] = keep
    model_type = tcfg.pop("model_type", model_config.get("model_type"))
    if "text_config" in model_config and not model_type.endswith("_text"):
        model_type += "_text"
    for key in ("architectures", "transformers_version", "auto_map", "quantization_config"):
        tcfg.pop(key, None)
    config = AutoConfig.for_model(model_type, **tcfg)
    with torch.device(device):
        small = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return small.eval(), max(1, len(keep))


def measure_forward_rate(model_config: dict[str, Any], device: str, tokens: int) -> dict[str, Any]:
    """The forward rate expected in the window, measured before it (staged, while the server serves):
    the small copy of the target's shape (`small_model`) timed on a second pass of `tokens` tokens
    (the first compiles), its time per layer scaled to the target's layers. The heads (embedding,
    lm_head over the real vocabulary) are left out, so it is an estimate: said in its basis."""
    import torch

    num_layers = int(text_config(model_config).get("num_hidden_layers") or 1)
    small, layers = small_model(model_config, device)
    n = max(16, min(int(tokens), 16384))
    ids = torch.randint(0, 256, (1, n), device=device)
    with torch.inference_mode():
        small(input_ids=ids, use_cache=False)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        small(input_ids=ids, use_cache=False)
        if device == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
    del small
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    per_layer = seconds / layers
    return {"forward_tokens_per_s": round(n / max(per_layer * num_layers, 1e-9), 1),
            "forward_rate_basis": f"{layers} of {num_layers} layers timed on {n} tokens at stage warm-up, "
                                  f"scaled to {num_layers} layers (heads left out: an estimate)"}


def host_bytes(tokens: int, n_layers: int, hidden_size: int) -> list[int]:
    """Bytes of one prompt's host copies: hidden (bf16), g (int64), top-k ids (int64), log-probs (fp32)."""
    return [tokens * n_layers * hidden_size * 2, tokens * 8, tokens * TOPK * 8, tokens * TOPK * 4]


def reserve_host_buffers(sizes: list[int], per_class: int) -> int:
    """Pin host buffers for the window's copies and free them at once; returns the bytes pinned.

    torch's pinned allocator rounds each request up to a power of two and hands a freed block only
    to a request of the same class; reserving up to `per_class` blocks of every class the prompts
    need means the window's copies find them ready instead of pinning fresh memory (cudaHostAlloc,
    milliseconds for tens of MB) in the first prompts.
    """
    import collections

    import torch

    classes = collections.Counter(1 << max(size - 1, 0).bit_length() for size in sizes if size)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True)
               for size, n in classes.items() for _ in range(min(n, per_class))]
    reserved = sum(b.numel() for b in buffers)
    del buffers
    return reserved


def prompt_tokens(entries: Iterable[dict[str, Any]]) -> int:
    """Tokens through the target for these completions entries: prompt + completion each."""
    return sum(len(p["prompt_ids"]) + len(p["completion_ids"]) for p in entries)


class Lease:
    """The console's lease on a staged worker: it renews `path` (touch) while it runs. A staged
    worker whose console is gone (killed, its disk full before it could end us, the link cut for
    good) would hold the weights in host RAM waiting for a go forever: once the file has not been
    renewed for `seconds`, the wait ends with an error, and the worker with it."""

    def __init__(self, path: str | None, seconds: float):
        self.path, self.seconds = path, seconds
        self.since = time.time()  # a lease file not made yet counts from the wait's start

    def check(self) -> None:
        if not self.path or self.seconds <= 0:
            return
        try:
            renewed = os.path.getmtime(self.path)
        except OSError:
            renewed = self.since
        age = time.time() - renewed
        if age > self.seconds:
            raise WorkerError(f"the console's lease ran out: {self.path} not renewed for {age:.0f} s (over "
                              f"{self.seconds:.0f} s), so its console is gone; ending, the weights freed",
                              "--lease-file")


def wait_for_go(go_file: str, events: EventWriter, lease: Lease | None = None) -> float:
    """Block until `go_file` exists (the console creates it over SSH); returns seconds waited. Ends
    with an error when the console's `lease` runs out first."""
    start = time.perf_counter()
    events.log(f"staged: waiting for the go signal ({go_file})")
    while not os.path.exists(go_file):
        if lease is not None:
            lease.check()
        time.sleep(0.05)
    return time.perf_counter() - start


def wait_for_file(path: str, go_file: str, events: EventWriter, lease: Lease | None = None) -> float:
    """Staged: block until the completions cache exists (written atomically by remote.completions)."""
    start = time.perf_counter()
    events.log(f"staged: weights read; waiting for the completions ({path})")
    while not os.path.exists(path):
        if os.path.exists(go_file):
            raise WorkerError(f"the go signal came before the completions {path} existed", "--go-file")
        if lease is not None:
            lease.check()
        time.sleep(0.1)
    return time.perf_counter() - start


def release_gpu(model: Any) -> None:
    """Free the model's GPU memory now and return it to the driver.

    The weights are dropped tensor by tensor instead of being left to the garbage collector:
    Hugging Face models hold reference cycles, and a full `gc.collect()` in a process that has
    imported transformers, fla and Triton costs a noticeable share of the window; it runs after
    `gpu_released` instead.
    """
    import itertools

    import torch

    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if tensor.device.type == "meta":
            # Offloaded by accelerate (`--device-map auto` with cpu entries: the values live in its
            # hooks' weights map, in host RAM) or never materialised: no GPU memory to free, and a
            # meta tensor cannot take a real one as its data ("incompatible tensor type").
            continue
        # An empty tensor on the same device: always a compatible type, and it allocates nothing.
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    t_start = time.perf_counter()
    args = parse_args(argv)
    events.phase("check")
    model_config = read_model_config(args.model)
    tcfg = text_config(model_config)
    num_layers, hidden_size = tcfg.get("num_hidden_layers"), tcfg.get("hidden_size")
    if not isinstance(num_layers, int) or not isinstance(hidden_size, int):
        raise WorkerError("config.json has no num_hidden_layers / hidden_size", f"{args.model}/config.json")
    overrides = extract_check.parse_overrides(args.layers_override, args.drafter)
    layer_ids = select_layers(num_layers, parse_layer_list(args.layers), args.drafter, overrides)
    max_memory = parse_max_memory(args.max_memory)

    def read_completions() -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
        completions = load_completions(args.completions)
        prompts = completions["prompts"][: args.limit] if args.limit else completions["prompts"]
        checked = extract_check.check(args.model, model_config, args.completions, completions, prompts, layer_ids,
                                      args.drafter, overrides, args.allow_incomplete, events, args.check_only)
        if completions.get("model_path") and Path(str(completions["model_path"])).resolve() != Path(args.model).resolve():
            events.log(f"completions were made by a server serving {completions['model_path']}; extracting "
                       f"{args.model}", level="warning")
        return completions, prompts, checked

    # Staged, the weights are read while the live server still generates the completions: the
    # cache is read (and checked) once it appears, before `staged`, so the stop still waits for it.
    late = args.staged and not args.check_only and not Path(args.completions).exists()
    if not late:
        completions, prompts, checked = read_completions()
        if args.check_only:
            return checked
    if args.staged and Path(args.go_file).exists():
        # A go file left by an earlier run would start the copy to the GPU while the server still holds it.
        raise WorkerError(f"the go file {args.go_file} already exists (left by an earlier run?): remove it first",
                          "--go-file")
    if args.stop_file and Path(args.stop_file).exists():
        # It would end the window before its first prompt: the console removes it before each window.
        raise WorkerError(f"the stop file {args.stop_file} already exists (left by an earlier window?): remove it "
                          f"first", "--stop-file")
    device = resolve_device(args.device)
    decision = kernels.apply_policy(args.kernels, device)
    events.log(f"kernel policy {args.kernels}: {decision['reason']}")
    out = prepare_out(args.out)  # this attempt's own directory; moved into args.out once complete

    events.phase("import")
    modeling = kernels.import_modeling(model_config.get("model_type", ""))
    binding = kernels.bound_kernels(modeling)
    if args.kernels == "fast":
        kernels.require_fast(binding)
    events.log(f"kernels bound ({binding['scheme']}): " + ", ".join(f"{k}={v}" for k, v in binding["bound"].items()))

    import torch
    from transformers import AutoModelForCausalLM

    facts = checkpoint_facts(args.model)
    events.phase("load")
    t_load = time.perf_counter()
    # Maps the files lazily (nothing read yet): place_weights below reads them with progress.
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16, device_map="cpu")
    model.eval()
    load_s = time.perf_counter() - t_load
    binding = kernels.bound_kernels(modeling, model)  # legacy scheme reads per-layer attributes
    if args.kernels == "fast":
        kernels.require_fast(binding)
    _, decoder_layers = find_decoder_layers(model)
    if len(decoder_layers) != num_layers:
        raise WorkerError(f"config says {num_layers} layers, the model has {len(decoder_layers)}", args.model)
    device_map = plan_device_map(model, device, args.device_map, max_memory, allow_offload=args.allow_offload)
    total_tensors, total_bytes = model_bytes(model)
    events.log(f"checkpoint: {facts['tensors']} tensors, {facts['tensor_bytes'] / 1e9:.2f} GB; "
               f"devices: {', '.join(devices_used(device_map))}")

    def on_tensor(key: str) -> Any:
        last = [0.0]

        def report(done: int, done_bytes: int) -> None:
            now = time.perf_counter()
            if done == total_tensors or now - last[0] > 0.2:
                last[0] = now
                events.progress(key, done, total_tensors, "tensors", label=f"{done_bytes / 1e9:.2f} GB")
                events.progress(f"{key}_bytes", done_bytes, total_bytes, "bytes")

        return report

    # Triton (the top-8 pass) only where the fast kernels run too; the torch policy stays Triton-free.
    triton_topk = device == "cuda" and any(kernels.is_fast_impl(m) for m in binding["bound"].values())
    window: dict[str, Any] = {"staged": bool(args.staged), "from_pretrained_s": round(load_s, 3), "bytes": total_bytes}
    this_run: dict[str, Any] = {
        "model_path": str(Path(args.model).resolve()), "layers": layer_ids, "hidden_size": hidden_size,
        "dtype": "bfloat16", "kernels": binding["bound"], "topk_pass": "triton" if triton_topk else "torch"}

    def keep() -> dict[str, dict[str, Any]]:
        """The partial extraction's verified prompt files this run keeps (outside the window when staged)."""
        this_run["completions_sha256"] = sha256_file(args.completions)
        return keep_verified(args.out, out, this_run, [str(p["id"]) for p in prompts], events)

    kept = {} if late else keep()
    if args.staged:
        t0 = time.perf_counter()
        pin = torch.cuda.is_available()
        place_weights(model, {"": "cpu"}, pin=pin, on_tensor=on_tensor("weights"))
        window["host_read_s"] = round(time.perf_counter() - t0, 3)
        if late:
            wait_for_file(args.completions, args.go_file, events, Lease(args.lease_file, args.lease_s))
            completions, prompts, checked = read_completions()
            kept = keep()
        # Only Triton kernels (fla, the top-8 pass) compile on first use; the torch path has nothing to warm.
        longest = max(len(p["prompt_ids"]) + len(p["completion_ids"]) for p in prompts)
        window["warmup_s"] = round(warm_kernels(model_config, device, events, longest), 3) if triton_topk else 0.0
        rate = measure_forward_rate(model_config, device, longest)  # for the window's forecast, before the stop
        if pin:
            sizes = [n for p in prompts
                     for n in host_bytes(len(p["prompt_ids"]) + len(p["completion_ids"]), len(layer_ids), hidden_size)]
            window["pinned_bytes"] = reserve_host_buffers(sizes, Writer.QUEUED + 2)
        events.emit("staged", bytes=total_bytes, tensors=total_tensors, pinned=pin,
                    host_read_s=window["host_read_s"], warmup_s=window["warmup_s"], go_file=args.go_file,
                    tokens=prompt_tokens(prompts), **rate,
                    tokens_to_extract=prompt_tokens(p for p in prompts if f"{p['id']}.safetensors" not in kept))
        window["waited_s"] = round(wait_for_go(args.go_file, events, Lease(args.lease_file, args.lease_s)), 3)
        events.phase("window")
    t_window = time.perf_counter()
    place_weights(model, device_map, on_tensor=on_tensor("weights_to_device" if args.staged else "weights"))
    if len(devices_used(device_map)) > 1:
        from accelerate import dispatch_model

        model = dispatch_model(model, device_map=device_map)
    if device == "cuda":
        torch.cuda.synchronize()
    window["copy_s"] = round(time.perf_counter() - t_window, 3)

    events.phase("forward")
    writer = Writer(out, layer_ids, events, len(prompts))
    writer.files.update(kept)
    todo = [p for p in prompts if f"{p['id']}.safetensors" not in kept]
    todo_tokens = prompt_tokens(todo)
    kept_ids = [str(p["id"]) for p in prompts if f"{p['id']}.safetensors" in kept]
    done = set(kept_ids)
    tokens = 0
    t_forward = time.perf_counter()
    first_forward_s = None
    first_tokens = 0
    stopped_early = False
    with kernels.count_kernel_calls(modeling) as calls:
        for i, entry in enumerate(todo, start=1):
            if args.stop_file and os.path.exists(args.stop_file):
                stopped_early = True
                events.log(f"stop file {args.stop_file}: stopping after {i - 1} of {len(todo)} prompts; the "
                           f"{len(todo) - i + 1} left are for a re-run into the same --out", level="warning")
                break
            ids = list(entry["prompt_ids"]) + list(entry["completion_ids"])
            t_one = time.perf_counter()
            outputs = forward_one(model, decoder_layers, layer_ids, ids, triton_topk=triton_topk)
            if first_forward_s is None:
                # The first pass carries any Triton compile / autotune: reported apart from the steady
                # rate, so it is waited for (later prompts are not: their copies land in the writer).
                outputs.wait()
                first_forward_s, first_tokens = time.perf_counter() - t_one, len(ids)
            writer.put(str(entry["id"]), len(entry["prompt_ids"]), outputs)
            tokens += len(ids)
            done.add(str(entry["id"]))
            events.progress("prompts", i, len(todo), "prompts", label=f"{entry['id']}: {len(ids)} tokens")
            events.progress("tokens", tokens, todo_tokens, "tokens")  # the window's projection reads these
    if device == "cuda":
        torch.cuda.synchronize()
    window["forward_s"] = round(time.perf_counter() - t_forward, 3)
    window["first_forward_s"] = round(first_forward_s or 0.0, 3)
    window["tokens"] = tokens
    window["tokens_per_s"] = round(tokens / max(window["forward_s"], 1e-9), 1)
    if len(todo) > 1 and not stopped_early:
        steady_s = window["forward_s"] - window["first_forward_s"]
        window["steady_tokens_per_s"] = round((tokens - first_tokens) / max(steady_s, 1e-9), 1)
    t_release = time.perf_counter()
    release_gpu(model)
    del decoder_layers, model
    window["release_s"] = round(time.perf_counter() - t_release, 3)
    if torch.cuda.is_available():
        window["gpu_bytes_still_allocated"] = int(sum(torch.cuda.memory_allocated(i)
                                                      for i in range(torch.cuda.device_count())))
    window["window_s"] = round(time.perf_counter() - t_window, 3)
    window["since_start_s"] = round(time.perf_counter() - t_start, 3)
    entries = [{"id": str(p["id"]), "file": f"{p['id']}.safetensors", "prompt_len": len(p["prompt_ids"]),
                "num_tokens": len(p["prompt_ids"]) + len(p["completion_ids"])} for p in prompts if str(p["id"]) in done]
    missing = [str(p["id"]) for p in prompts if str(p["id"]) not in done]
    window.update(stopped_early=stopped_early, prompts_done=len(entries), prompts_missing=len(missing))
    used_calls = {fn: n for fn, n in calls.items() if n}
    events.emit("gpu_released", **window)
    gc.collect()  # the model's Python objects (their storage is already gone)

    events.phase("flush")
    writer.finish()
    soundness = extract_check.soundness_of(out, writer.files, layer_ids, events)
    manifest_path = write_manifest(
        out, writer.files,
        format=EXTRACT_FORMAT, complete=not missing, prompts_done=[e["id"] for e in entries],
        prompts_missing=missing, prompts_kept=kept_ids, layers=layer_ids, hidden_size=hidden_size, dtype="bfloat16",
        num_target_layers=num_layers, layer_semantics="hidden_states[k+1]: output of decoder layer k; the last layer after the final norm, as Hugging Face gives it",
        model_path=this_run["model_path"], kernels=binding["bound"], kernel_scheme=binding["scheme"],
        kernels_fast=binding["fast"], topk_pass=this_run["topk_pass"], kernel_calls=used_calls, kernel_policy=args.kernels,
        kernel_decision=decision, versions=versions(), prompts=entries,
        kernel_configs=kernels.autotune_choices(),  # fla's autotuned configs: runs that differ here round differently
        device_map={k: str(v) for k, v in device_map.items()}, devices=devices_used(device_map),
        completions_file=str(Path(args.completions).resolve()), completions_sha256=this_run["completions_sha256"],
        prompt_set_sha256=completions.get("prompt_set_sha256"), checkpoint=facts, window=window,
        soundness=soundness, incomplete_allowed=checked["incomplete"], layer_overrides=overrides,
    )
    manifest_path, out = publish(out, args.out, partial=bool(missing)), Path(args.out)
    events.artifact(str(out), "extract" if not missing else "extract-partial", manifest=str(manifest_path),
                    prompts=len(entries), missing=len(missing))
    return {"out": str(out), "complete": not missing, "prompts": len(entries), "prompts_missing": missing,
            "prompts_kept": kept_ids, "tokens": tokens, "layers": layer_ids,
            "kernels": binding["bound"], "kernels_fast": binding["fast"], "window": window,
            "bytes_written": writer.bytes_written}


if __name__ == "__main__":
    run_worker(main)
