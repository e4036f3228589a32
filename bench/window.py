"""The downtime window on the drill, broken down by phase, staged and cold side by side.

    python bench/window.py [--runs N] [--routes staged,cold,zero-downtime,pause] [--dir DIR] [--json FILE]
                           [--gpu [--crowded]] [--load [--load-rate R]]
    python bench/window.py --replicas N --load [--flap | --flap-quick] [--router smg|sglang-router] [--load-rate R]
                           [--dir DIR] [--json FILE]

Downtime is the stop being issued until the server is ready again. Its phases, each timed by the
part that does the work:
  stop         the stop command (issued -> returned)
  vram free    returned -> the first telemetry sample showing the GPUs free (after a warm-up run,
               so the drill's stuck-VRAM first stop is not counted)
  extract      the extractor's own clock: staged, go seen -> GPUs released (`window_s`); cold,
               process start -> released (`since_start_s`: imports, weights read, forward)
  start->ready the start command issued -> health 200 and a one-token generation
The zero-downtime route (extract on the training host's free GPU) is run once too: its downtime is
0 when the server was never stopped. So is the pause route (the drill's server runs with SGLang's
memory saver): its downtime is the pause until the continue, the server process never stopped, split
into pause + release, the extraction, resume + continue. The console's overhead is the downtime minus those: noticing the free GPUs and writing the go,
noticing `gpu_released` and issuing the start, state and journal writes. Runs alternate staged and
cold; medians are printed. `--routes` runs fewer of them (the staged stop route is always run: it is
the baseline); the pause run also prints its journal from the pause to the continue, so where its
downtime goes is seen. Last line: the headline.

`--gpu`: the drill on this machine's CUDA GPU (`dflash-ops drill --gpu`: a 1.7 B target served from
the GPU, a real CUDA worker left holding memory by the first stop, NVML telemetry, the fast
kernels). The extract phase is then split into the copy to the GPU and the forward, the GPU's used
memory over one staged window is printed from NVML's samples in the run's telemetry, and the
headline sets the downtime beside its limit: stop + copy + forward + the server's own start to ready.
`--crowded` (with `--gpu`): the card filled but for a little room once the server is up (`drill up
--gpu --crowded`), so the pause route must release the weights too (issue 40's case). The pause run
then prints what it released, the weights' checksum check and the served drafter's check (SGLang loses
the draft weights on a weights release, sglang PR #31674: the check must see it). `--yes` never takes
the restart that would reload the drafter, so the window measured is the pause route's alone.

`--load`: users' requests throughout each run (`bench/loadgen.py`: greedy /generate at `--load-rate`
per second on the drill's server, bounded in flight), so each route's harm is counted: the requests
that failed (by kind) and the longest any waited, per route, printed under the phases and on the last
line. On the stop route every request sent while the server is down fails.

`--replicas N` (N > 1): the fleet window instead (bench/fleet_window.py): the drill's N rehearsal
servers behind SGLang's router, one drained, its window, rejoined, under users' chat requests through
the router, beside the one-server stop route under the same load in the same run (the load is always
on). Last line: failed requests during the fleet window, the longest wait, the replica's downtime,
beside the stop route's failed requests. `--router`: the drill's gateway (smg by default).

`--flap` (with `--replicas 3` or more; off unless asked, so the steady fleet's figures stay comparable):
one replica other than the drained one flaps while the window lasts (its process paused and continued
by turns, each turn held until the gateway's own health check lists it unhealthy, then healthy again:
bench/fleet_flap.py), and the bench says no to the console's offer to end the window early. Printed:
requests sent and failed, the longest wait, the answers per second through the gateway before, during
and after the window with each phase's span, the flap as the gateway listed it, one drain and one
rejoin, every replica back in the gateway after; the headline last. With 2 replicas the flapping one
would be the only one serving: refused. The drill's gateway keeps its default health check (3 failed
checks of 5 s each: a paused replica is listed unhealthy ~16 s after its pause); `--flap-quick` tunes
the flapping replica's in smg (`PATCH /workers/{id}`: 1 s timeout, 1 failure, 1 success), as a team
tunes its gateway, so that it flaps several times within one window.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.loadgen import Load, LoadReport  # noqa: E402
from console.config import load_config  # noqa: E402
from console.drill.hosts import down, up  # noqa: E402
from console.operator import Operator  # noqa: E402
from console.procedure.decider import ApproveAll  # noqa: E402
from console.procedure.forecast import against, forecast_errors  # noqa: E402
from console.procedure.store import RunStore  # noqa: E402


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.2f} s"


def phases(state: dict[str, Any]) -> dict[str, float]:
    """The downtime and its phases (seconds) from a finished run's state."""
    service, facts = state["service"], state["extraction"]
    if not service.get("stopped_at"):  # the zero-downtime route: the server was never stopped
        return {k: 0.0 for k in ("downtime", "stop", "vram_free", "extract", "copy", "forward", "start_ready",
                                 "overhead", "limit", "released_to_start")}
    window = facts.get("window") or {}
    downtime = service["ready_at"] - service["stopped_at"]
    copy, forward = window.get("copy_s"), window.get("forward_s")
    stop = service["stop_returned_at"] - service["stopped_at"]
    vram = service["vram_free_at"] - service["stop_returned_at"]
    extract = window["window_s"] if window.get("staged") else window["since_start_s"]
    start_ready = service["ready_at"] - service["start_issued_at"]
    # The restart overlaps the extractor's flush; only what lies inside the downtime counts.
    overhead = downtime - stop - vram - extract - start_ready
    return {"downtime": downtime, "stop": stop, "vram_free": vram, "extract": extract,
            "copy": copy, "forward": forward, "start_ready": start_ready, "overhead": overhead,
            "limit": stop + (copy or 0.0) + (forward or 0.0) + start_ready,
            "go_to_released": facts["gpu_released_at"] - facts["go_sent_at"] if facts.get("go_sent_at") else None,
            "released_to_start": service["start_issued_at"] - facts["gpu_released_at"]}


