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
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.loadgen import Load
from console.config import Config, load_config
from console.drill.hosts import down, status, up
from console.operator import Operator
from console.procedure.decider import ApproveAll
from console.procedure.steps.fleet import fleet_config
from console.service.router import RouterClient
from console.session.fleet_reach import standalone


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def one_run(config: Config, runs: Path, url: str | None, rate: float) -> dict[str, Any]:
    """One stop-route run on `config` (its fleet window when it has [fleet]); users' chat requests
    to `url` throughout when given. The run's state, its load's report and answers, and the window."""
    why = None
    if config.fleet is not None:
        async with standalone(config) as via:  # the replica chosen as `dflash-ops run` chooses it
            config, why = await fleet_config(config, via=via)
    operator = Operator(config, runs_dir=runs)
    load = Load(url, rate=rate, max_new_tokens=4, chat=True, timeout_s=120) if url else None
    operator.start()
    if load is not None:
        load.start()
    try:
        finished = await operator.run(ApproveAll(), route="window")
    finally:
        await operator.stop()
        report = await asyncio.to_thread(load.stop) if load is not None else None
    if finished.status != "done":
        raise SystemExit(f"bench: the run failed: {finished.message}")
    state = operator.store.open(finished.run_id).state
    first, last = ("drain", "rejoin") if config.fleet is not None else ("stop", "restart")
    window = (state.steps[first].started_at, state.steps[last].ended_at)
    return {"state": state, "why": why, "report": report, "answers": load.answers if load else [], "window": window}


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
    return {"before": rate(first, start), "during": rate(start, end), "after": rate(end, last),
            "sent_during": len(inside), "failed_during": sum(1 for a in inside if not a[2]),
            "longest_during_s": max((a[1] - a[0] for a in inside), default=0.0)}


def per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}/s"


def run_bench(replicas: int, rate: float, drill_dir: str | None, json_path: str | None) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        where = Path(drill_dir or Path(tmp) / "drill")
        config_path = up(where, fresh=True, replicas=replicas, say=say)
        try:
            config = load_config(config_path)
            fleet = config.fleet
            assert fleet is not None
            one = dataclasses.replace(config, fleet=None, service=fleet.replicas[0].service)
            store = Path(tmp) / "runs"
            say(f"warm-up stop route on {fleet.replicas[0].name} (the drill's first stop leaves VRAM held: not counted)")
            asyncio.run(one_run(one, store, None, rate))
            users = status(where).router_url  # the router as users reach it (the config's: seen from ct129)
            assert users is not None
            asyncio.run(healthy(config, users))
            say(f"fleet window, chat requests through the router {users} at {rate:g}/s")
            fleet_run = asyncio.run(one_run(config, store, users, rate))
            say(f"one-server stop route on {fleet.replicas[0].name}, chat requests straight to it at {rate:g}/s")
            stop_run = asyncio.run(one_run(one, store, one.service.url, rate))
        finally:
            down(where, say=lambda _: None)
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
                         "window_s": run["window"][1] - run["window"][0]}
        print(f"{name:<24}{report.sent:>6}{report.failed:>8}{report.longest_wait_s:>13.2f}s{per_s(parts['before']):>10}"
              f"{per_s(parts['during']):>10}{per_s(parts['after']):>10}{downtime:>9.2f}s")
    fleet_fig, stop_fig = figures["fleet window"], figures["one-server stop route"]
    replica = fleet_run["state"].facts.get("fleet_replica")
    print(f"fleet window: replica {replica} chosen ({fleet_run['why']}); out of the router "
          f"{fleet_fig['window_s']:.2f} s (drain to rejoin), of which down {fleet_fig['downtime_s']:.2f} s; "
          f"{fleet_fig['sent_during']} chat requests sent through the router in that time")
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(stop_fig["failures"].items())) or "none"
    print(f"one-server stop route: {stop_fig['failed']} of {stop_fig['sent']} requests failed ({kinds}), "
          f"{stop_fig['failed_during']} of the {stop_fig['sent_during']} sent between its stop and its restart")
    if json_path:
        Path(json_path).write_text(json.dumps({"replicas": replicas, "rate": rate, "runs": figures}, indent=2))
    print(f"fleet window ({replicas} replicas behind SGLang's router, {rate:g} chat requests/s): "
          f"{fleet_fig['failed_during']} failed requests during the fleet window ({fleet_fig['failed']} in the whole "
          f"run), longest wait {fleet_fig['longest_during_s']:.2f} s, replica {replica} down "
          f"{fleet_fig['downtime_s']:.2f} s; one-server stop route: {stop_fig['failed']} of {stop_fig['sent']} "
          f"requests failed, down {stop_fig['downtime_s']:.2f} s")
    return 0 if fleet_fig["failed"] == 0 else 1


async def healthy(config: Config, router_url: str, timeout_s: float = 60.0) -> None:
    """Until the router lists every replica healthy again (the warm-up's stop made it mark one unhealthy).
    `router_url`: the router as users reach it (the config's is seen from its router_host)."""
    assert config.fleet is not None
    router = RouterClient(router_url)
    for replica in config.fleet.replicas:
        await router.wait_listed(replica.worker_url, timeout_s)
