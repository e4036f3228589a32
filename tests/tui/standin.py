"""A stand-in for `console.operator.Operator` with the same surface, publishing real message objects
on a real `MessageBus`: fixed telemetry for snapshots, a scripted window for the functional tests,
and two 8-GPU hosts ticking at 1 Hz for the benchmark."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from pathlib import Path
from typing import Any

from console import messages as m
from console.config import Config, example_config_text, parse_config
from console.procedure import forecast as fc
from console.procedure.store import RunStore, RunSummary
from console.session.bus import MessageBus
from console.views.units import duration

T0 = 1_764_581_700.0  # 2025-12-01 09:35:00 UTC: every snapshot's clock
SGLANG = "/root/eval-venv/bin/python -m sglang.launch_server --model-path /root/models/Qwen3.6-27B --tp 2 --port 30000"


def example_config() -> Config:
    """The example two-host config: ct129 serves (2 GPUs), ct200 trains (8 GPUs)."""
    return parse_config(example_config_text())


def gpu(index: int, used: int, total: int = 49140, util: float = 0.0, temp: float = 40.0,
        power: float = 80.0, name: str = "NVIDIA L40S") -> m.GpuReading:
    return m.GpuReading(index, name, f"GPU-{index:04d}", used, total, util, temp, power)


def sample(host: str, gpus: list[m.GpuReading], processes: tuple[m.GpuProcess, ...] = (), seq: int = 1,
           t: float = T0, simulated: bool = False) -> m.TelemetrySample:
    return m.TelemetrySample(host=host, seq=seq, t=t, interval=1.0, source="simulated" if simulated else "nvml",
                             simulated=simulated, reason=None, gpus=tuple(gpus), processes=processes)


def serving_telemetry(simulated: bool = False, t: float = T0, seq: int = 1) -> list[m.TelemetryUpdate]:
    """ct129 serving (both GPUs nearly full, SGLang holding them), ct200 training on 8 GPUs."""
    sglang = (m.GpuProcess(4242, 0, 44100, "root", SGLANG), m.GpuProcess(4242, 1, 44100, "root", SGLANG))
    ct129 = sample("ct129", [gpu(0, 44950, util=62, temp=61, power=231), gpu(1, 44950, util=58, temp=59, power=224)],
                   sglang, seq=seq, t=t, simulated=simulated)
    trainer = tuple(m.GpuProcess(9100 + i, i, 70000, "dflash", "python train_drafter.py --config v4.yaml")
                    for i in range(8))
    ct200 = sample("ct200", [gpu(i, 71200 + 130 * i, 81559, util=97 - i, temp=70 + i % 3, power=390 + i,
                                 name="NVIDIA H100 80GB HBM3") for i in range(8)], trainer, seq=seq, t=t,
                   simulated=simulated)
    return [m.TelemetryUpdate("ct129", ct129, 0.4, False, True, service_pids=frozenset({4242})),
            m.TelemetryUpdate("ct200", ct200, 0.6, False, True)]


def stuck_telemetry(t: float = T0) -> m.TelemetryUpdate:
    """ct129 after the stop: the service is gone but a leftover process still holds 40 GB per GPU."""
    stuck = (m.GpuProcess(4301, 0, 40000, "root", "python -m sglang.srt.managers.scheduler"),
             m.GpuProcess(4302, 1, 40000, "root", "python -m sglang.srt.managers.scheduler"))
    return m.TelemetryUpdate("ct129", sample("ct129", [gpu(0, 40400, util=0, temp=44, power=71),
                                                       gpu(1, 40400, util=0, temp=43, power=70)], stuck, t=t),
                             0.3, False, True)


def service_view(active: bool = True, t: float = T0) -> m.ServiceView:
    if not active:
        return m.ServiceView(m.ServiceStatus("systemd", "sglang-qwen", False, "inactive", "dead"), None, t)
    status = m.ServiceStatus("systemd", "sglang-qwen", True, "active", "running", main_pid=4242, since=t - 3 * 86400 - 7260)
    health = m.ServiceHealth(200, True, model="Qwen3.6-27B", version="0.5.4", running_requests=3, queued_requests=1)
    return m.ServiceView(status, health, t)


PLAN_STEPS = (
    m.PlannedStep("preflight", True, "hosts, kernels, drafter configs, disk", estimate_s=6),
    m.PlannedStep("stage", True, "weights into pinned RAM while the server serves", "ct129", estimate_s=48),
    m.PlannedStep("cache", True, "10 completions from the live server", "ct129", estimate_s=35),
    m.PlannedStep("stop", True, "stop sglang-qwen", "ct129", ("systemctl", "stop", "sglang-qwen"), estimate_s=4),
    m.PlannedStep("free-vram", True, "wait until both GPUs are under 1024 MiB", "ct129", estimate_s=3),
    m.PlannedStep("extract", True, "hidden states of layers 1, 16, 31, 46, 61", "ct129", estimate_s=71),
    m.PlannedStep("restart", True, "start sglang-qwen, wait for ready", "ct129",
                  ("systemctl", "start", "sglang-qwen"), estimate_s=96),
    m.PlannedStep("evaluate", True, "2 drafters on ct200", "ct200", estimate_s=140),
    m.PlannedStep("report", True, "tables into the run directory", estimate_s=1),
)


STOP_FORECAST = m.Forecast("20251201-093500-ab12", 194.0, (
    m.ForecastPhase("stop", 11.0, "systemd's last stop of sglang-qwen"),
    m.ForecastPhase("free-vram", 2.0, "median of 2 earlier runs on ct129"),
    m.ForecastPhase("extract", 71.0, "median of 2 earlier runs on ct129"),
    m.ForecastPhase("start", 110.0, "systemd's last start of sglang-qwen"),
))


def stop_confirmation() -> m.Confirmation:
    """The engine's stop question (console/procedure/steps/stop.py: run_stop), its forecast written by
    the forecast's own summary."""
    return m.Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang-qwen"),
                          f"sglang-qwen on ct129 goes down; forecast downtime {fc.summary(STOP_FORECAST)}",
                          destructive=True, estimate_s=STOP_FORECAST.downtime_s, estimate_basis="forecast")


