"""The rehearsal server's GPU worker: the child process that holds the simulated GPU memory.

Like SGLang, whose scheduler subprocess holds the GPU memory, the server starts a child (`python -m
remote.drill.standin --gpu-worker ...`) that records `--gpu-mib` on every simulated GPU of
`--gpu-file` (`remote.drill.simgpu`) under its own pid. Its stdin is the server's pipe: when the
server stops (SIGTERM, or killed) the pipe closes and the worker releases the memory
`--release-after` seconds later, or with `--hold-until-killed` keeps it until someone kills it: the
story's 47 GB that stayed held after `systemctl stop`. With `--stuck-marker F` that choice is made when
the server ends: the first stop that finds no file F creates it and keeps the memory held, later ones
release it. `--stubborn-holder` makes the worker ignore SIGTERM, so only SIGKILL ends it.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from remote.drill import simgpu


def start_gpu_worker(args: argparse.Namespace) -> subprocess.Popen | None:
    """Start the GPU worker for the server's `args`; None without `--gpu-file` (nothing to hold)."""
    if not args.gpu_file:
        return None
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
    return subprocess.Popen(argv, stdin=subprocess.PIPE)


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

