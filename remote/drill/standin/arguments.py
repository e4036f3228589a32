"""The rehearsal server's command line: SGLang's flag names where SGLang has them (`--api-key`,
`--skip-server-warmup`, `--preferred-sampling-params`, the memory saver's from
`remote.drill.memory_saver`), the drill's simulated GPU and faults besides, and the checks argparse
cannot make alone (a bad `--gpu-indices` or `--preferred-sampling-params` is refused at start, not at
the first request). `--gpu-worker` (hidden) starts the GPU worker child instead of a server.
"""

from __future__ import annotations

import argparse
import json

import remote.drill.standin as package  # its docstring's first line is --help's description
from remote.drill import memory_saver, simgpu, weights_checker
from remote.drill.sglang_contract import decode_sampling_params


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The server's flags, or the GPU worker's with --gpu-worker; argparse's usage error (exit 2) for
    what is missing or malformed."""
    parser = argparse.ArgumentParser(prog="python -m remote.drill.standin", description=package.__doc__.splitlines()[0])
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
    weights_checker.add_arguments(parser)
    parser.add_argument("--preferred-sampling-params", help="SGLang's: a JSON object laid under each request's")
    parser.add_argument("--max-queued-requests", type=int, help="SGLang's: past this many waiting, a 503 abort")
    parser.add_argument("--sglang-version", default=memory_saver.SGLANG_VERSION, metavar="X.Y.Z",
                        help="the SGLang release it answers as (/server_info's version, with -standin): from "
                             f"{'.'.join(map(str, memory_saver.PAUSE_MODES_SINCE))} /pause_generation takes a mode; "
                             "before it, it reads no body and aborts every request in flight; /weights_checker as that "
                             "release has it (none before 0.5.6, no checksum before 0.5.23) (default %(default)s)")
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
    if memory_saver.release_of(args.sglang_version) is None:
        parser.error(f"--sglang-version {args.sglang_version!r}: a release such as 0.5.23 or 0.5.5")
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
