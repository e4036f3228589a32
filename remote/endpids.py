"""End exactly the listed processes: SIGTERM, a grace period, then SIGKILL; report each one's fate.

    python -m remote.endpids [--grace 10] PID:START_TIME [PID:START_TIME ...]

START_TIME is the process's start time in clock ticks since boot (/proc/PID/stat field 22, as the
telemetry agent reports it). A pid whose start time differs is another process that reused the
number: it is left alone. Prints one JSON line: {"results": [{"pid", "outcome", "detail", "after_s"}]}
with outcome one of gone | replaced | terminated | killed | survived | not_permitted.
Never signals anything but the listed pids (no process groups, no `fuser`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time

from remote.procstat import pid_alive, start_time

POLL_S = 0.05


def _wait_gone(pids: set[int], deadline: float) -> set[int]:
    """Poll until every pid is gone or the deadline passes; return those still alive."""
    alive = {p for p in pids if pid_alive(p)}
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = {p for p in alive if pid_alive(p)}
    return alive


def end_processes(targets: list[tuple[int, int | None]], grace: float) -> list[dict]:
    """TERM every target that is still the listed process, KILL those left after `grace` seconds."""
    results: dict[int, dict] = {}
    began = time.monotonic()
    termed: set[int] = set()
    for pid, expected in targets:
        if not pid_alive(pid):
            results[pid] = {"pid": pid, "outcome": "gone", "detail": "had already exited", "after_s": 0.0}
            continue
        actual = start_time(pid)
        if expected is not None and actual != expected:
            results[pid] = {"pid": pid, "outcome": "replaced", "after_s": 0.0,
                            "detail": f"pid now names another process (started at {actual}, listed {expected}): left alone"}
            continue
        try:
            os.kill(pid, signal.SIGTERM)
            termed.add(pid)
        except ProcessLookupError:
            results[pid] = {"pid": pid, "outcome": "gone", "detail": "had already exited", "after_s": 0.0}
        except PermissionError:
            results[pid] = {"pid": pid, "outcome": "not_permitted", "after_s": 0.0,
                            "detail": "not permitted to signal it (another user's process: needs sudo)"}
    left = _wait_gone(termed, began + grace)
    for pid in termed - left:
        results[pid] = {"pid": pid, "outcome": "terminated", "detail": "exited after SIGTERM",
                        "after_s": round(time.monotonic() - began, 2)}
    killed_at = time.monotonic()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    survivors = _wait_gone(left, killed_at + 5.0)
    for pid in left - survivors:
        results[pid] = {"pid": pid, "outcome": "killed", "after_s": round(time.monotonic() - began, 2),
                        "detail": f"still running {grace:g} s after SIGTERM: ended with SIGKILL"}
    for pid in survivors:
        results[pid] = {"pid": pid, "outcome": "survived", "after_s": round(time.monotonic() - began, 2),
                        "detail": "still running after SIGKILL (stuck in the kernel, e.g. a hung driver call)"}
    return [results[pid] for pid, _ in targets]


def parse_target(text: str) -> tuple[int, int | None]:
    pid, _, start = text.partition(":")
    if not pid.isdigit() or int(pid) <= 1 or (start and not start.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PID or PID:START_TIME (pid > 1)")
    return int(pid), int(start) if start else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.endpids", description=__doc__.splitlines()[0])
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("targets", nargs="+", type=parse_target, metavar="PID:START_TIME")
    args = parser.parse_args(argv)
    print(json.dumps({"results": end_processes(args.targets, args.grace)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
