"""End exactly the listed processes: SIGTERM, a grace period, then SIGKILL; report each one's fate.

    python -m remote.endpids [--grace 10] PID:START_TIME [PID:START_TIME ...]

START_TIME is the process's start time in clock ticks since boot (/proc/PID/stat field 22, as the
telemetry agent reports it). A pid whose start time differs is another process that reused the
number: it is left alone. Prints one JSON line: {"results": [{"pid", "outcome", "detail", "after_s"}]}
with outcome one of gone | replaced | terminated | killed | survived | not_permitted | not_visible.
Never signals anything but the listed pids (no process groups, no `fuser`), and each signal only
while the pid still has its listed start time (checked before the TERM and again before the KILL).
On a host with /dev/nvidia* devices a target must hold one of them open (`--gpu-check`): NVML reports
host pids, which inside a container may name another process or none ("not_visible", never signalled).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

from remote import gpu_source, procstat

POLL_S = 0.05


def identity(pid: int) -> int | None:
    """The start time of live process `pid` (None when it is gone or a zombie): pid + start time
    name exactly one process, so a pid reused by another process reads as another identity."""
    fields = procstat.read_stat(pid)
    if fields is None or fields[procstat.STATE] in ("Z", "X"):
        return None
    try:
        return int(fields[procstat.START_TIME])
    except ValueError:
        return None


def send(pid: int, expected: int, sig: int) -> str:
    """Signal `pid` only if it is still the process that started at `expected`: "sent", "gone",
    "replaced" or "not_permitted".

    With a pidfd (Linux >= 5.3) the check and the signal name the same process: the pidfd is opened
    first, then the identity read, then the signal sent through the pidfd, so a pid reused in between
    cannot receive it. Without one, the check comes right before `kill`.
    """
    fd = None
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return "gone"
    except (AttributeError, OSError):
        fd = None
    try:
        now = identity(pid)
        if now is None:
            return "gone"
        if now != expected:
            return "replaced"
        if fd is not None:
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return "sent"
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "not_permitted"
    finally:
        if fd is not None:
            os.close(fd)


def _wait_gone(idents: dict[int, int], deadline: float) -> set[int]:
    """Poll until every process (pid -> start time) is gone or the deadline passes; return those still
    running. A pid that now names another process counts as gone: it is not the one we signalled."""
    alive = {p for p, t in idents.items() if identity(p) == t}
    while alive and time.monotonic() < deadline:
        time.sleep(POLL_S)
        alive = {p for p in alive if identity(p) == idents[p]}
    return alive


def _check_gpu(mode: str) -> bool:
    return mode == "on" or (mode == "auto" and gpu_source.nvidia_devices_present())


def end_processes(targets: list[tuple[int, int | None]], grace: float, gpu_check: str = "auto") -> list[dict]:
    """TERM every target that is still the listed process, KILL those left after `grace` seconds.

    Identity (pid + start time) is checked before every signal, not only the first: a process that
    exits during the grace period and whose pid is reused is never sent the KILL. A target listed
    without a start time is pinned to the one it has when first seen. `gpu_check` ("auto": when this
    host has /dev/nvidia* devices): a target must hold an open /dev/nvidia* file, else it is not the
    process NVML reported (NVML gives host pids; inside a container the same number can name another
    process, or none) and it is refused as "not_visible".
    """
    results: dict[int, dict] = {}
    began = time.monotonic()
    termed: dict[int, int] = {}
    check_gpu = _check_gpu(gpu_check)

    def done(pid: int, outcome: str, detail: str) -> None:
        results[pid] = {"pid": pid, "outcome": outcome, "detail": detail, "after_s": round(time.monotonic() - began, 2)}

    for pid, expected in targets:
        actual = identity(pid)
        if actual is None:
            done(pid, "gone", "had already exited")
            continue
        if expected is not None and actual != expected:
            done(pid, "replaced", f"pid now names another process (started at {actual}, listed {expected}): left alone")
            continue
        if check_gpu:
            visible, reason = gpu_source.gpu_visibility(pid)
            if not visible:
                done(pid, "not_visible", f"{reason}: left alone")
                continue
        outcome = send(pid, actual, signal.SIGTERM)
        if outcome == "sent":
            termed[pid] = actual
        elif outcome == "not_permitted":
            done(pid, "not_permitted", "not permitted to signal it (another user's process: needs sudo)")
        elif outcome == "replaced":
            done(pid, "replaced", "pid now names another process: left alone")
        else:
            done(pid, "gone", "had already exited")
    left = _wait_gone(termed, began + grace)
    for pid in set(termed) - left:
        done(pid, "terminated", "exited after SIGTERM")
    killed: dict[int, int] = {}
    for pid in left:
        outcome = send(pid, termed[pid], signal.SIGKILL)
        if outcome == "sent":
            killed[pid] = termed[pid]
        elif outcome == "not_permitted":
            done(pid, "survived", f"still running {grace:g} s after SIGTERM, and not permitted to SIGKILL it")
        else:
            done(pid, "terminated", "exited after SIGTERM, just before the SIGKILL"
                 + ("; its pid now names another process, left alone" if outcome == "replaced" else ""))
    survivors = _wait_gone(killed, time.monotonic() + 5.0)
    for pid in set(killed) - survivors:
        done(pid, "killed", f"still running {grace:g} s after SIGTERM: ended with SIGKILL")
    for pid in survivors:
        done(pid, "survived", "still running after SIGKILL (stuck in the kernel, e.g. a hung driver call)")
    return [results[pid] for pid, _ in targets]


def parse_target(text: str) -> tuple[int, int | None]:
    pid, _, start = text.partition(":")
    if not pid.isdigit() or int(pid) <= 1 or (start and not start.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: expected PID or PID:START_TIME (pid > 1)")
    return int(pid), int(start) if start else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.endpids", description=__doc__.splitlines()[0])
    parser.add_argument("--grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("--gpu-check", choices=("auto", "on", "off"), default="auto",
                        help="refuse targets holding no /dev/nvidia* file (auto: when this host has such devices)")
    parser.add_argument("targets", nargs="+", type=parse_target, metavar="PID:START_TIME")
    args = parser.parse_args(argv)
    print(json.dumps({"results": end_processes(args.targets, args.grace, args.gpu_check)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
