"""The VRAM waiter: after a stop, wait until the service's GPUs are really free.

`systemctl stop` returning says nothing about GPU memory: in the story it stayed at 47 GB until the
leftover process was killed. So "free" means fresh telemetry (a sample that arrived after the stop)
shows every one of the service's GPUs under the threshold. On timeout the waiter lists the holders
(pid, MiB, command, whether it was the service's) and `end_holders` ends exactly those pids,
identified by pid *and* start time, with SIGTERM, a grace period and SIGKILL (`remote.endpids`),
reporting what became of each. Never a blanket `fuser -k`.

Our own processes on those GPUs (the staged extractor waiting for its go) are passed as `exclude`:
their memory is subtracted from the reading, they are never offered as holders, and the threshold
applies to everything else.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from console.messages import EndOutcome, TelemetrySample, VramHolder
from console.ssh.hosts import resolve_python


class VramError(Exception):
    """The waiter cannot decide (no GPU readings) or ending holders failed; the message says why."""


def selected_gpus(sample: TelemetrySample, gpus: Sequence[int]) -> list:
    """The readings of `gpus` in `sample` (all of them when `gpus` is empty)."""
    return [g for g in sample.gpus if not gpus or g.index in gpus]


def excluded_mib(sample: TelemetrySample, gpu: int, exclude: Iterable[int]) -> int:
    """MiB that the `exclude` pids hold on `gpu` in `sample` (ours, not the service's)."""
    pids = set(exclude)
    return sum(p.mib or 0 for p in sample.processes if p.pid in pids and p.gpu == gpu)


def others_used(sample: TelemetrySample, gpus: Sequence[int], exclude: Iterable[int] = ()) -> dict[int, int | None]:
    """Per selected GPU: MiB used by everything but `exclude` (None when the GPU is unreadable)."""
    pids = frozenset(exclude)
    return {g.index: None if g.mem_used_mib is None else max(0, g.mem_used_mib - excluded_mib(sample, g.index, pids))
            for g in selected_gpus(sample, gpus)}


def vram_free(sample: TelemetrySample, gpus: Sequence[int], threshold_mib: int, exclude: Iterable[int] = ()) -> bool:
    """True when every selected GPU reads under `threshold_mib` used, not counting the memory of the
    `exclude` pids. An unreadable GPU is not free."""
    used = others_used(sample, gpus, exclude)
    if not used:
        return False
    return all(u is not None and u < threshold_mib for u in used.values())


def used_summary(sample: TelemetrySample, gpus: Sequence[int], exclude: Iterable[int] = ()) -> str:
    """'GPU0 47179 MiB, GPU1 46237 MiB' for messages (with `exclude`: '... (+ 20000 MiB ours)')."""
    pids = frozenset(exclude)
    parts = []
    for g in selected_gpus(sample, gpus):
        ours = excluded_mib(sample, g.index, pids) if pids else 0
        if g.mem_used_mib is None:
            parts.append(f"GPU{g.index} ? MiB")
        elif ours:
            parts.append(f"GPU{g.index} {max(0, g.mem_used_mib - ours)} MiB (+ {ours} MiB ours)")
        else:
            parts.append(f"GPU{g.index} {g.mem_used_mib} MiB")
    return ", ".join(parts)


def find_holders(sample: TelemetrySample, gpus: Sequence[int],
                 service_pids: Iterable[int] = (), exclude: Iterable[int] = ()) -> list[VramHolder]:
    """The processes holding memory on `gpus` (all when empty), one entry per pid, largest first;
    the `exclude` pids (our own) are never among them."""
    service = set(service_pids)
    ours = set(exclude)
    by_pid: dict[int, dict[str, Any]] = {}
    for proc in sample.processes:
        if (gpus and proc.gpu not in gpus) or proc.pid in ours:
            continue
        entry = by_pid.setdefault(proc.pid, {"mib": 0, "gpus": [], "proc": proc})
        entry["mib"] += proc.mib or 0
        if proc.gpu is not None and proc.gpu not in entry["gpus"]:
            entry["gpus"].append(proc.gpu)
    holders = [
        VramHolder(pid=pid, mib=e["mib"], gpus=tuple(sorted(e["gpus"])), command=e["proc"].command,
                   user=e["proc"].user, start_time=e["proc"].start_time, was_service=pid in service,
                   visible=e["proc"].visible, visible_reason=e["proc"].visible_reason)
        for pid, e in by_pid.items()
    ]
    return sorted(holders, key=lambda h: (-h.mib, h.pid))


@dataclass(frozen=True)
class VramWaitResult:
    free: bool
    waited_s: float
    used: str  # the last reading, e.g. "GPU0 47179 MiB, GPU1 46237 MiB"
    holders: tuple[VramHolder, ...] = ()  # filled when not free: what to offer to end


async def wait_vram_free(stream: Any, gpus: Sequence[int], threshold_mib: int, timeout: float,
                         stopped_at: float | None = None, service_pids: Iterable[int] = (),
                         exclude: Iterable[int] = (),
                         clock: Callable[[], float] = time.monotonic) -> VramWaitResult:
    """Wait on `stream` (a `TelemetryStream`) until the service's GPUs are free or `timeout` passes.

    Only samples that arrived after `stopped_at` (console monotonic time; default: now) count, so a
    reading from before the stop can never pass for "free". `service_pids`: pids seen as the
    service's before the stop (default: what the stream saw), so leftovers are marked as such.
    `exclude`: our own pids (the staged extractor): their memory does not count, and they are never
    offered as holders.
    """
    ours = frozenset(exclude)
    began = clock()
    after = began if stopped_at is None else stopped_at
    known = set(service_pids) or set(getattr(stream.telemetry, "seen_service_pids", {}))
    try:
        # A host with no GPU readings at all ends the wait at once: waiting longer cannot help.
        sample = await stream.wait_for(lambda s: not s.gpus or vram_free(s, gpus, threshold_mib, ours), timeout,
                                       after=after, eager=True)
        if sample.gpus:
            return VramWaitResult(True, clock() - began, used_summary(sample, gpus, ours))
    except TimeoutError:
        pass
    sample = stream.telemetry.latest
    fresh = sample is not None and (stream.telemetry.received_at or 0) > after
    if not fresh:
        raise VramError(f"no telemetry from {stream.telemetry.host} since the stop "
                        f"({stream.error or 'the agent sent nothing'}): cannot tell whether VRAM is free")
    if not sample.gpus:
        raise VramError(f"{stream.telemetry.host} has no GPU readings ({sample.reason}): cannot tell whether VRAM is free")
    return VramWaitResult(False, clock() - began, used_summary(sample, gpus, ours),
                          tuple(find_holders(sample, gpus, known, ours)))


def endpids_argv(python: str, code_dir: str, holders: Sequence[VramHolder], grace_s: float,
                 sudo: bool = False) -> list[str]:
    """The exact command that ends `holders` (shown to the operator before it runs); `python` is
    already resolved for the host (`Host.resolve_python`: no shell expands `~`)."""
    targets = [f"{h.pid}:{h.start_time}" if h.start_time is not None else str(h.pid) for h in holders]
    argv = ["env", f"PYTHONPATH={code_dir}", python, "-m", "remote.endpids", "--grace", f"{grace_s:g}", *targets]
    return ["sudo", "-n", *argv] if sudo else argv


def parse_end_results(stdout: str) -> list[EndOutcome]:
    """`remote.endpids`' JSON line -> outcomes; VramError when it is not that."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and isinstance(data.get("results"), list):
            return [EndOutcome(int(r["pid"]), str(r["outcome"]), str(r.get("detail", "")), float(r.get("after_s", 0.0)))
                    for r in data["results"]]
    raise VramError(f"remote.endpids gave no result: {stdout.strip()[:200]!r}")


async def end_holders(runner: Any, python: str, code_dir: str, holders: Sequence[VramHolder], grace_s: float,
                      sudo: bool = False) -> list[EndOutcome]:
    """End exactly `holders` on the host (TERM, `grace_s`, KILL) and say what became of each.
    `runner` is the host (`Host`): a `~` in `python` is expanded there."""
    if not holders:
        return []
    argv = endpids_argv(await resolve_python(runner, python), code_dir, holders, grace_s, sudo)
    result = await runner.run(argv, check=False, timeout=grace_s + 30)
    if result.exit_status != 0:
        raise VramError(f"ending {', '.join(str(h.pid) for h in holders)} failed (exit {result.exit_status}): "
                        f"{(result.stderr or result.stdout).strip()[:300]}")
    return parse_end_results(result.stdout)


def describe_outcomes(outcomes: Sequence[EndOutcome]) -> list[str]:
    """One line per process for the event log: 'pid 1234: killed (still running 10 s after SIGTERM ...)'."""
    return [f"pid {o.pid}: {o.outcome} ({o.detail}, {o.after_s:.1f} s)" for o in outcomes]