def restart_confirmation(so_far: int = 90) -> m.Confirmation:
    """The engine's restart question (console/procedure/steps/stop.py: restart_service)."""
    return m.Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang-qwen"),
                          f"the extraction finished: brings sglang-qwen back (down {duration(so_far)} so far)", False,
                          96.0)


def holders_found() -> m.HoldersFound:
    holders = (m.VramHolder(4301, 40000, (0,), "python -m sglang.srt.managers.scheduler --tp-rank 0", "root", 88231, True),
               m.VramHolder(4302, 40000, (1,), "python -m sglang.srt.managers.scheduler --tp-rank 1", "root", 88232, True))
    return m.HoldersFound("ct129", holders, "GPU0 40400 MiB, GPU1 40400 MiB", 1024)


def holders_confirmation() -> m.Confirmation:
    argv = ("env", "PYTHONPATH=/root/dflash-ops/code/3f9a", "/root/eval-venv/bin/python", "-m", "remote.endpids",
            "--grace", "10", "4301:88231", "4302:88232")
    return m.Confirmation("free-vram", "end 2 processes holding VRAM", "ct129", argv,
                          "the two scheduler processes left by sglang-qwen are ended (TERM, KILL after 10 s)",
                          destructive=True, estimate_s=11)


class StandinSession:
    """The part of `Session` the console reads: GPU memory history for the sparklines."""

    def __init__(self) -> None:
        self._history: dict[tuple[str, int], deque] = {}

    def record(self, update: m.TelemetryUpdate) -> None:
        if update.sample is None:
            return
        for g in update.sample.gpus:
            self._history.setdefault((update.host, g.index), deque(maxlen=600)).append(g.mem_used_mib)

    def history(self, host: str, gpu: int, seconds: float | None = None) -> list[float | None]:
        return list(self._history.get((host, gpu), ()))


