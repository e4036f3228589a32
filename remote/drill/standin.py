"""The rehearsal server: a small real model behind SGLang's HTTP endpoints, for the drill and tests.

    python -m remote.drill.standin --model DIR --port N [--host 127.0.0.1] [--load-delay S]
        [--gpu-file F --gpu-mib M [--release-after S | --hold-until-killed] [--stubborn-holder]]
        [--served-name NAME] [--metrics] [--flap-health] [--dtype float32|bfloat16]

It serves the tiny target (`remote.drill.tinymodel`) with transformers on CPU, greedy:
  GET  /health, /health_generate   503 while loading and warming up; 200 once a one-token generation
                                   has worked and "fired up" is in the log (as SGLang)
  GET  /model_info (/get_model_info), /server_info (/get_server_info), /v1/models
  POST /generate                   `input_ids` or `text` in; `text`, `output_ids`, `meta_info` out
  POST /v1/completions             OpenAI-style
  GET  /metrics                    with --metrics: sglang:num_running_reqs, num_queue_reqs, token_usage, gen_throughput
and logs SGLang's start-up lines ("Load weight begin", shard progress, "Load weight end. elapsed=...",
"The server is fired up and ready to roll!") on stdout.

Simulated GPU memory (`--gpu-file`, see `remote.drill.simgpu`): like SGLang, whose scheduler subprocess holds
the GPU memory, the server starts a child "GPU worker" that records `--gpu-mib` on every simulated GPU
under its own pid. When the server stops (SIGTERM, or killed) the worker sees its pipe close and
releases the memory `--release-after` seconds later, or with `--hold-until-killed` keeps it until
someone kills it: the story's 47 GB that stayed held after `systemctl stop`. `--stubborn-holder` makes
that worker ignore SIGTERM, so only SIGKILL ends it. `--flap-health` makes /health alternate 200/503
while loading (a server whose health endpoint answers before it can generate).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from remote.drill import simgpu

VERSION = "0.5.23-standin"
DEFAULT_MAX_NEW_TOKENS = 128


def log(msg: str) -> None:
    """A start-up log line in SGLang's shape, flushed so a `tail -f` sees it at once."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {msg}", flush=True)


class Model:
    """The tiny target on CPU with its tokenizer, greedy generation under a lock."""

    def __init__(self, path: Path, dtype: str = "float32"):
        # CPU only: with fla / causal-conv1d installed, transformers would bind kernels that need a GPU.
        for name in ("fla", "causal_conv1d"):
            sys.modules.setdefault(name, None)  # type: ignore[arg-type]
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        torch.set_num_threads(1)
        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        # bfloat16 computes as SGLang serves and as the extractor reads; float32 is the default.
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
        self.eos_id = self.tokenizer.eos_token_id
        self.lock = threading.Lock()

    def generate(self, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], str]:
        """Greedy continuation of `input_ids` (the caller holds `lock`); returns (output_ids, finish)."""
        torch = self.torch
        if max_new_tokens <= 0:
            return [], "length"
        with torch.inference_mode():
            x = torch.tensor([input_ids], dtype=torch.long)
            out = self.model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=self.eos_id, pad_token_id=self.tokenizer.pad_token_id,
            )
        new = out[0, x.shape[1] :].tolist()
        if self.eos_id in new:
            return new[: new.index(self.eos_id) + 1], "stop"
        return new, "length"


