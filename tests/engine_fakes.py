"""Small named fakes of the world behind `WindowHosts`, for the engine's unit tests and its
crash-point sweep (`tests/test_engine_sweep.py`).

What cannot run here is faked, small and named: a systemd-like service manager (`FakeService`),
GPU telemetry (`FakeTelemetry`, the console's real `HostTelemetry` fed by the fake's samples), and
a job runner (`FakeJob`) whose workers are coroutines. Everything else is real: the hosts' files
live in real directories (so the real manifest checks read them), the workers write their events
with the real `remote.events.EventWriter`, the drafter provenance and the extractor's check phase
are the real workers' own `main`s run in-process, and the states, the evaluation and the probe are
the real producers' output, built once (`Producers`).

The world outlives the console: `FakeWorld` holds the hosts, the service and the jobs, and every
engine talks to it through its own `FakeHosts` view (`tests/fake_hosts.py`). `FakeHosts.kill()` is the console's SIGKILL:
from then on everything that view is asked raises `SimulatedCrash`, while the jobs and the service
go on. A new engine over a new view resumes against the same world.

Time is the world's own logical clock (`Clock`): it moves only when the world does something that
takes time (a stop, a start, an agent's sample, a timeout). The engine's module reads it too
(`install_clock`), so the downtime the run records can be compared exactly with the world's.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from console.config import Config, dump_toml, load_config
from console.messages import (
    Confirmation,
    GpuProcess,
    GpuReading,
    ServiceHealth,
    ServiceStatus,
    TelemetrySample,
)
from console.ssh.hosts import HostDisconnected
from console.ssh.jobs import JobExists, JobHandle
from console.telemetry import HostTelemetry
from remote.events import EventWriter, WorkerError
from remote.extract_check import PARTIAL_MANIFEST
from tests.fake_sglang import FakeServer

if TYPE_CHECKING:
    from tests.fake_hosts import FakeHosts  # the console's view of this world

INFERENCE, TRAINING = "ct129", "ct200"
GPU_TOTAL_MIB = 81559
SERVICE_MIB = 40000  # per GPU, while the server runs
EXTRACT_MIB = 20000  # the extractor on GPU0 between its copy to the GPU and `gpu_released`
SERVICE_PID, SCHEDULER_PID = 4242, 4243  # the scheduler is the story's leftover holder
STOP_S, START_S, SAMPLE_S = 4.0, 30.0, 1.0  # how long a stop, a start and one agent sample take
UNIT = "sglang.service"


class Clock:
    """The world's logical time: epoch seconds and a monotonic reading that move together."""

    EPOCH = 1_780_000_000.0

    def __init__(self) -> None:
        self.elapsed = 0.0

    def time(self) -> float:
        return self.EPOCH + self.elapsed

    def monotonic(self) -> float:
        return 1000.0 + self.elapsed

    def advance(self, seconds: float) -> None:
        self.elapsed += seconds


class _TimeModule:
    """What the engine's module calls `time`: the world's clock, the real formatting."""

    def __init__(self, clock: Clock):
        self.time, self.monotonic = clock.time, clock.monotonic
        self.strftime, self.localtime = time.strftime, time.localtime


def install_clock(monkeypatch: Any, clock: Clock) -> None:
    """The engine, its window and the steps read the world's clock (step times, the stop, the ready moment,
    decision time): every module of the engine's that imports `time`, and the workers' events."""
    import console.procedure.engine as engine_module
    import console.procedure.steps as steps_module

    # The workers' events carry the world's time too (their `t`, which the engine reads as when a
    # worker says something happened: the GPUs' release, the extraction's progress).
    modules = [engine_module, sys.modules["console.procedure.window"], sys.modules["console.procedure.run_jobs"],
               sys.modules["remote.events"]]
    modules += [m for name, m in sorted(sys.modules.items()) if name.startswith(steps_module.__name__ + ".")]
    for module in modules:
        if getattr(module, "time", None) is time:
            monkeypatch.setattr(module, "time", _TimeModule(clock))


# --- the real producers' output, built once -----------------------------------------------------


@dataclass(frozen=True)
class Producers:
    target: Path  # a target checkpoint (heads) whose config.json the extractor's check reads
    drafters: dict[str, Path]  # name -> a real DFlash checkpoint (remote.drafter's writer)
    states: Path  # a complete extraction directory (remote.drill.synthetic, the extractor's format)
    evaluation: Path  # a complete evaluation directory (remote.evaluate's main)
    probe: dict[str, Any]  # remote.probe's facts for this machine (the model replaced per call)


