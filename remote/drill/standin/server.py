"""The rehearsal server's model worker: what SGLang's scheduler and tokenizer manager keep, in one
process, behind the small set of public methods the HTTP front (`http_front`) and the chat route
(`remote.drill.chat`) call.

- start-up: the GPU worker child (`gpu_worker`), the simulated weight load with SGLang's log lines,
  then SGLang's warm-up through the server's own HTTP address, and "Up";
- the door the front uses: health and readiness, /model_info, /server_info, /v1/models and /metrics
  bodies, tokenizing and decoding, sampling params resolved and verified, `run_request` (queued,
  generated one at a time, answered with SGLang's meta_info), aborts, and the memory saver's routes;
- what `remote.drill.memory_saver` reaches: the `running` / `waiting` requests under `counter_lock`,
  `model`, `flush_cache` and `die`, which ends the server as a failing SGLang scheduler ends it.

A full queue is `QueueFull`; the front decides what HTTP answer that is.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from remote.drill import memory_saver, simgpu
from remote.drill.memory_saver import MemorySaver
from remote.drill.service import READY_LINE  # SGLang's line, which the service's crowding worker waits for
from remote.drill.sglang_contract import resolve_sampling_params, verify_sampling_params
from remote.drill.standin.gpu_worker import start_gpu_worker
from remote.drill.standin.model import Generation, Model, Request, generate, generate_tokens, import_ahead
from remote.drill.weights_checker import WeightsChecker

VERSION = f"{memory_saver.SGLANG_VERSION}-standin"  # /server_info's version (--sglang-version, with -standin)
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # http_server.py
WARMUP_TEXT = "The capital city of France is"  # http_server.py, _execute_server_warmup
WARMUP_MAX_NEW_TOKENS = 8
PREFIX_MEMORY = 64  # finished sequences kept for cached_tokens (SGLang's radix cache, much smaller)
QUEUE_FULL = "The request queue is full."  # scheduler.py, _abort_on_queued_limit


def log(msg: str) -> None:
    """A start-up log line in SGLang's shape, flushed so a `tail -f` sees it at once."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


class QueueFull(Exception):
    """`--max-queued-requests` reached: SGLang aborts the request with HTTP 503 (scheduler.py,
    _abort_on_queued_limit, through _handle_abort_finish_reason)."""


