"""The fleet window's own steps: one replica behind SGLang's router leaves it, has its window, and
comes back, while the other replicas carry the traffic (issue 29).

    drain → (the route's steps on that replica: stop … restart, or pause … continue) → rejoin

Choosing the replica (`choose_replica`, before anything changes): the router answers /health; every
replica is listed healthy; the one with the fewest running requests (its own /metrics) is taken; it
is never the last healthy one; the requests running on it must fit under the others'
`max_running_requests` (from their /server_info) when they report it. Each refusal says the numbers.

`drain` writes `drained = {replica, router, since, spec}` to the run's state *before* it asks the router
to remove the replica (a crash there still knows it may be out; `spec`: the worker's settings smg
lists, given back by the rejoin), waits until the router no longer lists it (smg: once the gateway's
own settle is over, the worker listed `draining` meanwhile; sglang-router: a short settle of ours),
then until the replica's own /v1/loads counts no request in a snapshot taken after that, within
`[fleet] drain_timeout_s` (never the /metrics gauges: console/service/replica_loads.py).
`rejoin` waits for the replica's /health_generate, adds it back, waits until the router lists it
healthy, clears `drained`, and verifies that requests through the router reach it (its own
`num_requests_total` rises; said when the policy cannot show it). One drain per window, one rejoin
per drain (`drains`, `rejoins` in the state, counted before each request). Every end after the drain
rejoins it (`rejoin_after`, called by the engine's compensation after the route's own restart or
resume + continue); what cannot be rejoined stays named "DRAINED by run X" by `status` and `runs`.
The router's contract: docs/sglang.md, "Router"; its client: console/service/router.py.

The choice's rules and what they read: steps/fleet_choice.py. Right before the removal they run again
(`fleet_guard.recheck`), and while the replica is out the other replicas and the router are watched,
a risk said at once and the window offered to end early and rejoin: steps/fleet_guard.py.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from console.messages import Confirmation
from console.procedure.outcomes import Found, Refused, Skip, StepFailed
from console.procedure.state import between_windows, recorded_replica
from console.procedure.steps import fleet_guard
from console.procedure.steps.fleet_choice import FLEET_ERRORS, choose, measure, replica_client, router_of
from console.service.router import SMG, SMG_DEFAULT_SETTLE_S, RouterError, Worker, wait_idle
from console.service.sglang_api import SglangClient

if TYPE_CHECKING:
    from console.config import Config
    from console.config.fleet import ReplicaConfig
    from console.procedure.window import Window

LISTED_S = 60.0  # the router lists a worker within a second of its health check; this is the bound
ROUTED_PROBES = 8  # requests sent through the router to see the rejoined replica get some


async def choose_replica(config: Config, eligible: set[str] | None = None, via: Any = None) -> tuple[ReplicaConfig, str]:
    """The replica to drain and why; StepFailed("preflight", the refusal) before anything changes."""
    fleet = config.fleet
    assert fleet is not None
    from console.config import ConfigError

    try:
        choice = choose(await measure(fleet, via), eligible)
    except (*FLEET_ERRORS, ConfigError) as exc:
        raise StepFailed("preflight", f"the fleet window is refused: {exc}; nothing was changed") from None
    if choice.replica is None:
        raise StepFailed("preflight", f"the fleet window is refused: {choice.why}; nothing was changed")
    replica = fleet.replica(choice.replica)
    assert replica is not None
    return replica, choice.why


def on_replica(config: Config, replica: ReplicaConfig) -> Config:
    """The config whose service is `replica`: the route's steps address it as the service."""
    return dataclasses.replace(config, service=replica.service)


def replica_of(window: Window) -> ReplicaConfig:
    """The replica this run's window is on: the one recorded when it drained, else the config's service."""
    fleet = window.config.fleet
    drained = window.state.service.drained or {}
    named = fleet.replica(drained["replica"]) if drained.get("replica") else None
    if named is not None:
        return named
    found = next((r for r in fleet.replicas if r.service == window.config.service), None)
    if found is None:
        raise StepFailed("drain", f"the service {window.config.service.url} is none of [fleet]'s replicas")
    return found


