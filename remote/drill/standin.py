"""The rehearsal server: a small real model behind SGLang's HTTP endpoints, for the drill and tests.

    python -m remote.drill.standin --model DIR --port N [--host 127.0.0.1] [--load-delay S]
        [--warmup-delay S | --skip-server-warmup] [--device cpu|cuda] [--dtype float32|bfloat16] [--api-key KEY]
        [--preferred-sampling-params JSON] [--max-queued-requests N] [--served-name NAME] [--metrics]
        [--gpu-file F --gpu-mib M [--release-after S | --hold-until-killed] [--stubborn-holder]]
        [--flap-health] [--speculative-drafter DRAFTER_DIR] [--step-delay S]
        [--enable-memory-saver [--enable-weights-cpu-backup] [--kv-cache-mib M] [--cuda-graph-mib M]]
        [--admin-api-key KEY]

It serves the tiny target (`remote.drill.tinymodel`) with transformers, and behaves as SGLang 0.5.23
does where the console and the workers meet it (each fact and its SGLang source: docs/sglang.md):
- start-up: the port stays closed while the weights load (SGLang starts uvicorn only once its
  scheduler has them), logging SGLang's lines ("Load weight begin", shard progress, "Load weight end.
  elapsed=..."); then it listens while "Starting": /health and /ready answer 503, the rest serves;
  after `--warmup-delay` it sends itself SGLang's warm-up (/model_info, then an 8-token /generate),
  turns "Up" and logs "The server is fired up and ready to roll!";
  GET  /health, /health_generate   503 until Up; then 200 once a one-token generation has answered
                                   (within SGLANG_HEALTH_CHECK_TIMEOUT, 20 s), else 503
  GET  /ready                      200 when Up, else 503
  GET  /model_info (/get_model_info), /server_info (/get_server_info), /v1/models
  POST /generate                   SGLang's JSON contract: `text` or `input_ids` (one, or a batch: a list
                                   answered by a list), `sampling_params` (unknown keys: 400), `rid`;
                                   `text`, `output_ids` (the stop token kept), `meta_info` (id,
                                   finish_reason object, prompt/completion/cached tokens, e2e_latency...)
  POST /v1/completions             OpenAI-style (temperature 1.0 unless given, as SGLang), return_token_ids
  POST /v1/chat/completions        OpenAI chat: the model's chat template, usage, finish reasons, stream
                                   (SSE chunks, data: [DONE]) (`remote.drill.chat`)
  POST /abort_request              {"rid": ...} or {"abort_all": true}: an abort finish, 200
  POST /pause_generation           {"mode": abort (default) | retract | in_place}; /continue_generation
  POST /release_memory_occupation  {"tags": kv_cache, weights, cuda_graph; none: all}; /resume_memory_occupation
                                   (GET too): SGLang's memory saver, `remote.drill.memory_saver`: each
                                   mode's effect on requests in flight, the idle assertion and the
                                   repeated calls that end SGLang's server, the memory leaving the
                                   simulated GPU (torch_memory_saver's real release on --device cuda)
  GET  /metrics                    with --metrics: SGLang's gauges and counters, its label set
- `--api-key KEY`: every route but /health*, /ready* and /metrics* answers 401 without
  `Authorization: Bearer KEY` (the four memory saver routes want `--admin-api-key` instead when set); `--preferred-sampling-params` is laid under each request's as SGLang
  does; `--max-queued-requests N` aborts with 503 "The request queue is full." past N waiting.
- errors in SGLang's shapes: a contract violation `{"error": "..."}`, a bad value `{"error":
  {"message": ...}}`, an unparsable body or an abort's HTTP error `{"object": "error", "message", ...}`,
  an unknown route `{"detail": "Not Found"}` (`remote.drill.sglang_contract`).

Generation is one function, `generate_tokens` (prefill, then one token per step through the KV
cache, SGLang's logit processing and finish checks), so a speculative drafter can take its place.
With `--speculative-drafter` a DFlash checkpoint drafts for it (`remote.drill.specdecode`, real
DFLASH speculative decoding: the drafter proposes a block from the target's layers, the target
verifies greedily): greedy requests without logit processing or stop strings are decoded so and
their meta_info carries SGLang's spec_verify_ct, spec_accept_length, spec_correct_drafts_histogram...;
/server_info reports speculative_algorithm "DFLASH", the draft model path and the block size.

`--device cuda` loads and serves the model on the GPU (default cpu). `--step-delay S` adds S seconds to
every decode step, a slower model, so that tests and drills can catch requests in flight.

Simulated GPU memory (`--gpu-file`, see `remote.drill.simgpu`): like SGLang, whose scheduler subprocess holds
the GPU memory, the server starts a child "GPU worker" that records `--gpu-mib` on every simulated GPU
under its own pid. When the server stops (SIGTERM, or killed) the worker sees its pipe close and
releases the memory `--release-after` seconds later, or with `--hold-until-killed` keeps it until
someone kills it: the story's 47 GB that stayed held after `systemctl stop`. With `--stuck-marker F`
that choice is made when the server ends: the first stop that finds no file F creates it and keeps
the memory held, later ones release it (removing F re-arms the episode on a running server: the
drill's `rearm`). `--stubborn-holder` makes
that worker ignore SIGTERM, so only SIGKILL ends it. `--flap-health` is a fault, not SGLang: the port
opens before the weights load, /health alternates 200/503 and /generate answers 503 until loaded, then
it is up without a warm-up (a server whose health endpoint answers before it can generate). `--nan-after N`
is another fault: from the N+1-th generated token on the logits are NaN (a broken kernel), which ends
the request as SGLang ends it, EOS in place of the bad token and finish `stop` "NaN happened".
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
import warnings
from collections import deque
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from remote.drill import chat, memory_saver, simgpu
from remote.drill.memory_saver import MemorySaver, Refused
from remote.drill.sglang_contract import (
    ContractError,
    allowed,
    decode_sampling_params,
    error_response,
    resolve_sampling_params,
    verify_sampling_params,
)

VERSION = "0.5.23-standin"
HEALTH_CHECK_TIMEOUT_S = float(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", 20))  # http_server.py
WARMUP_TEXT = "The capital city of France is"  # http_server.py, _execute_server_warmup
WARMUP_MAX_NEW_TOKENS = 8
NAN_STOP = "NaN happened"  # schedule_batch.py, Req._check_vocab_boundary_finish
PREFIX_MEMORY = 64  # finished sequences kept for cached_tokens (SGLang's radix cache, much smaller)


def log(msg: str) -> None:
    """A start-up log line in SGLang's shape, flushed so a `tail -f` sees it at once."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


