"""The fleet window under load beside the one-server stop route: `bench/window.py --replicas N --load`.

The drill comes up with N rehearsal servers behind SGLang's real router (`drill up --replicas N`).
Users' chat requests (`/v1/chat/completions`, bench/loadgen.py `chat=True`) are sent throughout:
- the fleet window: through the router, while one replica is drained, stopped, extracted on,
  restarted and put back (the replica the run chooses, as `dflash-ops run` does);
- the one-server stop route: straight to one replica, as the users of a one-server deployment reach
  their server, while the same procedure stops and restarts it.
A warm-up stop route on the first replica, without load, goes first (the drill's first stop of a
server leaves VRAM held: not counted). Printed: each run's requests sent, failed (by kind), the
longest wait, the answers per second before, during and after the window, and the downtime; the
last line the headline: failed requests during the fleet window, its longest wait, the replica's
downtime, beside the stop route's failed requests.

`flap` (`--flap`, 3 replicas or more): while the window lasts, one replica other than the drained one
flaps (bench/fleet_flap.py: its process paused and continued by turns, each turn held until the
gateway's own health check lists it unhealthy, then healthy again), and the bench's operator says no
to the console's offer to end the window early, so the window runs to its end. Printed then: the
flap as the gateway listed it, what the console said of it, each phase's span and answers per second
through the gateway, one drain and one rejoin, every replica listed healthy after; the headline last.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.fleet_flap import Flapper, KeepWindow, fleet_said, listing, quicken
from bench.loadgen import Load
from console.config import Config, load_config
from console.drill.hosts import down, status, up
from console.drill.layout import DrillLayout
from console.operator import Operator
from console.procedure.decider import ApproveAll
from console.procedure.steps.fleet import fleet_config
from console.service.router import RouterClient
from console.session.fleet_reach import standalone
from remote.drill.service import running_pid


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def one_run(config: Config, runs: Path, url: str | None, rate: float,
                  flap: Callable[[Config], Flapper] | None = None) -> dict[str, Any]:
    """One stop-route run on `config` (its fleet window when it has [fleet]); users' chat requests
    to `url` throughout when given; `flap(config)`: a replica flapping while the window lasts (the
    operator then says no to ending the window early). The run's state, its load's report and answers,
    the window, the flap's figures and the offers refused."""
    why = None
    if config.fleet is not None:
        async with standalone(config) as via:  # the replica chosen as `dflash-ops run` chooses it
            config, why = await fleet_config(config, via=via)
    operator = Operator(config, runs_dir=runs)
    load = Load(url, rate=rate, max_new_tokens=4, chat=True, timeout_s=120) if url else None
    flapper = flap(config) if flap is not None else None
    decider = KeepWindow() if flapper is not None else ApproveAll()
    operator.start()
    if load is not None:
        load.start()
    if flapper is not None:
        flapper.start()
    try:
        finished = await operator.run(decider, route="window")
    finally:
        if flapper is not None:
            await asyncio.to_thread(flapper.stop)
        await operator.stop()
        report = await asyncio.to_thread(load.stop) if load is not None else None
    if finished.status != "done":
        raise SystemExit(f"bench: the run failed: {finished.message}")
    state = operator.store.open(finished.run_id).state
    first, last = ("drain", "rejoin") if config.fleet is not None else ("stop", "restart")
    window = (state.steps[first].started_at, state.steps[last].ended_at)
    return {"state": state, "why": why, "report": report, "answers": load.answers if load else [], "window": window,
            "flap": flapper.figures() if flapper is not None else None,
            "offers": len(decider.offers) if isinstance(decider, KeepWindow) else None,
            "said": fleet_said(operator.run_dir(finished.run_id))}


def split(answers: list[tuple[float, float, bool]], window: tuple[float, float]) -> dict[str, Any]:
    """Answers per second before, during and after the window (by when each was answered), and the
    failures and longest wait of the requests sent during it."""
    start, end = window
    first = min((a[0] for a in answers), default=start)
    last = max((a[1] for a in answers), default=end)

    def rate(lo: float, hi: float) -> float | None:
        done = sum(1 for _, answered, ok in answers if ok and lo <= answered < hi)
        return done / (hi - lo) if hi - lo > 1.0 else None

    inside = [a for a in answers if start <= a[0] <= end]
    spans = {"before": (first, start), "during": (start, end), "after": (end, last)}
    return {**{f"{k}_s": hi - lo for k, (lo, hi) in spans.items()},
            **{f"answered_{k}": sum(1 for _, t, ok in answers if ok and lo <= t < hi) for k, (lo, hi) in spans.items()},
            "before": rate(first, start), "during": rate(start, end), "after": rate(end, last),
            "sent_during": len(inside), "failed_during": sum(1 for a in inside if not a[2]),
            "longest_during_s": max((a[1] - a[0] for a in inside), default=0.0)}