class Server:
    """The server's state: start-up, model, scheduler counters, and the simulated GPU worker.

    The front calls the methods under "what the front asks"; the rest is the server's own, or
    the memory saver's (see the module's docstring)."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model_path = Path(args.model)
        config_file = self.model_path / "config.json"
        if not config_file.is_file():
            raise SystemExit(f"standin: --model {args.model}: no config.json there (build it with remote.drill.tinymodel)")
        self.config = json.loads(config_file.read_text())
        self.served_name = args.served_name or str(self.model_path)
        self.version = f"{getattr(args, 'sglang_version', memory_saver.SGLANG_VERSION)}-standin"
        self.preferred = json.loads(args.preferred_sampling_params) if getattr(args, "preferred_sampling_params", None) else None
        self.model: Model | None = None
        self.load_error: str | None = None
        self.status = "Starting"  # tokenizer_manager.ServerStatus: Starting, Up, UnHealthy
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.health_calls = 0
        self.running: dict[str, Request] = {}
        self.waiting: dict[str, Request] = {}
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.cached_tokens = 0
        self.requests_done = 0
        self.gen_seconds = 0.0
        self.finished: deque[list[int]] = deque(maxlen=PREFIX_MEMORY)
        self.counter_lock = threading.Lock()
        self.gpu_worker: subprocess.Popen | None = None
        # Every forward pass runs on this one thread, as SGLang's one scheduler runs the model, never on
        # the HTTP front's worker threads: CUDA libraries keep state per thread (cuBLAS a handle and a
        # workspace), so forwards spread over the front's threads likely grew the server's GPU memory
        # with every thread the load woke (the crowded card's extraction ran out of room on the H100,
        # and ran with this; docs/benchmarks.md, 2026-12-06).
        self.scheduler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="scheduler")
        self.saver = MemorySaver(self, args)  # pause, continue, release, resume (remote.drill.memory_saver)
        # /weights_checker as the release answered as has it (remote.drill.weights_checker)
        self.weights_checker = WeightsChecker(self, getattr(args, "sglang_version", memory_saver.SGLANG_VERSION))

    @property
    def url(self) -> str:
        """Where the HTTP front listens (the warm-up sends its requests there)."""
        return f"http://{self.args.host}:{self.args.port}"

    # --- start-up ---

    def start_gpu_worker(self) -> None:
        """The child that holds the simulated GPU memory, with --gpu-file (`gpu_worker`)."""
        self.gpu_worker = start_gpu_worker(self.args)

    def load(self) -> None:
        """Load the model after the configured delay, logging SGLang's start-up lines."""
        try:
            log(f"Load weight begin. avail mem={simgpu.DEFAULT_TOTAL_MIB / 1024:.2f} GB (simulated)")
            device = getattr(self.args, "device", "cpu")
            # The libraries import during the simulated load (a start takes the longer of the two, not
            # their sum), as SGLang's processes start while the shards are read.
            importing = threading.Thread(target=import_ahead, args=(device,), name="import", daemon=True)
            importing.start()
            steps = 4
            for i in range(1, steps + 1):
                time.sleep(self.args.load_delay / steps)
                log(f"Loading safetensors checkpoint shards: {i * 100 // steps}% Completed | {i}/{steps}")
            importing.join()
            begin = time.time()
            self.saver.start_on_gpu()
            model = Model(self.model_path, self.args.dtype, device, self.saver.region)
            log(f"Load weight end. elapsed={time.time() - begin:.2f} s, type={type(model.model).__name__}")
            if self.args.speculative_drafter:
                from remote.drill.specdecode import load_speculator

                with self.saver.region("weights"):  # the draft model's weights are released with the target's
                    model.speculator = load_speculator(model.model, self.model_path, self.args.speculative_drafter)
                log(f"DFLASH draft model loaded from {self.args.speculative_drafter}, "
                    f"block size {model.speculator.block_size}")
            model.nan_after = self.args.nan_after
            self.saver.allocate_pools(model)
            if self.args.skip_server_warmup or self.args.flap_health:
                self.up()  # SGLang's --skip-server-warmup: Up at once (before any request can be served)
            self.model = model
        except Exception as exc:  # noqa: BLE001 - the server stays up and says why it cannot serve
            self.load_error = f"{type(exc).__name__}: {exc}"
            log(f"Load failed: {self.load_error}")

    def warm_up_when_loaded(self) -> None:
        """The warm-up once the model is in; none when its load failed, or when the load already
        made it Up (--skip-server-warmup, --flap-health)."""
        while self.model is None and self.load_error is None:
            time.sleep(0.05)
        if self.model is not None and self.status == "Starting":
            self.warm_up()

    def warm_up(self) -> None:
        """SGLang's warm-up (_execute_server_warmup): /model_info, then an 8-token /generate through
        its own HTTP front; Up on a 200, then "fired up" in the log (SGLang sets Up just before it
        logs; here the line comes first, so a log follower never sees ready after /health does)."""
        time.sleep(self.args.warmup_delay)
        headers = {"Content-Type": "application/json"}
        if self.args.api_key:
            headers["Authorization"] = f"Bearer {self.args.api_key}"
        body = {"text": WARMUP_TEXT, "sampling_params": {"temperature": 0, "max_new_tokens": WARMUP_MAX_NEW_TOKENS}}
        try:
            for path, data in (("/model_info", None), ("/generate", json.dumps(body).encode())):
                request = urllib.request.Request(self.url + path, data, headers)
                with urllib.request.urlopen(request, timeout=600) as response:
                    response.read()
        except OSError as exc:
            log(f"Initialization failed. warmup error: {exc}")
            self.status = "UnHealthy"
            return
        self.up()

    def up(self) -> None:
        log(READY_LINE)
        self.ready_at = time.time()
        self.status = "Up"

    # --- what the front asks ---

    def health(self) -> int:
        """/health's status: 503 until Up; then 200 once a one-token generation answers within
        SGLANG_HEALTH_CHECK_TIMEOUT, which keeps the server Up, else 503 and UnHealthy. With
        --flap-health, until Up, 200 and 503 by turns (the fault)."""
        if self.args.flap_health and self.status != "Up":
            self.health_calls += 1
            return 200 if self.health_calls % 2 == 0 else 503
        if self.status == "Starting" or self.model is None:
            return 503
        if self._healthy_within(HEALTH_CHECK_TIMEOUT_S):
            self.status = "Up"
            return 200
        self.status = "UnHealthy"
        return 503

    def ready(self) -> bool:
        """/ready (tokenizer_manager.is_ready): up, healthy and not paused."""
        return self.status == "Up" and not self.saver.front_paused

    def serving_error(self) -> str | None:
        """Why no request can be served (the model still loading, or its load failed); None once it
        can. The port is open without a model only with --flap-health, or after a failed load."""
        if self.model is not None:
            return None
        return self.load_error or "the model is still loading"

    def model_info(self) -> dict:
        """http_server.py, model_info: the fields SGLang reports (no multimodal, no parsers here)."""
        return {
            "model_path": str(self.model_path),
            "served_model_name": self.served_name,
            "tokenizer_path": str(self.model_path),
            "is_generation": True,
            "preferred_sampling_params": self.preferred,
            "weight_version": "default",
            "load_format": "auto",
            "reasoning_parser": None,
            "tool_call_parser": None,
            "disaggregation_mode": "null",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": self.config.get("model_type"),
            "architectures": self.config.get("architectures"),
        }

    def server_info(self) -> dict:
        """http_server.py, server_info: the launch's arguments, live state, version; and the
        rehearsal server's own facts (pid, gpu_worker_pid, started_at, ready_at, standin)."""
        args = self.args
        return {
            "model_path": str(self.model_path),
            "served_model_name": self.served_name,
            "host": args.host,
            "port": args.port,
            "device": getattr(args, "device", "cpu"),
            "dtype": args.dtype,
            "api_key": "<redacted>" if args.api_key else None,
            "enable_metrics": args.metrics,
            "preferred_sampling_params": json.dumps(self.preferred) if self.preferred else None,
            "max_queued_requests": args.max_queued_requests,
            "skip_server_warmup": False,
            **self.saver.server_args(),
            "startup_time": self.started_at,
            "internal_states": [{"last_gen_throughput": self._throughput(), **self.saver.server_args(),
                                 "memory_usage": self.saver.memory_usage()}],
            "version": self.version,
            "frontend": "python",
            "standin": True,
            "pid": os.getpid(),
            "gpu_worker_pid": self.gpu_worker.pid if self.gpu_worker else None,
            "released": sorted(self.saver.released), "paused": self.saver.front_paused,
            "requests": {"running": len(self.running), "waiting": len(self.waiting), "held": self.saver.held},
            "started_at": self.started_at,
            "ready_at": self.ready_at,
            "speculative_algorithm": None,
            **(self.model.speculator.server_args() if self.model is not None and self.model.speculator else {}),
        }

    def model_list(self) -> dict:
        """/v1/models: the one served model, in OpenAI's list shape."""
        return {"object": "list", "data": [{"id": self.served_name, "object": "model", "created": int(self.started_at),
                                            "owned_by": "sglang", "root": self.served_name}]}

    def metrics_text(self) -> str:
        """SGLang's gauges and counters under its scheduler label set (metrics_collector.py,
        SchedulerMetricsCollector.init_new: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank)."""
        label = f'{{model_name="{self.served_name}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"}}'
        rows = [
            ("sglang:num_running_reqs", "gauge", "The number of running requests.", len(self.running)),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", len(self.waiting)),
            ("sglang:token_usage", "gauge", "The token usage.", 0.01 if self.running else 0.0),
            ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", self._throughput()),
            ("sglang:cache_hit_rate", "gauge", "The prefix cache hit rate.",
             self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0),
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens),
            ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", self.generated_tokens),
            ("sglang:num_requests_total", "counter", "Number of requests processed.", self.requests_done),
        ]
        out = []
        for name, kind, help_text, value in rows:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {float(value)}"]
        return "\n".join(out) + "\n"

    def loads(self, include: set[str] | None) -> dict:
        """/v1/loads (entrypoints/v1_loads.py, managers/load_snapshot.py): one scheduler's load snapshot,
        taken now (SGLang's scheduler publishes one at each prefill, every 15 decode steps and when
        idle; this one is never older than the request). `include`: the sections asked for (None: all);
        an unknown one is ValueError, SGLang's 400."""
        sections = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if include is not None and not include <= sections:
            raise ValueError(f"Invalid include sections: {include - sections}. Valid options: {sorted(sections)}")
        with self.counter_lock:
            running, waiting = len(self.running), len(self.waiting)
        load: dict[str, Any] = {
            "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting,
            "num_waiting_uncached_tokens": 0, "num_used_tokens": 0, "num_total_tokens": 0, "num_active_tokens": 0,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": 0,
            "max_running_requests": 1,  # one request at a time (the model lock), the others wait
            "token_usage": 0.01 if running else 0.0, "gen_throughput": self._throughput(),
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "utilization": 1.0 if running else 0.0, "total_prefill_uncached_tokens": self.prompt_tokens - self.cached_tokens,
            "total_prefill_busy_us": 0, "decode_moments": None,
        }
        if include is None or include != {"core"}:
            if include is None or "all" in include or "disagg" in include:
                load["disaggregation"] = {"mode": "null", "prefill_bootstrap_queue_reqs": 0,
                                          "prefill_inflight_queue_reqs": 0, "decode_prealloc_queue_reqs": 0,
                                          "decode_transfer_queue_reqs": 0, "decode_retracted_queue_reqs": 0,
                                          "kv_transfer_speed_gb_s": 0.0, "kv_transfer_latency_ms": 0.0}
            if include is None or "all" in include or "queues" in include:
                load["queues"] = {"waiting": waiting, "grammar": 0, "paused": self.saver.held, "retracted": 0,
                                  "prealloc_ready": 0}
        return {"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()), "version": self.version,
                "accelerator": None, "num_accelerators": 1, "loads": [load]}

    def tokenize(self, text: str) -> list[int]:
        """`text`'s token ids, as /generate and /v1/completions tokenize a prompt."""
        assert self.model is not None
        return self.model.tokenizer(text)["input_ids"]

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """The token ids of the model's chat template over `messages`, with the generation prompt."""
        assert self.model is not None
        prompt = self.model.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.model.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens left out."""
        assert self.model is not None
        return self.model.decode(ids)

    def vocab_size(self) -> int:
        assert self.model is not None
        return self.model.vocab_size

    def sampling_params(self, given: dict[str, Any]) -> dict[str, Any]:
        """A request's sampling params, every one resolved: defaults, then --preferred-sampling-params,
        then the request's; then SamplingParams.verify's range checks (ValueError)."""
        params = resolve_sampling_params(given, self.preferred)
        verify_sampling_params(params, self.vocab_size())
        return params

    def run_request(self, rid: str, input_ids: list[int], params: dict[str, Any], *,
                    client_gone: threading.Event | None = None,
                    on_token: Callable[[list[int]], None] | None = None) -> tuple[Generation, dict[str, Any]]:
        """Queue the request for the model (one at a time, like one scheduler batch of one), generate,
        and return its generation and SGLang's meta_info; QueueFull past --max-queued-requests.
        `client_gone` set (the front saw its client disconnect) aborts it at its next step, as
        SGLang's tokenizer manager sends the scheduler an abort; `on_token` streams its tokens."""
        assert self.model is not None
        request = Request(rid, input_ids, params, on_token=on_token)
        self.saver.wait_at_front()  # a paused server holds new requests before they are queued
        begin = time.time()
        with self.counter_lock:
            limit = self.args.max_queued_requests
            if limit is not None and len(self.waiting) + 1 > limit:
                raise QueueFull(QUEUE_FULL)
            self.waiting[request.rid] = request
            cached = self._cached_prefix(request.input_ids)
        with self.model.lock:
            try:
                def checkpoint() -> bool:
                    retracted = self.saver.checkpoint(request, self.args.step_delay)
                    if client_gone is not None and client_gone.is_set():
                        request.aborted.set()
                    return retracted

                request.checkpoint = checkpoint
                request.checkpoint()  # it runs from here (waiting -> running), unless the scheduler is paused
                generation, speculative = self.scheduler.submit(generate, self.model, request).result()
            finally:
                with self.counter_lock:
                    self.running.pop(request.rid, None)
                    self.waiting.pop(request.rid, None)
                self.saver.finished(request)
        elapsed = time.time() - begin
        with self.counter_lock:
            self.prompt_tokens += len(request.input_ids)
            self.cached_tokens += cached
            self.generated_tokens += len(generation.output_ids)
            self.gen_seconds += elapsed
            self.requests_done += 1
            self.finished.append(request.input_ids + generation.output_ids)
        meta = {
            "id": request.rid,
            "finish_reason": generation.finish_reason,
            "prompt_tokens": len(request.input_ids),
            "weight_version": "default",
            "num_retractions": request.retractions,
            "reasoning_tokens": 0,
            "completion_tokens": len(generation.output_ids),
            "cached_tokens": cached,
            "e2e_latency": round(elapsed, 6),
            **speculative,  # SGLang's spec_* fields when the request was decoded speculatively
        }
        return generation, meta

    def abort(self, rid: str | None, abort_all: bool) -> None:
        """/abort_request: the requests whose rid starts with `rid`, or all of them, end as aborted."""
        with self.counter_lock:
            for request in [*self.waiting.values(), *self.running.values()]:
                if abort_all or (rid and request.rid.startswith(rid)):
                    request.aborted.set()

    def control(self, path: str, body: dict) -> tuple[int, Any]:
        """One of the memory saver's four routes (`remote.drill.memory_saver.CONTROL_ROUTES`): its
        status and JSON body; memory_saver.Refused for what SGLang refuses. Each is logged as it comes
        (an access log's line, before the answer: a request that ends the server is logged too), so
        a test counts what reached the server (`tests/test_give_back_race.py`)."""
        log(f"POST {path} {json.dumps(body, sort_keys=True)}")
        return memory_saver.answer(self.saver, path, body)

    def flush(self, timeout: str | None) -> tuple[int, str]:
        """/flush_cache (`timeout`: its query value): status and text body
        (`remote.drill.memory_saver.flush_answer`); memory_saver.Refused for a bad timeout. Logged as
        the memory saver's routes are, so a test counts what reached the server."""
        log(f"POST {memory_saver.FLUSH_ROUTE} timeout={timeout}")
        return memory_saver.flush_answer(self.saver, timeout)

    def check_weights(self, body: dict) -> tuple[int, Any]:
        """/weights_checker: its status and JSON body (`remote.drill.weights_checker`); memory_saver.Refused
        for what FastAPI's validation refuses."""
        return self.weights_checker.answer(body)  # read beside a parked request (one paused holds the model lock)

    # --- the server's own, and the memory saver's ---

    def _throughput(self) -> float:
        return round(self.generated_tokens / self.gen_seconds, 3) if self.gen_seconds else 0.0

    def _cached_prefix(self, ids: list[int]) -> int:
        """Prompt tokens a prefix cache would hold: the longest prefix shared with a finished
        sequence, at most all but the last (one token is always computed)."""
        best = 0
        for seq in self.finished:
            n = 0
            for a, b in zip(seq, ids[:-1], strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return best

    def flush_cache(self) -> None:
        """The prefix cache is emptied (a KV cache release flushes it)."""
        with self.counter_lock:
            self.finished.clear()

    def die(self, reason: str) -> None:
        """End the server as a failing SGLang scheduler does (scheduler.py, run_scheduler_process: the
        exception logged, SIGQUIT to the server, which kills its process tree): no answer is sent."""
        log(f"Scheduler hit an exception: Traceback (most recent call last):\n{reason}")
        log("SIGQUIT received. It usually means one child failed.")
        sys.stdout.flush()
        if self.gpu_worker is not None:
            with contextlib.suppress(OSError):
                self.gpu_worker.kill()  # kill_process_tree: the scheduler's memory goes with it
        os.kill(os.getpid(), signal.SIGKILL)

    def _healthy_within(self, timeout: float) -> bool:
        """/health's check (http_server.py, health_generate): any output within the timeout counts,
        so a busy model is healthy; else a one-token generation must answer in time."""
        assert self.model is not None
        if self.saver.front_paused and not self.saver.unpaused_within(timeout):
            return False  # its one-token request waited at a paused front until the timeout
        if self.running:
            return True
        request = Request(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], resolve_sampling_params(
            {"max_new_tokens": 1, "temperature": 0.0}, None))
        if not self.model.lock.acquire(timeout=timeout):
            return bool(self.running)
        try:
            self.scheduler.submit(generate_tokens, self.model, request).result()
        finally:
            self.model.lock.release()
        return True
