"""The rehearsal server's memory saver: SGLang 0.5.23's pause, continue, release and resume routes.

What it follows (facts and their sources: docs/sglang.md, "Pause and release"):
- `POST /pause_generation {"mode"}` (io_struct.py, PauseGenerationReqInput; tokenizer_manager.py and
  scheduler.py, pause_generation): every mode holds new requests at the server's front until
  `/continue_generation`. "abort" (the default) aborts every request in flight and answers once they
  have ended (each ends 200 with an abort finish, "Aborted"); "retract" puts the running requests back
  in the waiting queue, their KV cache given back (recomputed after continue, the same greedy tokens);
  "in_place" leaves them where they are, KV cache and all. Repeated pauses are answered again; a
  retract after an in_place pause retracts what it held.
- `POST /continue_generation`: held requests go on; answered the same when nothing was paused.
- `POST /release_memory_occupation {"tags"}` (GET too; weight_updater.py, release_memory_occupation):
  tags `kv_cache`, `weights`, `cuda_graph`, none or an empty list meaning all. It asserts the server
  is idle (nothing running; requests waiting count too unless a retract or in_place pause holds them),
  and in SGLang that assertion ends the scheduler and with it the whole server: the client's
  connection closes without an answer. The KV cache's release flushes the prefix cache. Without
  `--enable-memory-saver` a release frees nothing (SGLang's no-op adapter) and still answers 200.
  With it, releasing a tag already released ends the server too (torch_memory_saver: "Cannot pause
  allocation that is not active."), and so does a forward pass over released memory.
- `POST /resume_memory_occupation {"tags"}`: a tag that is not released ends the server (SGLang removes
  it from a set: KeyError), memory saver or not. The weights come back bit for bit with
  `--enable-weights-cpu-backup`; without it they come back as fresh memory, their values lost (the
  buffers SGLang stashes come back).
- With speculative decoding, the draft model's weights do not come back from a `weights` release
  (SGLang 0.5.23; PR #31674, open): the target's return, the drafter's stay wrong. Outputs stay
  correct (the target verifies every token) but nearly no draft is accepted (acceptance length ~1),
  and nothing errors. Here the drafter's weights are zeroed at the resume (it then proposes tokens
  the target rejects); `--draft-weights-survive-release` answers as a fixed SGLang.
- The four routes are ADMIN_OPTIONAL (utils/auth.py): the API key, or the admin key when one is set.
- `/flush_cache` (GET or POST, ADMIN_OPTIONAL, `?timeout=S`; http_server.py, flush_cache; scheduler.py,
  flush_cache; scheduler_components/flush_wrapper.py): the prefix cache is emptied when the server is
  idle as a release counts it (200 "Cache flushed. ..."), else 400 "Flush cache failed." (a timeout
  waits for idle first, else 400 "Timed out waiting for idle state."). Nothing in it looks at the
  released tags: with the KV cache released it answers 200 and touches none of the released memory
  (a release itself flushes after pausing the KV cache; issue #19029's crash was a Mamba pool's clear,
  made a no-op before 0.5.23), so the server serves again after the resume.
- `--release-frees-after S` (not SGLang's flag: torch_memory_saver's timing, slime PR #579): the
  release answers at once but its memory leaves the simulated GPU only S seconds later, as a driver
  that frees after the pause returned; a free-VRAM wait must watch the GPUs, not trust the answer.
- `--sglang-version` before 0.5.6 answers as SGLang 0.5.5 does (http_server.py, pause_generation takes
  only the Request; tokenizer_manager.py, pause_generation: `abort_request(abort_all=True)`): the pause
  reads no body, whatever mode is sent, and aborts every request in flight.

Where the memory is: on simulated GPUs the server's GPU worker holds `--gpu-mib` per GPU, split into
the weights, the KV cache (`--kv-cache-mib`) and the CUDA graphs (`--cuda-graph-mib`); a release
takes its share out of the simulated GPU file and a resume puts it back, so the telemetry agent and a
free-VRAM wait see it leave and come back. On `--device cuda` with the memory saver the weights (and
the drafter's) are loaded, and a KV pool and a graph pool allocated, inside torch_memory_saver's
regions, so NVML sees that memory really leave and come back.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from typing import Any

from remote.drill import simgpu

TAGS = ("kv_cache", "weights", "cuda_graph")  # constants.py, GPU_MEMORY_TYPE_*; also SGLang's order for "all"
PAUSE_MODES = ("abort", "retract", "in_place")
SGLANG_VERSION = "0.5.23"  # the release answered as unless --sglang-version says another
PAUSE_MODES_SINCE = (0, 5, 6)  # io_struct.py, PauseGenerationReqInput: the first release whose pause takes a mode
GRAPH_PHASES = ("prefill", "decode", "target_verify", "draft_prefill", "draft_decode", "draft_extend")
NOT_IDLE = "release_memory_occupation should be called only when server is idle."  # weight_updater.py
KV_SHARE, GRAPH_SHARE = 0.35, 0.03  # of --gpu-mib by default: a 27B bf16 server on 2 x 48 GB keeps ~35 % as KV cache
TMS_MISSING = ("enable_memory_saver is enabled, but torch-memory-saver is not installed. Please install it via "
               "`pip3 install torch-memory-saver`. ")  # utils/torch_memory_saver_adapter.py


def release_of(version: str) -> tuple[int, int, int] | None:
    """"0.5.5" (or "0.5.6.post2") as (0, 5, 5); None when it names no release."""
    match = re.fullmatch(r"(\d+)\.(\d+)(?:\.(\d+))?(?:[.+-]?\w+)*", version.strip())
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


class Refused(Exception):
    """A request SGLang answers with an HTTP error: `status` and the message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class TorchSaver:
    """torch_memory_saver on the GPU (what SGLang's _TorchMemorySaverAdapterReal calls), in its
    in-process allocator mode (SGLang preloads it into the scheduler; a server of one process cannot)."""

    def __init__(self) -> None:
        try:
            from torch_memory_saver import torch_memory_saver
        except ImportError as exc:
            raise RuntimeError(TMS_MISSING + f"({exc})") from None
        torch_memory_saver.hook_mode = "torch"
        self.saver = torch_memory_saver

    def region(self, tag: str, cpu_backup: bool = False) -> contextlib.AbstractContextManager:
        return self.saver.region(tag=tag, enable_cpu_backup=cpu_backup)

    def pause(self, tag: str) -> None:
        self.saver.pause(tag)

    def resume(self, tag: str) -> None:
        self.saver.resume(tag)


