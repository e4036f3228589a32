"""The window engine: runs the procedure's steps against the session's hosts, asking before it acts.

Each step has a check (already satisfied? skip and say why), a run and a verify; the state is saved
after every transition and every decision, command and exit is journalled, so a console killed at
any moment resumes from the first unsatisfied step. Jobs get deterministic ids (`<run>-<step>`)
recorded before they start, so a resumed run finds a job it started instead of starting it again,
and never extracts twice.

Interlocks: the stop waits for verified completions and (when staging) the `staged` worker; the
extraction waits until the service's GPUs are free (our staged worker's memory excluded); the
restart begins at `gpu_released`, not after the files are flushed. Any failure, cancel or Ctrl-C
after the stop offers the restart (`restart_on_failure`), and the exit code says whether the
service is still down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from console.config import Config
from console.messages import (
    Confirmation,
    DecisionMade,
    Downtime,
    HoldersFound,
    HostFit,
    JobProgress,
    PlanReady,
    ResultsReady,
    RunFinished,
    StepUpdate,
    TelemetrySample,
)
from console.procedure import remote_files
from console.procedure.decider import Decider
from console.procedure.fit import SPLIT_FILL, longest_tokens, where_it_fits
from console.procedure.steps import ROUTES, Preflight, estimates, planned, size_text, stage_decision
from console.procedure.store import Run, RunStore
from console.service.control import ReadyTimeout, ServiceError, start_and_wait
from console.service.vram import (
    VramError,
    describe_outcomes,
    end_holders,
    endpids_argv,
    others_used,
    wait_vram_free,
)
from console.session import Session, service_name
from console.ssh.hosts import HostDisconnected, HostError
from console.ssh.jobs import (
    JobDead,
    JobExists,
    JobHandle,
    JobRunner,
    JobStalledError,
    follow_with_reconnect,
    job_message,
)
from remote.prompts import DEFAULT_PROMPTS, load_prompts

EXIT_DONE, EXIT_FAILED, EXIT_USAGE, EXIT_DOWN = 0, 1, 2, 3
CONNECT_TIMEOUT_S = 30.0
PROBE_TIMEOUT_S = 300.0
LINK_RETRIES = 3  # a step whose link drops is run again this many times
SETTLED = ("done", "skipped", "left-out")
START_SETTLE_S = 90.0  # a start cut off by a crash settles on the host within about a minute


class StepFailed(Exception):
    """A step could not do its work; the message says what and where (one line)."""

    def __init__(self, step: str, msg: str):
        super().__init__(f"{step}: {msg}")
        self.step = step
        self.msg = msg


class Paused(Exception):
    """One step was asked for and it is done: the run waits, resumable, for the next."""

    def __init__(self, step: str):
        super().__init__(f"paused after {step}")
        self.step = step


class Refused(Exception):
    """The operator said no: the run ends there and nothing more is changed."""

    def __init__(self, step: str, action: str):
        super().__init__(f"{step}: the operator refused to {action}")
        self.step = step


class Engine:
    """Drives one run (new or resumed) of the procedure."""

    def __init__(self, session: Session, run: Run, decider: Decider, store: RunStore | None = None,
                 restart_on_failure: bool = True, route: str | None = None, plan_only: bool = False,
                 stage: bool | None = None, one_step: bool = False):
        self.session = session
        self.config: Config = session.config
        self.bus = session.bus
        self.run = run
        self.decider = decider
        self.store = store
        self.restart_on_failure = restart_on_failure
        self.plan_only = plan_only
        self.stage_override = stage  # None: the plan decides from the target host's RAM
        self.one_step = one_step  # run the next unsatisfied step (stage + cache together), then pause
        self.route = route or run.state.get("route") or "window"
        if self.route not in ROUTES:
            raise ValueError(f"unknown route {self.route!r}: expected one of {', '.join(ROUTES)}")
        self.facts = Preflight()
        self.fits: list[HostFit] = []
        self.plan: PlanReady | None = None
        self.earlier = estimates(s.state for s in self._earlier_runs())
        self._gpu_released = asyncio.Event()
        self._restart_task: asyncio.Task | None = None
        self._unsubscribe_telemetry: Callable[[], None] | None = None

    # --- bookkeeping --------------------------------------------------------------------------

    @property
    def state(self) -> dict[str, Any]:
        return self.run.state

    def _earlier_runs(self) -> list[Run]:
        if self.store is None:
            return []
        runs = []
        for run_id in self.store.run_ids():
            if run_id != self.run.run_id:
                with contextlib.suppress(Exception):
                    runs.append(self.store.open(run_id))
        return runs

    def journal(self, step: str | None, message: str, **fields: Any) -> None:
        self.bus.publish(self.run.journal(step, message, **fields))

    def _step(self, name: str, status: str, detail: str | None = None) -> None:
        step = self.run.step(name)
        now = time.time()
        if status == "running":
            step["started_at"] = step.get("started_at") or now
            step.pop("ended_at", None)
        elif status in ("done", "skipped", "failed", "refused", "cancelled", "left-out"):
            step["ended_at"] = now
        step["status"] = status
        if detail is not None:
            step["detail"] = detail
        self.run.save()
        self.bus.publish(StepUpdate(self.run.run_id, name, status, step.get("started_at"), step.get("ended_at"),
                                    detail))
        if status != "running" or detail:
            self.journal(name, f"{name}: {status}" + (f": {detail}" if detail else ""),
                         level="error" if status == "failed" else "info")

    async def _ask(self, confirmation: Confirmation) -> bool:
        approved = await self.decider.decide(confirmation)
        self.bus.publish(DecisionMade(confirmation, approved, self.decider.name))
        self.journal(confirmation.step, f"{'approved' if approved else 'refused'}: {confirmation.action}",
                     host=confirmation.host, decision=f"{'yes' if approved else 'no'} ({self.decider.name})",
                     argv=list(confirmation.argv))
        return approved

    def _publish_downtime(self) -> None:
        service = self.state["service"]
        self.bus.publish(Downtime(self.run.run_id, service.get("stopped_at") if service.get("down") else None,
                                  service.get("ready_at")))

    @property
    def service_down_by_us(self) -> bool:
        return bool(self.state["service"].get("down"))

    # --- the run ------------------------------------------------------------------------------

    async def execute(self) -> RunFinished:
        """Run (or resume) the procedure to its end; never raises for a failed step."""
        self.state["route"] = self.route
        self.state["status"] = "running"
        self.run.save()
        resumed = bool(self.state.get("started"))
        self.state["started"] = True
        self.journal(None, ("resumed" if resumed else "started") + f" run {self.run.run_id} "
                     f"({self.route} route, config {self.config.source})")
        self._unsubscribe_telemetry = self.session.bus.subscribe(self._record_telemetry)
        if self.service_down_by_us:
            self._publish_downtime()
        status, message = "done", "the procedure finished"
        try:
            await self._do("preflight", self._preflight)
            if self.plan_only:
                return self._finish("done", "plan only: nothing was changed")
            await self._steps()
        except Paused as exc:
            status, message = "paused", f"paused after {exc.step}: the next step runs on resume (run --resume)"
        except Refused as exc:
            status, message = "refused", str(exc)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # the compensation below must still be able to wait
            status, message = "cancelled", "cancelled by the operator"
        except StepFailed as exc:
            status, message = "failed", str(exc)
        except (HostError, ServiceError, VramError, ReadyTimeout, OSError) as exc:
            status, message = "failed", str(exc)
        finally:
            if self._unsubscribe_telemetry:
                self._unsubscribe_telemetry()
        if status not in ("done", "paused"):
            if status != "failed":  # a failed step journalled its own error
                self.journal(None, message, level="warning")
            await self._compensate(status)
        return self._finish(status, message)

    def _finish(self, status: str, message: str) -> RunFinished:
        down = self.service_down_by_us
        code = EXIT_DONE if status in ("done", "paused") else (EXIT_DOWN if down else EXIT_FAILED)
        if not self.plan_only:
            self.state["status"] = status
            self.state["exit_code"] = code
        self.state["message"] = message
        self.run.save()
        if down:
            since = self.state["service"].get("stopped_at")
            message += f"; THE SERVICE IS STILL DOWN (since {time.strftime('%H:%M:%S', time.localtime(since))})"
        finished = RunFinished(self.run.run_id, status, code, not down, message, str(self.run.dir))
        self.journal(None, f"run {status} (exit {code}): {message}", exit=code)
        self.bus.publish(finished)
        self.run.close()
        return finished

    async def _end_own_jobs(self) -> None:
        """A run that ends without finishing leaves no worker of its own behind: the staged extractor
        would wait for its go forever holding the weights in RAM, and an extraction still on the
        GPUs would fight the restarting server for them. Ended before the restart."""
        for key, record in self.state["jobs"].items():
            if "handle" not in record or key.startswith("probe-"):
                continue
            handle = JobHandle.from_json(record["handle"])
            try:
                runner = await self.session.runner(handle.host, CONNECT_TIMEOUT_S)
                if await runner.is_alive(handle):
                    status = await runner.cancel(handle, grace=5.0)
                    self.journal(None, f"ended our {handle.worker} job on {handle.host} (pid {handle.pid}): "
                                       f"{status.state}" + (f", {status.note}" if status.note else ""),
                                 host=handle.host, level="warning")
            except (HostError, TimeoutError) as exc:
                self.journal(None, f"could not end our {handle.worker} job on {handle.host} (pid {handle.pid}): {exc}",
                             host=handle.host, level="error")

    async def _compensate(self, why: str) -> None:
        """After a failure, refusal or cancel: end our jobs, and with the service down because of us,
        offer the restart."""
        await self._end_own_jobs()
        if self._restart_task is not None:
            with contextlib.suppress(Exception):
                await self._restart_task
        if not self.service_down_by_us:
            return
        if not self.restart_on_failure:
            self.journal("restart", "the service is left down (--no-restart)", level="warning")
            return
        try:
            await self.restart_service(reason=f"the run {why} after the stop")
        except (Refused, StepFailed, HostError, ServiceError, ReadyTimeout) as exc:
            self.journal("restart", f"the restart failed: {exc}", level="error")

    async def _steps(self) -> None:
        steps = ROUTES[self.route]
        if self.route == "window" and "stage" in steps:
            # Stage and cache run side by side while the server still serves.
            units = [("stage", "cache"), *((name,) for name in steps[steps.index("cache") + 1:])]
        else:
            units = [(name,) for name in steps[1:]]
        for unit in units:
            settled = all(self.run.step(n).get("status") in SETTLED for n in unit)
            await asyncio.gather(*(self._do(n, getattr(self, "_" + n.replace("-", "_"))) for n in unit))
            if self.one_step and not settled and unit[-1] != steps[-1]:
                raise Paused(unit[-1])

    async def _do(self, name: str, work: Callable[[], Awaitable[str | None]]) -> None:
        """Run one step with its status published; its function returns a detail or raises.

        Every step runs its own check, on resume too (a host's real state is trusted, not the saved
        one), which makes a step safe to run again: a link that drops mid-step (outside a job's
        events, which are followed through drops) runs the step again once the host is back.
        """
        self._step(name, "running")
        try:
            for attempt in range(LINK_RETRIES + 1):
                try:
                    detail = await work()
                    break
                except HostDisconnected as exc:
                    if attempt == LINK_RETRIES:
                        raise
                    self.journal(name, f"the link dropped ({exc.msg}); running the step again once "
                                       f"{exc.host} is back", host=exc.host, level="warning")
                    await asyncio.sleep(0.5)  # the supervisor notices the drop and reconnects
        except Refused:
            self._step(name, "refused")
            raise
        except asyncio.CancelledError:
            self._step(name, "cancelled")
            raise
        except StepFailed as exc:
            self._step(name, "failed", exc.msg)
            raise
        except Exception as exc:
            self._step(name, "failed", str(exc) or type(exc).__name__)
            raise StepFailed(name, str(exc) or type(exc).__name__) from exc
        if isinstance(detail, LeftOut):
            self._step(name, "left-out", detail.why)
        elif isinstance(detail, Skip):
            self._step(name, "skipped", detail.why)
        else:
            self._step(name, "done", detail)

    # --- preflight ----------------------------------------------------------------------------

    async def _preflight(self) -> str:
        await self._preflight_checks()
        return f"{len(self.config.hosts)} hosts, layers {self.facts.layers}"

    async def _connected(self, name: str, step: str):
        try:
            return await self.session.host(name, CONNECT_TIMEOUT_S)
        except TimeoutError:
            state = self.session.supervisors[name].state
            raise StepFailed(step, f"{name} is not connected after {CONNECT_TIMEOUT_S:.0f} s "
                                   f"({state.last_error or state.status})") from None

    async def _preflight_checks(self) -> None:
        config = self.config
        for name in config.hosts:
            await self._connected(name, "preflight")
        prompts = self._prompt_records()  # bad prompt files fail here, before anything else
        self.state["facts"]["prompt_ids"] = [p["id"] for p in prompts]
        # Facts from every host at once: probes (kernels, RAM, model size), drafter configs, the service.
        probes, drafters, view = await asyncio.gather(self._probe_all(), self._read_drafters(),
                                                      self.session.check_service())
        self.facts.probes = probes
        self.facts.drafters = drafters
        target_probe = probes.get(config.target.host, {})
        model = target_probe.get("model", {})
        if model.get("exists") is False:
            raise StepFailed("preflight", f"{config.target.model_path} does not exist on {config.target.host}")
        if model.get("error"):
            raise StepFailed("preflight", f"the target on {config.target.host}: {model['error']}")
        self.facts.model_bytes = model.get("tensor_bytes")
        self.facts.ram_available = target_probe.get("ram", {}).get("available")
        kernels = target_probe.get("kernels", {})
        if config.target.kernels == "fast" and not kernels.get("fast") and not self.session.simulated.get(config.target.host):
            raise StepFailed("preflight", f"kernels = \"fast\" but {config.target.host} binds "
                                          f"{', '.join(f'{k}={v}' for k, v in kernels.get('bound', {}).items()) or 'nothing'}")
        self.facts.layers = self._layers(drafters)
        for name, facts in drafters.items():
            overridden = facts.get("layers_source") == "override"
            self.journal("preflight", f"drafter {name} on {facts.get('host')}: target layers {facts.get('target_layer_ids')}"
                         + (f" from the config's override (the checkpoint says {facts.get('config_target_layer_ids')})"
                            if overridden else " from its config.json")
                         + f", fc width {facts.get('fc_width')}, block size {facts.get('block_size')}, "
                           f"mask token {facts.get('mask_token_id')}, hidden {facts.get('hidden_size')}",
                         level="warning" if overridden else "info")
        # The service must be up and serving the target before anything is cached from it (a resumed
        # run that stopped it already is the exception).
        if not self.service_down_by_us:
            if view.status is None:
                raise StepFailed("preflight", f"the service manager on {config.service.host} did not answer: {view.error}")
            if not view.status.active or view.health is None or not view.health.ready:
                why = view.error or (view.health.error if view.health else None) or view.status.state
                raise StepFailed("preflight", f"{service_name(config)} on {config.service.host} is not up and "
                                              f"ready ({why}); the window starts from a live server")
            self.facts.service_ready = True
            self.facts.service_model = view.health.model_path
            if view.health.model_path and not _same_model(view.health.model_path, config.target.model_path):
                raise StepFailed("preflight", f"the server serves {view.health.model_path}, the target is "
                                              f"{config.target.model_path}: completions would come from another model")
        await self._where_it_fits(prompts)
        self.state["facts"]["preflight"] = self.facts.to_json()
        self.state["facts"]["layers"] = self.facts.layers
        self.run.save()
        (self.run.dir / "probes.json").write_text(json.dumps({"format": "dflash-ops.probes/1", "hosts": probes}))
        await self._choose_plan()

    async def _where_it_fits(self, prompts: list[dict[str, Any]]) -> None:
        """Which hosts could extract without the serving GPUs; the zero-downtime route needs one."""
        await self.session.wait_first_samples(15.0)
        samples = {name: stream.telemetry.latest for name, stream in self.session.streams.items()}
        self.fits = where_it_fits(self.config, self.facts.probes, samples, longest_tokens(prompts),
                                  len(self.facts.layers))
        for fit in self.fits:
            self.journal("preflight", f"zero-downtime on {fit.host}: {'fits' if fit.proposed else 'no'}: {fit.why}")
        chosen = self.state["facts"].get("extract_on")
        if self.route == "zero-downtime" and chosen is None:
            fit = next((f for f in self.fits if f.proposed), None)
            if fit is None:
                raise StepFailed("preflight", "the zero-downtime route needs a host with room, the weights and "
                                              "the same kernels; none has: " + "; ".join(f"{f.host}: {f.why}" for f in self.fits))
            gpus = list(fit.gpus or (fit.gpu,))
            sample = samples[fit.host]
            free = {g.index: (g.mem_total_mib or 0) - (g.mem_used_mib or 0) for g in sample.gpus}
            self.state["facts"]["extract_on"] = {"host": fit.host, "gpu": fit.gpu, "gpus": gpus,
                                                 "model_path": fit.model_path, "need_mib": fit.need_mib,
                                                 "free_mib": {str(i): free.get(i, 0) for i in gpus}}
            self.journal("preflight", f"route zero-downtime: extracting on {fit.host} GPU{fit.gpu}; the server is "
                                      f"never touched")

    def _extract_host(self) -> tuple[str, str]:
        """(host, model path) of the extraction: the target host, or the zero-downtime route's choice."""
        chosen = self.state["facts"].get("extract_on")
        if self.route == "zero-downtime" and chosen:
            return chosen["host"], chosen["model_path"]
        return self.config.target.host, self.config.target.model_path

    def _prompt_records(self) -> list[dict[str, Any]]:
        """The prompts as the workers will read them (the config's max_new_tokens applied)."""
        source = self.config.prompts.file
        path = DEFAULT_PROMPTS if source is None else Path(source).expanduser()
        if not path.is_absolute():
            path = self.config.base_dir() / path
        try:
            prompt_set = load_prompts(path)
        except Exception as exc:  # PromptFileError names file, line and field
            raise StepFailed("preflight", getattr(exc, "msg", str(exc))) from None
        records = []
        for prompt in prompt_set.prompts:
            record = prompt.to_json()
            if self.config.prompts.max_new_tokens:
                record["max_new_tokens"] = self.config.prompts.max_new_tokens
            records.append(record)
        return records

    async def _probe_all(self) -> dict[str, dict[str, Any]]:
        async def probe(name: str) -> tuple[str, dict[str, Any]]:
            args = ["--workdir", await (await self.session.runner(name)).workdir()]
            path = self.config.target.path_on(name)
            if path is not None:
                args += ["--model", path]
            outcome = await self._job(name, "probe", f"probe-{name}", args, step="preflight", fresh=True)
            if not isinstance(outcome.get("result"), dict):
                raise StepFailed("preflight", f"the probe on {name} gave no facts: {outcome.get('error')}")
            return name, outcome["result"]
        return dict(await asyncio.gather(*(probe(name) for name in self.config.hosts)))

    async def _read_drafters(self) -> dict[str, dict[str, Any]]:
        """Each drafter's provenance, checked where it lives (`remote.drafter --provenance`): every
        config field the forward uses, `target_layer_ids` (required, or the config's explicit
        override), the fc width from the weights, finite weights. One job per drafter host."""
        by_host: dict[str, list[Any]] = {}
        for drafter in self.config.drafters:
            by_host.setdefault(drafter.host, []).append(drafter)

        async def check(host_name: str, drafters: list[Any]) -> dict[str, dict[str, Any]]:
            args = [arg for d in drafters for arg in ("--provenance", f"{d.name}={d.path}")]
            args += [arg for d in drafters if d.layers for arg in ("--layers-override", layer_override(d))]
            outcome = await self._job(host_name, "drafter", f"provenance-{host_name}", args, step="preflight",
                                      fresh=True)
            found = (outcome.get("result") or {}).get("drafters")
            if not isinstance(found, dict):
                raise StepFailed("preflight", f"the drafter check on {host_name} gave no provenance")
            for drafter in drafters:
                found[drafter.name] = {**found[drafter.name], "host": host_name}
            return found

        results = await asyncio.gather(*(check(h, ds) for h, ds in by_host.items()))
        return {name: facts for found in results for name, facts in found.items()}

    def _layers(self, drafters: dict[str, dict[str, Any]]) -> list[int]:
        if self.config.target.layers != "auto":
            return sorted(set(self.config.target.layers))
        layers = sorted({int(i) for d in drafters.values() for i in d["target_layer_ids"]})
        if not layers:
            raise StepFailed("preflight", "layers = \"auto\" but no drafter is configured to take them from")
        return layers

    async def _choose_plan(self) -> None:
        acts: dict[str, tuple[bool, str]] = {}
        if self.route == "window":
            stage, why = stage_decision(self.facts)
            if self.stage_override is False:
                stage, why = False, "left out: --no-stage (the weights are read inside the window)"
            if "stage" in self.state["facts"].get("plan_stage", {}):  # a resumed run keeps its plan
                stage, why = self.state["facts"]["plan_stage"]["stage"], self.state["facts"]["plan_stage"]["why"]
            self.state["facts"]["plan_stage"] = {"stage": stage, "why": why}
            acts["stage"] = (stage, why)
        manager = await self.session.service.manager(CONNECT_TIMEOUT_S)
        downtime = self.earlier.get("downtime")
        acts["stop"] = (True, f"{service_name(self.config)} on {self.config.service.host} goes down"
                              + (f"; earlier windows took {downtime:.0f} s" if downtime else ""))
        hosts = {"stage": self.config.target.host, "cache": self.config.service.host, "stop": self.config.service.host,
                 "free-vram": self.config.service.host, "extract": self.config.target.host,
                 "restart": self.config.service.host, "evaluate": self.config.eval.host}
        argvs = {"stop": manager.stop_argv(), "restart": manager.start_argv()}
        extract_host, _ = self._extract_host()
        hosts["extract"] = extract_host
        if self.route == "zero-downtime":
            hosts["evaluate"] = self.config.eval.host
        steps = planned(self.route, acts, hosts, argvs, self.earlier)
        fit = next((f for f in self.fits if f.proposed), None)
        proposal = None
        if fit is not None:
            downtime = self.earlier.get("downtime")
            proposal = (f"zero-downtime: extract on {fit.host} GPU{fit.gpu} ({fit.why}); the window route would "
                        f"stop the server" + (f" for ~{downtime:.0f} s (earlier windows)" if downtime else ""))
            self.journal("preflight", f"proposed route: {proposal}; chosen: {self.route}"
                         + (" (--route zero-downtime to take it)" if self.route == "window" else ""))
        self.plan = PlanReady(self.run.run_id, self.route, steps, tuple(self.fits), proposal)
        self.state["plan"] = [{"name": s.name, "acts": s.acts, "why": s.why, "host": s.host, "argv": list(s.argv),
                               "estimate_s": s.estimate_s} for s in steps]
        self.run.save()
        self.bus.publish(self.plan)
        for step in steps:
            self.journal("preflight", f"plan: {step.name}: {'acts' if step.acts else 'left out'}: {step.why}"
                         + (f" ({shlex.join(step.argv)} on {step.host})" if step.argv else ""))

    def _acts(self, name: str) -> bool:
        return any(s.name == name and s.acts for s in (self.plan.steps if self.plan else ()))

    # --- paths on the hosts -------------------------------------------------------------------

    async def _window_dir(self, name: str) -> str:
        """This run's directory on host `name` (created private)."""
        runner = await self.session.runner(name, CONNECT_TIMEOUT_S)
        path = f"{await runner.workdir()}/windows/{self.run.run_id}"
        host = runner.host
        await host.run(["mkdir", "-p", "-m", "700", path])
        return path

    # --- jobs ---------------------------------------------------------------------------------

    async def _job(self, host_name: str, worker: str, key: str, args: list[str], step: str,
                   fresh: bool = False, until: str | None = None,
                   on_event: Callable[[dict[str, Any]], Any] | None = None,
                   env: dict[str, str] | None = None) -> dict[str, Any]:
        """Start (or find again) job `key` on `host_name` and follow it until it exits (or until an
        event of type `until` arrives; then the job keeps running). Returns its outcome.

        The job's id is recorded in the state before it starts, so a console killed in between
        finds it by id on resume instead of starting a second one. `fresh`: a read-only job
        (probes) is simply run again on resume.
        """
        jobs = self.state["jobs"]
        record = jobs.get(key)
        runner = await self.session.runner(host_name, CONNECT_TIMEOUT_S)
        handle: JobHandle | None = None
        if record and not fresh:
            handle = await _find_job(runner, record["job_id"])
        if handle is None:
            job_id = f"{self.run.run_id}-{key}" + ("" if not fresh else f"-{int(time.time() * 1000) % 100000}")
            jobs[key] = {"job_id": job_id, "host": host_name, "worker": worker, "args": args}
            self.run.save()  # before the start: found again by id after a crash
            handle = await self._start_once(runner, worker, args, env, job_id)
            self.journal(step, f"started {worker} on {host_name} (pid {handle.pid})", host=host_name,
                         argv=["python", "-m", f"remote.{worker}", *args])
        else:
            self.journal(step, f"found {worker} job {handle.job_id} on {host_name} again (pid {handle.pid})",
                         host=host_name)
        jobs[key]["handle"] = json.loads(handle.to_json())
        self.run.save()
        return await self._follow(handle, step, until=until, on_event=on_event)

    async def _start_once(self, runner: JobRunner, worker: str, args: list[str], env: dict[str, str] | None,
                          job_id: str) -> JobHandle:
        """Start job `job_id`, or find it: a console killed during a start leaves the start half done
        on the host; the job then either appears under its id or is given up there (JobRunner's
        start protocol), and is found or started again, never twice."""
        deadline = time.monotonic() + START_SETTLE_S
        while True:
            try:
                return await runner.start(worker, args, env=env, job_id=job_id)
            except JobExists:
                found = await _find_job(runner, job_id)
                if found is not None:
                    return found
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(1.0)

    async def _follow(self, handle: JobHandle, step: str, until: str | None = None,
                      on_event: Callable[[dict[str, Any]], Any] | None = None) -> dict[str, Any]:
        outcome: dict[str, Any] = {"handle": handle, "artifacts": []}
        supervisor = self.session.supervisors[handle.host]
        try:
            async for _, event in follow_with_reconnect(supervisor, handle, connect_timeout=CONNECT_TIMEOUT_S):
                kind = event.get("type")
                self._publish_event(handle, event)
                if on_event is not None:
                    result = on_event(event)
                    if asyncio.iscoroutine(result):
                        await result
                if kind == "result":
                    outcome["result"] = event.get("data")
                elif kind == "error":
                    outcome["error"] = event.get("msg")
                elif kind == "artifact":
                    outcome["artifacts"].append(event)
                elif kind == "exit":
                    outcome["exit"] = event.get("code")
                if until is not None and kind == until:
                    outcome["until"] = event
                    return outcome
        except (JobDead, JobStalledError) as exc:
            raise StepFailed(step, str(exc)) from None
        except TimeoutError:
            raise StepFailed(step, f"{handle.host} did not reconnect within {CONNECT_TIMEOUT_S:.0f} s while "
                                   f"following {handle.worker}") from None
        if until is not None:
            raise StepFailed(step, f"{handle.worker} on {handle.host} exited ({outcome.get('exit')}) before "
                                   f"`{until}`: {outcome.get('error') or 'no error reported'}")
        if outcome.get("exit") not in (0, None) or outcome.get("error"):
            tail = ""
            with contextlib.suppress(Exception):
                tail = await (await self.session.runner(handle.host)).stderr_tail(handle)
            raise StepFailed(step, f"{handle.worker} on {handle.host} failed (exit {outcome.get('exit')}): "
                                   f"{outcome.get('error') or 'no error event'}" + (f"; stderr: {tail[-300:]}" if tail and not outcome.get("error") else ""))
        return outcome

    def _publish_event(self, handle: JobHandle, event: dict[str, Any]) -> None:
        message = job_message(handle, event)
        if message is not None:
            self.bus.publish(message)
        if event.get("type") == "log":
            self.journal(None, f"{handle.host} {handle.worker}: {event.get('msg')}", host=handle.host,
                         level=event.get("level", "info") if event.get("level") in ("warning", "error") else "info")

    # --- steps --------------------------------------------------------------------------------

    def _extract_args(self, window_dir: str, staged: bool) -> list[str]:
        target = self.config.target
        args = ["--model", target.model_path, "--completions", f"{window_dir}/completions.json",
                "--out", f"{window_dir}/states", "--layers", ",".join(map(str, self.facts.layers)),
                "--kernels", target.kernels]
        if staged:
            args += ["--staged", "--go-file", f"{window_dir}/go"]
        return args

    async def _stage(self) -> str | Skip | LeftOut:
        if not self._acts("stage"):
            return LeftOut(self.state["facts"]["plan_stage"]["why"])
        if await self._extraction_complete():
            return Skip("the extraction already finished")
        window = await self._window_dir(self.config.target.host)
        outcome = await self._job(self.config.target.host, "extract", "extract", self._extract_args(window, True),
                                  step="stage", until="staged")
        staged = outcome["until"]
        self.state["facts"]["staged_pid"] = outcome["handle"].pid
        self.run.save()
        return (f"{size_text(staged.get('bytes', 0))} in host RAM, kernels warmed "
                f"({staged.get('warmup_s', 0):.1f} s); waiting for the go")

    async def _cache(self) -> str | Skip:
        service_host = self.config.service.host
        window = await self._window_dir(service_host)
        completions = f"{window}/completions.json"
        host = await self._connected(service_host, "cache")
        verified = await self._verify_completions(host, completions)
        if verified is None:
            if self.service_down_by_us:
                raise StepFailed("cache", f"no verified completions at {service_host}:{completions} and the "
                                          f"service is down: restart it and run again")
            prompts = "\n".join(json.dumps(r) for r in self._prompt_records()) + "\n"
            await remote_files.write_text(host, f"{window}/prompts.jsonl", prompts)
            args = ["--server", self.config.service.url, "--out", completions, "--prompts", f"{window}/prompts.jsonl",
                    "--tokenizer", self.config.target.model_path]
            await self._job(service_host, "completions", "cache", args, step="cache")
            verified = await self._verify_completions(host, completions)
            if verified is None:
                raise StepFailed("cache", f"{service_host}:{completions} was not written")
        elif verified:
            return Skip(f"already cached and verified: {verified}")
        if self.config.target.host != service_host:
            target_window = await self._window_dir(self.config.target.host)
            await self._relay_file(service_host, completions, self.config.target.host,
                                   f"{target_window}/completions.json", "cache")
        checked = await self._check_against_target()
        return (f"{len(self.state['facts']['prompt_ids'])} completions cached and verified; {checked}")

    async def _check_against_target(self) -> str:
        """The extractor's own check phase, run now while the server serves (no GPU): token ids inside
        the target's vocabulary, lengths within its context, finish reasons, the layers."""
        window = await self._window_dir(self.config.target.host)
        args = ["--check-only", "--model", self.config.target.model_path, "--completions",
                f"{window}/completions.json", "--layers", ",".join(map(str, self.facts.layers))]
        outcome = await self._job(self.config.target.host, "extract", "check", args, step="cache", fresh=True)
        result = outcome.get("result") or {}
        return (f"checked against the target: {result.get('prompts', '?')} prompts, {result.get('tokens', '?')} "
                f"tokens within vocab {result.get('vocab_size', '?')} and context {result.get('max_position_embeddings', '?')}")

    async def _verify_completions(self, host: Any, path: str) -> str | None:
        """None when there is no cache; else raises unless it matches the prompts and the target."""
        try:
            text = await remote_files.read_text(host, path)
        except FileNotFoundError:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StepFailed("cache", f"{host.name}:{path}: not JSON ({exc})") from None
        ids = [p.get("id") for p in data.get("prompts", [])]
        want = self.state["facts"]["prompt_ids"]
        if ids != want:
            raise StepFailed("cache", f"{host.name}:{path} holds prompts {ids}, expected {want}")
        # remote.completions marks an aborted, failed or empty generation incomplete (never complete).
        incomplete = [p for p in data["prompts"] if p.get("complete") is False or not p.get("completion_ids")]
        if incomplete:
            why = "; ".join(f"{p.get('id')}: {p.get('incomplete_reason') or 'no completion tokens'}" for p in incomplete)
            raise StepFailed("cache", f"{host.name}:{path}: incomplete generations ({why}); the server must answer "
                                      f"them in full before it is stopped")
        model = data.get("model_path")
        if model and not _same_model(model, self.config.target.model_path):
            raise StepFailed("cache", f"{host.name}:{path} was made by a server serving {model}, not the target "
                                      f"{self.config.target.model_path}")
        self.state["facts"]["completion_tokens"] = sum(len(p["completion_ids"]) for p in data["prompts"])
        return f"{len(ids)} prompts, {self.state['facts']['completion_tokens']} completion tokens"

    async def _stop(self) -> str | Skip:
        service = self.config.service
        if self.service_down_by_us:
            return Skip(f"stopped by this run at {time.strftime('%H:%M:%S', time.localtime(self.state['service']['stopped_at']))}")
        if self.state["steps"].get("cache", {}).get("status") not in ("done", "skipped"):
            raise StepFailed("stop", "refused: the completions are not cached and verified")
        if self._acts("stage") and self.state["steps"].get("stage", {}).get("status") not in ("done", "skipped"):
            raise StepFailed("stop", "refused: the staged extractor has not reported `staged`")
        manager = await self.session.service.manager(CONNECT_TIMEOUT_S)
        argv = manager.stop_argv()
        downtime = self.earlier.get("downtime")
        impact = f"{service_name(self.config)} on {service.host} goes down; " + (
            f"earlier windows took {downtime:.0f} s" if downtime else "no earlier window to estimate the downtime from")
        if not await self._ask(Confirmation("stop", "stop the service", service.host, tuple(argv), impact, True, downtime)):
            raise Refused("stop", "stop the service")
        stream = self.session.streams[service.host]
        self.state["service"]["pids_before_stop"] = sorted(stream.telemetry.seen_service_pids) \
            if hasattr(stream.telemetry, "seen_service_pids") else []
        now = time.time()
        self.state["service"].update(stopped_at=now, down=True, stopped_monotonic=time.monotonic())
        self.run.save()  # before the command: a crash during the stop still knows the service may be down
        self._publish_downtime()
        started = time.monotonic()
        try:
            await manager.stop()
            self.state["service"]["stop_returned_at"] = time.time()
            self.run.save()
        finally:
            self.journal("stop", "stop command ran", host=service.host, argv=list(argv),
                         duration_s=round(time.monotonic() - started, 3))
            self.session.poke_service()
        return f"stopped in {time.monotonic() - started:.1f} s"

    async def _free_vram(self) -> str | Skip:
        service = self.config.service
        stream = self.session.streams[service.host]
        exclude = []
        if self.state["facts"].get("staged_pid") and self.config.target.host == service.host:
            exclude.append(self.state["facts"]["staged_pid"])
        if self._extraction_done_or_running():
            return Skip("the extraction already started")
        after = self.state["service"].get("stopped_monotonic")
        if after is None or after > time.monotonic():  # resumed in a new process: only fresh samples count
            after = time.monotonic()
        known = self.state["service"].get("pids_before_stop", [])
        result = await wait_vram_free(stream, service.gpus, service.vram_free_mib, service.vram_wait_s, stopped_at=after,
                                      service_pids=known, exclude=exclude)
        if result.free:
            self._vram_free_now()
            return f"free after {result.waited_s:.1f} s ({result.used})"
        holders = result.holders
        self.bus.publish(HoldersFound(service.host, holders, result.used, service.vram_free_mib))
        self.journal("free-vram", f"VRAM still held after {result.waited_s:.0f} s ({result.used}): "
                     + "; ".join(f"pid {h.pid} {h.mib} MiB {h.command or '?'}" for h in holders), level="warning")
        hidden = [h for h in holders if not h.visible]
        holders = tuple(h for h in holders if h.visible)  # a pid that names no GPU process here is never signalled
        for h in hidden:
            self.journal("free-vram", f"pid {h.pid} ({h.mib} MiB) is not visible from this namespace "
                                      f"({h.visible_reason or 'no /dev/nvidia* file open'}): left alone", level="warning")
        if not holders:
            raise StepFailed("free-vram", f"VRAM still held ({result.used}) and no process that holds it can be "
                                          f"ended from here" + (f" ({len(hidden)} not visible from this namespace: "
                                                                f"end them on the host itself)" if hidden else ""))
        code_dir = await self.session.code_dir(service.host)
        host = await self._connected(service.host, "free-vram")
        python = await host.resolve_python()
        argv = endpids_argv(python, code_dir, holders, service.stop_grace_s, sudo=service.sudo)
        action = f"end {len(holders)} process{'es' if len(holders) > 1 else ''} holding VRAM"
        impact = ", ".join(f"pid {h.pid} ({h.mib} MiB, {h.command or '?'}"
                           + (", was the service's" if h.was_service else "") + ")" for h in holders)
        if not await self._ask(Confirmation("free-vram", action, service.host, tuple(argv),
                                            f"SIGTERM, then SIGKILL after {service.stop_grace_s:g} s: {impact}", True)):
            raise Refused("free-vram", action)
        outcomes = await end_holders(host, python, code_dir, holders, service.stop_grace_s, sudo=service.sudo)
        for line in describe_outcomes(outcomes):
            self.journal("free-vram", line, host=service.host)
        result = await wait_vram_free(stream, service.gpus, service.vram_free_mib, service.vram_wait_s,
                                      stopped_at=time.monotonic(), service_pids=known, exclude=exclude)
        if not result.free:
            raise StepFailed("free-vram", f"VRAM still held after ending the holders ({result.used})")
        self._vram_free_now()
        return f"free after ending {len(outcomes)} holder(s) ({result.used})"

    def _vram_free_now(self) -> None:
        self.state["service"]["vram_free_at"] = time.time()
        self.run.save()

    def _extraction_done_or_running(self) -> bool:
        return bool(self.state["facts"].get("go_sent") or self.state["facts"].get("extraction_complete"))

    async def _extraction_complete(self) -> bool:
        """The states' manifest on the target host is complete and its files match their sha256."""
        if self.state["facts"].get("extraction_complete"):
            return True
        if "extract" not in self.state["jobs"]:
            return False
        host_name, _ = self._extract_host()
        window = await self._window_dir(host_name)
        host = await self._connected(host_name, "extract")
        code = await self.session.code_dir(host_name)
        if await remote_files.manifest_complete(host, code, f"{window}/states"):
            self.state["facts"]["extraction_complete"] = True
            self.run.save()
            return True
        return False

    async def _extract(self) -> str | Skip:
        if self.route == "zero-downtime":
            return await self._extract_elsewhere()
        target = self.config.target.host
        window = await self._window_dir(target)
        if await self._extraction_complete():
            self._gpu_released.set()
            return Skip(f"already extracted (manifest complete, sha256 verified): {target}:{window}/states")
        staged = self._acts("stage") and "extract" in self.state["jobs"]

        def on_event(event: dict[str, Any]) -> None:
            if event.get("type") == "gpu_released":
                self.state["facts"]["gpu_released_at"] = time.time()
                self.state["facts"]["window"] = {k: v for k, v in event.items() if k not in ("type", "seq")}
                self.run.save()
                self._gpu_released.set()
                if self.route == "window" and self.service_down_by_us and self._restart_task is None:
                    # The restart begins now, not after the files are flushed.
                    self.state["service"]["restart_begun_at"] = time.time()
                    self.run.save()
                    self._restart_task = asyncio.create_task(self._restart_now(), name="restart-at-gpu-released")

        if staged:
            host = await self._connected(target, "extract")
            if not self.state["facts"].get("go_sent"):
                await host.run(["sh", "-c", f"umask 077; : > {shlex.quote(window + '/go')}"])
                self.state["facts"]["go_sent"] = time.time()
                self.run.save()
                self.journal("extract", "go: the staged extractor copies the weights to the GPU", host=target)
        outcome = await self._job(target, "extract", "extract", self._extract_args(window, False), step="extract",
                                  on_event=on_event)
        self.state["facts"]["extraction_complete"] = True
        self.run.save()
        result = outcome.get("result") or {}
        window_facts = result.get("window", {})
        return (f"{result.get('prompts', '?')} prompts, {result.get('tokens', '?')} tokens, layers "
                f"{result.get('layers')}; window {window_facts.get('window_s', '?')} s")

    async def _extract_elsewhere(self) -> str | Skip:
        """The zero-downtime route: extract on the host with room while the server keeps serving."""
        host_name, model_path = self._extract_host()
        chosen = self.state["facts"]["extract_on"]
        window = await self._window_dir(host_name)
        if await self._extraction_complete():
            return Skip(f"already extracted (manifest complete, sha256 verified): {host_name}:{window}/states")
        if host_name != self.config.service.host:
            service_window = await self._window_dir(self.config.service.host)
            await self._relay_file(self.config.service.host, f"{service_window}/completions.json", host_name,
                                   f"{window}/completions.json", "extract")
        args = self._extract_args(window, False)
        args[args.index("--model") + 1] = model_path
        gpus = chosen.get("gpus") or [chosen["gpu"]]
        if len(gpus) > 1:  # a device_map split, each GPU capped at what it had free (renumbered from 0)
            caps = ",".join(f"{n}={int(chosen['free_mib'][str(g)] * SPLIT_FILL)}MiB" for n, g in enumerate(gpus))
            args += ["--device-map", "auto", "--max-memory", caps]
        env = {} if self.session.simulated.get(host_name) else {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        job = asyncio.create_task(self._job(host_name, "extract", "extract", args, step="extract", env=env))
        taken = asyncio.create_task(self._gpu_taken(host_name, gpus, chosen["need_mib"]))
        done, _ = await asyncio.wait({job, taken}, return_when=asyncio.FIRST_COMPLETED)
        if taken in done and not job.done():
            job.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await job
            await self._end_own_jobs()  # stopped cleanly, before the other process meets an OOM
            raise StepFailed("extract", f"{taken.result()} during the extraction: it was stopped before an OOM. "
                                        f"The window route remains: dflash-ops run --route window")
        taken.cancel()
        outcome = await job
        self.state["facts"]["extraction_complete"] = True
        self.run.save()
        result = outcome.get("result") or {}
        return (f"on {host_name} GPU{chosen['gpu']} with the server serving: {result.get('prompts', '?')} prompts, "
                f"{result.get('tokens', '?')} tokens, layers {result.get('layers')}")

    async def _gpu_taken(self, host: str, gpus: list[int], need_mib: int) -> str:
        """Returns (says why) once other processes leave the chosen GPUs less room than the extraction
        needs; our own job's memory is not counted. Watches every telemetry sample of `host`."""
        stream = self.session.streams[host]
        ours = self.state["jobs"].get("extract", {}).get("handle", {}).get("pid")
        fill = 1.0 if len(gpus) == 1 else SPLIT_FILL

        def room(sample: TelemetrySample) -> int | None:
            readings = [g for g in sample.gpus if g.index in gpus and g.mem_total_mib is not None]
            if len(readings) != len(gpus):
                return None
            used = others_used(sample, gpus, [ours] if ours else [])
            if any(used.get(g.index) is None for g in readings):
                return None
            return sum(int((g.mem_total_mib - used[g.index]) * fill) for g in readings)

        def short(sample: TelemetrySample) -> bool:
            left = room(sample)
            return left is not None and left < need_mib

        latest = stream.telemetry.latest
        sample = latest if latest is not None and short(latest) else await stream.wait_for(short, timeout=1e9)
        names = "+".join(f"GPU{g}" for g in gpus)
        others = [f"pid {p.pid} ({p.mib} MiB)" for p in sample.processes if p.gpu in gpus and p.pid != ours]
        return (f"{names} on {host} was taken by {', '.join(others) or 'another process'}: "
                f"{room(sample)} MiB left, ~{need_mib} MiB needed")

    async def _restart_now(self) -> None:
        """The restart started at `gpu_released` (its result is the restart step's)."""
        await self.restart_service(reason="the extraction released the GPUs")

    async def _restart(self) -> str | Skip:
        if self._restart_task is not None:
            task, self._restart_task = self._restart_task, None
            await task  # begun at gpu_released; if it failed, running this step again restarts anew
            return f"ready {self.state['service'].get('ready_at', 0) - self.state['service'].get('stopped_at', 0):.1f} s after the stop"
        if not self.service_down_by_us:
            return Skip("the service was not stopped by this run (or is already back)")
        await self.restart_service(reason="the extraction finished")
        return f"ready {self.state['service']['ready_at'] - self.state['service']['stopped_at']:.1f} s after the stop"

    async def restart_service(self, reason: str) -> None:
        """Start the service (asking first) and wait until it is ready; the downtime ends then."""
        service = self.config.service
        manager = await self.session.service.manager(CONNECT_TIMEOUT_S)
        argv = manager.start_argv()
        down = self.state["service"].get("stopped_at")
        so_far = f"down {time.time() - down:.0f} s so far" if down else "not stopped by this run"
        if not await self._ask(Confirmation("restart", "start the service", service.host, tuple(argv),
                                            f"{reason}: brings {service_name(self.config)} back ({so_far})", False,
                                            self.earlier.get("restart"))):
            raise Refused("restart", "start the service")
        client = await self.session.service.client(CONNECT_TIMEOUT_S)
        host = await self._connected(service.host, "restart")
        started = time.monotonic()
        self.state["service"]["start_issued_at"] = time.time()
        self.run.save()
        health = await start_and_wait(manager, client, service.ready_timeout_s, host=host,
                                      on_progress=self.bus.publish, on_health=None)
        self.state["service"].update(down=False, ready_at=time.time())
        self.run.save()
        self.journal("restart", f"ready after {time.monotonic() - started:.1f} s ({health.model or 'model ?'})",
                     host=service.host, argv=list(argv), duration_s=round(time.monotonic() - started, 3))
        self._publish_downtime()
        self.session.poke_service()

    async def _evaluate(self) -> str | Skip:
        ev = self.config.eval
        window = await self._window_dir(ev.host)
        out = f"{window}/eval"
        host = await self._connected(ev.host, "evaluate")
        code = await self.session.code_dir(ev.host)
        if await remote_files.manifest_complete(host, code, out):
            return Skip(f"already evaluated (manifest complete): {ev.host}:{out}")
        if not self.config.drafters:
            return Skip("no drafters configured")
        extract_host, extract_model = self._extract_host()
        states = f"{await self._window_dir(extract_host)}/states"
        target_model = self.config.target.path_on(ev.host)
        if ev.host != extract_host:
            states = await self._relay_tree(extract_host, states, ev.host, "evaluate")
        if target_model is None:  # the eval host has no copy: the heads alone, exported where one is
            target_model = await self._relay_heads(extract_host, extract_model, ev.host)
        args = ["--states", states, "--target", target_model, "--out", out, "--device", ev.device,
                "--budgets", ",".join(map(str, ev.budgets)), "--topk", str(ev.topk)]
        for drafter in self.config.drafters:
            path = drafter.path
            if drafter.host != ev.host:
                path = await self._relay_tree(drafter.host, path, ev.host, "evaluate")
            args += ["--drafter", f"{drafter.name}={path}"]
            if drafter.layers:
                args += ["--layers-override", layer_override(drafter)]
        if self.config.reference:
            args += ["--reference", self.config.reference.name]
        await self._job(ev.host, "evaluate", "evaluate", args, step="evaluate")
        return f"{len(self.config.drafters)} drafters evaluated on {ev.host}"

    async def _report(self) -> str:
        from console.views.report import write_report

        ev = self.config.eval
        window = await self._window_dir(ev.host)
        host = await self._connected(ev.host, "report")
        results_dir = self.run.results_dir
        await remote_files.fetch_tree(host, f"{window}/eval", results_dir, progress=self._relay_progress("report"))
        probes = self.run.dir / "probes.json"
        if probes.exists():
            (results_dir / "probes.json").write_text(probes.read_text())
        results, paths = write_report(results_dir, self.run.dir)
        headline = {name: (d.get("tau", {}).get("vanilla") or {}).get("macro")
                    for name, d in results.get("drafters", {}).items()}
        self.state["headline"] = headline
        self.run.save()
        self.bus.publish(ResultsReady(self.run.run_id, str(self.run.dir)))
        return "; ".join(f"{k} tau {v:.2f}" for k, v in headline.items() if v is not None) + f"; {paths[0]}"

    # --- data between hosts -------------------------------------------------------------------

    async def _relay_file(self, src: str, src_path: str, dst: str, dst_path: str, step: str) -> None:
        src_host = await self._connected(src, step)
        dst_host = await self._connected(dst, step)
        await remote_files.relay_file(src_host, src_path, dst_host, dst_path, progress=self._relay_progress(step))

    async def _relay_tree(self, src: str, src_path: str, dst: str, step: str) -> str:
        """Copy directory `src_path` from host `src` to host `dst` through the console, content-addressed
        (an unchanged tree is not sent twice) and sha256-verified; returns its path on `dst`."""
        src_host = await self._connected(src, step)
        dst_host = await self._connected(dst, step)
        dst_root = f"{await (await self.session.runner(dst)).workdir()}/relayed"
        path, sent = await remote_files.relay_tree(src_host, await src_host.expand(src_path), dst_host, dst_root,
                                                   progress=self._relay_progress(step))
        self.journal(step, f"{src}:{src_path} -> {dst}:{path} ({'sent ' + str(sent) + ' bytes' if sent else 'already there'})")
        return path

    async def _relay_heads(self, source: str, model_path: str, dst: str) -> str:
        """The target's embed_tokens/lm_head on the eval host (exported once where the weights are)."""
        host = await self._connected(source, "evaluate")
        code = await self.session.code_dir(source)
        heads = f"{await self._window_dir(source)}/target-heads"
        await remote_files.export_heads(host, code, model_path, heads)
        return await self._relay_tree(source, heads, dst, "evaluate")

    def _relay_progress(self, step: str) -> Callable[[int, int], None]:
        def progress(done: int, total: int) -> None:
            self.bus.publish(relay_message(self.run.run_id, step, done, total))
        return progress

    # --- telemetry ----------------------------------------------------------------------------

    def _record_telemetry(self, message: Any) -> None:
        from console.messages import TelemetryUpdate

        if isinstance(message, TelemetryUpdate) and message.sample is not None:
            self.run.record_telemetry(message.host, message.sample,
                                      {"service_down": self.service_down_by_us})


class Skip(str):
    """A step's work was already done: the step is skipped, saying why."""

    @property
    def why(self) -> str:
        return str(self)


class LeftOut(Skip):
    """The plan leaves the step out (e.g. no staging without the RAM for it)."""


def layer_override(drafter: Any) -> str:
    """`NAME=1,2,3`: the config's explicit layers for a drafter (`[[drafters]] layers`)."""
    return f"{drafter.name}={','.join(map(str, drafter.layers))}"


def _same_model(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/") or Path(a).name == Path(b).name and Path(a).name != ""


async def _find_job(runner: JobRunner, job_id: str) -> JobHandle | None:
    """The job with this id on the runner's host, or None when it was never started there."""
    try:
        return await runner.attach(job_id)
    except (FileNotFoundError, KeyError, LookupError):
        return None


def relay_message(run_id: str, step: str, done: int, total: int) -> JobProgress:
    """Progress of a copy between hosts through the console, shown like a job's."""
    return JobProgress(job_id=f"{run_id}-relay-{step}", worker="relay", host="console", done=done, total=total,
                       unit="bytes", phase=step, message="copying between hosts", key="relay")