def import_libraries(device: str) -> None:
    """Import torch and transformers (seconds on a CPU) as the model will use them."""
    if device == "cpu":
        # On a CPU: with fla / causal-conv1d installed, transformers would bind kernels that need a GPU.
        for name in ("fla", "causal_conv1d"):
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401


def import_ahead(device: str) -> None:
    """import_libraries in the background: a failure is left to the model's own import, which names it."""
    with contextlib.suppress(Exception):  # Model() imports again and reports what is missing
        import_libraries(device)


class Model:
    """The tiny target with its tokenizer, on `device`; generation under a lock (one at a time)."""

    def __init__(self, path: Path, dtype: str = "float32", device: str = "cpu",
                 region: Any = lambda tag: contextlib.nullcontext()):
        import_libraries(device)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        # transformers 5.x renames forward's past_key_values to cache; the old name still works.
        warnings.filterwarnings("ignore", message=".*past_key_values.*deprecated", category=FutureWarning)
        if device == "cpu":
            torch.set_num_threads(1)
        self.torch = torch
        self.device = device
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # bfloat16 computes as SGLang serves and as the extractor reads; float32 is the default.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        with region("weights"):  # the memory saver's weights region (torch_memory_saver on the GPU)
            self.model = model.to(device).eval()
        self.eos_id = self.tokenizer.eos_token_id
        config_eos = getattr(self.model.config, "eos_token_id", None)
        self.eos_ids = {self.eos_id, *(config_eos if isinstance(config_eos, list) else [config_eos])} - {None}
        self.vocab_size = int(self.model.config.vocab_size)
        self.lock = threading.Lock()
        self.speculator: Any = None  # with --speculative-drafter: remote.drill.specdecode.Speculator
        self.nan_after: int | None = None  # the --nan-after fault

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


@dataclass
class Generation:
    """One request's output and SGLang's finish reason object (schedule_batch.py, FINISH_*.to_json)."""

    output_ids: list[int]
    finish_reason: dict[str, Any]
    text_end: int | None = None  # a stop string's position in the text (the text is cut there)


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: dict[str, Any]
    aborted: threading.Event = field(default_factory=threading.Event)
    retractions: int = 0  # times a retract pause gave its KV cache back (meta_info num_retractions)
    checkpoint: Any = None  # before each forward pass: parks while paused; True when retracted


