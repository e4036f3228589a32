"""Live GPU telemetry per host: parse the agent's lines, keep a history, age them, attribute processes.

`TelemetryStream` runs `python -m remote.agent` on a host over the supervisor's connection and
restarts it after every reconnect. `HostTelemetry` is the pure part: the last sample, when it came
(by the console's clock, so a host with a wrong clock is not "stale" or "fresh" by mistake), and a
bounded per-GPU history for sparklines. `service_pids` says which GPU processes are the service's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from console.fanout import FanOut
from console.messages import GpuProcess, GpuReading, TelemetrySample, TelemetryUpdate
from console.ssh.hosts import resolve_python
from console.tasks import cancel_and_wait

log = logging.getLogger(__name__)

HISTORY_S = 900.0  # 15 minutes: the brief asks for at least 10 at 1 s
STALE_INTERVALS = 3.0  # a sample older than this many intervals is drawn as stale
MAX_RETRY_S = 30.0
EAGER_S = 0.1  # an eager wait asks for the next sample this long after one that did not satisfy it


class SampleError(ValueError):
    """A telemetry line that is not a valid agent sample."""


def _opt_int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SampleError(f"{what}: expected a number or null, got {value!r}")
    return int(value)


def _opt_float(value: Any, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise SampleError(f"{what}: expected a number or null, got {value!r}")
    return float(value)


def _opt_str(value: Any) -> str | None:
    return None if value is None else str(value)


def parse_sample(line: str) -> TelemetrySample:
    """Parse one `remote.agent` line; raise SampleError saying what is wrong with it."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SampleError(f"not JSON ({exc.msg} at column {exc.colno}): {line[:80]!r}") from None
    if not isinstance(raw, dict):
        raise SampleError(f"expected a JSON object, got {type(raw).__name__}")
    for key in ("seq", "t", "gpus", "processes"):
        if key not in raw:
            raise SampleError(f"missing {key!r}: {line[:80]!r}")
    if not isinstance(raw["gpus"], list) or not isinstance(raw["processes"], list):
        raise SampleError("'gpus' and 'processes' must be lists")
    gpus = []
    for i, g in enumerate(raw["gpus"]):
        if not isinstance(g, dict) or _opt_int(g.get("index"), f"gpus[{i}].index") is None:
            raise SampleError(f"gpus[{i}]: expected an object with an index, got {g!r}")
        gpus.append(GpuReading(
            index=int(g["index"]),
            name=_opt_str(g.get("name")),
            uuid=_opt_str(g.get("uuid")),
            mem_used_mib=_opt_int(g.get("mem_used_mib"), f"gpus[{i}].mem_used_mib"),
            mem_total_mib=_opt_int(g.get("mem_total_mib"), f"gpus[{i}].mem_total_mib"),
            util_pct=_opt_float(g.get("util_pct"), f"gpus[{i}].util_pct"),
            temp_c=_opt_float(g.get("temp_c"), f"gpus[{i}].temp_c"),
            power_w=_opt_float(g.get("power_w"), f"gpus[{i}].power_w"),
        ))
    processes = []
    for i, p in enumerate(raw["processes"]):
        if not isinstance(p, dict) or _opt_int(p.get("pid"), f"processes[{i}].pid") is None:
            raise SampleError(f"processes[{i}]: expected an object with a pid, got {p!r}")
        ancestors = p.get("ancestors") or []
        processes.append(GpuProcess(
            pid=int(p["pid"]),
            gpu=_opt_int(p.get("gpu"), f"processes[{i}].gpu"),
            mib=_opt_int(p.get("mib"), f"processes[{i}].mib"),
            user=_opt_str(p.get("user")),
            command=_opt_str(p.get("command")),
            ppid=_opt_int(p.get("ppid"), f"processes[{i}].ppid"),
            ancestors=tuple(int(a) for a in ancestors if isinstance(a, int)),
            start_time=_opt_int(p.get("start_time"), f"processes[{i}].start_time"),
            cgroup=_opt_str(p.get("cgroup")),
            visible=p.get("visible") is not False,  # older agents say nothing: their pids were checked by /proc
            visible_reason=_opt_str(p.get("visible_reason")),
        ))
    ram = raw.get("ram") or {}
    return TelemetrySample(
        host=str(raw.get("host", "")),
        seq=int(_opt_int(raw["seq"], "seq") or 0),
        t=float(_opt_float(raw["t"], "t") or 0.0),
        interval=float(_opt_float(raw.get("interval"), "interval") or 1.0),
        source=str(raw.get("source", "none")),
        simulated=bool(raw.get("simulated", False)),
        reason=_opt_str(raw.get("reason")),
        gpus=tuple(gpus),
        processes=tuple(processes),
        ram_total_mib=_opt_int(ram.get("total_mib"), "ram.total_mib"),
        ram_available_mib=_opt_int(ram.get("available_mib"), "ram.available_mib"),
        agent_cpu_ms=_opt_float(raw.get("cpu_ms"), "cpu_ms"),
    )


