"""The fleet on the drill (issue 41): `drill up --replicas 2` behind SGLang's real gateways, smg 1.13.0
(the default) and sglang-router 0.3.2, and whole fleet runs of the console through them under users'
chat requests, with the gateway restarted and a replica flapping mid-window. Its own rehearsal hosts
(a fleet), apart from tests/test_drill_hosts.py's one-server drill, so that the two files run side by
side in CI's test processes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from bench.loadgen import Load
from console.config import Config, load_config
from console.drill import procs
from console.drill.config import ROUTER_NAME
from console.drill.fleet import FleetError, launch_router
from console.drill.hosts import down, status
from console.drill.layout import DrillLayout
from console.procedure.store import RunStore
from console.service.router import RouterClient
from console.service.sglang_api import ServerUnreachable
from remote.drill import service as drill_service
from remote.drill import simgpu
from remote.procstat import pid_alive, start_time
from tests.drill_helpers import ENTRY_POINT, ROOT, drill_up, http_status, wait_for
from tests.router_helpers import QUICK_HEALTH, ROUTER_START_S, need_router
from tests.router_helpers import listing as router_listing
from tests.standin_helpers import stop


@pytest.mark.timeout(600)  # the fleet run's two windows, on a loaded CI machine
def test_replicas_bring_up_the_real_router_in_front_of_rehearsal_servers(drill_cache: Path, tmp_path: Path):
    need_router()
    from console.drill.fleet import DRAIN_SETTLE_S
    from console.service.router import SGLANG_ROUTER, SMG, Gateway

    layout = DrillLayout.at(tmp_path / "fleet")
    done = drill_up(layout.dir, "--replicas", "2", "--simulated")
    assert done.returncode == 0, done.stderr
    started: list[subprocess.Popen] = []  # a router this test started again (the fault below)
    try:
        config = load_config(done.stdout.strip().splitlines()[-1])
        fleet = config.fleet
        assert fleet is not None and [r.name for r in fleet.replicas] == ["r1", "r2"]
        assert config.service == fleet.replicas[0].service  # the drill's own service is the first replica
        # The router as the config documents it: seen from ct129, by a name only ct129 resolves; the
        # console reaches it through ct129's connection alone (issue 41). Users reach it at 127.0.0.1.
        found = status(layout.dir)
        router = found.router_url
        assert router is not None and router.startswith("http://127.0.0.1:")
        assert fleet.router_host == "ct129" and fleet.router == router.replace("127.0.0.1", ROUTER_NAME)
        with pytest.raises(ServerUnreachable):
            asyncio.run(RouterClient(fleet.router, timeout=5).health())
        workers = asyncio.run(RouterClient(router).workers())
        assert sorted(w.url for w in workers) == sorted(r.worker_url for r in fleet.replicas)
        assert all(w.healthy for w in workers)
        assert asyncio.run(RouterClient(router).gateway()) == Gateway(SMG, "1.13.0")  # smg, the default
        # The replicas share ct129's simulated GPUs, each its own pair held by its own GPU worker, and
        # each replica's window watches only its pair.
        assert [list(r.service.gpus) for r in fleet.replicas] == [[0, 1], [2, 3]]
        processes = simgpu.read(DrillLayout.at(layout.dir).simulated_gpus("ct129"))["processes"]
        held = {pid: sorted(p["gpu"] for p in processes if p["pid"] == pid and p["mib"] > 0)
                for pid in {p["pid"] for p in processes}}
        assert sorted(held.values()) == [[0, 1], [2, 3]], processes
        body = json.dumps({"model": workers[0].model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                           "temperature": 0})  # smg routes a chat by its model
        request = urllib.request.Request(router + "/v1/chat/completions", body.encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            assert json.loads(answer.read())["usage"]["completion_tokens"] == 2
        assert any(f"router (smg) {router}" in line for line in found.lines())
        # `drill --replicas 2` finds the fleet up and runs the whole fleet run on it while users' chat
        # requests go through the router the whole time: none fails. Its first window is cut short at
        # its budget as the operator's stop at the budget cuts it (the stop file the budget's offer
        # writes, here once the first stop is done), so the same run takes the next replica for the
        # missing prompts: drain, the window, rejoin on each, then one evaluation of the whole set.
        runs = tmp_path / "runs"
        with _chat_load(router) as load, _drilling(layout, runs, tmp_path / "drill") as drilled:
            run_id = _cut_first_window(runs, config, drilled.console)
        said = drilled.said
        assert drilled.console.returncode == 0, drilled.tail()
        after = _assert_served(load.report, router, fleet)
        store = RunStore(runs)
        assert store.run_ids() == [run_id]
        run = store.open(run_id).state
        assert run.status == "done" and run.service.drained is None and len(run.windows) == 1
        first, second = run.windows[0]["replica"], run.facts["fleet_replica"]
        assert {first, second} == {"r1", "r2"}  # two windows, on two replicas
        for window in _windows(run):  # the stop route, each its own
            assert (window["drains"], window["rejoins"], window["stops"], window["starts"]) == (1, 1, 1, 1)
        assert [run.windows[0]["steps"][step]["status"] for step in ("drain", "stop", "extract", "restart", "rejoin")] \
            == ["done"] * 5
        assert [run.status_of(step) for step in ("drain", "stop", "extract", "restart", "rejoin", "evaluate")] == \
            ["done"] * 6
        assert said.count("[drain] done") == 2 and said.count("[rejoin] done") == 2
        assert f"fleet: the window runs on replica {first}" in said
        journal = store.open(run_id).read_journal()
        assert any(f"the run goes on with the next replica: {second}" in e["message"] for e in journal)
        # Each window's stop left its own replica's GPU worker holding (the drill's stuck episode), and
        # each window ended that one only: the other replica's GPUs were never watched or touched.
        worker_of = {"r1": next(pid for pid, gpus in held.items() if gpus == [0, 1]),
                     "r2": next(pid for pid, gpus in held.items() if gpus == [2, 3])}
        ended = [int(m.group(1)) for e in journal
                 if e.get("step") == "free-vram" and (m := re.match(r"pid (\d+): terminated", e["message"]))]
        assert ended == [worker_of[first], worker_of[second]], ended
        extracted = _assert_extracted_once(config, run_id, run)
        # The first window was cut (here before its first prompt: the stop file lands before the go);
        # the fake world's sweep (tests/test_fleet_sweep.py) cuts one half-way.
        assert len(run.windows[0]["extraction"]["partial"]["done"]) < len(extracted)
        evaluations = [e for e in journal if e.get("step") == "evaluate" and e["message"].startswith("evaluate: done")]
        assert len(evaluations) == 1  # the whole set, evaluated once
        assert (Path(store.root) / run_id / "report.md").is_file()
        assert all(w.settle_s == DRAIN_SETTLE_S for w in after)  # each rejoin gave smg the worker's settings back
        assert any("(smg 1.13.0: after its settle)" in e["message"] for e in journal if e.get("step") == "drain")
        # The console read the router and both replicas through ct129's SSH connection (its log says
        # each forward it was asked for), the router by the name only ct129 resolves.
        forwards = set(re.findall(r"ct129: forwarding to (\S+)", layout.log.read_text()))
        assert {urlsplit(fleet.router).netloc, *(urlsplit(r.service.url).netloc for r in fleet.replicas)} <= forwards
        smg_pid = json.loads(layout.state_file.read_text())["router_pid"]
        # `--router sglang-router` keeps the old router. A drill up with another router is never replaced
        # silently (issue 41): refused, naming both, the fleet left running; with --fresh it ends this one
        # (by its recorded pid: smg retitles itself too), says so, and brings the fleet up behind the old one.
        done = drill_up(layout.dir, "--replicas", "2", "--simulated", "--router", "sglang-router")
        assert done.returncode == 1 and "(2 replicas behind smg, SIMULATED GPUs), not the one asked for (2 " \
            "replicas behind sglang-router, SIMULATED GPUs)" in done.stderr, done.stderr
        assert pid_alive(smg_pid)
        done = drill_up(layout.dir, "--replicas", "2", "--simulated", "--router", "sglang-router", "--fresh")
        assert done.returncode == 0, done.stderr
        assert "ending the drill up at" in done.stderr and "(2 replicas behind smg, SIMULATED GPUs)" in done.stderr
        assert not pid_alive(smg_pid)
        fleet = load_config(done.stdout.strip().splitlines()[-1]).fleet
        assert fleet is not None
        old = RouterClient(status(layout.dir).router_url)
        assert asyncio.run(old.gateway()) == Gateway(SGLANG_ROUTER)
        assert sorted(w.url for w in asyncio.run(old.workers())) == sorted(r.worker_url for r in fleet.replicas)
        assert any(f"router (sglang-router) {old.base_url}" in line for line in status(layout.dir).lines())
        # Behind it, the whole console through a gateway restart and a flap mid-window, then a window
        # under chat load (the gateway started again is recorded as the drill's: `down` ends it below).
        _faults_then_a_window_under_load(layout, tmp_path, started)
        state = json.loads(layout.state_file.read_text())
        router_pid = state["router_pid"]
        # A crashed drill: its hosts' process killed, its own shutdown never run. The router (which the
        # drill's mark cannot find: setproctitle) is still ended by `down`, by its recorded pid.
        os.kill(state["pid"], signal.SIGKILL)
        assert pid_alive(router_pid)
    finally:
        down(layout.dir, say=lambda msg: None)
        for proc in started:
            stop(proc)
    assert not pid_alive(router_pid) and not procs.marked_pids(layout.dir)


def _chat_load(router: str) -> Load:
    """Users' chat requests through the router (4 a second), for as long as a fleet run lasts. The body
    names the model the router's GET /v1/models lists, as an OpenAI client does: smg routes a chat by
    its model (400 without one, 404 for one no worker serves); sglang-router forwards any chat to the
    worker its policy picks, whatever model it names (docs/sglang.md, "Router")."""
    return Load(router, rate=4.0, max_new_tokens=4, chat=True, timeout_s=120)


def _faults_then_a_window_under_load(layout: DrillLayout, tmp: Path, started: list[subprocess.Popen]) -> None:
    """The fleet behind sglang-router 0.3.2 (issue 41, sections 2 and 4), one run of the whole console
    (`drill --headless --yes`, its engine over the real gateway and rehearsal servers) in three windows:

    1. the gateway killed once the window's drain is done, and started again on the same port (from a
       configuration with the other replica only, and QUICK_HEALTH) once the console said so;
    2. `drill --resume`: the other replica flaps in the next window (stopped until the gateway lists it
       unhealthy and the console said the risk, continued until the gateway lists it healthy);
    3. `drill --resume` under users' chat requests through the gateway: none fails.

    Under --yes each fault ends its window early (the fleet at risk): the run ends paused (EXIT_PAUSED),
    saying why, the replica back in the gateway and serving; each resume extracts only what is missing.
    Each fault comes as the replica is drained, and the console's watch (every 2 s) must see it before
    the extraction gives the GPUs back: from then on ending the window early gains nothing, so the
    risk is only said (fleet_guard._ending). Never left to the watch's pace against the window's: in
    both faulted windows the replica's stop is held (`_stops_held`, the drill's STOP_HOLD) until the
    console has ended the window early, which it does at the next step (fleet_guard.cut); a fault seen
    sooner, in the drain's wait, ends it there. Each fault runs on this gateway only, for CI's time;
    the flap comes after the restart, whose QUICK_HEALTH lists a stopped replica unhealthy within a
    second or two (the drill's gateways keep their default checks: ~16 s, docs/benchmarks.md). smg's
    two windows are above; the guard's steps meet both faults on both gateways in
    tests/test_fleet_guard.py, and the whole engine at every crash point over the fake router in
    tests/test_fleet_guard_sweep.py."""
    config = load_config(layout.config)
    fleet = config.fleet
    assert fleet is not None
    router = status(layout.dir).router_url
    assert router is not None
    runs = tmp / "legacy-runs"
    run_id, drilled = _restart_router_mid_window(layout, fleet, runs, tmp, started)
    _assert_ended_early(drilled, runs, run_id, fleet, router, f"the router {fleet.router} cannot be read: ")
    assert asyncio.run(RouterClient(router).gateway()).kind == "sglang-router"  # the gateway started again
    flapped, drilled = _flap_mid_window(layout, fleet, runs, tmp, run_id)
    out = RunStore(runs).open(run_id).state.facts["fleet_replica"]
    _assert_ended_early(drilled, runs, run_id, fleet, router, f"the router {fleet.router} lists no healthy worker")
    assert flapped != out
    with _chat_load(router) as load, _drilling(layout, runs, tmp / "resumed", "--router", "sglang-router", "--resume",
                                               run_id) as drilled:
        pass
    assert drilled.console.returncode == 0, drilled.tail()
    _assert_served(load.report, router, fleet)
    run = RunStore(runs).open(run_id).state
    assert run.status == "done" and run.service.drained is None and len(run.windows) == 2
    # Each window one drain and one rejoin; one ended early started again what it had stopped (a fault
    # is seen in the drain's wait, or in the stop, held until the window was ended early).
    for window in _windows(run):
        assert (window["drains"], window["rejoins"], window["stops"]) == (1, 1, window["starts"]), window
    assert (run.service.stops, run.service.starts) == (1, 1)
    whys = [w["service"]["ended_early"]["why"] for w in run.windows]  # each window's record keeps why it ended
    assert whys[0].startswith(f"the router {fleet.router} cannot be read: ") and \
        whys[1] == f"the router {fleet.router} lists no healthy worker: the requests through it fail", whys
    # Each resume extracted only what was missing (a window ended before its extraction kept none), and
    # the run's states hold every prompt once.
    prompts = len(run.facts["prompt_ids"])
    kept = [len((w["extraction"]["partial"] or {}).get("done") or []) for w in run.windows]
    said = [int(m.group(1)) for e in RunStore(runs).open(run_id).read_journal()
            if (m := re.match(rf"window \d of run {run_id} on replica r\d: the (\d+) prompts? missing", e["message"]))]
    assert said == [prompts - kept[0], prompts - kept[1]] and kept[1] >= kept[0], (said, kept)
    _assert_extracted_once(config, run_id, run)


def _cut_first_window(runs: Path, config: Config, console: subprocess.Popen) -> str:
    """The operator's stop at the budget in the run's first window: the stop file the budget's offer
    writes (steps/extract.py), once the first stop is done (the staged extractor checks it before each
    prompt). The run's id."""
    run_id = _journal_says(runs, '"message": "stop: done', console)
    (Path(config.hosts["ct129"].workdir) / "windows" / run_id / "stop").touch()
    return run_id




class _Drilled:
    """`drill --headless --yes --replicas 2 --simulated` running as a subprocess (its output in files: a
    pipe left unread would block it)."""

    def __init__(self, console: subprocess.Popen, out: Path, err: Path):
        self.console, self.out, self.err = console, out, err

    @property
    def said(self) -> str:
        return self.err.read_text()

    def tail(self) -> str:
        return self.out.read_text()[-3000:] + self.said[-3000:]


@contextlib.contextmanager
def _drilling(layout: DrillLayout, runs: Path, name: Path, *extra: str) -> Iterator[_Drilled]:
    """The drill's run on the fleet that is up (`extra`: --router, --resume), waited for on leaving."""
    out, err = name.with_suffix(".out"), name.with_suffix(".err")
    with out.open("w") as out_file, err.open("w") as err_file:
        console = subprocess.Popen([str(ENTRY_POINT), "drill", "--headless", "--yes", "--dir", str(layout.dir),
                                    "--replicas", "2", "--simulated", "--runs", str(runs), *extra], stdout=out_file,
                                   stderr=err_file, text=True, cwd=ROOT, env={**os.environ, "COLUMNS": "200"})
        try:
            yield _Drilled(console, out, err)
            console.wait(timeout=400)
        finally:
            if console.poll() is None:
                console.kill()


def _journal_says(runs: Path, words: str, console: subprocess.Popen, seen: int = 0, timeout: float = 180) -> str:
    """Waits until the journals under `runs` hold `words` more than `seen` times (each line is read
    whole: one being written is read again next time); the id of the run that said it."""
    found: list[str] = []

    def said() -> bool:
        for path in runs.glob("*/journal.jsonl"):
            if path.read_text().count(words) > seen:
                found.append(path.parent.name)
                return True
        assert console.poll() is None, f"the drill exited ({console.returncode}) before saying {words!r}"
        return False

    wait_for(said, timeout, f"the journal says {words!r}")
    return found[-1]


def _journal_count(runs: Path, words: str) -> int:
    return sum(path.read_text().count(words) for path in runs.glob("*/journal.jsonl"))


def _run_state(runs: Path, run_id: str) -> dict:
    """The run's state.json as the console last saved it (written whole: a rename)."""
    return json.loads((runs / run_id / "state.json").read_text())


def _assert_served(report: Any, router: str, fleet: Any) -> list[Any]:
    """The users' side of a fleet window: enough chat requests through the router, none failed; every
    replica listed healthy in the router after. The router's workers."""
    assert report is not None and report.sent >= 20 and report.failed == 0, report.line()
    after = asyncio.run(RouterClient(router).workers())
    assert sorted(w.url for w in after) == sorted(r.worker_url for r in fleet.replicas), after
    assert all(w.healthy for w in after), after
    return after


def _windows(run: Any) -> list[dict]:
    """Each window's service record, the run's last one included."""
    return [w["service"] for w in run.windows] + [dataclasses.asdict(run.service)]


def _assert_extracted_once(config: Config, run_id: str, run: Any) -> list[str]:
    """The run's extraction complete, every prompt in it once; the prompts extracted."""
    window_dir = Path(config.hosts["ct129"].workdir) / "windows" / run_id
    manifest = json.loads((window_dir / "states" / "manifest.json").read_text())
    assert manifest["complete"] is True and manifest["prompts_missing"] == []
    extracted = sorted(str(f["prompt_id"]) for f in manifest["files"].values() if "prompt_id" in f)
    assert extracted == sorted(map(str, run.facts["prompt_ids"]))  # every prompt, once
    return extracted


def _refused(url: str) -> bool:
    """Whether nothing listens at `url` any more (a router going down may still accept, then close)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2):
            return False
    except urllib.error.URLError as exc:
        return isinstance(exc.reason, ConnectionRefusedError)
    except (OSError, http.client.HTTPException):
        return False


def _listed_healthy(router: str, worker_url: str) -> bool | None:
    """Whether the router lists the worker healthy now (None: not listed, or the router unreadable)."""
    with contextlib.suppress(OSError, ValueError, KeyError):
        listed = {w["url"].rstrip("/"): bool(w.get("is_healthy")) for w in router_listing(router)}
        return listed.get(worker_url.rstrip("/"))
    return None


def _ended_early(runs: Path, run_id: str) -> bool:
    with contextlib.suppress(OSError, ValueError):
        return _run_state(runs, run_id)["service"]["ended_early"] is not None
    return False


def _restart_router_mid_window(layout: DrillLayout, fleet: Any, runs: Path, tmp: Path,
                               started: list[subprocess.Popen]) -> tuple[str, _Drilled]:
    """Fault (b): the drill's gateway killed once the window's replica is drained; once the console
    said so (and, under --yes, ended the window early: its stop held until then, `_stops_held`) it is
    started again on the same port, from a configuration without the replica out (the others only),
    with QUICK_HEALTH, and recorded as the drill's router (`down` ends it by its pid). (the run's id,
    the drill's run)"""
    state = json.loads(layout.state_file.read_text())
    router, gateway = state["router_url"], state["router"]
    with _stops_held(layout, fleet) as release, _drilling(layout, runs, tmp / "restart", "--router", gateway) as drilled:
        try:
            # Once the drain is done (its own last look at the gateway taken: a gateway lost before that
            # fails the drain itself, the replica then left out until `run --resume` finds the gateway back)
            run_id = _journal_says(runs, '"message": "drain: done', drilled.console)
            os.kill(state["router_pid"], signal.SIGTERM)
            wait_for(lambda: _refused(router), 30, "the router is gone")
            wait_for(lambda: _ended_early(runs, run_id), 60, "the window ended early")
        finally:
            release()  # the stop returns: the engine's next step finds the window ended (fleet_guard.cut)
        out = _run_state(runs, run_id)["facts"]["fleet_replica"]
        others = [r.worker_url for r in fleet.replicas if r.name != out]
        try:
            proc, _ = launch_router(gateway, sys.executable, urlsplit(router).port, others, tmp / "restarted.log",
                                    ROUTER_START_S, *QUICK_HEALTH, cwd=ROOT)
        except FleetError as exc:
            raise AssertionError(str(exc)) from None
        started.append(proc)
        state.update(router_pid=proc.pid, router_start=start_time(proc.pid))
        layout.state_file.write_text(json.dumps(state))
    return run_id, drilled


def _flap_mid_window(layout: DrillLayout, fleet: Any, runs: Path, tmp: Path, run_id: str) -> tuple[str, _Drilled]:
    """Fault (a), in `run_id`'s next window (`drill --resume`): right after the fleet's check before the
    removal, the other replica's server is stopped (SIGSTOP) until the gateway lists it unhealthy and
    the console said the risk and, under --yes, ended the window early, then continued (SIGCONT) until
    the gateway lists it healthy again. Meanwhile the window's stop is held (`_stops_held`): it cannot
    reach the extraction, whose GPUs given back make the risk one only said, never offered. (The race
    CI once lost: this replica's stop frees its GPUs 1.5 s after the server ends, the extraction gives
    them back ~0.1 s after that, ~2.5 s after the drain, and the watch's look that saw the flap came
    after it.) (the other replica's name, the drill's run)"""
    router = json.loads(layout.state_file.read_text())["router_url"]
    gateway = json.loads(layout.state_file.read_text())["router"]
    checks = _journal_count(runs, "the fleet checked again right before the removal")
    risks = _journal_count(runs, "THE FLEET IS AT RISK")
    ends = _journal_count(runs, "the window ends early: ")
    with _stops_held(layout, fleet) as release, \
            _drilling(layout, runs, tmp / "flap", "--router", gateway, "--resume", run_id) as drilled:
        try:
            _journal_says(runs, "the fleet checked again right before the removal", drilled.console, checks)
            out = _run_state(runs, run_id)["facts"]["fleet_replica"]
            index, other = next((i, r) for i, r in enumerate(fleet.replicas) if r.name != out)
            pid = drill_service.running_pid(layout.replica_state(index))
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            try:
                wait_for(lambda: _listed_healthy(router, other.worker_url) is False, 60,
                         f"{other.name} listed unhealthy")
                _journal_says(runs, "THE FLEET IS AT RISK", drilled.console, risks)
                # the --yes to the offer: recorded in the run's state before this line (fleet_guard.end_early)
                _journal_says(runs, "the window ends early: ", drilled.console, ends)
            finally:
                os.kill(pid, signal.SIGCONT)
        finally:
            release()  # the stop returns: the engine's next step finds the window ended (fleet_guard.cut)
        wait_for(lambda: _listed_healthy(router, other.worker_url) is True, 60, f"{other.name} listed healthy again")
    return other.name, drilled


@contextlib.contextmanager
def _stops_held(layout: DrillLayout, fleet: Any) -> Iterator[Callable[[], None]]:
    """Every replica's stop held (the drill's STOP_HOLD file in its service directory, made before the
    drill's run starts: which replica the window takes is chosen in it) until the test calls the
    release it is given, once the console has done what the test waits for and before the drill's run
    is waited for (a stop still held would hold the run up); released on leaving too. Only the
    window's replica is stopped by the console (the compensation starts it again, never stops it): a
    hold on the other is never met."""
    holds = [layout.replica_state(i) / drill_service.STOP_HOLD for i in range(len(fleet.replicas))]

    def release() -> None:
        for hold in holds:
            hold.unlink(missing_ok=True)

    for hold in holds:
        hold.touch()
    try:
        yield release
    finally:
        release()


def _assert_ended_early(drilled: _Drilled, runs: Path, run_id: str, fleet: Any, router: str, why: str) -> None:
    """A window ended early under --yes: the run paused and resumable, saying why; the replica out back
    in the router (one removal, one add) and serving; every replica listed healthy."""
    from console.procedure.ending import EXIT_PAUSED

    assert drilled.console.returncode == EXIT_PAUSED, drilled.tail()
    run = RunStore(runs).open(run_id).state
    assert run.status == "paused" and run.service.ended_early["why"].startswith(why), run.service.ended_early
    assert f"the window ended early: {run.service.ended_early['why']}; every prompt extracted is kept, and `run " \
           f"--resume {run_id}` extracts the rest" in drilled.said
    svc = run.service
    assert (svc.drains, svc.rejoins, svc.drained) == (1, 1, None) and svc.stops == svc.starts
    out = next(r for r in fleet.replicas if r.name == run.facts["fleet_replica"])
    assert http_status(out.service.url + "/health") == 200  # serving again
    wait_for(lambda: all(_listed_healthy(router, r.worker_url) for r in fleet.replicas), 60,
          "every replica listed healthy in the router")