def build_producers(root: Path) -> Producers:
    """Everything the fake workers hand out, from the real producers (CPU, some seconds, once)."""
    from remote.drafter import save_random_drafter
    from remote.drill.synthetic import build_copying_setup
    from remote.evaluate import main as evaluate_main
    from remote.probe import probe

    setup = build_copying_setup(root / "copying", block_size=16, prompts=2, num_tokens=40)
    random = save_random_drafter(root / "random", 34, 32, [1, 2], 4, block_size=16, mask_token_id=31, seed=3)
    target = root / "target"
    shutil.copytree(setup["target"], target)
    config = json.loads((target / "config.json").read_text())
    config.update(num_hidden_layers=4, max_position_embeddings=4096)  # what the extractor's check reads
    (target / "config.json").write_text(json.dumps(config))
    evaluation = root / "eval"
    with open(root / "eval-events.jsonl", "w") as sink:
        evaluate_main(EventWriter(stream=sink), [
            "--states", str(setup["states"]), "--target", str(setup["target"]),
            "--drafter", f"reference={setup['drafter']}", "--drafter", f"candidate={random}",
            "--reference", "reference", "--out", str(evaluation), "--device", "cpu", "--budgets", "8,16"])
    return Producers(target, {"reference": setup["drafter"], "candidate": random}, setup["states"], evaluation,
                     probe(str(target), str(root)))


def write_config(root: Path, producers: Producers, **service: Any) -> Config:
    """A real config file for the fake world (loaded by `load_config`, as an operator's is)."""
    hosts = {name: {"address": f"{name}.example", "user": "ops", "workdir": str(root / name / "work"),
                    "lock_dir": str(root / name / "locks"),
                    "simulated_gpus": True} for name in (INFERENCE, TRAINING)}
    data = {
        "hosts": hosts,
        "service": {"host": INFERENCE, "manager": "systemd", "unit": UNIT, "url": "http://127.0.0.1:30000",
                    "ready_timeout_s": 900, "vram_free_mib": 1024, "stop_grace_s": 2, "vram_wait_s": 30, **service},
        "target": {"host": INFERENCE, "model_path": str(producers.target), "kernels": "any", "layers": "auto",
                   "paths": {TRAINING: str(producers.target)}},
        "prompts": {"max_new_tokens": 8},
        "drafters": [{"name": "reference", "host": TRAINING, "path": str(producers.drafters["reference"]),
                      "reference": True},
                     {"name": "candidate", "host": TRAINING, "path": str(producers.drafters["candidate"])}],
        "eval": {"host": INFERENCE, "device": "cpu", "budgets": [8, 16], "topk": 8},
    }
    path = root / "dflash-ops.toml"
    path.write_text(dump_toml(data))
    return load_config(path)


# --- faults -------------------------------------------------------------------------------------


@dataclass
class Fault:
    """One injected failure. `where` is a host method ("run", "stop", "start", "fetch_tree", ...) or
    a worker's point ("extract:staged", "completions:generate", ...); `how` is "link" (the link
    drops: HostDisconnected), "dead" (the worker is killed, no `exit` event), "exit" (the worker
    fails cleanly, exit 2), "stall" (alive, silent), "timeout" (the wait runs out), "stuck" (the
    holders survive being ended), "sudo" (the manager's command refused: ServiceError, nothing done). `match`: the call's facts it applies to. `times`: how often."""

    where: str
    how: str
    match: dict[str, Any] = field(default_factory=dict)
    times: int = 1
    after: bool = False  # "link" on "stop": the stop ran, then the link dropped before the answer
    skip: int = 0  # matching calls let through before it fires
    hit: int = 0


def raise_fault(fault: Fault, where: str, host: str) -> None:
    if fault.how == "link":
        raise HostDisconnected(host, f"the link dropped during {where} (injected)")
    if fault.how == "timeout":
        raise TimeoutError(f"{where} on {host} timed out (injected)")
    if fault.how == "error":
        raise RuntimeError(f"{where} on {host}: an unexpected error (injected)")
    if fault.how == "sudo":  # the command refused before it did anything (systemd's manager's own error)
        from console.service.control import ServiceError

        raise ServiceError(f"`sudo -n systemctl {where} {UNIT}` failed (exit 1): sudo: a password is required "
                           f"(injected)")


# --- the service ---------------------------------------------------------------------------------