class MemorySaver:
    """The pause state, the released tags (SGLang's `offload_tags`) and the memory behind them.

    `server` is the standin's Server: its `running` / `waiting` requests (under `counter_lock`), its
    model, its prefix memory (`finished`) and `die(reason)`, which ends the server as SGLang's
    scheduler failure does."""

    def __init__(self, server: Any, args: Any):
        self.server = server
        self.enabled = bool(args.enable_memory_saver)
        self.weights_cpu_backup = bool(args.enable_weights_cpu_backup)
        self.draft_weights_survive = bool(getattr(args, "draft_weights_survive_release", False))
        self.weights_come_back_wrong = getattr(args, "weights_come_back_wrong", None)  # a fault (`come_back_wrong`)
        self.device = getattr(args, "device", "cpu")
        # SGLang 0.5.5 and earlier: /pause_generation reads no body and aborts every request in flight
        release = release_of(getattr(args, "sglang_version", SGLANG_VERSION))
        self.pause_takes_mode = release is None or release >= PAUSE_MODES_SINCE
        self.cond = threading.Condition()
        self.front_paused = False  # the tokenizer manager's is_pause: new requests wait at the front
        self.engine_paused: str | None = None  # the scheduler's pause: "retract" or "in_place"
        self.computing: set[str] = set()  # requests between two checkpoints (doing a forward pass)
        self.held = 0  # requests waiting at the front
        self.released: set[str] = set()
        self.gpu_mib = int(args.gpu_mib) if args.gpu_file else 0
        kv = args.kv_cache_mib if args.kv_cache_mib is not None else int(self.gpu_mib * KV_SHARE)
        graph = args.cuda_graph_mib if args.cuda_graph_mib is not None else int(self.gpu_mib * GRAPH_SHARE)
        self.share_mib = {"kv_cache": int(kv), "cuda_graph": int(graph)}
        self.share_mib["weights"] = max(0, self.gpu_mib - self.share_mib["kv_cache"] - self.share_mib["cuda_graph"])
        self.torch_saver: TorchSaver | None = None
        self.pools: dict[str, Any] = {}  # on the GPU: the KV and graph pools torch_memory_saver holds
        self.weight_bytes = 0
        self.stashed_buffers: list[tuple[str, Any]] = []
        self.frees_after = float(getattr(args, "release_frees_after", 0.0) or 0.0)
        self.shown = 0  # the latest change written (or due) to the simulated GPU file
        self.flushing = False  # a deferred /flush_cache waits for idle (flush_wrapper.py: one at a time)

    # --- loading ---

    def start_on_gpu(self) -> None:
        """On `--device cuda` with the memory saver: torch_memory_saver or SGLang's refusal to start."""
        if self.enabled and self.device == "cuda":
            self.torch_saver = TorchSaver()

    def region(self, tag: str) -> contextlib.AbstractContextManager:
        """Where the model's memory of `tag` is allocated (a torch_memory_saver region on the GPU)."""
        if self.torch_saver is None:
            return contextlib.nullcontext()
        return self.torch_saver.region(tag, cpu_backup=tag == "weights" and self.weights_cpu_backup)

    def allocate_pools(self, model: Any) -> None:
        """After the weights: the KV pool and the graph pool on the GPU, as the scheduler allocates
        them, and the weights' size for /server_info."""
        self.weight_bytes = sum(t.numel() * t.element_size() for t in (*model.model.parameters(), *model.model.buffers()))
        if self.device != "cuda":
            return
        torch = model.torch
        for tag in ("kv_cache", "cuda_graph"):
            mib = self.share_mib[tag]
            if mib > 0:
                with self.region(tag):
                    self.pools[tag] = torch.ones(mib << 20, dtype=torch.uint8, device="cuda")  # touched: really resident

    def memory_usage(self) -> dict[str, Any]:
        """SGLang's memory_usage (memory_usage.py, build_memory_usage): GiB on one GPU, resident or not."""
        gib = 1 << 10
        if self.gpu_mib:
            weight, kv, graph = (self.share_mib[t] / gib for t in ("weights", "kv_cache", "cuda_graph"))
        else:
            weight = self.weight_bytes / (1 << 30)
            kv, graph = (self.share_mib[t] / gib if t in self.pools else 0.0 for t in ("kv_cache", "cuda_graph"))
        return {"weight": round(weight, 3), "kvcache": round(kv, 3),
                "startup_available": round(simgpu.DEFAULT_TOTAL_MIB / gib, 3) if self.gpu_mib else None,
                "token_capacity": int(self.share_mib["kv_cache"]) * 16, "token_capacity_swa": None,
                "graph": {phase: round(graph if phase == "decode" else 0.0, 3) for phase in GRAPH_PHASES}}

    def server_args(self) -> dict[str, bool]:
        """The launch arguments /server_info reports (and each internal_states entry)."""
        return {"enable_memory_saver": self.enabled, "enable_weights_cpu_backup": self.weights_cpu_backup}

    def resident_mib(self) -> int:
        """MiB per simulated GPU the server's worker holds now."""
        return sum(mib for tag, mib in self.share_mib.items() if not (self.enabled and tag in self.released))

    # --- the front and the scheduler's checkpoints ---

    def wait_at_front(self) -> None:
        """A new request waits here while generation is paused (tokenizer_manager: is_pause_cond)."""
        with self.cond:
            self.held += 1
            try:
                self.cond.wait_for(lambda: not self.front_paused)
            finally:
                self.held -= 1

    def unpaused_within(self, timeout: float) -> bool:
        """/health's generation waits at the front too: True once not paused, False after `timeout`."""
        with self.cond:
            return self.cond.wait_for(lambda: not self.front_paused, timeout)

    def checkpoint(self, request: Any, step_delay: float = 0.0) -> bool:
        """Before each forward pass of `request`: park while the scheduler is paused (a retract moves a
        running request back to the waiting queue and gives its KV cache back), then run (waiting ->
        running); True when its KV cache must be recomputed. A forward pass over released memory ends
        the server."""
        server = self.server
        if step_delay:
            time.sleep(step_delay)  # --step-delay: the forward pass takes this much longer
        with self.cond:
            self.computing.discard(request.rid)
            retracted = False
            while self.engine_paused is not None and not request.aborted.is_set():
                if self.engine_paused == "retract":
                    with server.counter_lock:
                        if server.running.pop(request.rid, None) is not None:
                            server.waiting[request.rid] = request
                            request.retractions += 1
                            retracted = True
                self.cond.notify_all()
                self.cond.wait()
            with server.counter_lock:  # (back) into the running batch: one step at a time, as a scheduler's loop
                if server.waiting.pop(request.rid, None) is not None:
                    server.running[request.rid] = request
            gone = [t for t in ("weights", "kv_cache") if t in self.released] if self.enabled else []
            if gone and not request.aborted.is_set():
                server.die(f"RuntimeError: CUDA error: an illegal memory access was encountered (a forward pass "
                           f"while {' and '.join(gone)} are released: the rehearsal server's reading of "
                           f"torch_memory_saver, whose release unmaps that memory)")
            self.computing.add(request.rid)
            return retracted

    def finished(self, request: Any) -> None:
        with self.cond:
            self.computing.discard(request.rid)
            self.cond.notify_all()

    # --- the four routes ---

    def pause(self, mode: str, settle_s: float = 600.0) -> None:
        """Answered once the pause holds: no forward pass runs (retract, in_place), or every request in
        flight has ended (abort)."""
        server = self.server
        with self.cond:
            self.front_paused = True
            if mode != "abort":
                self.engine_paused = mode
            self.cond.notify_all()
        deadline = time.monotonic() + settle_s
        while time.monotonic() < deadline:
            if mode == "abort":
                server.abort(None, True)  # tokenizer_manager.pause_generation: abort_all until none is left
                with self.cond:
                    self.cond.notify_all()
                with server.counter_lock:
                    if not server.running and not server.waiting:
                        return
                time.sleep(0.02)
                continue
            with self.cond:
                if self.cond.wait_for(lambda: not self.computing, 0.5):
                    return
        raise Refused(503, f"the pause did not settle within {settle_s:g} s")

    def continue_(self) -> None:
        with self.cond:
            self.front_paused = False
            self.engine_paused = None
            self.cond.notify_all()

    def idle(self) -> bool:
        """weight_updater.is_fully_idle(ignore_waiting=the scheduler is paused)."""
        server = self.server
        with self.cond, server.counter_lock:
            if self.computing or server.running:
                return False
            return self.engine_paused is not None or not server.waiting

    def release(self, tags: list[str] | None) -> None:
        tags = list(tags or TAGS)
        if not self.idle():
            self.server.die(f"AssertionError: {NOT_IDLE}")
        with self.cond:
            for tag in [t for t in TAGS if t in tags]:
                if self.enabled and tag in self.released:
                    self.server.die(f"[torch_memory_saver.cpp] Cannot pause allocation that is not active. tag={tag}")
            already = set(self.released)
            self.released.update(tags)  # offload_tags.add: an unknown tag is kept, and changes nothing
            if "kv_cache" in tags:
                self._pause("kv_cache")
                self.server.flush_cache()
            if "weights" in tags:
                model = self.server.model
                self.stashed_buffers = [(n, b.detach().clone()) for n, b in model.model.named_buffers()] if model else []
                self._pause("weights")
            if "cuda_graph" in tags:
                self._pause("cuda_graph")
            self._show(already, self.frees_after)

    def resume(self, tags: list[str] | None) -> None:
        tags = list(tags or TAGS)
        with self.cond:
            already = set(self.released)
            for tag in tags:
                if tag not in self.released:
                    self.server.die(f"KeyError: {tag!r} (resume_memory_occupation of a tag that is not released)")
                self.released.discard(tag)
            if "cuda_graph" in tags:
                self._resume("cuda_graph")
            if "weights" in tags:
                self._resume("weights")
                self._restore_weights()
                if self.enabled:
                    come_back_wrong(self.server.model, self.weights_come_back_wrong)
            if "kv_cache" in tags:
                self._resume("kv_cache")
            self._show(already)

    # --- the memory behind the tags ---

    def _pause(self, tag: str) -> None:
        if self.enabled and self.torch_saver is not None:
            self.server.model.torch.cuda.synchronize()
            self.torch_saver.pause(tag)

    def _resume(self, tag: str) -> None:
        if self.enabled and self.torch_saver is not None:
            self.torch_saver.resume(tag)

    def _restore_weights(self) -> None:
        """SGLang's _import_static_state (the buffers); without a CPU backup the parameters are lost: on
        the GPU they are whatever fresh memory holds, on a simulated GPU they are zeroed."""
        model = self.server.model
        if model is None:
            return
        torch = model.torch
        with torch.inference_mode():
            named = dict(model.model.named_buffers())
            for name, value in self.stashed_buffers:
                named[name][...] = value
            if self.enabled and not self.weights_cpu_backup and self.torch_saver is None:
                for parameter in model.model.parameters():
                    parameter.zero_()
            speculator = getattr(model, "speculator", None)
            if speculator is not None and self.enabled and not self.draft_weights_survive:  # PR #31674 (above)
                for weight in speculator.drafter.w.values():
                    weight.zero_()
        self.stashed_buffers = []

    def _show(self, before: set[str], delay: float = 0.0) -> None:
        """The simulated GPU file shows what the worker holds now, or `delay` seconds from now
        (`--release-frees-after`: the release answered before the memory left). A later change
        supersedes one still due."""
        server = self.server
        if not (self.enabled and server.args.gpu_file and server.gpu_worker is not None and before != self.released):
            return
        self.shown += 1
        if delay <= 0:
            self._write(self.shown)
            return
        timer = threading.Timer(delay, self._write, args=(self.shown,))
        timer.daemon = True
        timer.start()

    def _write(self, change: int) -> None:
        server = self.server
        with self.cond:
            if change == self.shown and server.gpu_worker is not None:
                simgpu.hold(server.args.gpu_file, server.gpu_worker.pid, self.resident_mib(),
                            simgpu.parse_indices(server.args.gpu_indices))

    # --- /flush_cache ---

    def flush(self, timeout_s: float) -> tuple[bool, str]:
        """SGLang's /flush_cache (scheduler.py, flush_cache; flush_wrapper.py, SchedulerFlushWrapper):
        (success, message). Flushed when idle as a release counts it (a retract or in_place pause
        ignores the waiting queue); with a timeout, waited for idle until then. The released tags
        play no part (0.5.23 reads no `offload_tags` there)."""
        with self.cond:
            if self.flushing:
                return False, "Another flush_cache is already in progress."
            if timeout_s <= 0 or self.idle():
                return self._flush(), ""
            self.flushing = True
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                if self.idle():
                    return self._flush(), ""
                with self.cond:
                    self.cond.wait(min(0.05, max(0.0, deadline - time.monotonic())))
            return False, "Timed out waiting for idle state."
        finally:
            with self.cond:
                self.flushing = False

    def _flush(self) -> bool:
        if not self.idle():
            return False  # "Cache not flushed because there are pending requests."
        self.server.flush_cache()
        return True