# --- drain ------------------------------------------------------------------------------------------


async def check_drain(window: Window) -> Skip | None:
    if window.config.fleet is None:
        return Skip("one server: no router to leave")
    svc = window.state.service
    if svc.drained is None:
        return Found("the replica is back in the router") if svc.rejoins else None
    if svc.drains and svc.rejoins >= svc.drains:  # its add was sent: the drain is over, the rejoin settles it
        return Found("drained; its rejoin was sent")
    replica = replica_of(window)
    try:
        listed = await router_of(window).worker(replica.worker_url)
    except FLEET_ERRORS as exc:
        raise StepFailed("drain", str(exc)) from None
    if listed is not None:
        return None  # recorded, and the removal never landed: drained again (not a second drain)
    idle = await _idle_within(window, replica, 0.0)
    if idle:
        fleet_guard.watch(window, replica)  # a resumed window: the others watched again while it is out
    return Found(f"{replica.name} out of the router since "
                 f"{time.strftime('%H:%M:%S', time.localtime(svc.drained['since']))}") if idle else None


async def _idle_within(window: Window, replica: ReplicaConfig, bound_s: float) -> bool:
    try:
        await wait_idle(replica_client(window, replica), bound_s)
        return True
    except RouterError:
        return False


async def run_drain(window: Window) -> str:
    fleet = window.config.fleet
    replica = replica_of(window)
    router = router_of(window)
    svc = window.state.service
    try:
        listed = await router.worker(replica.worker_url)
        if svc.drained is None or listed is not None:
            if listed is None:
                raise StepFailed("drain", f"the router does not list {replica.name} ({replica.worker_url}): it "
                                          f"is not drained by this run")
            if svc.drained is None:
                impact = (f"the router stops sending requests to {replica.name}; the other replicas carry them; its "
                          f"requests in flight finish (the router's settle, then bound {fleet.drain_timeout_s:g} s)")
                if not await window.ask(Confirmation("drain", f"take replica {replica.name} out of the router",
                                                      fleet.router_host or "console",
                                                      ("DELETE", f"{fleet.router}/workers/{listed.id}"), impact, False)):
                    raise Refused("drain", f"take replica {replica.name} out of the router")
            await fleet_guard.recheck(window, replica)  # the preflight's rules again, the fleet as it is now
            if svc.drained is None:
                window.crash_point("before-drain-recorded")
                svc.drained = {"replica": replica.name, "router": fleet.router, "since": time.time(),
                               "spec": listed.spec}
                window.state.facts["fleet_replica"] = replica.name
                svc.drains += 1
                window.run.save()  # before the removal: a crash during it knows the replica may be out
                window.crash_point("drain-recorded")
            await router.remove_worker(replica.worker_url)  # smg: not again while it drains (it would cut the settle)
            await router.wait_gone(replica.worker_url, LISTED_S + (listed.settle_s or SMG_DEFAULT_SETTLE_S))
        fleet_guard.watch(window, replica)  # out: the others carry every request until the rejoin begins
        gateway = await router.gateway()
        settled = await router.settle()
        window.journal("drain", f"{replica.name} ({replica.worker_url}) is out of the router {fleet.router} ({gateway}"
                                f"{': after its settle' if gateway.settles else f', then {settled:g} s of ours'})")
        window.crash_point("draining")
        waited = await fleet_guard.unless_ended(window, "drain",
                                                wait_idle(replica_client(window, replica), fleet.drain_timeout_s))
    except FLEET_ERRORS as exc:
        raise StepFailed("drain", f"{exc}; the replica is put back in the router") from None
    return f"{replica.name} out of the router and idle after {waited:.1f} s"