class FakeService:
    """A systemd-like unit: active -> deactivating -> inactive -> activating -> active. Counts every
    stop and start command and logs every real transition with the world's time."""

    def __init__(self, world: FakeWorld):
        self.world = world
        self.state = "active"
        self.ready = True
        self.stop_commands = 0
        self.start_commands = 0
        self.transitions: list[tuple[float, str, str]] = []  # (time, from, to)
        self.commands: list[tuple[float, str]] = []  # (time, "stop" | "start")
        self.start_hangs = False  # a start that never becomes ready (ReadyTimeout)
        self.active_since = world.clock.time() - 3600.0  # systemd's ActiveEnterTimestamp: up an hour already

    def _to(self, state: str) -> None:
        self.transitions.append((self.world.clock.time(), self.state, state))
        self.state = state
        self.world.changed()

    def status(self) -> ServiceStatus:
        return ServiceStatus("systemd", UNIT, self.state == "active", self.state,
                             main_pid=SERVICE_PID if self.state != "inactive" else None, since=self.active_since)

    async def stop(self) -> None:
        """`systemctl stop` returns once the unit is inactive; the first stop leaves the scheduler's
        VRAM held (the story's leftover), when the world says so."""
        self.stop_commands += 1
        self.commands.append((self.world.clock.time(), "stop"))
        if self.state == "inactive":
            return
        self.ready = False
        self._to("deactivating")
        await asyncio.sleep(0)
        self.world.clock.advance(STOP_S)
        gpus = self.world.gpus
        gpus.pop(SERVICE_PID, None)
        if not (self.world.stuck_holder and self.stop_commands == 1):
            gpus.pop(SCHEDULER_PID, None)
        self._to("inactive")
        self.world.sample(INFERENCE)

    def start(self) -> None:
        """`systemctl start` of a unit that loads for START_S: it becomes active and ready in the
        world's own time, whether or not anyone watches."""
        self.start_commands += 1
        self.commands.append((self.world.clock.time(), "start"))
        if self.state in ("active", "activating"):
            return
        self._to("activating")
        if not self.start_hangs:
            self.world.spawn(self._activate())

    async def _activate(self) -> None:
        for _ in range(3):
            await asyncio.sleep(0)
        self.world.clock.advance(START_S)
        self.world.gpus[SERVICE_PID] = (INFERENCE, {0: SERVICE_MIB - 2000, 1: SERVICE_MIB - 2000}, "sglang.launch_server")
        self.world.gpus[SCHEDULER_PID] = (INFERENCE, {0: 2000, 1: 2000}, "sglang::scheduler")
        self.world.server.resume_all()  # a new process: nothing paused, nothing released
        self.ready = True
        self.active_since = self.world.clock.time()
        self._to("active")
        self.world.sample(INFERENCE)

    def restart_outside(self) -> None:
        """Someone restarts the unit outside the run (its own stop and start, by hand): a new process,
        its memory all held again, active at once on the world's clock. Not the run's commands: the
        stop and start counts stay as they were."""
        self._to("inactive")
        self.world.clock.advance(STOP_S + START_S)
        self.world.gpus[SERVICE_PID] = (INFERENCE, {0: SERVICE_MIB - 2000, 1: SERVICE_MIB - 2000}, "sglang.launch_server")
        self.world.gpus[SCHEDULER_PID] = (INFERENCE, {0: 2000, 1: 2000}, "sglang::scheduler")
        self.world.server.restarted()
        self.ready = True
        self.active_since = self.world.clock.time()
        self._to("active")
        self.world.sample(INFERENCE)

    def health(self) -> ServiceHealth:
        if self.state == "active" and self.ready:
            return ServiceHealth(200, True, model="target", model_path=str(self.world.config.target.model_path))
        return ServiceHealth(None, False, error=f"{UNIT} is {self.state}")

    def down_periods(self) -> list[tuple[float, float | None, int]]:
        """(stop command time, ready time or None, start commands in between) per stop command."""
        out = []
        stops = [t for t, what in self.commands if what == "stop"]
        for i, t in enumerate(stops):
            end = stops[i + 1] if i + 1 < len(stops) else float("inf")
            ready = next((when for when, _, to in self.transitions if to == "active" and t <= when < end), None)
            starts = sum(1 for when, what in self.commands if what == "start" and t <= when < (ready or end))
            out.append((t, ready, starts))
        return out


class FakeManager:
    """The `ServiceManager` the engine is handed (systemd's argv, the fake unit's answers)."""

    name = f"systemd unit {UNIT}"

    def __init__(self, hosts: FakeHosts):
        self._hosts = hosts

    def stop_argv(self) -> list[str]:
        return ["systemctl", "stop", UNIT]

    def start_argv(self) -> list[str]:
        return ["systemctl", "start", UNIT]

    async def status(self) -> ServiceStatus:
        self._hosts._alive()
        await self._hosts.answer("status")
        self._hosts._fault("status")
        return self._hosts.world.service.status()

    async def stop(self) -> None:
        hosts = self._hosts
        hosts._alive()
        fault = hosts._fault("stop")
        await hosts.world.service.stop()
        if hosts.world.after_stop is not None:  # a signal in the moment the stop's work is done
            hosts.world.after_stop()
            await asyncio.sleep(0)  # where it lands: the command has not returned yet
        hosts._alive()
        if fault is not None:  # the stop ran, then the link dropped before its answer came back
            raise_fault(fault, "stop", INFERENCE)