def _process_logits(torch: Any, logits: Any, tokens: list[int], output: list[int], params: dict[str, Any],
                    eos_ids: set[int]) -> Any:
    """SGLang's penalties and biases on one step's logits (the penalizers, then logit_bias)."""
    logits = logits.float()
    if output and (params["frequency_penalty"] or params["presence_penalty"]):
        counts = torch.bincount(torch.tensor(output, device=logits.device), minlength=logits.shape[-1])
        logits = logits - params["frequency_penalty"] * counts - params["presence_penalty"] * (counts > 0)
    if params["repetition_penalty"] != 1.0:
        seen = torch.tensor(sorted(set(tokens)), device=logits.device)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / params["repetition_penalty"], picked * params["repetition_penalty"])
    if len(output) < params["min_new_tokens"]:
        for token in eos_ids | set(params["stop_token_ids"] or []):
            logits[token] = float("-inf")
    for token, bias in (params["logit_bias"] or {}).items():
        logits[int(token)] += bias
    return logits


def _choose(torch: Any, logits: Any, params: dict[str, Any], generator: Any) -> int:
    """Greedy when top_k is 1 (what temperature 0 becomes); else top-k / top-p / min-p sampling."""
    if params["top_k"] == 1:
        return int(logits.argmax())
    probs = torch.softmax(logits / params["temperature"], dim=-1)
    if params["top_k"] < probs.shape[-1]:
        kth = torch.topk(probs, params["top_k"]).values[-1]
        probs = torch.where(probs < kth, torch.zeros_like(probs), probs)
    if params["top_p"] < 1.0:
        ordered, order = torch.sort(probs, descending=True)
        outside = ordered.cumsum(-1) - ordered > params["top_p"] * ordered.sum()
        probs[order[outside]] = 0.0
    if params["min_p"] > 0:
        probs = torch.where(probs < params["min_p"] * probs.max(), torch.zeros_like(probs), probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def _stop_string(text: str, params: dict[str, Any]) -> tuple[str, int] | None:
    """(matched, where) for the first stop string or stop regex in `text`."""
    stops = params["stop"]
    for stop in [stops] if isinstance(stops, str) else stops or []:
        if stop and stop in text:
            return stop, text.index(stop)
    regexes = params["stop_regex"]
    for pattern in [regexes] if isinstance(regexes, str) else regexes or []:
        if (match := re.search(pattern, text)) is not None:
            return pattern, match.start()
    return None


def speculative_request(params: dict[str, Any]) -> bool:
    """A request the DFLASH path serves: greedy, no logit processing, no stop strings (the others
    take generate_tokens, without speculative fields)."""
    return (params["top_k"] == 1 and not params["frequency_penalty"] and not params["presence_penalty"]
            and params["repetition_penalty"] == 1.0 and not params["min_new_tokens"] and not params["logit_bias"]
            and not params["stop"] and not params["stop_regex"])


def generate(model: Model, request: Request) -> tuple[Generation, dict[str, Any]]:
    """The request's generation and the speculative fields of its meta_info: DFLASH speculative
    decoding (--speculative-drafter, `remote.drill.specdecode`) where it serves the request, else
    generate_tokens and none."""
    params = request.params
    if model.speculator is None or not speculative_request(params):
        return generate_tokens(model, request), {}
    max_new = params["max_new_tokens"] if params["max_new_tokens"] is not None else 128
    stops = set(params["stop_token_ids"] or []) | (set() if params["ignore_eos"] else model.eos_ids)
    def aborted() -> bool:  # asked before each step: a pause parks it there (no KV cache to give back)
        if request.checkpoint is not None:
            request.checkpoint()
        return request.aborted.is_set()

    out = model.speculator.generate(request.input_ids, max_new, stops, aborted)
    reason: dict[str, Any] = {"type": "length", "length": max_new}
    if out.finish == "abort":
        reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    elif out.finish == "stop":
        reason = {"type": "stop", "matched": out.output_ids[-1]}
    return Generation(out.output_ids, reason), out.meta_info()


def generate_tokens(model: Model, request: Request) -> Generation:
    """Prefill, then one token per step through the KV cache, until a finish (the caller holds the lock).

    SGLang's finish checks per step (schedule_batch.py, Req.update_finish_state): a token outside the
    vocabulary, or a NaN, is replaced by EOS and ends as stop "NaN happened"; then stop strings and
    regexes; then the EOS / stop tokens (unless ignore_eos); then max_new_tokens. An abort
    (/abort_request) ends it with what it has."""
    torch = model.torch
    params = request.params
    max_new = params["max_new_tokens"] if params["max_new_tokens"] is not None else 128
    output: list[int] = []
    if max_new <= 0:
        return Generation(output, {"type": "length", "length": max_new})
    generator = None
    if params["top_k"] != 1:
        generator = torch.Generator(device=model.device)
        generator.manual_seed(params["sampling_seed"] if params["sampling_seed"] is not None else time.time_ns())
    stop_tokens = set(params["stop_token_ids"] or []) | (set() if params["ignore_eos"] else model.eos_ids)
    tokens = list(request.input_ids)
    with torch.inference_mode():
        step = torch.tensor([tokens], device=model.device)
        cache = None
        while True:
            if request.checkpoint is not None and request.checkpoint():
                # retracted by a pause: its KV cache was given back; recomputed from every token so far
                cache, step = None, torch.tensor([tokens], device=model.device)
            if request.aborted.is_set():
                return Generation(output, {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None})
            out = model.model(input_ids=step, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            logits = out.logits[0, -1]
            if model.nan_after is not None and len(output) >= model.nan_after:
                logits = logits * float("nan")  # the --nan-after fault: a kernel gone bad
            if not bool(torch.isfinite(logits).any()):
                output.append(model.eos_id)
                return Generation(output, {"type": "stop", "matched": NAN_STOP})
            token = _choose(torch, _process_logits(torch, logits, tokens, output, params, model.eos_ids), params,
                            generator)
            if not 0 <= token < model.vocab_size:
                output.append(model.eos_id)
                return Generation(output, {"type": "stop", "matched": NAN_STOP})
            output.append(token)
            tokens.append(token)
            if params["stop"] or params["stop_regex"]:
                found = _stop_string(model.decode(output), params)
                if found is not None:
                    return Generation(output, {"type": "stop", "matched": found[0]}, text_end=found[1])
            if token in stop_tokens:
                return Generation(output, {"type": "stop", "matched": token})
            if len(output) >= max_new:
                return Generation(output, {"type": "length", "length": max_new})
            step = torch.tensor([[token]], device=model.device)


class BadRequest(Exception):
    """An HTTP error answer: `status` and the body in SGLang's shape for it."""

    def __init__(self, status: int, body: Any):
        super().__init__(str(body))
        self.status, self.body = status, body


def value_error(message: str) -> BadRequest:
    """A ValueError in SGLang's request path: 400 {"error": {"message": ...}} (_create_error_response)."""
    return BadRequest(400, {"error": {"message": message}})


def validation_error(message: str) -> BadRequest:
    """What FastAPI's validation of GenerateReqInput gives: 400 in the ErrorResponse shape."""
    return BadRequest(400, error_response(400, message, "Bad Request"))


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)


class Server:
    """The server's state: start-up, model, scheduler counters, and the simulated GPU worker."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model_path = Path(args.model)
        config_file = self.model_path / "config.json"
        if not config_file.is_file():
            raise SystemExit(f"standin: --model {args.model}: no config.json there (build it with remote.drill.tinymodel)")
        self.config = json.loads(config_file.read_text())
        self.served_name = args.served_name or str(self.model_path)
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
        self.saver = MemorySaver(self, args)  # pause, continue, release, resume (remote.drill.memory_saver)

    @property
    def url(self) -> str:
        return f"http://{self.args.host}:{self.args.port}"

    def start_gpu_worker(self) -> None:
        args = self.args
        if not args.gpu_file:
            return
        argv = [sys.executable, "-m", "remote.drill.standin", "--gpu-worker", "--gpu-file", args.gpu_file,
                "--gpu-mib", str(args.gpu_mib), "--release-after", str(args.release_after)]
        if args.gpu_indices:
            argv += ["--gpu-indices", args.gpu_indices]
        if args.hold_until_killed:
            argv.append("--hold-until-killed")
        if args.stuck_marker:
            argv += ["--stuck-marker", args.stuck_marker]
        if args.stubborn_holder:
            argv.append("--stubborn-holder")
        # The worker's stdin is our pipe: it closes when we end, however we end.
        self.gpu_worker = subprocess.Popen(argv, stdin=subprocess.PIPE)

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
        log("The server is fired up and ready to roll!")
        self.ready_at = time.time()
        self.status = "Up"

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
            "internal_states": [{"last_gen_throughput": self.throughput(), **self.saver.server_args(),
                                 "memory_usage": self.saver.memory_usage()}],
            "version": VERSION,
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

    def throughput(self) -> float:
        return round(self.generated_tokens / self.gen_seconds, 3) if self.gen_seconds else 0.0

    def metrics_text(self) -> str:
        """SGLang's gauges and counters under its scheduler label set (metrics_collector.py,
        SchedulerMetricsCollector.init_new: model_name, engine_type, tp_rank, pp_rank, moe_ep_rank)."""
        label = f'{{model_name="{self.served_name}",engine_type="unified",tp_rank="0",pp_rank="0",moe_ep_rank="0"}}'
        rows = [
            ("sglang:num_running_reqs", "gauge", "The number of running requests.", len(self.running)),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", len(self.waiting)),
            ("sglang:token_usage", "gauge", "The token usage.", 0.01 if self.running else 0.0),
            ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", self.throughput()),
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

    def cached_prefix(self, ids: list[int]) -> int:
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

    def run(self, request: Request) -> tuple[Generation, dict[str, Any]]:
        """Queue `request` for the model (one at a time, like one scheduler batch of one), generate,
        and return its generation and SGLang's meta_info."""
        assert self.model is not None
        self.saver.wait_at_front()  # a paused server holds new requests before they are queued
        begin = time.time()
        with self.counter_lock:
            limit = self.args.max_queued_requests
            if limit is not None and len(self.waiting) + 1 > limit:
                # scheduler.py, _abort_on_queued_limit: HTTP 503 through _handle_abort_finish_reason.
                raise BadRequest(503, error_response(503, "The request queue is full."))
            self.waiting[request.rid] = request
            cached = self.cached_prefix(request.input_ids)
        with self.model.lock:
            try:
                request.checkpoint = lambda: self.saver.checkpoint(request, self.args.step_delay)
                request.checkpoint()  # it runs from here (waiting -> running), unless the scheduler is paused
                generation, speculative = generate(self.model, request)
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

    def abort(self, rid: str | None, abort_all: bool) -> None:
        with self.counter_lock:
            for request in [*self.waiting.values(), *self.running.values()]:
                if abort_all or (rid and request.rid.startswith(rid)):
                    request.aborted.set()

    def healthy_within(self, timeout: float) -> bool:
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
            generate_tokens(self.model, request)
        finally:
            self.model.lock.release()
        return True


