"""The telemetry agent: one JSON line per interval on stdout, until stdout closes.

    python -m remote.agent [--interval 1] [--source auto|nvml|nvidia-smi|none] [--simulate FILE] [--count N]

Each line (a "sample"):
  {"v": 1, "seq": 0, "t": unix_s, "host": str, "interval": s, "source": "nvml"|"nvidia-smi"|"simulated"|"none",
   "simulated": bool, "reason": str|null,          # why there are no GPU readings, when there are none
   "gpus": [{"index", "name", "uuid", "mem_used_mib", "mem_total_mib", "util_pct", "temp_c", "power_w"}],
   "processes": [{"pid", "gpu", "mib", "user", "command", "ppid", "ancestors", "start_time", "cgroup"}],
   "ram": {"total_mib", "available_mib"}, "cpu_ms": agent CPU time spent on this sample}
A field that cannot be read is null. The console starts it over SSH and reads the lines as they come;
when the connection drops, stdout closes and the agent ends.

A line `now` on stdin takes a sample at once (the console asks for one at a time), then the interval's grid
starts again from it: a window waiting for memory to leave or come back sees it within a fraction
of the interval, not up to a whole one later. A closed stdin changes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from typing import Any

from remote import gpu_source

MIN_INTERVAL_S = 0.2
MAX_INTERVAL_S = 10.0
SAMPLE_VERSION = 1


def take_sample(source: Any, seq: int, interval: float, host: str) -> dict:
    """One sample from `source`, processes enriched from /proc. Never raises for a bad reading."""
    cpu_start = time.process_time()
    reason = source.reason
    try:
        gpus, processes = source.read()
    except Exception as exc:  # noqa: BLE001 - a source failing mid-stream: report it, keep streaming
        gpus, processes = [], []
        reason = f"{source.name}: {exc}"
    for proc in processes:
        proc.update(gpu_source.describe_process(proc["pid"]))
    sample = {
        "v": SAMPLE_VERSION,
        "seq": seq,
        "t": round(time.time(), 3),
        "host": host,
        "interval": interval,
        "source": source.name,
        "simulated": bool(source.simulated),
        "reason": reason,
        "gpus": gpus,
        "processes": processes,
        "ram": gpu_source.host_memory(),
    }
    sample["cpu_ms"] = round((time.process_time() - cpu_start) * 1000.0, 3)
    return sample


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m remote.agent", description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples (0.2 to 10)")
    parser.add_argument("--source", choices=["auto", "nvml", "nvidia-smi", "none"], default="auto")
    parser.add_argument("--simulate", metavar="FILE", help="read a drill host's simulated GPU file instead")
    parser.add_argument("--count", type=int, default=0, help="stop after N samples (0: until stdout closes)")
    args = parser.parse_args(argv)
    if not MIN_INTERVAL_S <= args.interval <= MAX_INTERVAL_S:
        parser.error(f"--interval {args.interval:g}: expected {MIN_INTERVAL_S:g} to {MAX_INTERVAL_S:g} seconds")
    return args


def _listen(asked: threading.Event) -> None:
    """Set `asked` on every `now` line on stdin, until it closes. Raw reads of fd 0, not sys.stdin:
    this thread may still be reading when the agent exits, and sys.stdin's lock would then be held
    at the interpreter's shutdown (a fatal error)."""
    pending = b""
    try:
        while chunk := os.read(0, 4096):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if any(line.strip() == b"now" for line in lines):
                asked.set()
    except OSError:  # no stdin at all: samples on the interval only
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = gpu_source.open_source(args.source, args.simulate)
    host = socket.gethostname()
    out = sys.stdout
    seq = 0
    asked = threading.Event()
    threading.Thread(target=_listen, args=(asked,), name="now", daemon=True).start()
    next_at = time.monotonic()
    try:
        while not args.count or seq < args.count:
            line = json.dumps(take_sample(source, seq, args.interval, host), separators=(",", ":"))
            out.write(line + "\n")
            out.flush()
            seq += 1
            # Keep to the interval's grid: a slow sample shortens the next wait instead of drifting.
            next_at += args.interval
            delay = next_at - time.monotonic()
            if delay <= 0:
                next_at = time.monotonic()
            elif asked.wait(delay):  # asked for a sample now: take it, and the grid starts from it
                asked.clear()
                next_at = time.monotonic()
    except (BrokenPipeError, KeyboardInterrupt):
        # The reader went away (connection closed): that is how the agent is meant to end.
        sys.stdout = None  # type: ignore[assignment]  # no flush error at interpreter exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