class StandinOperator:
    """`Operator`'s surface over a real bus; `run` walks a scripted window through the decider."""

    def __init__(self, config: Config | None = None, runs_dir: Path | None = None, read_only: bool = False,
                 now: float = T0) -> None:
        self.config = config or example_config()
        self.bus = MessageBus()
        self.session = StandinSession()
        self.read_only = read_only
        self.runs_dir = runs_dir or Path("/nonexistent-runs")
        self.now = now
        self.started = self.stopped = self.cancelled = False
        self.unfinished: str | None = None
        self.decisions: list[tuple[str, bool]] = []
        self.run_id = "20251201-093500-ab12"
        self.results_dir: Path | None = None
        self.bus.subscribe(self.session.record, m.TelemetryUpdate)

    def publish(self, message: Any) -> None:
        self.bus.publish(message)

    def seed(self, simulated: bool = False, history: int = 0) -> None:
        """Hosts connected, serving telemetry (with `history` earlier samples), the service up."""
        for name, latency in (("ct129", 0.0012), ("ct200", 0.0031)):
            self.publish(m.HostState(name, "connected", self.now - 3600, latency_s=latency))
        for i in range(history):
            for update in serving_telemetry(simulated):
                s = update.sample
                wobble = [m.GpuReading(g.index, g.name, g.uuid, max(0, (g.mem_used_mib or 0) - 9000 + (i * 97 + g.index * 31) % 9000),
                                       g.mem_total_mib, g.util_pct, g.temp_c, g.power_w) for g in s.gpus]
                self.session.record(m.TelemetryUpdate(update.host, m.TelemetrySample(
                    s.host, i, s.t, 1.0, s.source, s.simulated, None, tuple(wobble), s.processes), 0.1, False, True))
        for update in serving_telemetry(simulated):
            self.publish(update)
        self.publish(service_view(True, self.now))

    # --- the Operator surface -------------------------------------------------------------------

    def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True

    def cancel(self, leave_down: bool = False) -> None:
        self.cancelled = True
        self.left_down_on_quit = leave_down

    def unfinished_run(self) -> str | None:
        return self.unfinished

    def driven_elsewhere(self, run_id: str) -> str | None:
        """The real store's answer over the test's runs directory (as `Operator.driven_elsewhere`)."""
        from console.procedure.store import RunStoreError, owned_elsewhere, what_next

        try:
            run = RunStore(self.runs_dir).open(run_id)
        except RunStoreError:  # a run the test names without a store: nobody else drives it
            return None
        return what_next(run) if owned_elsewhere(run.state) else None

    def left_down(self) -> Any:
        """The real store's answer over the test's runs directory (as `Operator.left_down`)."""
        return RunStore(self.runs_dir).left_down() if self.runs_dir.is_dir() else None

    async def follow_live_run(self) -> None:
        """The real follower over the test's runs directory (no hosts to read job bars from)."""
        from console.procedure.follower import RunFollower

        await RunFollower(RunStore(self.runs_dir), self.bus, ours=lambda run_id: run_id == self.run_id).run()

    def runs(self) -> list[RunSummary]:
        found = RunStore(self.runs_dir).summaries() if self.runs_dir.is_dir() else []
        return [s for s in found if isinstance(s, RunSummary)]

    def run_dir(self, run_id: str) -> Path:
        return self.runs_dir / run_id

    async def plan(self) -> m.PlanReady:
        plan = m.PlanReady(self.run_id, "window", PLAN_STEPS)
        self.publish(plan)
        return plan

    def _journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.now += 1
        self.publish(m.JournalEntry(self.now, self.run_id, step, message, user="op", **fields))

    def _step(self, step: str, status: str, started: float | None = None, detail: str | None = None) -> None:
        self.publish(m.StepUpdate(self.run_id, step, status, started_at=started,
                                  ended_at=None if status == "running" else self.now, detail=detail))

    async def _ask(self, decider: Any, confirmation: m.Confirmation) -> bool:
        approved = await decider.decide(confirmation)
        self.decisions.append((confirmation.step, approved))
        self.publish(m.DecisionMade(confirmation, approved, decider.name))
        self._journal(confirmation.step, f"{confirmation.action}: {'approved' if approved else 'refused'}",
                      host=confirmation.host, decision="approved" if approved else "refused",
                      argv=confirmation.argv)
        return approved

    async def run(self, decider: Any, resume: str | bool | None = None, route: str | None = None,
                  no_restart: bool = True, one_step: bool = False) -> m.RunFinished:
        await self.plan()
        for name in ("preflight", "stage", "cache"):
            start = self.now
            self._step(name, "running", start)
            self._journal(name, f"{name} started")
            await asyncio.sleep(0)
            self._step(name, "done", start)
        start = self.now
        self._step("stop", "running", start)
        if not await self._ask(decider, stop_confirmation()):
            self._step("stop", "refused", start, detail="refused by op")
            return self._finish("refused", 0, True, "the stop was refused; nothing changed")
        self.publish(service_view(False, self.now))
        self.publish(m.Downtime(self.run_id, self.now))
        self._step("stop", "done", start)
        down = self.now
        start = self.now
        self._step("free-vram", "running", start)
        self.publish(stuck_telemetry(self.now))
        self.publish(holders_found())
        if not await self._ask(decider, holders_confirmation()):
            self._step("free-vram", "refused", start, detail="holders left running")
            return self._finish("refused", 3, False, "VRAM is still held; the service is down")
        self._step("free-vram", "done", start)
        for name in ("extract",):
            start = self.now
            self._step(name, "running", start)
            self._journal(name, "extracting")
            await self.extracting()
            self._step(name, "done", start)
        start = self.now
        self._step("restart", "running", start)
        self.publish(service_view(True, self.now))
        self.publish(m.Downtime(self.run_id, None, restarted_at=self.now))
        self._journal("restart", f"service ready after {self.now - down:.0f} s down")
        self._step("restart", "done", start)
        for name in ("evaluate", "report"):
            start = self.now
            self._step(name, "running", start)
            self._step(name, "done", start)
        if self.results_dir is not None:
            self.publish(m.ResultsReady(self.run_id, str(self.results_dir.parent)))
        return self._finish("done", 0, True, "done")

    async def extracting(self) -> None:
        """The extraction's own work, with the service down: none here (a test may hold the window in it)."""

    def _finish(self, status: str, code: int, up: bool, message: str) -> m.RunFinished:
        finished = m.RunFinished(self.run_id, status, code, up, message, str(self.run_dir(self.run_id)))
        self.publish(finished)
        return finished

    async def restart_service(self, decider: Any) -> None:
        confirmation = m.Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang-qwen"),
                                      "SGLang on ct129 starts; ready in about 96 s", destructive=False,
                                      estimate_s=96)
        if not await self._ask(decider, confirmation):
            return
        self.publish(service_view(True, self.now))
        self.publish(m.Downtime(self.run_id, None, restarted_at=self.now))