def make_handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "sglang-standin"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # keep the log to SGLang's start-up lines

        def _send(self, status: int, body: Any = b"", content_type: str = "application/json") -> None:
            if isinstance(body, bytes):
                data = body
            else:
                data = (json.dumps(body) if content_type == "application/json" else body).encode()
            self.send_response(status)
            if data or content_type != "application/json":
                self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self, path: str) -> bool:
            level = "admin_optional" if path in memory_saver.CONTROL_ROUTES else "normal"
            if allowed(path, self.command, self.headers.get("Authorization"), server.args.api_key,
                       server.args.admin_api_key, level):
                return True
            self._send(401, {"error": "Unauthorized"})
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if not self._authorized(path):
                return
            if path in ("/health", "/health_generate"):
                self._health()
            elif path == "/ready":  # tokenizer_manager.is_ready: up, healthy and not paused
                self._send(200 if server.status == "Up" and not server.saver.front_paused else 503)
            elif path in memory_saver.GET_TOO:
                self.do_POST()
            elif path in ("/model_info", "/get_model_info"):
                self._send(200, server.model_info())
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, server.server_info())
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.served_name, "object": "model",
                                                             "created": int(server.started_at), "owned_by": "sglang",
                                                             "root": server.served_name}]})
            elif path == "/metrics" and server.args.metrics:
                self._send(200, server.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
            elif path in POST_ROUTES or path in memory_saver.CONTROL_ROUTES:
                self._send(405, {"detail": "Method Not Allowed"})
            else:
                self._send(404, {"detail": "Not Found"})

        def _health(self) -> None:
            if server.args.flap_health and server.status != "Up":
                server.health_calls += 1
                self._send(200 if server.health_calls % 2 == 0 else 503)
            elif server.status == "Starting" or server.model is None:
                self._send(503)
            elif server.healthy_within(HEALTH_CHECK_TIMEOUT_S):
                server.status = "Up"
                self._send(200)
            else:
                server.status = "UnHealthy"
                self._send(503)

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized(path):
                return
            if path not in POST_ROUTES and path not in memory_saver.CONTROL_ROUTES:
                self._send(405 if path in GET_ROUTES else 404,
                           {"detail": "Method Not Allowed" if path in GET_ROUTES else "Not Found"})
                return
            try:
                try:
                    body = json.loads(raw or b"null")
                except json.JSONDecodeError as exc:
                    raise validation_error(f"JSON decode error: {exc.msg}") from None
                if not isinstance(body, dict):
                    raise validation_error(f"Input should be a valid dictionary, got {type(body).__name__}")
                if server.model is None:  # only with --flap-health: the port opened before the weights
                    raise BadRequest(503, error_response(503, server.load_error or "the model is still loading"))
                if path in memory_saver.CONTROL_ROUTES:
                    try:
                        self._send(*memory_saver.answer(server.saver, path, body))
                    except Refused as exc:
                        raise (validation_error(str(exc)) if exc.status == 400 else
                               BadRequest(exc.status, error_response(exc.status, str(exc)))) from None
                elif path == "/generate":
                    self._send(200, self._generate(body))
                elif path == "/v1/completions":
                    self._send(200, self._completions(body))
                elif path == "/v1/chat/completions":  # remote.drill.chat: JSON, or SSE with stream
                    chat.answer(self, server, body, validation_error, Request)
                else:
                    server.abort(body.get("rid"), bool(body.get("abort_all")))
                    self._send(200)
            except BadRequest as exc:
                self._send(exc.status, exc.body)

        def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
            """(token ids per request, single): GenerateReqInput's text / input_ids, one or a batch."""
            model = server.model
            assert model is not None
            text, ids = body.get("text"), body.get("input_ids")
            if text is not None and not (isinstance(text, str) or (isinstance(text, list)
                                                                   and all(isinstance(t, str) for t in text))):
                raise validation_error("text: Input should be a valid string or a list of strings")
            if ids is not None and not (_is_ids(ids) or (isinstance(ids, list) and all(_is_ids(i) for i in ids))):
                raise validation_error("input_ids: Input should be a valid list of integers or a list of lists")
            if text is None and ids is None:
                raise value_error("Either text, input_ids or input_embeds should be provided.")
            if text is not None:
                texts = [text] if isinstance(text, str) else text
                return [model.tokenizer(t)["input_ids"] for t in texts], isinstance(text, str)
            if not ids:
                raise value_error("input_ids cannot be empty.")
            batch = [ids] if _is_ids(ids) else ids
            for one in batch:
                if not one:
                    raise value_error("input_ids cannot be empty.")
                bad = next((t for t in one if not 0 <= t < model.vocab_size), None)
                if bad is not None:
                    raise value_error(f"The input_ids {bad} is out of the vocabulary (size {model.vocab_size}).")
            return batch, _is_ids(ids)

        def _params(self, raw: Any, n: int) -> list[dict[str, Any]]:
            """Each request's resolved sampling params: contract, then preferred, then verify."""
            assert server.model is not None
            try:
                given = [decode_sampling_params(p) for p in raw] if isinstance(raw, list) else \
                    [decode_sampling_params(raw if raw is not None else {})] * n
            except ContractError as exc:
                raise BadRequest(400, {"error": str(exc)}) from None
            if len(given) != n:
                raise value_error(f"The number of sampling_params ({len(given)}) does not match the batch size ({n}).")
            resolved = [resolve_sampling_params(p, server.preferred) for p in given]
            try:
                for params in resolved:
                    verify_sampling_params(params, server.model.vocab_size)
            except ValueError as exc:
                raise value_error(str(exc)) from None
            return resolved

        def _generate(self, body: dict) -> Any:
            model = server.model
            assert model is not None
            batch, single = self._prompts(body)
            params = self._params(body.get("sampling_params"), len(batch))
            rids = body.get("rid")
            rids = [rids] if isinstance(rids, str) else rids if isinstance(rids, list) else [None] * len(batch)
            if len(rids) != len(batch):
                raise value_error(f"The number of rids ({len(rids)}) does not match the batch size ({len(batch)}).")
            answers = []
            for ids, p, rid in zip(batch, params, rids, strict=True):
                generation, meta = server.run(Request(rid or uuid.uuid4().hex, ids, p))
                if generation.finish_reason.get("type") == "abort" and generation.finish_reason.get("status_code"):
                    raise BadRequest(generation.finish_reason["status_code"],
                                     error_response(generation.finish_reason["status_code"],
                                                    generation.finish_reason["message"]))
                text = model.decode(generation.output_ids)
                if generation.text_end is not None:
                    text = text[:generation.text_end]
                answers.append({"text": text, "output_ids": generation.output_ids, "meta_info": meta})
            return answers[0] if single else answers

        def _completions(self, body: dict) -> dict:
            model = server.model
            assert model is not None
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                ids = model.tokenizer(prompt)["input_ids"]
            elif _is_ids(prompt) and prompt:
                ids = prompt
            else:
                raise validation_error("prompt: Input should be a valid string or a list of integers")
            # serving_completions / protocol.py CompletionRequest: OpenAI's defaults (temperature 1.0).
            fields = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "frequency_penalty": 0.0,
                      "presence_penalty": 0.0, "repetition_penalty": 1.0, "stop": None, "stop_token_ids": None,
                      "ignore_eos": False, "logit_bias": None}
            request = {k: body.get(k, v) for k, v in fields.items()}
            request["max_new_tokens"] = body.get("max_tokens", 16)
            request["min_new_tokens"] = body.get("min_tokens", 0)
            if body.get("seed") is not None:
                request["sampling_seed"] = body["seed"]
            (params,) = self._params(request, 1)
            generation, meta = server.run(Request(f"cmpl-{uuid.uuid4().hex}", ids, params))
            reason = generation.finish_reason
            choice = {"index": 0, "text": model.decode(generation.output_ids)[:generation.text_end],
                      "logprobs": None, "finish_reason": reason["type"], "matched_stop": reason.get("matched")}
            if body.get("return_token_ids"):
                choice["token_ids"] = generation.output_ids
                choice["prompt_token_ids"] = ids
            return {"id": meta["id"], "object": "text_completion", "created": int(time.time()),
                    "model": server.served_name, "choices": [choice],
                    "usage": {"prompt_tokens": len(ids), "completion_tokens": len(generation.output_ids),
                              "total_tokens": len(ids) + len(generation.output_ids)}}

    return Handler