async def verify_drain(window: Window) -> None:
    replica = replica_of(window)
    if await router_of(window).worker(replica.worker_url) is not None:
        raise StepFailed("drain", f"the router lists {replica.name} again after its removal")


# --- rejoin -----------------------------------------------------------------------------------------


async def check_rejoin(window: Window) -> Skip | None:
    if window.config.fleet is None:
        return Skip("one server: no router to rejoin")
    svc = window.state.service
    fleet_guard.stop_watch(window)  # its window is over: the others are no longer watched
    if svc.drained is None:
        return Found("the replica is back in the router") if svc.rejoins else Skip("the replica was not drained")
    replica = replica_of(window)
    try:
        listed = await router_of(window).worker(replica.worker_url)
    except FLEET_ERRORS as exc:
        raise StepFailed("rejoin", str(exc)) from None
    if listed is not None and listed.healthy:
        _rejoined(window, replica, "found listed healthy")
        return Found(f"{replica.name} listed healthy by the router")
    return None


async def run_rejoin(window: Window, reason: str = "its window is over") -> str:
    fleet = window.config.fleet
    replica = replica_of(window)
    router = router_of(window)
    svc = window.state.service
    try:
        status = (await replica_client(window, replica).get("/health_generate")).status
        if status != 200:
            raise StepFailed("rejoin", f"{replica.name}'s GET /health_generate answers {status}: it is not put back "
                                       f"in the router until it generates")
        if svc.rejoins >= svc.drains:  # an add was sent and its listing never seen: wait for that one first
            try:
                return _rejoined(window, replica, "the add sent earlier had landed",
                                 await router.wait_listed(replica.worker_url, LISTED_S))
            except RouterError:
                window.journal("rejoin", "the add sent earlier never landed: sent again", level="warning")
        spec = (svc.drained or {}).get("spec") or {}
        body = json.dumps({"url": replica.worker_url, **spec}) if (await router.gateway()).kind == SMG else \
            json.dumps({"url": replica.worker_url})
        if not await window.ask(Confirmation("rejoin", f"put replica {replica.name} back in the router",
                                              fleet.router_host or "console",
                                              ("POST", f"{fleet.router}/workers", body),
                                              f"{reason}: the router sends {replica.name} requests again", False)):
            raise Refused("rejoin", f"put replica {replica.name} back in the router")
        window.crash_point("before-add")
        svc.rejoins += 1
        window.run.save()
        await router.add_worker(replica.worker_url, spec)
        window.crash_point("added")
        worker = await router.wait_listed(replica.worker_url, LISTED_S)
    except FLEET_ERRORS as exc:
        raise StepFailed("rejoin", str(exc)) from None
    return _rejoined(window, replica, "added", worker)


def _rejoined(window: Window, replica: ReplicaConfig, how: str, worker: Worker | None = None) -> str:
    svc = window.state.service
    since = (svc.drained or {}).get("since") or time.time()
    svc.drained = None
    svc.rejoined_at = time.time()
    window.run.save()
    line = f"{replica.name} back in the router ({how}) after {svc.rejoined_at - since:.1f} s out"
    window.journal("rejoin", line)
    return line


async def verify_rejoin(window: Window) -> None:
    """Requests through the router reach the replica again (its own num_requests_total rises), when
    the policy spreads short prompts (round_robin, random, power_of_two); said when it cannot be seen."""
    replica = replica_of(window)
    client = replica_client(window, replica)
    before = await client.metrics()
    if before is None or "sglang:num_requests_total" not in before:
        window.journal("rejoin", f"{replica.name} serves no num_requests_total: that the router routes to it is "
                                 f"not verified", level="warning")
        return
    through = getattr(router_of(window), "inference", None) or SglangClient(window.config.fleet.router, timeout=60)
    for i in range(ROUTED_PROBES):
        answer = await through.post("/generate", {"text": f"{uuid.uuid4().hex} rejoin probe {i}",
                                                  "sampling_params": {"max_new_tokens": 1, "temperature": 0}})
        if answer.status != 200:
            raise StepFailed("rejoin", f"a request through the router {window.config.fleet.router} failed after the "
                                       f"rejoin: HTTP {answer.status}")
    after = await client.metrics() or {}
    if after.get("sglang:num_requests_total", 0) <= before["sglang:num_requests_total"]:
        window.journal("rejoin", f"none of {ROUTED_PROBES} requests through the router reached {replica.name} (a "
                                 f"policy such as cache_aware may keep short prompts elsewhere): routing to it is not "
                                 f"seen", level="warning")