def fixed_clock() -> float:
    return T0 + 30


def wall_clock() -> float:
    return time.time()


def extract_progress(t: float = T0) -> list[m.JobProgress]:
    """The extractor mid-way: weights loaded, prompts 4 of 10 (no ETA; rates from the core)."""
    job = dict(job_id="extract-3f9a", worker="extract", host="ct129", phase="forward")
    return [m.JobProgress(**job, done=480, total=480, unit="tensors", key="weights", rate=None,
                          message="27.8 GB", t=t),
            m.JobProgress(**job, done=27.8e9, total=27.8e9, unit="bytes", key="weights_bytes", rate=2.1e9, t=t),
            m.JobProgress(**job, done=4, total=10, unit="prompts", key="prompts", rate=0.4,
                          message="async_rate_limiter: 1536 tokens", t=t)]


def mid_window(op: StandinOperator) -> None:
    """The window 90 s after the stop: extraction running, the service down."""
    now = op.now
    # This console drives it (its follower says so as the engine runs): the restart is on its way.
    op.publish(m.LiveRun(op.run_id, "running", "op@ws1 pid 4242 since 09:30:00", False, True, ours=True))
    op.publish(m.PlanReady(op.run_id, "window", PLAN_STEPS))
    t = now - 190
    # (step, wall time, of it waiting for the operator's answer): the engine sends both
    for name, took, asked in (("preflight", 6, 0), ("stage", 48, 0), ("cache", 35, 0), ("stop", 4, 3),
                              ("free-vram", 11, 0)):
        op.publish(m.StepUpdate(op.run_id, name, "done", t, t + took, work_s=took - asked, decision_s=asked))
        t += took
    op.publish(m.StepUpdate(op.run_id, "extract", "running", now - 75))
    op.publish(m.Downtime(op.run_id, now - 90))
    op.publish(service_view(False, now))
    loading = (m.GpuProcess(5120, 0, 15200, "root", "/root/eval-venv/bin/python -m remote.extract --go-file go"),
               m.GpuProcess(5120, 1, 14600, "root", "/root/eval-venv/bin/python -m remote.extract --go-file go"))
    ct129 = sample("ct129", [gpu(0, 15600, util=88, temp=55, power=260), gpu(1, 15000, util=85, temp=54, power=250)],
                   loading, t=now)
    op.publish(m.TelemetryUpdate("ct129", ct129, 0.5, False, True))
    for p in extract_progress(now):
        op.publish(p)
    for i, (step, text) in enumerate((
            ("cache", "10 completions cached (10/10 complete)"),
            ("stop", "stop the service: approved"),
            ("stop", "sglang-qwen stopped"),
            ("free-vram", "2 processes still hold VRAM: GPU0 40400 MiB, GPU1 40400 MiB"),
            ("free-vram", "ended 4301 (terminated), 4302 (terminated); GPUs free after 11 s"),
            ("extract", "go: weights to GPU"))):
        op.publish(m.JournalEntry(now - 100 + 10 * i, op.run_id, step, text, host="ct129",
                                  argv=("systemctl", "stop", "sglang-qwen") if text.startswith("sglang") else None,
                                  exit=0 if text.startswith("sglang") else None))