def per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}/s"


def run_bench(replicas: int, rate: float, drill_dir: str | None, json_path: str | None, flap: bool = False,
              router: str | None = None, quick: bool = False) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        where = Path(drill_dir or Path(tmp) / "drill")
        config_path = up(where, fresh=True, replicas=replicas, say=say, **({"router": router} if router else {}))
        try:
            config = load_config(config_path)
            fleet = config.fleet
            assert fleet is not None
            one = dataclasses.replace(config, fleet=None, service=fleet.replicas[0].service)
            store = Path(tmp) / "runs"
            say(f"warm-up stop route on {fleet.replicas[0].name} (the drill's first stop leaves VRAM held: not counted)")
            asyncio.run(one_run(one, store, None, rate))
            drill = status(where)
            users = drill.router_url  # the router as users reach it (the config's: seen from ct129)
            assert users is not None
            asyncio.run(healthy(config, users))
            tuned: list[str] = []
            flapper = flapping(where, users, quick, tuned) if flap else None
            say(f"fleet window, chat requests through the router {users} at {rate:g}/s"
                + (", one other replica flapping" if flap else ""))
            fleet_run = asyncio.run(one_run(config, store, users, rate, flapper))
            fleet_run["back"] = back_in(config, users)  # every replica listed healthy again, and how soon
            say(f"one-server stop route on {fleet.replicas[0].name}, chat requests straight to it at {rate:g}/s")
            stop_run = asyncio.run(one_run(one, store, one.service.url, rate))
        finally:
            down(where, say=lambda _: None)
    gateway = drill.router or "sglang-router"
    rows = {"fleet window": fleet_run, "one-server stop route": stop_run}
    figures: dict[str, Any] = {}
    print(f"{'':<24}{'sent':>6}{'failed':>8}{'longest wait':>14}{'before':>10}{'during':>10}{'after':>10}"
          f"{'downtime':>10}")
    for name, run in rows.items():
        service, report = run["state"].service, run["report"]
        parts = split(run["answers"], run["window"])
        downtime = service.ready_at - service.stopped_at
        figures[name] = {**parts, "sent": report.sent, "failed": report.failed, "failures": report.failures,
                         "longest_wait_s": report.longest_wait_s, "downtime_s": downtime,
                         "window_s": run["window"][1] - run["window"][0], "drains": service.drains,
                         "rejoins": service.rejoins}
        print(f"{name:<24}{report.sent:>6}{report.failed:>8}{report.longest_wait_s:>13.2f}s{per_s(parts['before']):>10}"
              f"{per_s(parts['during']):>10}{per_s(parts['after']):>10}{downtime:>9.2f}s")
    fleet_fig, stop_fig = figures["fleet window"], figures["one-server stop route"]
    fleet_fig.update(flap=fleet_run["flap"], offers_refused=fleet_run["offers"], said=fleet_run["said"],
                     back=fleet_run["back"])
    replica = fleet_run["state"].facts.get("fleet_replica")
    print(f"fleet window: replica {replica} chosen ({fleet_run['why']}); out of the router "
          f"{fleet_fig['window_s']:.2f} s (drain to rejoin), of which down {fleet_fig['downtime_s']:.2f} s; "
          f"{fleet_fig['sent_during']} chat requests sent through the router in that time")
    print("fleet window, through the gateway: " + "; ".join(
        f"{k} {fleet_fig[f'{k}_s']:.1f} s, {fleet_fig[f'answered_{k}']} answered ({per_s(fleet_fig[k])})"
        for k in ("before", "during", "after")))
    flap_fig = fleet_fig["flap"]
    if flap_fig is not None:
        print(f"flap, the gateway's health check: {tuned[0] if tuned else 'as the drill runs it (defaults)'}")
        print(f"flap: {flap_fig['replica']} paused {flap_fig['pauses']} times (longest {flap_fig['longest_pause_s']:.1f} s), "
              f"listed unhealthy by {gateway} {flap_fig['listed_unhealthy']} times (after "
              f"{', '.join(f'{s:.1f}' for s in flap_fig['seen_unhealthy_after_s']) or '-'} s) and healthy again "
              f"{flap_fig['listed_healthy_again']} times; the console said THE FLEET IS AT RISK "
              f"{fleet_fig['said']['at_risk']} times, healthy again {fleet_fig['said']['healthy_again']} times, "
              f"offered to end the window early {fleet_fig['offers_refused']} times"
              + (" (each refused: the window went on)" if fleet_fig["offers_refused"] else
                 " (none: an offer is made only while ending early gains something, before the GPUs are given back)"))
    back = fleet_fig["back"]
    print(f"after the window: {fleet_fig['drains']} drain, {fleet_fig['rejoins']} rejoin; "
          + (f"every replica listed healthy by {gateway} {back['after_s']:.1f} s after the run"
             if back["all"] else f"NOT every replica back: {back['listed']}"))
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(stop_fig["failures"].items())) or "none"
    print(f"one-server stop route: {stop_fig['failed']} of {stop_fig['sent']} requests failed ({kinds}), "
          f"{stop_fig['failed_during']} of the {stop_fig['sent_during']} sent between its stop and its restart")
    if json_path:
        Path(json_path).write_text(json.dumps({"replicas": replicas, "rate": rate, "gateway": gateway, "flap": flap,
                                               "health_tuned": tuned,
                                               "runs": figures}, indent=2, default=str))
    fleet_kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(fleet_fig["failures"].items()))
    flapped = (f", {flap_fig['replica']} flapping ({flap_fig['listed_unhealthy']} times unhealthy, "
               f"{flap_fig['listed_healthy_again']} healthy again in the gateway"
               f"{', its health check tuned' if tuned and 'not applied' not in tuned else ''})") if flap_fig else ""
    print(f"fleet window ({replicas} replicas behind {gateway}, {rate:g} chat requests/s{flapped}): "
          f"{fleet_fig['failed']} of {fleet_fig['sent']} requests failed{f' ({fleet_kinds})' if fleet_kinds else ''} "
          f"({fleet_fig['failed_during']} of the {fleet_fig['sent_during']} sent during the window), longest wait "
          f"{fleet_fig['longest_wait_s']:.2f} s; answers/s through the gateway {per_s(fleet_fig['before'])} before, "
          f"{per_s(fleet_fig['during'])} during, {per_s(fleet_fig['after'])} after; replica {replica} out "
          f"{fleet_fig['window_s']:.2f} s, down {fleet_fig['downtime_s']:.2f} s; {fleet_fig['drains']} drain, "
          f"{fleet_fig['rejoins']} rejoin, {'every replica back in the gateway' if back['all'] else 'NOT every replica back'}"
          f"; one-server stop route: {stop_fig['failed']} of {stop_fig['sent']} requests failed, down "
          f"{stop_fig['downtime_s']:.2f} s")
    ok = fleet_fig["failed"] == 0 and back["all"] and (fleet_fig["drains"], fleet_fig["rejoins"]) == (1, 1)
    return 0 if ok else 1