@dataclass(frozen=True)
class ServiceIdentity:
    """How to recognise the service's processes: its main pid's tree, or its cgroup."""

    main_pid: int | None = None
    cgroup: str | None = None


def is_service_process(proc: GpuProcess, service: ServiceIdentity) -> bool:
    """True when `proc` is the service's main process, one of its descendants, or in its cgroup."""
    if service.main_pid and (proc.pid == service.main_pid or service.main_pid in proc.ancestors):
        return True
    if service.cgroup and proc.cgroup and service.cgroup not in ("/", ""):
        return proc.cgroup == service.cgroup or proc.cgroup.startswith(service.cgroup.rstrip("/") + "/")
    return False


def service_pids(sample: TelemetrySample | None, service: ServiceIdentity) -> frozenset[int]:
    """The pids of `sample`'s GPU processes that belong to the service."""
    if sample is None:
        return frozenset()
    return frozenset(p.pid for p in sample.processes if is_service_process(p, service))


class HostTelemetry:
    """The console's view of one host's telemetry: last sample, arrival time, bounded history.

    History is a ring of (t, used MiB, util %) per GPU, sized for `history_s` at the sample
    interval, so memory stays bounded however long the console watches.
    """

    def __init__(self, host: str, interval: float = 1.0, history_s: float = HISTORY_S,
                 clock: Callable[[], float] = time.monotonic):
        self.host = host
        self.interval = interval
        self.history_s = history_s
        self._clock = clock
        self._maxlen = max(2, math.ceil(history_s / interval) + 1)
        self.latest: TelemetrySample | None = None
        self.received_at: float | None = None
        self.bad_lines = 0
        self.last_bad: str | None = None
        self._history: dict[int, deque[tuple[float, int | None, float | None]]] = {}
        self.service = ServiceIdentity()
        # pids seen as the service's while it ran: after a stop its leftovers are recognised by them
        self.seen_service_pids: dict[int, int | None] = {}

    def add_line(self, line: str) -> TelemetrySample | None:
        """Add one agent line; a bad line is counted and remembered, never raised."""
        try:
            sample = parse_sample(line)
        except SampleError as exc:
            self.bad_lines += 1
            self.last_bad = str(exc)
            log.warning("%s: bad telemetry line: %s", self.host, exc)
            return None
        self.add(sample)
        return sample

    def add(self, sample: TelemetrySample) -> None:
        self.latest = sample
        self.received_at = self._clock()
        if sample.interval and abs(sample.interval - self.interval) > 1e-9:
            self._resize(sample.interval)
        for gpu in sample.gpus:
            ring = self._history.setdefault(gpu.index, deque(maxlen=self._maxlen))
            ring.append((sample.t, gpu.mem_used_mib, gpu.util_pct))
        for pid in service_pids(sample, self.service):
            proc = next(p for p in sample.processes if p.pid == pid)
            self.seen_service_pids[pid] = proc.start_time

    def _resize(self, interval: float) -> None:
        self.interval = interval
        self._maxlen = max(2, math.ceil(self.history_s / interval) + 1)
        self._history = {k: deque(v, maxlen=self._maxlen) for k, v in self._history.items()}

    def age(self) -> float | None:
        """Seconds since the last sample arrived; None if none ever did."""
        return None if self.received_at is None else max(0.0, self._clock() - self.received_at)

    def is_stale(self) -> bool:
        age = self.age()
        return age is None or age > STALE_INTERVALS * self.interval

    def history(self, gpu: int, field: str = "mem_used_mib", seconds: float | None = None) -> list[float | None]:
        """The last `seconds` (default: all) of one GPU's `mem_used_mib` or `util_pct`, oldest first."""
        column = {"mem_used_mib": 1, "util_pct": 2}[field]
        ring = self._history.get(gpu, deque())
        if seconds is None or not ring:
            return [row[column] for row in ring]
        since = ring[-1][0] - seconds
        return [row[column] for row in ring if row[0] > since]

    def rings(self) -> dict[int, list[tuple[float, int | None, float | None]]]:
        """Each GPU's history rows (t, used MiB, util %), oldest first: what `seed` takes (a viewer of
        `serve` starts its sparklines from the hub's, console/sharing.py)."""
        return {gpu: list(ring) for gpu, ring in self._history.items()}

    def seed(self, rings: dict[int, list[tuple[float, int | None, float | None]]]) -> None:
        """Start the history from `rings` (another console's `rings()`), kept to this ring's length."""
        self._history = {gpu: deque(rows, maxlen=self._maxlen) for gpu, rows in rings.items()}

    def history_len(self, gpu: int) -> int:
        return len(self._history.get(gpu, ()))

    def update(self, streaming: bool, error: str | None = None) -> TelemetryUpdate:
        """The snapshot to publish now."""
        return TelemetryUpdate(
            host=self.host,
            sample=self.latest,
            age_s=self.age(),
            stale=self.is_stale(),
            streaming=streaming,
            error=error,
            service_pids=service_pids(self.latest, self.service),
        )


