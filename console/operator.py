"""The operator's console core: one object every view uses (headless `run`, the drill, the TUI).

It holds the config, the live session (connections, telemetry, service watch, one message bus),
the run store, and the engine of the run in progress. A view calls its methods and renders what it
publishes on `bus`; none of them wires parts together itself.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from console.config import Config
from console.messages import PlanReady, RunFinished
from console.procedure import identity
from console.procedure.decider import Decider, RefuseAll
from console.procedure.engine import Engine
from console.procedure.hosts import SessionHosts
from console.procedure.store import Run, RunStore, RunSummary, owned_elsewhere, what_next
from console.request import refuse_new_run, resumable
from console.session import MessageBus, Session


@dataclass(frozen=True)
class Asked:
    """What the command line asked of every run this console starts (`run --route --no-restart
    --step` on a terminal opens the console, whose keys cannot say it): its route, no restart after
    a failure, one step at a time (the console's `n` runs the next)."""

    route: str | None = None
    no_restart: bool = False
    one_step: bool = False


class ReadOnly(Exception):
    """The console was opened read-only: nothing that acts is offered."""


class Operator:
    """The config's hosts, watched; the procedure, run on request."""

    def __init__(self, config: Config, runs_dir: Path | str | None = None, read_only: bool = False,
                 session: Session | None = None, asked: Asked = Asked()):
        self.read_only = read_only
        self.asked = asked
        self.session = session or Session(config)
        self.session.config = config
        self.bus: MessageBus = self.session.bus
        self.store = RunStore(runs_dir)
        self.engine: Engine | None = None
        self._task: asyncio.Task | None = None
        self.notifier: Any = None  # console/notify's Notifier, while started with [notify] urls

    @property
    def config(self) -> Config:
        """The config as the session addresses it now: a fleet run that goes on to its next replica
        (`Session.address`) moves the service there, and every view that reads it follows."""
        return self.session.config

    @config.setter
    def config(self, config: Config) -> None:
        self.session.config = config

    def start(self) -> None:
        """Connect every host, start telemetry and the service watch (on the running loop); with
        `[notify] urls`, the notifier: of the runs this console drives, and of another console's run
        whose console is gone while it holds the server (a read-only console tells only that: it
        drives none; `console-gone` is told once among every watching console)."""
        self.session.start()
        if self.config.notify.urls and self.notifier is None:
            from console.notify import Notifier

            self.notifier = Notifier(self.config, self.store, self.bus)
            self.notifier.start()

    async def stop(self) -> None:
        if self.notifier is not None:  # what waits (the run's end) gets a few seconds to go out
            notifier, self.notifier = self.notifier, None
            await notifier.close()
        await self.session.stop()

    def _config_sha(self) -> str | None:
        source = self.config.source
        return hashlib.sha256(Path(source).read_bytes()).hexdigest() if source and Path(source).exists() else None

    def open_run(self, resume: str | bool | None) -> Run:
        """A new run, or the one to resume (`True`: the one a console offers), checked as every
        request is (`console/request.py`: one answer for the CLI, the console and `serve`)."""
        if resume:  # a damaged newer run is named, never passed over
            return resumable(self.store, self.config, resume)
        refuse_new_run(self.store)
        return self.store.create(self._config_path(), self._config_sha())

    def refuse_new_run(self) -> None:
        """Raises when a new run must not begin (`request.refuse_new_run`)."""
        refuse_new_run(self.store)

    def _config_path(self) -> str | None:
        """The config's absolute path, recorded in the run: `run --resume`, `status` and `crosscheck`
        find it from any directory (during an outage too)."""
        return str(Path(self.config.source).resolve()) if self.config.source else None

    async def run(self, decider: Decider, resume: str | bool | None = None, route: str | None = None,
                  no_restart: bool = False, stage: bool | None = None, one_step: bool = False) -> RunFinished:
        """Run the whole procedure (or resume one); publishes its messages on `bus`. `one_step`: run
        the next unsatisfied step (of the resumed run, or of a new one) and pause, resumable. What
        the command line asked (`asked`) holds for every run."""
        route, no_restart = route or self.asked.route, no_restart or self.asked.no_restart
        one_step = one_step or self.asked.one_step
        if self.read_only:
            raise ReadOnly("read-only console: the procedure cannot be run")
        run = self.open_run(resume)
        self.engine = Engine(SessionHosts(self.session), self.config, run, decider, self.store,
                             restart_on_failure=not no_restart, route=route, stage=stage, one_step=one_step)
        self._task = asyncio.current_task()
        try:
            return await self.engine.execute()
        finally:
            self._task = None

    async def plan(self, route: str | None = None) -> PlanReady:
        """Preflight only: connect, probe, read the drafters, choose the plan. Changes nothing on the
        hosts (beyond shipping the worker code) and keeps no run: its scratch run lives in a temporary
        directory outside the store, so no other console, `runs` or a resume ever sees it (a plan
        killed half-way included)."""
        with tempfile.TemporaryDirectory(prefix="dflash-ops-plan-") as scratch:
            run = RunStore(scratch).create(self._config_path(), self._config_sha())
            engine = Engine(SessionHosts(self.session), self.config, run, RefuseAll(), self.store,
                            restart_on_failure=False, route=route, plan_only=True)
            finished = await engine.execute()
            if engine.plan is None:
                raise RuntimeError(finished.message)
            return engine.plan

    async def restart_service(self, decider: Decider) -> None:
        """Start the service now (asking first): the one key that ends a downtime."""
        if self.read_only:
            raise ReadOnly("read-only console: the service cannot be started from here")
        engine = self.engine
        if engine is None or not engine.service_down_by_us:
            run = self.store.left_down(service=self.config)  # this config's service only
            if run is None:
                other = self.store.left_down()
                if other is not None:  # another service's run: its resume, under its own config
                    raise LookupError(f"no run left {identity.describe(identity.of(self.config))} down; run "
                                      f"{other.run_id} left {identity.describe(other.state.service_identity)} down "
                                      f"(config {other.state.config}): `dflash-ops run --resume {other.run_id} "
                                      f"--config {other.state.config}` restarts it")
                raise LookupError("no run left the service down")
            engine = Engine(SessionHosts(self.session), self.config, run, decider, self.store)
        await engine.restart_service(reason="the operator asked for it", decider=decider)

    def cancel(self, leave_down: bool = False) -> None:
        """Cancel the procedure in progress: it then offers the restart if the service is down,
        unless the operator chose to leave it down (`leave_down`, its own key in the quit modal)."""
        if self.engine is not None:
            self.engine.cancel(leave_down)  # asked again until the run takes it (a cancel can be lost on 3.11)

    def driven_elsewhere(self, run_id: str) -> str | None:
        """Who drives run `run_id` when it is another live console (or one that cannot be told):
        its resume and `r` are refused here, and this says so; None when nobody else drives it."""
        try:
            run = self.store.open(run_id)
        except Exception:  # noqa: BLE001 - unreadable: opening it for real says why
            return None
        return what_next(run) if owned_elsewhere(run.state) else None

    def unfinished_run(self) -> str | None:
        """The run a new console offers to continue: the one that left the service down, else the
        newest unfinished one (one store query, whatever the run's status)."""
        run = self.store.to_resume()
        return run.run_id if run else None

    async def follow_live_run(self) -> None:
        """Publish the live run as its store and hosts say (another console's, or `run --headless`'s):
        what a read-only console and `status --watch` show. Runs until cancelled."""
        from console.procedure.follower import RunFollower

        def ours(run_id: str) -> bool:
            return self.engine is not None and self.engine.run.run_id == run_id and self._task is not None

        await RunFollower(self.store, self.bus, self.session, ours).run()

    def left_down(self) -> Run | None:
        """The run that left this config's service down (whatever its status), or None."""
        return self.store.left_down(service=self.config)

    def runs(self) -> list[RunSummary]:
        """Earlier runs that can be read (`store.summaries()` also lists the unreadable ones)."""
        return [s for s in self.store.summaries() if isinstance(s, RunSummary)]

    def run_dir(self, run_id: str) -> Path:
        return self.store.root / run_id