async def rejoin_after(window: Window, reason: str) -> None:
    """The compensation's last part: a drained replica goes back in the router, once the route's own
    compensation (restart, or resume + continue) gave it back. Never while it is down or paused."""
    svc = window.state.service
    if window.config.fleet is None or svc.drained is None or svc.down or svc.held:
        return
    if await check_rejoin(window) is None:
        await run_rejoin(window, reason)


def plan_acts(window: Window) -> dict[str, tuple[bool, str]]:
    """What the plan says of drain and rejoin: left out on one server, else the replica and router."""
    fleet = window.config.fleet
    if fleet is None:
        why = "left out: one server (no [fleet] router)"
        return {"drain": (False, why), "rejoin": (False, why)}
    replica = replica_of(window)
    return {"drain": (True, f"take {replica.name} out of the router {fleet.router}; the other replicas carry the "
                            f"traffic (its requests finish within {fleet.drain_timeout_s:g} s)"),
            "rejoin": (True, f"put {replica.name} back in the router once /health_generate passes")}


def drained_line(run_id: str, service: Any) -> str:
    """"REPLICA r1 IS STILL OUT OF THE ROUTER: drained by run X since 09:31:02"."""
    drained = service.drained or {}
    since = time.strftime("%H:%M:%S", time.localtime(drained.get("since") or time.time()))
    return f"REPLICA {drained.get('replica', '?')} IS STILL OUT OF THE ROUTER: DRAINED by run {run_id} since {since}"


async def fleet_config(config: Config, state: Any | None = None, replica: str | None = None,
                       known: Any = (), via: Any = None) -> tuple[Config, str | None]:
    """`config` addressed to the replica whose window this is: the one a resumed run recorded, else
    the one chosen now (`choose_replica`: StepFailed naming the refusal, nothing changed), among
    `replica` alone when the operator named one (`run --replica`), else among those the newest
    preflight on this config found able to take the window (`known_fits` over `known`, the store's
    run states). One server: `config` itself."""
    if config.fleet is None:
        if replica is not None:
            raise StepFailed("preflight", f"--replica {replica}: this config has no [fleet] (one server)")
        return config, None
    if replica is not None and config.fleet.replica(replica) is None:
        raise StepFailed("preflight", f"--replica {replica}: [fleet] has no such replica (it lists "
                                      f"{', '.join(r.name for r in config.fleet.replicas)})")
    name = recorded_replica(state) if state is not None else None
    if name is not None and between_windows(state):  # its next window: the next replica, chosen now
        chosen, why = await next_replica(config, name, replica, known_fits(config, known), via)
        return on_replica(config, chosen), why
    if name is not None:
        replica = config.fleet.replica(name)
        if replica is None:
            raise StepFailed("preflight", f"the run's window is on replica {name!r}, which [fleet] no longer lists")
        return on_replica(config, replica), f"{name}: the replica this run's window is on"
    if replica is not None and name is not None and name != replica:
        raise StepFailed("preflight", f"--replica {replica}: the run's window is on replica {name}")
    eligible = {replica} if replica is not None else known_fits(config, known)
    chosen, why = await choose_replica(config, eligible, via)
    if replica is None and eligible is not None:
        why += f"; of those the last preflight found able to take the window ({', '.join(sorted(eligible)) or 'none'})"
    return on_replica(config, chosen), why