# --- jobs ----------------------------------------------------------------------------------------


class _Killed(Exception):
    """The worker's process was killed (SIGKILL): no `exit` event is written."""


class EventsFile:
    """A job's events.jsonl: the worker's real `EventWriter` writes complete lines into it."""

    def __init__(self, world: FakeWorld):
        self.world = world
        self.data = bytearray()

    def write(self, text: str) -> None:
        self.data += text.encode()
        self.world.changed()

    def flush(self) -> None:
        pass

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(line) for line in self.data.decode().splitlines()]


@dataclass
class FakeJob:
    handle: JobHandle
    kind: str  # "extract-staged", "extract", "extract-check", "completions", "evaluate", "probe", "provenance"
    args: list[str]
    log: EventsFile
    events: EventWriter
    state: str = "running"  # running | exited | dead
    exit_code: int | None = None
    stderr: str = ""
    stalled: bool = False
    task: asyncio.Task | None = None
    reached: list[str] = field(default_factory=list)  # the worker's points it got past

    def arg(self, name: str) -> str | None:
        return self.args[self.args.index(name) + 1] if name in self.args else None

    def seen(self, kind: str) -> bool:
        return any(e.get("type") == kind for e in self.log.events())


# --- telemetry -----------------------------------------------------------------------------------


class FakeTelemetry:
    """One host's agent stream: the console's real `HostTelemetry` fed with the world's GPUs. A
    sample arrives whenever the world changes what the GPUs hold, and one more (an agent interval
    later) whenever somebody waits for one."""

    def __init__(self, world: FakeWorld, host: str):
        self.world = world
        self.host = host
        self.telemetry = HostTelemetry(host, interval=SAMPLE_S, clock=world.clock.monotonic)
        self.error: str | None = None
        # Faults: `frozen`, the agent sends nothing more (the latest sample grows stale); `no_readings`,
        # its samples carry no GPU memory readings (nvidia-smi failing).
        self.frozen = False
        self.no_readings = False
        self._seq = 0
        self._waiters: list[tuple[Callable[[TelemetrySample], bool], float | None, asyncio.Future]] = []

    def sample(self) -> TelemetrySample:
        if self.host == self.world.service_host:
            self.world.server.tick()  # a release answered before its memory left (fake_sglang.py)
        gpus, processes = [], []
        held = {i: 0 for i in range(2)}
        for pid, (host, per_gpu, command) in sorted(self.world.gpus.items()):
            if host != self.host:
                continue
            for gpu, mib in per_gpu.items():
                held[gpu] += mib
                processes.append(GpuProcess(pid, gpu, mib, "ops", command, start_time=pid * 10))
        for i in range(2):
            gpus.append(GpuReading(i, "H100 (simulated)", f"GPU-{self.host}-{i}",
                                   None if self.no_readings else 300 + held[i], GPU_TOTAL_MIB, 0.0, 40.0, 90.0))
        self._seq += 1
        sample = TelemetrySample(self.host, self._seq, self.world.clock.time(), SAMPLE_S, "simulated", True, None,
                                 tuple(gpus), tuple(processes))
        if self.frozen:
            return sample  # never received
        self.telemetry.add(sample)
        for pid, (host, _, command) in self.world.gpus.items():
            if host == self.host and command.startswith("sglang"):
                self.telemetry.seen_service_pids[pid] = pid * 10
        for waiter in list(self._waiters):
            predicate, after, future = waiter
            if not future.done() and (after is None or self.telemetry.received_at > after) and predicate(sample):
                future.set_result(sample)
        return sample

    async def wait_for(self, predicate: Callable[[TelemetrySample], bool], timeout: float,
                       after: float | None = None, eager: bool = False) -> TelemetrySample:
        """The next matching sample after `after`. When nothing in the world can change the GPUs any
        more, the wait runs out at once (its timeout passes on the world's clock)."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        waiter = (predicate, after, future)
        self._waiters.append(waiter)
        try:
            self.world.clock.advance(SAMPLE_S)  # the agent's next sample
            self.sample()
            while not future.done():
                ahead = None if after is None else after - self.world.clock.monotonic()
                if ahead is not None and ahead >= 0 and not self.frozen and ahead + SAMPLE_S <= timeout:
                    self.world.clock.advance(ahead + SAMPLE_S)  # the agent samples on: its first after `after`
                    self.sample()
                    continue
                if self.host == self.world.service_host and self.world.server.freeing:
                    self.world.clock.advance(SAMPLE_S)  # a release's memory leaves at a later agent sample
                    self.sample()
                    continue
                if not self.world.gpus_may_change(self.host):
                    self.world.clock.advance(timeout)
                    raise TimeoutError
                await self.world.wait_changed()
                if not future.done():
                    self.sample()
            return future.result()
        finally:
            self._waiters.remove(waiter)


class _Watch:
    """A view's handle on a telemetry stream: dead with its console."""

    def __init__(self, hosts: FakeHosts, stream: FakeTelemetry):
        self._hosts, self._stream = hosts, stream

    @property
    def telemetry(self) -> HostTelemetry:
        return self._stream.telemetry

    @property
    def error(self) -> str | None:
        return self._stream.error

    async def wait_for(self, predicate: Callable[[TelemetrySample], bool], timeout: float,
                       after: float | None = None, eager: bool = False) -> TelemetrySample:
        self._hosts._alive()
        sample = await self._stream.wait_for(predicate, timeout, after, eager)
        self._hosts._alive()
        return sample


