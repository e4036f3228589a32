"""`python -m remote.drill.standin`: start the rehearsal server, or with `--gpu-worker` its GPU worker.

The order is SGLang's: the port is bound at once (a clash is told before anything loads) but listens
only once the weights are in, so a client is refused meanwhile; then the warm-up, then Up. SIGTERM
aborts the requests under way (each answered) and ends it within a second or two (uvicorn's shutdown,
`http_front`): "Shutting down", exit 0, and the GPU worker's pipe closes with it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from remote.drill.standin.arguments import parse_args
from remote.drill.standin.gpu_worker import run_gpu_worker
from remote.drill.standin.http_front import HttpFront
from remote.drill.standin.server import Server, log


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.gpu_worker:
        return run_gpu_worker(args)
    server = Server(args)
    front = HttpFront(server, args)
    try:
        args.port = front.bind()
    except OSError as exc:
        print(f"standin: cannot listen on {args.host}:{args.port}: {exc.strerror}", file=sys.stderr, flush=True)
        return 1

    def on_term(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    log(f"standin {server.version} serving {args.model} on {server.url} (pid {os.getpid()}, {args.device})")
    try:
        server.start_gpu_worker()
        if args.flap_health:  # the fault: the port opens before the weights are in
            front.listen()
            threading.Thread(target=server.load, name="load", daemon=True).start()
        else:
            server.load()
            front.listen()
        threading.Thread(target=server.warm_up_when_loaded, name="warm-up", daemon=True).start()
        front.serve()
    except (SystemExit, KeyboardInterrupt):
        pass
    finally:
        front.close()
        log("Shutting down")
    # Skip the interpreter's slow teardown of torch: the server ends (and its GPU worker's pipe
    # closes) the moment it has stopped serving.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