class Server:
    """The server's state: loading, model, counters, and the simulated GPU worker."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.model_path = Path(args.model)
        config_file = self.model_path / "config.json"
        if not config_file.is_file():
            raise SystemExit(f"standin: --model {args.model}: no config.json there (build it with remote.drill.tinymodel)")
        self.config = json.loads(config_file.read_text())
        self.served_name = args.served_name or str(self.model_path)
        self.model: Model | None = None
        self.load_error: str | None = None
        self.started_at = time.time()
        self.ready_at: float | None = None
        self.health_calls = 0
        self.running = 0
        self.queued = 0
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.gen_seconds = 0.0
        self.counter_lock = threading.Lock()
        self.gpu_worker: subprocess.Popen | None = None

    def start_gpu_worker(self) -> None:
        args = self.args
        if not args.gpu_file:
            return
        argv = [sys.executable, "-m", "remote.drill.standin", "--gpu-worker", "--gpu-file", args.gpu_file,
                "--gpu-mib", str(args.gpu_mib), "--release-after", str(args.release_after)]
        if args.hold_until_killed:
            argv.append("--hold-until-killed")
        if args.stubborn_holder:
            argv.append("--stubborn-holder")
        # The worker's stdin is our pipe: it closes when we end, however we end.
        self.gpu_worker = subprocess.Popen(argv, stdin=subprocess.PIPE)

    def load(self) -> None:
        """Load the model after the configured delay, logging SGLang's start-up lines."""
        try:
            log(f"Load weight begin. avail mem={simgpu.DEFAULT_TOTAL_MIB / 1024:.2f} GB (simulated)")
            steps = 4
            for i in range(1, steps + 1):
                time.sleep(self.args.load_delay / steps)
                log(f"Loading safetensors checkpoint shards: {i * 100 // steps}% Completed | {i}/{steps}")
            begin = time.time()
            model = Model(self.model_path, self.args.dtype)
            log(f"Load weight end. elapsed={time.time() - begin:.2f} s, type={type(model.model).__name__}")
            # Like SGLang: ready only once a one-token generation (its warm-up request) has worked,
            # and the log says so before /health answers 200.
            with model.lock:
                model.generate(model.tokenizer("warm up")["input_ids"], 1)
            log("The server is fired up and ready to roll!")
            self.ready_at = time.time()
            self.model = model  # from here on /health is 200 and requests are served
        except Exception as exc:  # noqa: BLE001 - the server stays up and says why it cannot serve
            self.load_error = f"{type(exc).__name__}: {exc}"
            log(f"Load failed: {self.load_error}")

    def model_info(self) -> dict:
        return {
            "model_path": str(self.model_path),
            "tokenizer_path": str(self.model_path),
            "served_model_name": self.served_name,
            "is_generation": True,
            "model_type": self.config.get("model_type"),
            "architectures": self.config.get("architectures"),
        }

    def server_info(self) -> dict:
        return {
            "version": VERSION,
            "model_path": str(self.model_path),
            "served_model_name": self.served_name,
            "host": self.args.host,
            "port": self.args.port,
            "enable_metrics": self.args.metrics,
            "standin": True,
            "pid": os.getpid(),
            "gpu_worker_pid": self.gpu_worker.pid if self.gpu_worker else None,
            "started_at": self.started_at,
            "ready_at": self.ready_at,
        }

    def metrics_text(self) -> str:
        label = f'{{model_name="{self.served_name}"}}'
        throughput = self.generated_tokens / self.gen_seconds if self.gen_seconds else 0.0
        rows = [
            ("sglang:num_running_reqs", "gauge", "The number of running requests.", self.running),
            ("sglang:num_queue_reqs", "gauge", "The number of requests in the waiting queue.", self.queued),
            ("sglang:token_usage", "gauge", "The token usage.", 0.01 if self.running else 0.0),
            ("sglang:gen_throughput", "gauge", "The generation throughput (token/s).", round(throughput, 3)),
            ("sglang:prompt_tokens_total", "counter", "Number of prefill tokens processed.", self.prompt_tokens),
            ("sglang:generation_tokens_total", "counter", "Number of generation tokens processed.", self.generated_tokens),
        ]
        out = []
        for name, kind, help_text, value in rows:
            out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{label} {float(value)}"]
        return "\n".join(out) + "\n"

    def generate(self, input_ids: list[int], max_new_tokens: int) -> tuple[list[int], str, float]:
        assert self.model is not None
        with self.counter_lock:
            self.queued += 1
        begin = time.time()
        with self.model.lock:
            with self.counter_lock:
                self.queued -= 1
                self.running += 1
            try:
                output, finish = self.model.generate(input_ids, max_new_tokens)
            finally:
                with self.counter_lock:
                    self.running -= 1
        elapsed = time.time() - begin
        with self.counter_lock:
            self.prompt_tokens += len(input_ids)
            self.generated_tokens += len(output)
            self.gen_seconds += elapsed
        return output, finish, elapsed


class BadRequest(Exception):
    pass


def _int_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise BadRequest(f"{what}: expected a non-empty list of token ids")
    return value