def agent_argv(python: str, code_dir: str, interval: float = 1.0, simulate: str | None = None) -> list[str]:
    """The command that runs the agent from the uploaded code directory (no shell involved).

    `python` must already be resolved for the host (`Host.resolve_python`): no shell expands `~`."""
    argv = ["env", f"PYTHONPATH={code_dir}", python, "-m", "remote.agent", "--interval", f"{interval:g}"]
    if simulate:
        argv += ["--simulate", simulate]
    return argv


Subscriber = Callable[[TelemetryUpdate], Any]


class TelemetryStream:
    """Streams one host's agent over its supervisor's connection, for as long as it runs.

    `code_dir(host)` returns the remote code directory (e.g. `JobRunner(host).ensure_code`). After a
    dropped connection or an agent that ended, it waits for the supervisor to reconnect and starts
    the agent again; in between it publishes the telemetry as not streaming (and stale once old).
    """

    def __init__(self, supervisor: Any, code_dir: Callable[[Any], Awaitable[str]], python: str | None = None,
                 interval: float = 1.0, simulate: str | None = None, history_s: float = HISTORY_S,
                 retry_s: float = 1.0):
        self.supervisor = supervisor
        self.code_dir = code_dir
        self.python = python
        self.interval = interval
        self.simulate = simulate
        self.retry_s = retry_s
        name = getattr(supervisor, "name", None) or getattr(getattr(supervisor, "spec", None), "name", "host")
        self.telemetry = HostTelemetry(str(name), interval=interval, history_s=history_s)
        self.streaming = False
        self.error: str | None = None
        self.starts = 0  # how many times the agent was started (1 + restarts)
        self._subscribers = FanOut("telemetry")
        self._task: asyncio.Task | None = None
        self._ask: Callable[[str], None] | None = None  # writes to the running agent's stdin
        self._asked_at: float | None = None  # a `now` sent, its sample not yet seen (monotonic)

    def subscribe(self, callback: Subscriber) -> Callable[[], None]:
        """Call `callback(update)` on every sample and stream change; returns an unsubscribe."""
        return self._subscribers.subscribe(callback)

    def set_service(self, service: ServiceIdentity) -> None:
        self.telemetry.service = service

    def _publish(self) -> None:
        self._subscribers.publish(self.telemetry.update(self.streaming, self.error))

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"telemetry-{self.telemetry.host}")
        return self._task

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def run(self) -> None:
        """Stream until cancelled, restarting the agent after every drop."""
        failures = 0
        while True:
            got_samples = False
            try:
                host = await self.supervisor.wait_connected(None)
                code = await self.code_dir(host)
                # None: the host's own python (its spec); `~` paths are expanded on the host.
                python = await resolve_python(host, self.python or host.spec.python)
                argv = agent_argv(python, code, self.interval, self.simulate)
                self.starts += 1
                async for line in host.stream(argv, stdin=self._agent_stdin):
                    self._asked_at = None
                    if self.telemetry.add_line(line) is not None:
                        self.streaming, self.error, got_samples = True, None, True
                    self._publish()
                self.error = "the agent ended"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a dropped link or a failed agent: retry
                self.error = str(exc) or type(exc).__name__
            self.streaming = False
            self._publish()
            # An agent that fails at once (no python, bad code dir) is retried ever more slowly.
            failures = 0 if got_samples else failures + 1
            await asyncio.sleep(min(self.retry_s * 2 ** max(0, failures - 1), MAX_RETRY_S))

    def _agent_stdin(self, write: Callable[[str], None] | None) -> None:
        self._ask, self._asked_at = write, None

    def sample_now(self) -> None:
        """Ask the agent for a sample at once (one request outstanding at a time; an agent that has
        not answered within its interval is not asked again until it does)."""
        now = time.monotonic()
        if self._ask is None or (self._asked_at is not None and now - self._asked_at < self.interval):
            return
        self._asked_at = now
        try:
            self._ask("now\n")
        except Exception:  # noqa: BLE001 - a closing channel: the interval's samples still come
            self._asked_at = None

    async def wait_for(self, predicate: Callable[[TelemetrySample], bool], timeout: float,
                       after: float | None = None, eager: bool = False) -> TelemetrySample:
        """Wait for a sample satisfying `predicate` that arrived after `after` (console monotonic).
        `eager`: a window waits on it (memory leaving or coming back): samples are asked for every
        EAGER_S until it holds, rather than waiting for the interval's."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[TelemetrySample] = loop.create_future()

        def check(update: TelemetryUpdate) -> None:
            sample = update.sample
            fresh = after is None or (self.telemetry.received_at or 0) > after
            if sample is not None and fresh and not future.done() and predicate(sample):
                future.set_result(sample)
            elif eager and not future.done():
                loop.call_later(EAGER_S, self.sample_now)

        unsubscribe = self.subscribe(check)
        if eager:
            self.sample_now()
        try:
            async with asyncio.timeout(timeout):  # not wait_for: on 3.11 it drops a cancel that lands as the sample does
                return await future
        finally:
            unsubscribe()