async def next_replica(config: Config, last: str, named: str | None, fits: set[str] | None,
                       via: Any = None) -> tuple[ReplicaConfig, str]:
    """The replica of a run's next window (its prompts did not fit one window's budget): the least
    loaded among those able to take it, not `last` (the one just used) when another can take it;
    `named` alone when the operator named one (`run --resume --replica NAME`). The same refusals as
    the first choice (StepFailed, nothing changed)."""
    assert config.fleet is not None
    if named is not None:
        chosen, why = await choose_replica(config, {named}, via)
        return chosen, f"{why}; the run's next window, as named"
    able = fits if fits is not None else {r.name for r in config.fleet.replicas}
    others = able - {last}
    if others:
        try:
            chosen, why = await choose_replica(config, others, via)
            return chosen, f"{why}; the run's next window (its last was on {last})"
        except StepFailed:
            if last not in able:
                raise
    chosen, why = await choose_replica(config, able, via)
    return chosen, f"{why}; the run's next window, on {last} again: no other replica can take it"


async def next_in_run(window: Window) -> tuple[ReplicaConfig, str]:
    """The replica of a run's next window chosen within the run (its window cut short at its budget,
    its replica back in the router): `next_replica`, as `run --resume` chooses it, from the fits this
    run's preflight (or the newest one) found. StepFailed with the refusal; nothing changed."""
    state = window.state
    last = recorded_replica(state) or replica_of(window).name
    known = [state, *(run.state for run in window.earlier_runs())]
    via = window.hosts if getattr(window.hosts, "router_client", None) is not None else None
    return await next_replica(window.config, last, None, known_fits(window.config, known), via)


def known_fits(config: Config, states: Any) -> set[str] | None:
    """The replicas the newest preflight on this config found able to take the window (its run's
    `fleet_fits`), or None when no run recorded them. Fits rarely change (hosts, GPUs, kernels); a
    stale one is caught again by the preflight before the drain."""
    from console.procedure.identity import config_path

    path = config_path(config)
    names = {r.name for r in config.fleet.replicas} if config.fleet is not None else set()
    for state in sorted(states, key=lambda s: s.created_at, reverse=True):
        fits = state.facts.get("fleet_fits")
        if isinstance(fits, dict) and state.config == path and set(fits) == names:
            return {name for name, verdict in fits.items() if isinstance(verdict, dict) and verdict.get("fits")}
    return None


def check_fits(window: Window, samples: dict[str, Any], tokens: int) -> None:
    """Preflight, before the drain: the run's replica can take the window (`fit.replica_fits`: it
    serves on the target's host, whose kernels are the drafters', and its GPUs hold the extraction),
    else the window is refused, naming why and the replicas that can (`run --replica NAME`); nothing
    has changed yet. Each replica's verdict is journalled and kept in the run's facts."""
    from console.procedure.fit import replica_fits

    if window.config.fleet is None or window.state.service.drains:  # drained already: the window is on it
        return
    fits = replica_fits(window.config, window.facts.probes, samples, tokens, len(window.facts.layers),
                        simulated=window.hosts.simulated)
    window.state.facts["fleet_fits"] = {f.name: {"fits": f.fits, "why": f.why} for f in fits}
    for f in fits:
        window.journal("preflight", f"fleet window on {f.name}: {'fits' if f.fits else 'no'}: {f.why}")
    mine = replica_of(window).name
    verdict = next(f for f in fits if f.name == mine)
    if verdict.fits:
        return
    others = [f for f in fits if f.fits and f.name != mine]
    can = ("; " + ", ".join(f.name for f in others) + " can: `dflash-ops run --replica NAME` runs the window there"
           if others else "; no replica can")
    raise StepFailed("preflight", f"the fleet window is refused: replica {mine} cannot take it: {verdict.why}{can}; "
                                  f"nothing was changed")