def make_handler(server: Server) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "sglang-standin"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # keep the log to SGLang's start-up lines

        def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else (json.dumps(body) if content_type == "application/json" else body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, msg: str) -> None:
            self._send(status, {"error": {"message": msg, "code": status}})

        def _not_ready(self) -> bool:
            if server.model is None:
                self._error(503, server.load_error or "the server is still loading the model")
                return True
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate"):
                server.health_calls += 1
                flapped_up = server.args.flap_health and server.health_calls % 2 == 0
                if server.model is not None or flapped_up:
                    self._send(200, b"", "text/plain")
                else:
                    self._send(503, b"loading", "text/plain")
            elif path in ("/model_info", "/get_model_info"):
                self._send(200, server.model_info())
            elif path in ("/server_info", "/get_server_info"):
                self._send(200, server.server_info())
            elif path == "/v1/models":
                self._send(200, {"object": "list", "data": [{"id": server.served_name, "object": "model", "owned_by": "standin"}]})
            elif path == "/metrics" and server.args.metrics:
                self._send(200, server.metrics_text(), "text/plain; version=0.0.4")
            else:
                self._error(404, f"no route {path}")

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw or b"{}")
                if not isinstance(body, dict):
                    raise BadRequest("expected a JSON object")
            except (json.JSONDecodeError, BadRequest) as exc:
                self._error(400, f"bad request body: {exc}")
                return
            if path not in ("/generate", "/v1/completions"):
                self._error(404, f"no route {path}")
                return
            if self._not_ready():
                return
            try:
                if path == "/generate":
                    self._generate(body)
                else:
                    self._completions(body)
            except BadRequest as exc:
                self._error(400, str(exc))

        def _ids(self, value: Any, what: str) -> list[int]:
            assert server.model is not None
            if isinstance(value, str):
                return server.model.tokenizer(value)["input_ids"]
            return _int_list(value, what)

        def _generate(self, body: dict) -> None:
            assert server.model is not None
            if "input_ids" in body:
                ids = _int_list(body["input_ids"], "input_ids")
            elif isinstance(body.get("text"), str):
                ids = self._ids(body["text"], "text")
            else:
                raise BadRequest("give `input_ids` (a list of token ids) or `text`")
            params = body.get("sampling_params") or {}
            max_new = int(params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
            output, finish, elapsed = server.generate(ids, max_new)
            reason: dict[str, Any] = {"type": finish}
            if finish == "length":
                reason["length"] = max_new
            else:
                reason["matched"] = server.model.eos_id
            self._send(200, {
                "text": server.model.tokenizer.decode(output, skip_special_tokens=True),
                "output_ids": output,
                "meta_info": {
                    "id": f"standin-{time.time_ns()}",
                    "prompt_tokens": len(ids),
                    "completion_tokens": len(output),
                    "finish_reason": reason,
                    "e2e_latency": round(elapsed, 4),
                },
            })

        def _completions(self, body: dict) -> None:
            assert server.model is not None
            ids = self._ids(body.get("prompt"), "prompt")
            max_new = int(body.get("max_tokens", 16))
            output, finish, _ = server.generate(ids, max_new)
            self._send(200, {
                "id": f"cmpl-{time.time_ns()}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": server.served_name,
                "choices": [{
                    "index": 0,
                    "text": server.model.tokenizer.decode(output, skip_special_tokens=True),
                    "finish_reason": finish,
                    "logprobs": None,
                }],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(output),
                          "total_tokens": len(ids) + len(output)},
            })

    return Handler


def run_gpu_worker(args: argparse.Namespace) -> int:
    """The child that holds the simulated GPU memory (SGLang's scheduler process, in the story)."""
    if args.stubborn_holder:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started the server
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pid = os.getpid()
    simgpu.hold(args.gpu_file, pid, args.gpu_mib)
    sys.stdin.buffer.read()  # returns at EOF: the server has ended
    if args.hold_until_killed:
        while True:
            time.sleep(3600)
    time.sleep(args.release_after)
    simgpu.release(args.gpu_file, pid)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m remote.drill.standin", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="the tiny target's directory (remote.drill.tinymodel)")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds of simulated weight loading")
    parser.add_argument("--gpu-file", help="the simulated GPU file to fill while up (remote.drill.simgpu)")
    parser.add_argument("--gpu-mib", type=int, default=40000, help="MiB held on each simulated GPU")
    parser.add_argument("--release-after", type=float, default=2.0, help="seconds after a stop until memory is free")
    parser.add_argument("--hold-until-killed", action="store_true", help="never release until the holder is killed")
    parser.add_argument("--stubborn-holder", action="store_true", help="the holder ignores SIGTERM (needs KILL)")
    parser.add_argument("--served-name", help="served_model_name (default: the model path)")
    parser.add_argument("--metrics", action="store_true", help="serve /metrics (SGLang's --enable-metrics)")
    parser.add_argument("--flap-health", action="store_true", help="/health alternates 200/503 while loading")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's compute dtype")
    parser.add_argument("--gpu-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.gpu_worker:
        if not args.gpu_file:
            parser.error("--gpu-worker needs --gpu-file")
        return args
    if not args.model or args.port is None:
        parser.error("--model and --port are required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu_worker:
        return run_gpu_worker(args)
    state = Server(args)
    try:
        httpd = ThreadingHTTPServer((args.host, args.port), make_handler(state))
    except OSError as exc:
        print(f"standin: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr, flush=True)
        return 1
    httpd.daemon_threads = True

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    log(f"standin {VERSION} serving {args.model} on http://{args.host}:{httpd.server_address[1]} (pid {os.getpid()})")
    state.start_gpu_worker()
    threading.Thread(target=state.load, name="load", daemon=True).start()
    try:
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