def flapping(where: Path, users: str, quick: bool, tuned: list[str]) -> Callable[[Config], Flapper]:
    """The flap of the fleet run: the first replica other than the one chosen for the window, by its
    process on ct129 (the drill's hosts are this machine), watched through the users' gateway; `quick`:
    its health check tuned first (`quicken`, said in `tuned`)."""
    def make(config: Config) -> Flapper:
        fleet = config.fleet
        assert fleet is not None
        chosen = next(r for r in fleet.replicas if r.service == config.service)
        index, other = next((i, r) for i, r in enumerate(fleet.replicas) if r.name != chosen.name)
        pid = running_pid(DrillLayout.at(where).replica_state(index))
        if pid is None:
            raise SystemExit(f"bench: replica {other.name}'s process is not running: nothing to flap")
        if quick:
            applied, words = quicken(users, other.worker_url)
            tuned.append(f"{other.name}'s health check in the gateway: {words}")
            say(tuned[-1])
            if not applied:
                tuned.append("not applied")
        say(f"{other.name} (pid {pid}) flaps while {chosen.name} is out of the gateway")
        return Flapper(users, other.name, other.worker_url, pid, chosen.worker_url)
    return make


def back_in(config: Config, router_url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Whether the gateway lists every replica healthy (waited for up to `timeout_s`), how soon, and
    its listing."""
    assert config.fleet is not None
    urls = [r.worker_url.rstrip("/") for r in config.fleet.replicas]
    began = time.monotonic()
    now: dict[str, bool] = {}
    while time.monotonic() - began < timeout_s:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            now = listing(router_url)
        if all(now.get(url) for url in urls):
            return {"all": True, "after_s": time.monotonic() - began, "listed": now}
        time.sleep(0.2)
    return {"all": False, "after_s": time.monotonic() - began, "listed": now}


async def healthy(config: Config, router_url: str, timeout_s: float = 60.0) -> None:
    """Until the router lists every replica healthy again (the warm-up's stop made it mark one unhealthy).
    `router_url`: the router as users reach it (the config's is seen from its router_host)."""
    assert config.fleet is not None
    router = RouterClient(router_url)
    for replica in config.fleet.replicas:
        await router.wait_listed(replica.worker_url, timeout_s)