CONTROL_ROUTES = ("/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation")
FLUSH_ROUTE = "/flush_cache"  # http_server.py, flush_cache: GET and POST, ADMIN_OPTIONAL
FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, "
           "the operation will not be performed.)\n")  # http_server.py, flush_cache
FLUSH_FAILED = "Flush cache failed.\n"
GET_TOO = ("/release_memory_occupation", "/resume_memory_occupation")  # http_server.py: methods GET and POST
PAUSED = {"message": "Generation paused successfully.", "status": "ok"}  # http_server.py, pause_generation
CONTINUED = {"message": "Generation continued successfully.", "status": "ok"}


def add_arguments(parser: Any) -> None:
    """The rehearsal server's memory saver flags (SGLang's names where SGLang has them)."""
    parser.add_argument("--admin-api-key", help="SGLang's --admin-api-key: required instead of --api-key on the "
                        "admin routes (here: pause, continue, release, resume)")
    parser.add_argument("--enable-memory-saver", action="store_true",
                        help="SGLang's: release_memory_occupation gives GPU memory back (simulated, or "
                             "torch_memory_saver on --device cuda)")
    parser.add_argument("--enable-weights-cpu-backup", action="store_true",
                        help="SGLang's: released weights are kept in CPU memory and come back as they were")
    parser.add_argument("--draft-weights-survive-release", action="store_true",
                        help="answer as a fixed SGLang (PR #31674): the draft model's weights come back from a "
                             "`weights` release too (default: they come back wrong, as in SGLang 0.5.23: "
                             "acceptance length ~1, outputs still correct)")
    parser.add_argument("--release-frees-after", type=float, default=0.0, metavar="S",
                        help="a fault seen with torch_memory_saver (slime PR #579): a release answers at once but its "
                             "memory leaves the simulated GPU only S seconds later (default: at once)")
    parser.add_argument("--kv-cache-mib", type=int, metavar="MIB",
                        help="the KV cache's MiB per GPU (default: 35 %% of --gpu-mib simulated, none on cuda)")
    parser.add_argument("--cuda-graph-mib", type=int, metavar="MIB",
                        help="the CUDA graphs' MiB per GPU (default: 3 %% of --gpu-mib simulated, none on cuda)")


