"""A simulated training run on a drill host: holds simulated GPU memory until it is ended.

    python -m remote.drill.trainer --gpu-file F --gpus 0,1,2 --mib M [--name NAME]

It records `--mib` on each of `--gpus` in the simulated GPU file (`remote.drill.simgpu`) under its
own pid, prints a training-like line now and then, and releases the memory on SIGTERM / SIGINT. The
drill starts one on the training host (seven of its eight GPUs busy, one free) and ends it on
`drill down`; like any holder, its memory is free the moment it dies, however it dies.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from remote.drill import simgpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.drill.trainer", description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-file", required=True)
    parser.add_argument("--gpus", required=True, help="comma-separated GPU indices to hold")
    parser.add_argument("--mib", type=int, required=True, help="MiB held on each of them")
    parser.add_argument("--name", default="dflash-train v4", help="what the log lines call the run")
    parser.add_argument("--interval", type=float, default=30.0, help="seconds between log lines")
    args = parser.parse_args(argv)
    gpus = [int(g) for g in args.gpus.split(",") if g.strip()]

    def on_signal(signum: int, frame: Any) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started it
    pid = os.getpid()
    simgpu.hold(args.gpu_file, pid, args.mib, gpus)
    print(f"{args.name}: pid {pid} holding {args.mib} MiB on GPUs {gpus} (simulated)", flush=True)
    step = 5400
    try:
        while True:
            time.sleep(args.interval)
            step += 10
            print(f"{args.name}: step {step}", flush=True)
    finally:
        simgpu.release(args.gpu_file, pid)


if __name__ == "__main__":
    sys.exit(main())