GET_ROUTES = ("/health", "/health_generate", "/ready", "/model_info", "/get_model_info", "/server_info",
              "/get_server_info", "/v1/models", "/metrics")
POST_ROUTES = ("/generate", "/v1/completions", "/v1/chat/completions", "/abort_request")


def run_gpu_worker(args: argparse.Namespace) -> int:
    """The child that holds the simulated GPU memory (SGLang's scheduler process, in the story)."""
    if args.stubborn_holder:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started the server
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pid = os.getpid()
    simgpu.hold(args.gpu_file, pid, args.gpu_mib, simgpu.parse_indices(args.gpu_indices))
    sys.stdin.buffer.read()  # returns at EOF: the server has ended
    if args.hold_until_killed or (args.stuck_marker and _first_stuck_stop(args.stuck_marker)):
        while True:
            time.sleep(3600)
    time.sleep(args.release_after)
    simgpu.release(args.gpu_file, pid)
    return 0


def _first_stuck_stop(marker: str) -> bool:
    """Whether this stop is the episode's (the marker created now, by this holder alone)."""
    try:
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as out:
        out.write(f"used by the stop at {time.strftime('%Y-%m-%d %H:%M:%S')}: pid {os.getpid()} holds the memory\n")
    return True


def _warm_up_when_loaded(state: Server) -> None:
    while state.model is None and state.load_error is None:
        time.sleep(0.05)
    if state.model is not None and state.status == "Starting":
        state.warm_up()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m remote.drill.standin", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the tiny target's directory (remote.drill.tinymodel)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds of simulated weight loading")
    parser.add_argument("--gpu-file", help="the simulated GPU file to fill while up (remote.drill.simgpu)")
    parser.add_argument("--gpu-mib", type=int, default=40000, help="MiB held on each simulated GPU")
    parser.add_argument("--gpu-indices", default=None, metavar="I,J",
                        help="which GPUs of --gpu-file are this server's (default: all; a fleet's replicas share "
                             "one host's file, each on its own GPUs)")
    parser.add_argument("--release-after", type=float, default=2.0, help="seconds after a stop until memory is free")
    parser.add_argument("--hold-until-killed", action="store_true", help="never release until the holder is killed")
    parser.add_argument("--stuck-marker", help="the first stop that finds no such file creates it and holds until killed")
    parser.add_argument("--stubborn-holder", action="store_true", help="the holder ignores SIGTERM (needs KILL)")
    parser.add_argument("--served-name", help="served_model_name (default: the model path)")
    parser.add_argument("--metrics", action="store_true", help="serve /metrics (SGLang's --enable-metrics)")
    parser.add_argument("--flap-health", action="store_true",
                        help="a fault: the port opens before the weights load and /health alternates 200/503 until up")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's compute dtype")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the model is loaded and served")
    parser.add_argument("--warmup-delay", type=float, default=1.0,
                        help="seconds listening before the warm-up request (SGLang waits 1 s)")
    parser.add_argument("--nan-after", type=int, metavar="N",
                        help="a fault: logits turn NaN after N generated tokens (SGLang ends such a request as "
                             "stop 'NaN happened')")
    parser.add_argument("--step-delay", type=float, default=0.0, metavar="S",
                        help="seconds added to each decode step (a slower model: requests stay in flight)")
    parser.add_argument("--skip-server-warmup", action="store_true", help="SGLang's: up once loaded, no warm-up request")
    parser.add_argument("--api-key", help="SGLang's --api-key: required as a Bearer token on all but /health, /ready, /metrics")
    memory_saver.add_arguments(parser)
    parser.add_argument("--preferred-sampling-params", help="SGLang's: a JSON object laid under each request's")
    parser.add_argument("--max-queued-requests", type=int, help="SGLang's: past this many waiting, a 503 abort")
    parser.add_argument("--speculative-drafter", metavar="PATH",
                        help="DFLASH speculative decoding with this DFlash drafter checkpoint (remote.drill.specdecode)")
    parser.add_argument("--gpu-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gpu_indices is not None:
        try:
            simgpu.parse_indices(args.gpu_indices)
        except ValueError:
            parser.error(f"--gpu-indices {args.gpu_indices!r}: comma-separated GPU indices (0, 1, ...)")
    if args.gpu_worker:
        if not args.gpu_file:
            parser.error("--gpu-worker needs --gpu-file")
        return args
    if not args.model or args.port is None:
        parser.error("--model and --port are required")
    if args.gpu_file and sum(m or 0 for m in (args.kv_cache_mib, args.cuda_graph_mib)) > args.gpu_mib:
        parser.error(f"--kv-cache-mib + --cuda-graph-mib exceed --gpu-mib {args.gpu_mib}")
    if args.preferred_sampling_params is not None:
        try:
            preferred = json.loads(args.preferred_sampling_params)
            if not isinstance(preferred, dict):
                raise ValueError("not a JSON object")
            decode_sampling_params(preferred)
        except ValueError as exc:
            parser.error(f"--preferred-sampling-params: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu_worker:
        return run_gpu_worker(args)
    state = Server(args)
    try:
        # Bound now (the port is ours, a clash is told at once) but listening only once the weights
        # are in: until then a client is refused, as by SGLang, which starts its HTTP server last.
        httpd = ThreadingHTTPServer((args.host, args.port), make_handler(state), bind_and_activate=False)
        httpd.server_bind()
    except OSError as exc:
        print(f"standin: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr, flush=True)
        return 1
    httpd.daemon_threads = True
    args.port = httpd.server_address[1]

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    log(f"standin {VERSION} serving {args.model} on {state.url} (pid {os.getpid()}, {args.device})")
    try:
        state.start_gpu_worker()
        if args.flap_health:  # the fault: the port opens before the weights are in
            httpd.server_activate()
            threading.Thread(target=state.load, name="load", daemon=True).start()
        else:
            state.load()
            httpd.server_activate()
        threading.Thread(target=lambda: _warm_up_when_loaded(state), name="warm-up", daemon=True).start()
        httpd.serve_forever(poll_interval=0.2)
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        httpd.server_close()
        log("Shutting down")
    # Skip the interpreter's slow teardown of torch: the server ends (and its GPU worker's pipe
    # closes) the moment it has stopped serving.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