# --- the world ------------------------------------------------------------------------------------


class FakeWorld:
    """The hosts, the service, the jobs and the GPUs: what outlives every console."""

    def __init__(self, root: Path, config: Config, producers: Producers, stuck_holder: bool = True):
        self.root = root
        self.config = config
        self.producers = producers
        self.clock = Clock()
        self.service = FakeService(self)
        self.service_host = INFERENCE
        self.server = FakeServer(self, SERVICE_PID)  # its memory-saver routes (tests/fake_sglang.py)
        self.stuck_holder = stuck_holder  # the first stop leaves the scheduler's VRAM held
        self.holders_survive = False  # ending the holders does not free their VRAM
        self.extract_mib = EXTRACT_MIB  # what the extractor holds on GPU0
        self.gpus: dict[int, tuple[str, dict[int, int], str]] = {
            SERVICE_PID: (INFERENCE, {0: SERVICE_MIB - 2000, 1: SERVICE_MIB - 2000}, "sglang.launch_server"),
            SCHEDULER_PID: (INFERENCE, {0: 2000, 1: 2000}, "sglang::scheduler"),
        }
        self.jobs: dict[tuple[str, str], FakeJob] = {}
        self.job_order: list[FakeJob] = []
        self.faults: list[Fault] = []
        # Cancels the next host calls lose (FakeHosts.answer), and the calls that lost one.
        self.swallow_cancels = 0
        self.swallowed: list[str] = []
        self.tasks: set[asyncio.Task] = set()
        self.streams = {name: FakeTelemetry(self, name) for name in config.hosts}
        self.ended: list[int] = []  # pids the console had ended
        self.go_files: list[str] = []
        self.vram_free_seen: list[float] = []  # when a sample showed the service's GPUs free
        self.flush_gate: asyncio.Event | None = None  # set: the extractor's flush waits for it
        self.after_stop: Callable[[], Any] | None = None  # called once the unit is down, before the stop returns
        # The operator's stop at the budget: the engine offers it from the extraction's projection and
        # writes the stop file on a yes (tests/test_budget_window.py drives that offer on the drill);
        # here the file is written once this many prompts of a window are extracted (None: never).
        self.budget_prompts: int | None = None
        self.extracted: list[str] = []  # every prompt an extractor extracted, in order (none twice)
        self._changed = asyncio.Event()
        self._next_pid = 7000
        for name in config.hosts:
            self.workdir(name).mkdir(parents=True, exist_ok=True)

    # change notification: every waiter in the world wakes on any change
    def changed(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def spawn(self, coro: Any) -> asyncio.Task:
        """A task of the world (a job, a unit starting): it lives on when a console dies."""
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def workdir(self, host: str) -> Path:
        return Path(self.config.hosts[host].workdir)

    def sample(self, host: str) -> None:
        sample = self.streams[host].sample()
        if host == INFERENCE and all((g.mem_used_mib or 0) < self.config.service.vram_free_mib for g in sample.gpus):
            self.vram_free_seen.append(self.clock.time())

    def gpus_may_change(self, host: str) -> bool:
        """Whether anything under way can still change what `host`'s GPUs hold."""
        if host == self.service_host and self.server.freeing:
            return True
        if host == INFERENCE and self.service.state in ("deactivating", "activating") and not self.service.start_hangs:
            return True
        for job in self.extraction_jobs():
            if job.state != "running" or job.handle.host != host or "gpu_released" in job.reached:
                continue
            go = job.arg("--go-file")
            if job.kind == "extract" or "holds-gpu" in job.reached or go is not None and Path(go).exists():
                return True
        return False

    def take_fault(self, where: str, **facts: Any) -> Fault | None:
        for fault in self.faults:
            if fault.where == where and fault.hit < fault.times and all(facts.get(k) == v for k, v in fault.match.items()):
                if fault.skip:
                    fault.skip -= 1
                    continue
                fault.hit += 1
                return fault
        return None

    # --- jobs ---

    def extraction_jobs(self) -> list[FakeJob]:
        return [j for j in self.job_order if j.kind in ("extract", "extract-staged")]

    def kill_job(self, job: FakeJob) -> None:
        """SIGKILL: gone without an `exit` event."""
        if job.state == "running" and job.task is not None:
            job.task.cancel(msg="SIGKILL")
            job.reached.append("killed")

    def start_job(self, host: str, worker: str, args: list[str], job_id: str) -> FakeJob:
        if (host, job_id) in self.jobs:
            raise JobExists(host, f"job {job_id} already exists")
        self._next_pid += 1
        run_dir = str(self.workdir(host) / "runs" / job_id)
        handle = JobHandle(host, job_id, worker, run_dir, self._next_pid, self._next_pid * 10, self.clock.time(),
                           ("python", "-m", f"remote.{worker}", *args))
        kind = worker
        if worker == "extract":
            kind = "extract-check" if "--check-only" in args else "extract-staged" if "--staged" in args else "extract"
        log = EventsFile(self)
        job = FakeJob(handle, kind, list(args), log, EventWriter(stream=log))
        self.jobs[(host, job_id)] = job
        self.job_order.append(job)
        job.task = self.spawn(self._run(job))
        return job

    async def _run(self, job: FakeJob) -> None:
        """Like `remote.events.run_worker`: result on success, error and exit code otherwise; a
        SIGTERM (cancel) still writes `exit`, a SIGKILL writes nothing."""
        events, code = job.events, 0
        try:
            await asyncio.sleep(0)
            data = await WORKERS[job.kind](self, job)
            if data is not None:
                events.result(data)
        except WorkerError as exc:
            events.error(exc.msg, exc.where)
            code = 2
        except (_Killed, asyncio.CancelledError) as exc:
            if isinstance(exc, _Killed) or "killed" in job.reached:
                self._gone(job, "dead")
                job.stderr = "Killed"
                return
            events.log("stopped (exit 143)", level="warning")
            code = 143
        except Exception as exc:  # noqa: BLE001 - the protocol reports every failure
            job.stderr = traceback.format_exc()
            events.error(f"{type(exc).__name__}: {exc}")
            code = 1
        events.exit(code)
        job.exit_code = code
        self._gone(job, "exited")

    def _gone(self, job: FakeJob, state: str) -> None:
        job.state = state
        if self.gpus.pop(job.handle.pid, None) is not None:
            self.sample(job.handle.host)
        self.changed()

    async def point(self, job: FakeJob, name: str) -> None:
        """A worker got past `name`: an injected fault there fires now."""
        job.reached.append(name)
        await asyncio.sleep(0)
        fault = self.take_fault(f"{job.handle.worker}:{name}", kind=job.kind, host=job.handle.host)
        if fault is None:
            return
        if fault.how == "dead":
            job.reached.append("killed")
            raise _Killed
        if fault.how == "exit":
            raise WorkerError(f"injected failure after {name}", name)
        if fault.how == "stall":
            job.stalled = True
            self.changed()
            await asyncio.Event().wait()

    async def wait_file(self, path: Path) -> None:
        while not path.exists():
            await self.wait_changed()


# --- the workers (scripted as the real ones behave) ----------------------------------------------


async def probe_worker(world: FakeWorld, job: FakeJob) -> dict[str, Any]:
    """remote.probe: this machine's facts (the real probe's), the model's read by its own helper."""
    from remote.probe import model_facts

    job.events.phase("probe")
    await world.point(job, "start")
    return {**copy.deepcopy(world.producers.probe), "model": model_facts(job.arg("--model"))}


async def provenance_worker(world: FakeWorld, job: FakeJob) -> dict[str, Any]:
    """remote.provenance: the real worker's main, in-process."""
    from remote.provenance import provenance_main

    await world.point(job, "start")
    return provenance_main(job.events, job.args)


async def completions_worker(world: FakeWorld, job: FakeJob) -> dict[str, Any]:
    """remote.completions against a live server: the same file (format, records, completeness by
    its own `completeness`), tokens made up inside the target's vocabulary."""
    from remote.artifacts import write_json_atomic
    from remote.completions import FORMAT, completeness
    from remote.prompts import load_prompts

    events = job.events
    events.phase("prompts")
    if world.service.state != "active":
        raise WorkerError(f"{job.arg('--server')} gives no usable /model_info: connection refused", "--server")
    prompt_set = load_prompts(job.arg("--prompts"))
    events.phase("generate")
    records = []
    for i, prompt in enumerate(prompt_set.prompts, start=1):
        digest = hashlib.sha256(json.dumps(prompt.to_json()).encode()).digest()
        ids = [b % 30 for b in digest[:12]]
        record = {"id": prompt.id, "prompt_ids": ids, "max_new_tokens": prompt.max_new_tokens,
                  "completion_ids": [(b + 1) % 30 for b in digest[12:12 + prompt.max_new_tokens]], "text": "x",
                  "finish_reason": "length", "endpoint": "generate"}
        record["complete"], why = completeness(record)
        if why:
            record["incomplete_reason"] = why
        records.append(record)
        events.progress("prompts", i, len(prompt_set.prompts), "prompts", label=prompt.id)
        if i == 1:
            await world.point(job, "generate")
    out = job.arg("--out")
    write_json_atomic(out, {"format": FORMAT, "prompt_set_sha256": prompt_set.sha256, "prompt_file": prompt_set.path,
                            "model_path": str(world.config.target.model_path), "served_model_name": "target",
                            "server_url": job.arg("--server"), "sampling": {"temperature": 0.0},
                            "server_preferred_sampling_params": None, "prompts": records,
                            "incomplete": [r["id"] for r in records if not r["complete"]]})
    events.artifact(out, "completions", prompts=len(records))
    return {"out": out, "prompts": len(records), "model_path": str(world.config.target.model_path),
            "endpoint": "generate", "completion_tokens": sum(len(r["completion_ids"]) for r in records),
            "incomplete": []}


async def check_worker(world: FakeWorld, job: FakeJob) -> dict[str, Any]:
    """remote.extract --check-only: the real extractor's check phase, in-process."""
    from remote.extract import main as extract_main

    await world.point(job, "start")
    return extract_main(job.events, job.args)


async def extract_worker(world: FakeWorld, job: FakeJob) -> dict[str, Any]:
    """remote.extract, staged or cold, in the real worker's order: (staged: weights into host RAM,
    `staged`, wait for the go file) the copy to GPU0, the forward, `gpu_released`, the flush, the
    manifest (the real states directory, renamed into place last), `artifact`, the result."""
    events = job.events
    staged = job.kind == "extract-staged"
    go_file = Path(job.arg("--go-file")) if staged else None
    out = Path(job.arg("--out"))
    events.phase("check")
    if go_file is not None and go_file.exists():
        raise WorkerError(f"the go file {go_file} already exists (left by an earlier run?): remove it first",
                          "--go-file")
    events.phase("load")
    await world.point(job, "load")  # a worker that cannot load the weights fails here ("exit")
    window: dict[str, Any] = {"staged": staged, "from_pretrained_s": 0.1, "bytes": 4352}
    if staged:
        await world.wait_file(Path(job.arg("--completions")))
        # The real worker's `staged` fields, its warm-up's forward rate among them (the forecast reads it).
        events.emit("staged", bytes=4352, tensors=2, pinned=False, host_read_s=0.2, warmup_s=0.0, go_file=str(go_file),
                    tokens=120, tokens_to_extract=120, forward_tokens_per_s=60.0,
                    forward_rate_basis="1 of 2 layers timed on 97 tokens at stage warm-up, scaled to 2")
        await world.point(job, "staged")
        events.log(f"staged: waiting for the go signal ({go_file})")
        await world.wait_file(go_file)
        events.phase("window")
    world.gpus[job.handle.pid] = (job.handle.host, {0: world.extract_mib}, "python -m remote.extract")
    job.reached.append("holds-gpu")
    world.sample(job.handle.host)
    events.phase("forward")
    kept, done, missing = await _forward(world, job, out)
    window.update(copy_s=0.5, forward_s=2.0, tokens=120, window_s=2.6, stopped_early=bool(missing),
                  prompts_done=len(kept) + len(done), prompts_missing=len(missing))
    world.gpus.pop(job.handle.pid, None)
    events.emit("gpu_released", **window)
    job.reached.append("gpu_released")
    world.sample(job.handle.host)
    await world.point(job, "gpu_released")
    events.phase("flush")
    if world.flush_gate is not None:  # the files take their time: written once the test opens the gate
        await world.flush_gate.wait()
    incoming = out.with_name(out.name + ".incoming")
    shutil.rmtree(incoming, ignore_errors=True)
    shutil.copytree(world.producers.states, incoming)
    if missing:  # the real extractor's partial: manifest.partial.json, never manifest.json
        (incoming / "manifest.json").unlink()
        (incoming / PARTIAL_MANIFEST).write_text(json.dumps({"complete": False, "prompts_done": kept + done,
                                                             "prompts_missing": missing}))
    shutil.rmtree(out, ignore_errors=True)
    incoming.rename(out)
    manifest = out / (PARTIAL_MANIFEST if missing else "manifest.json")
    events.artifact(str(out), "extract-partial" if missing else "extract", manifest=str(manifest),
                    prompts=len(kept) + len(done), missing=len(missing))
    return {"out": str(out), "complete": not missing, "prompts": len(kept) + len(done), "prompts_missing": missing,
            "prompts_kept": kept, "tokens": 120, "layers": [1, 2], "window": window}


async def _forward(world: FakeWorld, job: FakeJob, out: Path) -> tuple[list[str], list[str], list[str]]:
    """The forward over the prompts, as the real extractor's: the verified prompts of a partial
    extraction in `out` are kept, the stop file is checked before each prompt. (kept, done, missing)."""
    partial = out / PARTIAL_MANIFEST
    kept = json.loads(partial.read_text())["prompts_done"] if partial.is_file() else []
    if world.budget_prompts is None and not kept:  # the usual window: its two progress events, its point
        job.events.progress("prompts", 1, 2, "prompts")
        await world.point(job, "forward")
        job.events.progress("prompts", 2, 2, "prompts")
        return [], [], []
    ids = [r["id"] for r in json.loads(Path(job.arg("--completions")).read_text())["prompts"]]
    todo, done = [i for i in ids if i not in kept], []
    stop = Path(job.arg("--stop-file"))
    for prompt in todo:
        if stop.exists():
            break
        world.extracted.append(prompt)
        done.append(prompt)
        job.events.progress("prompts", len(done), len(todo), "prompts", label=prompt)
        if len(done) == 1:
            await world.point(job, "forward")
        if len(done) == world.budget_prompts:
            stop.touch()
    return kept, done, [i for i in todo if i not in done]


async def evaluate_worker(world: FakeWorld, job: FakeJob) -> dict[str, Any]:
    """remote.evaluate: the real evaluation's output directory, the manifest last."""
    events = job.events
    events.phase("evaluate")
    await world.point(job, "start")
    out = Path(job.arg("--out"))
    incoming = out.with_name(out.name + ".incoming")
    shutil.rmtree(incoming, ignore_errors=True)
    shutil.copytree(world.producers.evaluation, incoming)
    await world.point(job, "mid")
    shutil.rmtree(out, ignore_errors=True)
    incoming.rename(out)
    events.artifact(str(out), "evaluation")
    return {"out": str(out), "drafters": sorted(world.producers.drafters)}


WORKERS: dict[str, Callable[[FakeWorld, FakeJob], Any]] = {
    "probe": probe_worker, "provenance": provenance_worker, "completions": completions_worker,
    "extract-check": check_worker, "extract": extract_worker, "extract-staged": extract_worker,
    "evaluate": evaluate_worker,
}


# --- who answers the engine's questions ------------------------------------------------------------


@dataclass
class ScriptedDecider:
    """Approves everything but the steps in `refuse`; `think_s` of the world's time pass while the
    operator decides (decision time, kept apart from work time)."""

    clock: Clock | None = None
    refuse: set[str] = field(default_factory=set)
    think_s: float = 0.0
    asked: list[Confirmation] = field(default_factory=list)
    name: str = "scripted"

    async def decide(self, confirmation: Confirmation) -> bool:
        self.asked.append(confirmation)
        if self.clock is not None:
            self.clock.advance(self.think_s)
        await asyncio.sleep(0)
        return confirmation.step not in self.refuse


async def settled() -> None:
    """Until every other task of the world and of the console waits on something: what can go on
    without an answer has gone on. (asyncio's ready queue is empty when this task runs again and no
    other callback is scheduled; a bound keeps a task that only ever yields from holding it forever.)"""
    loop = asyncio.get_running_loop()
    for _ in range(10_000):
        await asyncio.sleep(0)
        if not loop._ready:  # asyncio has no public way to ask this
            return


@dataclass
class SlowOperator(ScriptedDecider):
    """Answers each question `delay_s` of the world's time after it is asked, as an operator who reads
    it first: everything that can go on without the answer goes on meanwhile (the extractor flushes
    its files, the steps that need the answer come to wait on it), then the world's clock moves by
    the delay, then the answer comes. `delay_s=0` answers at once, in the same order of events."""

    delay_s: float = 0.0

    async def decide(self, confirmation: Confirmation) -> bool:
        self.asked.append(confirmation)
        await settled()
        if self.clock is not None:
            self.clock.advance(self.delay_s)
        return confirmation.step not in self.refuse