def answer(saver: MemorySaver, path: str, body: dict) -> tuple[int, Any]:
    """One control route's answer (status, JSON body) for a body already parsed as a JSON object;
    Refused(400) for what FastAPI's validation of the request struct refuses."""
    if path == "/pause_generation":
        mode = body.get("mode", "abort") if saver.pause_takes_mode else "abort"  # 0.5.5: no body read at all
        if mode not in PAUSE_MODES:
            raise Refused(400, f"mode: Input should be 'abort', 'retract' or 'in_place', got {mode!r}")
        saver.pause(mode)
        return 200, PAUSED
    if path == "/continue_generation":
        saver.continue_()
        return 200, CONTINUED
    tags = body.get("tags")
    if tags is not None and not (isinstance(tags, list) and all(isinstance(t, str) for t in tags)):
        raise Refused(400, f"tags: Input should be a valid list of strings or null, got {tags!r}")
    (saver.release if path == "/release_memory_occupation" else saver.resume)(tags)
    return 200, None  # the endpoint returns None: JSON null


WRONG_TENSOR = "lm_head.weight"  # the tensor --weights-come-back-wrong changes


def come_back_wrong(model: Any, delta: float | None) -> None:
    """The `--weights-come-back-wrong` fault, at a `weights` resume."""
    if not delta or model is None:
        return
    import torch

    with torch.inference_mode():
        dict(model.model.named_parameters())[WRONG_TENSOR].add_(delta)


def flush_answer(saver: MemorySaver, timeout: str | None) -> tuple[int, str]:
    """/flush_cache's (status, text body) for its `timeout` query value (None: 0); Refused(400) for a
    value FastAPI's Query(0.0, ge=0.0) refuses."""
    try:
        timeout_s = float(timeout) if timeout is not None else 0.0
    except ValueError:
        raise Refused(400, f"timeout: Input should be a valid number, got {timeout!r}") from None
    if not timeout_s >= 0:
        raise Refused(400, f"timeout: Input should be greater than or equal to 0, got {timeout!r}")
    success, message = saver.flush(timeout_s)
    return (200, FLUSHED) if success else (400, message or FLUSH_FAILED)
