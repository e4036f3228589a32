"""What the operator asks for, chosen once: a new window, the resume of a run, its discard, a plan,
or the console over the hosts.

Every view hands its request here (`dflash-ops run`, `console`, `serve`, the console's own keys
through `Operator.open_run`), and one call answers it: which run (the one named, or the one a console
offers), under which config (the one given, else the one the run recorded), on which replica of a
fleet (the one the run's window is on, else the least loaded that can take it), and whether it may go
on (a run another live console drives, a run made for another service or config file, a new run
while one is unfinished or left the service down: refused, saying why; an unfinished run is
offered instead where a console opens on the answer). Nothing is written or sent before the answer,
and every line of it is said on `say`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from console.config import Config, ConfigError
from console.config_source import config_for
from console.procedure import identity
from console.procedure.outcomes import ResumeRefused, StepFailed
from console.procedure.store import (
    Run,
    RunStore,
    RunStoreError,
    UnfinishedRun,
    left_line,
    owned_elsewhere,
    what_next,
)

Action = Literal["run", "resume", "discard", "plan", "console"]


@dataclass(frozen=True)
class Request:
    """One request, as the operator says it: `run_id` None with "resume" or "discard" is the run a
    console offers (the one that left the service down, else the newest unfinished one)."""

    action: Action
    run_id: str | None = None
    config: str | None = None  # --config as given (None: ./dflash-ops.toml, else the run's own)
    runs: str | None = None  # --runs (None: the default store)
    replica: str | None = None  # --replica: a fleet's window on this replica only
    read_only: bool = False  # a console that only watches: no replica is chosen for it


@dataclass
class Choice:
    """The answer: the config to use (a fleet's narrowed to its replica), the store, and the run
    resumed or discarded (None: a new run begins, or nothing to offer)."""

    request: Request
    config: Config
    store: RunStore
    run: Run | None
    said: list[str] = field(default_factory=list)


class Refused(Exception):
    """The request cannot be answered as asked; the message says why and what to do (exit 2)."""


def choose(request: Request, say: Callable[[str], None] = lambda line: None, offered: bool = False) -> Choice:
    """Answer `request` (see the module's docstring). Raises `Refused`, `ResumeRefused`,
    `RunStoreError` or `ConfigError`, each naming what and where. A new run asked for while another
    is unfinished is refused (`UnfinishedRun`), unless a console opens on the answer (`offered`): it
    offers that run first (resume / discard), and no run is chosen here."""
    said: list[str] = []

    def tell(line: str) -> None:
        said.append(line)
        say(line)

    store = RunStore(request.runs)
    named = _named(store, request)
    try:
        config = config_for(request.config, named, tell)
    except ConfigError:
        if request.action != "discard":
            raise
        config = None  # a discard says what it leaves all the same, less precisely
    # (a replica named for a one-server config is refused there, never passed over)
    if config is not None and (config.fleet is not None or request.replica is not None) \
            and request.action in ("run", "resume", "plan", "console") and not request.read_only:
        config = _on_replica(config, named, request, store, tell)
    run = None
    if request.action == "resume":
        run = resumable(store, config, request.run_id or True)
    elif request.action == "discard":
        run = named
    elif request.action == "run":
        try:
            refuse_new_run(store)
        except UnfinishedRun:  # a console offers it (resume / discard); a script is refused it
            if not offered:
                raise
    return Choice(request, config, store, run, said)


def resumable(store: RunStore, config: Config, resume: str | bool) -> Run:
    """The run to resume (`True`: the one a console offers, a damaged newer one named, never passed
    over), checked: not driven by another live console, made for this service and config file."""
    run = store.run_to_resume() if resume is True else store.open(str(resume))
    if owned_elsewhere(run.state):  # another live console drives it: refused before anything is sent
        raise ResumeRefused(f"{what_next(run)}; nothing was written or sent")
    refused = identity.refusal(run.state, config, run.run_id) if run.state.started else None
    if refused is not None:  # another service or config file: said before connecting (the engine checks too)
        raise ResumeRefused(refused)
    return run


def refuse_new_run(store: RunStore) -> None:
    """Raises when a new run must not begin: a run left the service down (it comes first: its
    resume restarts the service), or a run has not finished (resume or discard it: never a second
    window over its lock and its jobs)."""
    left = store.left_down()
    if left is not None and left.state.service.left_as() in ("paused", "drained"):  # the same, paused or drained
        raise ResumeRefused(f"{left_line(left)}: {what_next(left)}; then start a new run")
    if left is not None:  # a new run would start from a server that is down: the old one comes first
        since = left.state.service.stopped_at
        raise ResumeRefused(f"run {left.run_id} left the service down (since "
                            f"{time.strftime('%H:%M:%S', time.localtime(since or time.time()))}): "
                            f"{what_next(left)}; then start a new run")
    unfinished = store.latest_unfinished()
    if unfinished is not None:  # never a second window over it (its lock, its jobs): resume or discard it
        raise UnfinishedRun(unfinished)


def _named(store: RunStore, request: Request) -> Run | None:
    """The run the request names, to find its recorded config (and a fleet's replica): an
    unreadable one is None here, and opening it for real (`resumable`, the discard) says why."""
    if request.action == "discard" and request.run_id is None:
        latest = store.latest_unfinished()
        if latest is None:
            raise Refused(f"no unfinished run to discard in {store.root}")
        return latest
    try:
        if request.action in ("resume", "discard"):
            return store.to_resume() if request.run_id is None else store.open(request.run_id)
        if request.action == "plan" and request.run_id is not None:  # `run --plan --resume RUN`: under its config
            return store.open(request.run_id)
        if request.action == "console":
            return store.to_resume()  # the run the console offers: a DRAINED replica is its replica
    except RunStoreError:
        if request.action == "discard":
            raise
    return None


def _on_replica(config: Config, named: Run | None, request: Request, store: RunStore,
                tell: Callable[[str], None]) -> Config:
    """A fleet config addressed to the replica whose window this is: the one the run recorded, else
    the one chosen now among those the newest preflight found able to take it (`fleet_config`)."""
    from console.procedure.steps.fleet import fleet_config
    from console.session.fleet_reach import standalone

    try:
        known = [run.state for run in store.readable()]
    except RunStoreError:
        known = []

    async def place() -> tuple[Config, str | None]:
        async with standalone(config) as via:  # each URL from the host it is seen from ([fleet])
            return await fleet_config(config, named.state if named is not None else None, request.replica, known,
                                      via=via)

    try:
        placed, why = asyncio.run(place())
    except StepFailed as exc:
        raise Refused(exc.msg + (" (--read-only watches the fleet)" if request.action == "console" else "")) from None
    if request.action != "console" and why is not None:
        tell(f"fleet: the window runs on replica {why}")
    return placed