def pause_phases(state: dict[str, Any]) -> dict[str, float]:
    """The pause route's downtime (pause sent -> continued) and its parts (seconds), from its state."""
    service, facts = state["service"], state["extraction"]
    window = facts.get("window") or {}
    extract = window["window_s"] if window.get("staged") else window["since_start_s"]
    return {"downtime": service["continued_at"] - service["paused_at"],
            "pause_release": service["released_at"] - service["paused_at"],
            "extract": extract,
            "resume_continue": service["continued_at"] - facts["gpu_released_at"]}


def pause_checks(state: dict[str, Any]) -> dict[str, Any]:
    """What the pause run released (and why), how the weights were checked, and the drafter check's
    figures (before and after the window), from its state."""
    facts, service = state["facts"], state["service"]
    plan, drafter = facts.get("plan_release") or {}, facts.get("drafter") or {}
    return {"released": ", ".join(plan.get("tags") or ()) or "?", "why": plan.get("why"),
            "weights check": service.get("weights_check"), "status": state.get("status"),
            "drafter before": drafter.get("before"), "drafter after": drafter.get("after"),
            "drafter": drafter.get("line")}


def pause_timeline(run_dir: Path) -> str:
    """Each journal entry from the pause to the continue, as seconds since the pause: where the pause
    route's downtime goes (the steps, the questions, the extractor's lines)."""
    state = json.loads((run_dir / "state.json").read_text())
    start, end = state["service"]["paused_at"], state["service"]["continued_at"]
    entries = []
    for line in (run_dir / "journal.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if start - 0.5 <= entry["t"] <= end + 0.1 and entry.get("kind") not in ("job-progress",):
            entries.append(f"{entry['t'] - start:+.2f} {entry.get('step') or '-'}: {entry['message'][:70]}")
    return "\n  " + "\n  ".join(entries)


def memory_over_window(run_dir: Path, host: str = "ct129", gpu: int = 0) -> list[tuple[float, int | None, bool]]:
    """(seconds since the stop, used MiB, service down) per telemetry sample of `host`'s GPU, from a
    few seconds before the stop to a few after the server is ready: NVML's view of the window."""
    state = json.loads((run_dir / "state.json").read_text())
    start, end = state["service"]["stopped_at"] - 3, state["service"]["ready_at"] + 3
    rows = []
    for line in (run_dir / "telemetry.jsonl").read_text().splitlines():
        record = json.loads(line)
        sample = record.get("sample")
        if record["host"] != host or not sample or not start <= record["t"] <= end:
            continue
        used = next((g["mem_used_mib"] for g in sample["gpus"] if g["index"] == gpu), None)
        rows.append((round(record["t"] - state["service"]["stopped_at"], 2), used, bool(record.get("service_down"))))
    return rows


async def one_run(config_path: Path, runs: Path, stage: bool, route: str = "window",
                  load_rate: float | None = None) -> dict[str, Any]:
    """One run of `route`, with a client load on the server throughout when `load_rate` is given (its
    LoadReport under "load"). A pause run may end degraded (the drafter check): it is measured too."""
    config = load_config(config_path)
    operator = Operator(config, runs_dir=runs)
    load = Load(config.service.url, rate=load_rate, api_key=config.service.api_key(), timeout_s=120) \
        if load_rate else None
    operator.start()
    if load is not None:
        load.start()
    try:
        finished = await operator.run(ApproveAll(), stage=None if stage else False, route=route)
    finally:
        await operator.stop()
        report = await asyncio.to_thread(load.stop) if load is not None else None
    if finished.status not in (("done", "degraded") if route == "pause" else ("done",)):
        raise SystemExit(f"bench: the run failed: {finished.message}")
    return {**operator.store.open(finished.run_id).state.to_json(), "run_dir": str(operator.run_dir(finished.run_id)),
            "load": report}


def load_line(kind: str, reports: list[LoadReport]) -> str:
    """One route's harm to users over its runs: requests failed (by kind) and the longest wait."""
    failures: dict[str, int] = {}
    for report in reports:
        for name, n in report.failures.items():
            failures[name] = failures.get(name, 0) + n
    kinds = ", ".join(f"{n} {name}" for name, n in sorted(failures.items()))
    return (f"{kind}: {sum(r.failed for r in reports)} of {sum(r.sent for r in reports)} requests failed"
            f"{f' ({kinds})' if kinds else ''}, longest wait {max(r.longest_wait_s for r in reports):.2f} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2, help="runs of each kind (default 2)")
    parser.add_argument("--dir", default=None, help="the drill directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    parser.add_argument("--gpu", action="store_true", help="the drill on this machine's CUDA GPU (REAL GPU)")
    parser.add_argument("--crowded", action="store_true",
                        help="with --gpu: no room for the extraction beside the weights (the pause route releases them)")
    parser.add_argument("--load", action="store_true", help="users' requests throughout each run (bench/loadgen.py)")
    parser.add_argument("--load-rate", type=float, default=2.0, help="--load's requests per second (default 2)")
    parser.add_argument("--routes", default="staged,cold,zero-downtime,pause",
                        help="which routes to run (comma-separated; default all four). The stop route's "
                             "staged run stays the baseline the pause route is compared with")
    parser.add_argument("--replicas", type=int, default=1,
                        help="N > 1: the fleet window behind SGLang's router under load, beside the stop route")
    parser.add_argument("--flap", action="store_true",
                        help="with --replicas 3 or more: another replica flaps while the window lasts")
    parser.add_argument("--flap-quick", action="store_true",
                        help="--flap, the flapping replica's health check tuned in smg (1 s timeout, 1 failure, "
                             "1 success) so that the gateway sees each turn within seconds")
    parser.add_argument("--router", choices=("smg", "sglang-router"), default=None,
                        help="with --replicas: the drill's gateway (default smg)")
    args = parser.parse_args()
    args.flap = args.flap or args.flap_quick
    if args.flap and args.replicas < 3:
        parser.error(f"--flap needs --replicas 3 or more (got {args.replicas}): with 2, the flapping replica "
                     f"would be the only one serving while the other is out")
    if args.replicas > 1:
        from bench.fleet_window import run_bench

        return run_bench(args.replicas, args.load_rate, args.dir, args.json, flap=args.flap, router=args.router,
                         quick=args.flap_quick)
    rate = args.load_rate if args.load else None
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    unknown = sorted(set(routes) - {"staged", "cold", "zero-downtime", "pause"})
    if unknown or "staged" not in routes:
        parser.error(f"--routes {args.routes!r}: " + (f"unknown {', '.join(unknown)}" if unknown else
                     "the staged stop route is the baseline every other route is compared with"))
    with tempfile.TemporaryDirectory(prefix="bench-window-") as tmp:
        drill_dir = Path(args.dir or Path(tmp) / "drill")
        config = up(drill_dir, fresh=True, gpu=args.gpu, crowded=args.crowded,
                    say=lambda line: print(line, file=sys.stderr))
        pause: dict[str, float] | None = None
        checks: dict[str, Any] = {}
        try:
            store = Path(tmp) / "runs"
            print("warm-up run (the drill's first stop leaves VRAM held: not counted)", file=sys.stderr)
            asyncio.run(one_run(config, store, stage=True))
            stop_kinds = [k for k in ("staged", "cold") if k in routes]
            rows: dict[str, list[dict[str, float]]] = {k: [] for k in stop_kinds}
            loads: dict[str, list[LoadReport]] = {}
            memory: list[tuple[float, int | None, bool]] = []
            for i in range(args.runs):
                for kind in stop_kinds if i % 2 == 0 else stop_kinds[::-1]:
                    state = asyncio.run(one_run(config, store, stage=kind == "staged", load_rate=rate))
                    rows[kind].append(phases(state))
                    if state["load"] is not None:
                        loads.setdefault(kind, []).append(state["load"])
                    if kind == "staged" and not memory:
                        memory = memory_over_window(Path(state["run_dir"]))
                    print(f"{kind} run {len(rows[kind])}: " + ", ".join(
                        f"{k} {v:.2f} s" for k, v in rows[kind][-1].items() if v is not None), file=sys.stderr)
            if "zero-downtime" in routes:
                state = asyncio.run(one_run(config, store, stage=False, route="zero-downtime", load_rate=rate))
                rows["zero-downtime"] = [phases(state)]
                if state["load"] is not None:
                    loads["zero-downtime"] = [state["load"]]
                print(f"zero-downtime run: extracted on {state['facts']['extract_on']['host']}; the server was "
                      f"{'STOPPED' if state['service'].get('stopped_at') else 'never stopped'}", file=sys.stderr)
            if "pause" in routes:
                # The drill's server runs with the memory saver (drill up's default): the pause route, once.
                state = asyncio.run(one_run(config, store, stage=True, route="pause", load_rate=rate))
                pause = pause_phases(state)
                if state["load"] is not None:
                    loads["pause"] = [state["load"]]
                print("pause run: " + ", ".join(f"{k} {v:.2f} s" for k, v in pause.items()), file=sys.stderr)
                print("pause run, from the pause (s): " + pause_timeline(Path(state["run_dir"])), file=sys.stderr)
                checks = pause_checks(state)
                print("pause run, what it released and what it checked: " + "; ".join(
                    f"{k}: {v}" for k, v in checks.items()), file=sys.stderr)
            # The downtime forecast (issues 21, 43): the one each run made before its stop (from the runs
            # before it, with this drill's config), against what it measured, the answers left out of both.
            windows = [run.state for run in RunStore(store).readable() if run.state.route == "window"]
            forecasts = forecast_errors(windows)
            # Each phase too, with what it was based on: a miss names its phase (the states go with the drill).
            by_phase = {state.run_id: against(state) for state in windows}
        finally:
            down(drill_dir, say=lambda _: None)
    keys = ("downtime", "stop", "vram_free", "extract", "copy", "forward", "start_ready", "overhead", "limit",
            "released_to_start")
    keys = tuple(k for k in keys if all(r.get(k) is not None for runs in rows.values() for r in runs))
    medians = {kind: {k: statistics.median(r[k] for r in runs) for k in keys} for kind, runs in rows.items() if runs}
    nan = {k: float("nan") for k in keys}  # a route not run (--routes) prints as nan
    cold_m, zero_m = medians.get("cold", nan), medians.get("zero-downtime", nan)
    print(f"{'phase':<20}{'staged':>10}{'cold':>10}{'cold/staged':>14}{'zero-downtime':>16}")
    for key in keys:
        staged, cold = medians["staged"][key], cold_m[key]
        ratio = f"{cold / staged:.2f}x" if staged > 0.005 else "-"
        print(f"{key:<20}{staged:>9.2f}s{cold:>9.2f}s{ratio:>14}{zero_m[key]:>15.2f}s")
    if memory:
        print(f"GPU0 used over a staged window ({'NVML' if args.gpu else 'simulated'}, through the agent; MiB, t from "
              f"the stop, * = service down): "
              + ", ".join(f"{t:+.1f}s {u}{'*' if d else ''}" for t, u, d in memory))
    # A release of the KV cache is near instant, so the pause route's target is the extraction + 1 s; a
    # weights release copies them to CPU memory and back, so there the target is the stop route's downtime.
    target = (f"at most the staged stop route's {medians['staged']['downtime']:.2f} s" if args.crowded else
              f"at most the extraction + 1 s = {pause['extract'] + 1:.2f} s, at least 10x") if pause else ""
    if pause is not None:
        print(f"pause route (the server never stopped): downtime {pause['downtime']:.2f} s = pause + release "
              f"{pause['pause_release']:.2f} s, extract {pause['extract']:.2f} s, resume + continue "
              f"{pause['resume_continue']:.2f} s (target: {target})")
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": args.gpu, "crowded": args.crowded, "pause_checks": checks,
                                               "runs": rows, "medians": medians, "pause": pause,
                                               "memory_over_staged_window": memory,
                                               "forecast_by_phase": {run_id: [dataclasses.asdict(r) for r in by_phase[run_id]]
                                                                     for run_id, _ in forecasts},
                                               "load": {k: [dataclasses.asdict(r) for r in v] for k, v in loads.items()}},
                                              indent=2))
    for kind, reports in loads.items():
        print(f"users' requests during the window, {load_line(kind, reports)}")
    print("downtime forecast vs measured, each window-route run's own forecast before its stop (target: within 20 % "
          "from the second window on; the first has no earlier run): "
          + ", ".join(f"window {n} {row.forecast_s:.2f} s vs {row.measured_s:.2f} s ("
                      + (f"{row.error:+.0%})" if row.error is not None else "a phase unknown)")
                      for n, (_, row) in enumerate(forecasts, 1)))
    for n, (run_id, _) in enumerate(forecasts, 1):
        print(f"  window {n} by phase (forecast vs measured, what the forecast was based on): " + "; ".join(
            f"{r.phase} {_s(r.forecast_s)} vs {_s(r.measured_s)} ({r.basis})" for r in by_phase[run_id]
            if r.phase != "downtime"))
    worst = max(m["overhead"] for kind, m in medians.items() if kind != "zero-downtime")
    limit = f" (limit {medians['staged']['limit']:.2f} s: stop + copy + forward + server start)" \
        if "limit" in medians["staged"] and args.gpu else ""
    others = [f"{m['downtime']:.2f} s {kind}" for kind, m in (("cold", medians.get("cold")),
                                                             ("zero-downtime", medians.get("zero-downtime"))) if m]
    print(f"{'GPU ' if args.gpu else ''}window downtime {medians['staged']['downtime']:.2f} s staged{limit}"
          + (f" vs {', '.join(others)}" if others else "")
          + (f", pause route {pause['downtime']:.2f} s ({medians['staged']['downtime'] / pause['downtime']:.1f}x "
             f"shorter than the staged stop route; target: {target})" if pause else "")
          + (f", releasing {checks['released']} (weights checked by {checks['weights check']}; served drafter's "
             f"acceptance {checks['drafter before']} before, {checks['drafter after']} after: the run "
             f"{checks['status']})" if args.crowded and checks else "") + "; "
          f"overhead {medians['staged']['overhead']:.2f} s staged"
          + (f", {medians['cold']['overhead']:.2f} s cold" if "cold" in medians else "") + " (target < 1 s)"
          + ("; failed requests " + ", ".join(f"{kind} {sum(r.failed for r in reports)}" for kind, reports in loads.items())
             if loads else ""))
    return 0 if worst < 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
