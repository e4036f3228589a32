"""The drill's rehearsal hosts and assets: real processes, real SSH, the real workers.

One drill (module scope) serves the tests that only look or cycle the service; the test of `down`
brings up its own. The assets come from the machine's drill cache, as the console's do (built once,
rebuilt when their code changes).
"""

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
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from bench.loadgen import Load
from console.config import Config, load_config
from console.drill import procs
from console.drill.assets import CACHE_ENV, cache_root, ensure_assets, find_assets, version_key
from console.drill.config import ROUTER_NAME
from console.drill.fleet import FleetError, launch_router
from console.drill.hosts import down, status, up
from console.drill.layout import DrillLayout
from console.drill.rearm import rearm
from console.procedure.store import RunStore
from console.service.control import manager_from_config
from console.service.router import RouterClient
from console.service.sglang_api import ServerUnreachable
from console.ssh.host_specs import host_spec
from console.ssh.hosts import Host, HostSpec, UnknownHostKey
from remote.drill import service as drill_service
from remote.drill import simgpu
from remote.procstat import pid_alive, start_time
from tests.router_helpers import QUICK_HEALTH, ROUTER_START_S, need_router
from tests.router_helpers import listing as router_listing
from tests.standin_helpers import stop

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = Path(sys.executable).parent / "dflash-ops"


@pytest.fixture(scope="module")
def drill_cache() -> Path:
    """The assets cache these tests use: the one the console and the other drill tests use (built
    once per machine, under its lock, whichever test or console comes first)."""
    ensure_assets()
    return cache_root()


def _drill_up(drill_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ENTRY_POINT), "drill", "up", "--dir", str(drill_dir), *extra], capture_output=True,
                          text=True, timeout=180, cwd=ROOT)


@pytest.fixture(scope="module")
def drill(drill_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillLayout]:
    layout = DrillLayout.at(tmp_path_factory.mktemp("drill"))
    done = _drill_up(layout.dir)
    assert done.returncode == 0, done.stderr
    yield layout
    down(layout.dir)


def _spec(layout: DrillLayout, name: str) -> tuple[Config, HostSpec]:
    config = load_config(layout.config)
    # The drill's own empty ssh_config: nothing of the user's ~/.ssh/config applies.
    return config, dataclasses.replace(host_spec(config, name), ssh_config=str(layout.ssh_dir(name) / "ssh_config"))


def _holders(layout: DrillLayout) -> list[dict]:
    return simgpu.live_view(simgpu.read(layout.simulated_gpus("ct129")))["processes"]


def _get(url: str) -> int:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.status


def _wait(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout} s: {what}")


def test_up_prints_a_loadable_config_last_and_is_idempotent(drill: DrillLayout, capsys: pytest.CaptureFixture[str],
                                                            monkeypatch: pytest.MonkeyPatch):
    config = load_config(drill.config)
    assert set(config.hosts) == {"ct129", "ct200"}
    assert config.service.manager == "command" and config.service.host == "ct129"
    assert [(d.name, d.host, d.reference) for d in config.drafters] == [("reference", "ct200", True),
                                                                         ("candidate", "ct200", False)]
    for drafter in config.drafters:
        assert json.loads((Path(drafter.path) / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    first = status(drill.dir)
    assert first.up and first.service_health == 200 and first.service_pid is not None
    # Each host's probe cache is the one this machine keeps for that host beside the assets.
    for host in ("ct129", "ct200"):
        kept = drill.workdir(host) / "probe-cache"
        assert kept.is_symlink() and kept.resolve() == (cache_root() / "probe-cache" / host).resolve()

    again = _drill_up(drill.dir)
    assert again.returncode == 0, again.stderr
    assert again.stdout.splitlines()[-1] == str(drill.config)  # `$(dflash-ops drill up | tail -n1)`
    assert status(drill.dir).pid == first.pid  # the same hosts, not a second drill

    shown = subprocess.run([str(ENTRY_POINT), "drill", "status", "--dir", str(drill.dir)], capture_output=True,
                           text=True, timeout=30)
    assert shown.returncode == 0
    assert f"(pid {first.pid})" in shown.stdout and str(drill.config) in shown.stdout
    assert f"running, pid {first.service_pid}, /health 200, memory saver on" in shown.stdout

    # The console sees two simulated hosts and the service up.
    from console.cli.main import main

    monkeypatch.setenv("COLUMNS", "200")
    assert main(["status", "--config", str(drill.config)]) == 0
    out = capsys.readouterr().out
    hosts = [line for line in out.splitlines() if line.lstrip().startswith(("ct129 ", "ct200 "))]  # a host's first row
    assert len(hosts) == 2 and all("connected" in line and "SIMULATED" in line for line in hosts)
    assert f"on ct129: running, pid {first.service_pid}" in out and "/health 200, ready" in out
    assert "0.0/95.6 GiB" in out  # ct200's free GPU (97887 MiB) beside the seven the training run holds


async def test_the_drills_server_runs_with_the_memory_saver_unless_told_not_to(drill: DrillLayout, tmp_path: Path):
    """`drill up` (the default): the pause route's case; `--no-memory-saver` (on `drill` and `drill
    up`) writes the other one."""
    from console.cli.main import build_parser
    from console.drill.config import service_commands
    from console.service.sglang_api import SglangClient

    saver = await SglangClient(load_config(drill.config).service.url).memory_saver()
    assert saver.enabled and saver.weights_cpu_backup and saver.memory_gib and saver.memory_gib["kv_cache"] > 0
    start = " ".join(service_commands(DrillLayout.at(tmp_path, memory_saver=False), sys.executable, 1)["start"])
    assert "--enable-memory-saver" not in start and "--kv-cache-mib" not in start
    assert "--enable-memory-saver --enable-weights-cpu-backup" in " ".join(
        service_commands(DrillLayout.at(tmp_path), sys.executable, 1)["start"])
    for argv in (["drill", "up", "--no-memory-saver"], ["drill", "--headless", "--no-memory-saver"]):
        assert build_parser().parse_args(argv).no_memory_saver is True
    assert build_parser().parse_args(["drill", "up"]).no_memory_saver is False


async def test_hosts_take_ssh_with_their_own_keys_and_serve_health_through_it(drill: DrillLayout):
    for name in ("ct129", "ct200"):
        config, spec = _spec(drill, name)
        host = Host(spec)
        await host.connect()
        try:
            result = await host.run(["sh", "-c", "echo $HOME; test -f dflash-ops/simulated-gpu.json && echo sim"])
            assert result.stdout.split() == [str(drill.home(name)), "sim"]
            if name == "ct129":
                port = int(config.service.url.rsplit(":", 1)[1])
                local = await host.forward_local_port("127.0.0.1", port)
                # In a thread: the forward is served by this very loop.
                assert await asyncio.to_thread(_get, f"http://127.0.0.1:{local}/health") == 200
        finally:
            await host.close()
        # Host keys are checked: the other host's known_hosts does not vouch for this one.
        other = "ct200" if name == "ct129" else "ct129"
        wrong = dataclasses.replace(spec, known_hosts=str(drill.ssh_dir(other) / "known_hosts"))
        with pytest.raises(UnknownHostKey):
            await Host(wrong).connect()


def test_console_ignores_the_users_ssh_config_for_drill_hosts(drill: DrillLayout, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch):
    from console.cli.main import main

    (tmp_path / ".ssh").mkdir()
    (tmp_path / ".ssh" / "config").write_text("Host *\n    ProxyCommand false\n")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["status", "--config", str(drill.config)]) == 0


async def test_first_stop_leaves_vram_held_by_a_live_holder_and_a_later_stop_does_not(drill: DrillLayout):
    config, spec = _spec(drill, "ct129")
    host = Host(spec)
    await host.connect()
    manager = manager_from_config(config.service, host)
    try:
        assert (await manager.status()).active
        server_pid = drill_service.running_pid(drill.service_state)
        holders_before = {p["pid"] for p in _holders(drill)}
        await manager.stop()
        assert not (await manager.status()).active and not pid_alive(server_pid)
        time.sleep(2.5)  # longer than a release would take
        held = _holders(drill)
        assert {p["gpu"] for p in held} == {0, 1} and all(p["mib"] == 40000 for p in held)
        holder = held[0]["pid"]
        assert holder in holders_before and pid_alive(holder)  # a real process, the server's GPU worker
        cmdline = Path(f"/proc/{holder}/cmdline").read_bytes().split(b"\0")
        assert b"--gpu-worker" in cmdline and b"--stuck-marker" in cmdline
        # The holder took the episode at the stop: its marker names it, so later stops release.
        assert f"pid {holder} holds" in (drill.service_state / drill_service.STUCK_MARKER).read_text()
        os.kill(holder, signal.SIGTERM)  # what the VRAM waiter's end_holders does
        _wait(lambda: not _holders(drill), 20, "the memory is free once its holder is ended")

        await manager.start()
        _wait(lambda: _holders(drill) and status(drill.dir).service_health == 200, 60, "the server is back")
        second_holder = _holders(drill)[0]["pid"]
        await manager.stop()
        # The worker releases its memory, then exits: both, by themselves, with nobody ending it.
        _wait(lambda: not _holders(drill), 20, "a later stop releases the memory by itself")
        _wait(lambda: not pid_alive(second_holder), 20, "the holder ends by itself after its release")
    finally:
        # Leave the drill as it was found, serving, whatever failed above: the tests after this one
        # in the module share it.
        if not (await manager.status()).active:
            await manager.start()
        _wait(lambda: status(drill.dir).service_health == 200, 60, "the server is back")
        await host.close()


def test_rearm_undoes_a_rehearsal_without_starting_the_hosts_again(drill: DrillLayout):
    """What the tests' shared drill relies on: after a window's leftovers (a stop whose holder keeps
    the VRAM, a detached job, a console still driving it, an edited config, a run directory), `rearm`
    ends them, restores the rest and starts the service again; the hosts' process stays. A serving
    server is kept, and the episode is re-armed on it: its next stop holds the VRAM again."""
    state = json.loads(drill.state_file.read_text())
    pristine = drill.config.read_text()
    config = load_config(drill.config)
    stop = subprocess.run(list(config.service.stop), cwd=drill.home("ct129"), capture_output=True, text=True, timeout=60)
    assert stop.returncode == 0, stop.stderr
    _wait(lambda: bool(_holders(drill)), 20, "the first stop leaves the VRAM held")
    holder = _holders(drill)[0]["pid"]
    job = subprocess.Popen(["sleep", "300"], env={**os.environ, procs.MARK_ENV: procs.mark_value(drill.dir)},
                           start_new_session=True)
    console = subprocess.Popen([str(ENTRY_POINT), "status", "--watch", "--config", str(drill.config)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    (drill.workdir("ct129") / "runs" / "left-by-a-run").mkdir(parents=True)
    drill.lock_dir("ct129").mkdir(exist_ok=True)
    (drill.lock_dir("ct129") / "dflash-ops.lock").write_text('{"run_id": "left-by-a-run"}')  # its host lock
    drill.config.write_text(pristine + "\n# edited by a rehearsal\n")
    try:
        assert rearm(drill.dir, say=lambda msg: None) == drill.config
        job.wait(10), console.wait(10)  # ended (they would sleep and watch for minutes)
        _wait(lambda: not pid_alive(holder), 10, "the holder the stop left is ended")
        assert json.loads(drill.state_file.read_text())["pid"] == state["pid"] and pid_alive(state["pid"])
        assert drill.config.read_text() == pristine and not (drill.workdir("ct129") / "runs").exists()
        assert not drill.lock_dir("ct129").exists()  # no run holds the host of a fresh rehearsal
        assert status(drill.dir).service_health == 200  # started again: one new server holds the VRAM
        assert len({p["pid"] for p in _holders(drill)}) == 1 and holder not in {p["pid"] for p in _holders(drill)}
        server = drill_service.running_pid(drill.service_state)
        assert rearm(drill.dir, say=lambda msg: None) == drill.config
        assert drill_service.running_pid(drill.service_state) == server  # serving as up left it: kept
        stop = subprocess.run(list(config.service.stop), cwd=drill.home("ct129"), capture_output=True, text=True,
                              timeout=60)
        assert stop.returncode == 0, stop.stderr
        _wait(lambda: bool(_holders(drill)), 20, "the re-armed episode: the next stop holds the VRAM again")
    finally:
        job.kill()
        console.kill()
        rearm(drill.dir, say=lambda msg: None)  # the module's other tests share this drill
        assert status(drill.dir).service_health == 200


def test_drafters_taus_differ_on_the_real_workers(drill: DrillLayout, tmp_path: Path):
    """completions from the drill's server, extraction of the tiny target and evaluation, all on CPU."""
    config = load_config(drill.config)
    env = {**os.environ, "DFLASH_EVENTS": str(tmp_path / "events.jsonl")}

    def worker(*argv: str) -> None:
        done = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]

    drafters = {d.name: d.path for d in config.drafters}
    worker("remote.completions", "--server", config.service.url, "--out", str(tmp_path / "completions.json"),
           "--prompts", str(config.prompts.file), "--tokenizer", config.target.model_path)
    worker("remote.extract", "--model", config.target.model_path, "--completions", str(tmp_path / "completions.json"),
           "--out", str(tmp_path / "states"), *(f"--drafter={p}" for p in drafters.values()), "--kernels", "any",
           "--device", "cpu")
    worker("remote.evaluate", "--states", str(tmp_path / "states"), "--target", config.target.model_path,
           *(f"--drafter={n}={p}" for n, p in drafters.items()), "--reference", "reference",
           "--out", str(tmp_path / "eval"), "--device", "cpu", "--budgets", "8,16", "--topk", "8")
    results = json.loads((tmp_path / "eval" / "results.json").read_text())["drafters"]
    tau = {name: results[name]["tau"]["vanilla"]["macro"] for name in drafters}
    print(f"vanilla tau: {tau}")
    assert tau["reference"] >= 6.0, tau
    assert tau["reference"] - tau["candidate"] >= 3.0, tau


def test_down_leaves_no_process_behind(drill_cache: Path, tmp_path: Path):
    layout = DrillLayout.at(tmp_path / "drill")
    assert up(layout.dir, say=lambda msg: None) == layout.config
    first = json.loads(layout.state_file.read_text())["pid"]
    # A fresh drill ends this one and re-arms the stuck-VRAM episode for its first stop.
    assert up(layout.dir, fresh=True, say=lambda msg: None) == layout.config
    state = json.loads(layout.state_file.read_text())
    assert state["pid"] != first and not pid_alive(first)
    server = drill_service.running_pid(layout.service_state)
    worker = _holders(layout)[0]["pid"]
    assert b"--stuck-marker" in Path(f"/proc/{server}/cmdline").read_bytes().split(b"\0")
    assert not (layout.service_state / drill_service.STUCK_MARKER).exists()  # armed: the next stop holds
    started = {"hosts": state["pid"], "trainer": state["trainer_pid"], "server": server, "gpu worker": worker}
    # A detached job started over SSH, as the console starts its workers.
    config, spec = _spec(layout, "ct200")
    async def start_job() -> int:
        host = Host(spec)
        await host.connect()
        try:
            result = await host.run(["sh", "-c", "setsid nohup sleep 300 </dev/null >/dev/null 2>&1 & echo $!"])
            return int(result.stdout.strip())
        finally:
            await host.close()

    started["detached job"] = asyncio.run(start_job())
    assert all(pid_alive(pid) for pid in started.values()), started
    assert set(started.values()) <= set(procs.marked_pids(layout.dir))

    down(layout.dir, say=lambda msg: None)
    alive = {what: pid for what, pid in started.items() if pid_alive(pid)}
    assert not alive, f"left running after drill down: {alive}"
    assert not procs.marked_pids(layout.dir)
    assert not layout.pid_file.exists()
    assert not status(layout.dir).up


def test_a_killed_build_is_not_taken_as_complete(drill_cache: Path, tmp_path: Path):
    root = tmp_path / "cache"
    env = {**os.environ, CACHE_ENV: str(root)}
    build = subprocess.Popen([sys.executable, "-m", "console.drill.assets"], cwd=ROOT, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    key = version_key()
    try:
        # Killed once the target is written, while the drafters are being fitted.
        _wait(lambda: any(root.glob(f".{key}.build-*/target/config.json")), 90, "the build has begun")
    finally:
        os.killpg(build.pid, signal.SIGKILL)
        build.wait(10)
    assert find_assets(root) is None
    assert not (root / key).exists()
    debris = list(root.glob(f".{key}.build-*"))
    assert debris  # what the killed build left is there, under a name no reader takes

    # The next build (here a stand-in for the builder that copies a finished build, to stay quick)
    # clears the debris and publishes a complete entry.
    builder = tmp_path / "python"
    builder.write_text(f'#!/bin/sh\n# called as: python -m remote.drill.assets OUT\ncp -r {drill_cache / key}/. "$3"\n')
    builder.chmod(0o755)
    assets = ensure_assets(python=str(builder), root=root, say=lambda msg: None)
    assert assets.root == root / key and find_assets(root) == assets
    assert not any(d.exists() for d in debris)
    assert assets.fit_taus["reference"] - assets.fit_taus["candidate"] >= 2.0


def test_simulated_gpus_are_the_configs_flag_never_a_file_found_in_a_workdir(drill: DrillLayout, tmp_path: Path):
    """ct200's workdir holds a simulated GPU file either way; only `simulated_gpus` makes it read."""
    from console.config import dump_toml
    from console.session import Session

    written = load_config(drill.config)
    assert all(h.simulated_gpus for h in written.hosts.values())  # the drill's config says so
    assert drill.simulated_gpus("ct200").is_file()
    text = drill.config.read_text()
    real = tmp_path / "real.toml"
    # The same hosts, ct200 now configured as a real host (its file is still in its workdir).
    import tomllib

    data = tomllib.loads(text)
    data["hosts"]["ct200"]["simulated_gpus"] = False
    real.write_text(dump_toml(data))

    async def sample_of(config: Config) -> tuple[bool, str]:
        session = Session(config, telemetry_interval=0.2)
        session.start(watch_service=False)
        try:
            await session.code_dir("ct200", timeout=20)  # what decides the agent's source
            stream = session.streams["ct200"]
            sample = await stream.wait_for(lambda s: True, 30)
            return session.simulated["ct200"], sample.source
        finally:
            await session.stop()

    assert asyncio.run(sample_of(written)) == (True, "simulated")
    simulated, source = asyncio.run(sample_of(load_config(real)))
    assert not simulated and source != "simulated"  # this machine's own GPUs (none here): NVML or none


async def test_a_real_host_receives_the_workers_it_runs_and_a_drill_host_the_drills_too(drill: DrillLayout,
                                                                                       tmp_path: Path):
    from console.ssh.jobs import JobRunner

    config, spec = _spec(drill, "ct200")
    assert spec.drill  # from the config's simulated_gpus
    shipped = {}
    for drill_host in (False, True):
        host = Host(dataclasses.replace(spec, workdir=str(tmp_path / f"work-{drill_host}"), drill=drill_host))
        await host.connect()
        try:
            shipped[drill_host] = Path(await JobRunner(host).ensure_code()) / "remote"
        finally:
            await host.close()
    real, rehearsal = shipped[False], shipped[True]
    assert (real / "extract.py").is_file() and (real / "agent.py").is_file() and (real / "evaluate.py").is_file()
    assert not (real / "drill").exists()  # a real host gets no rehearsal workers
    assert (rehearsal / "drill" / "simgpu.py").is_file() and (rehearsal / "extract.py").is_file()
    assert real.parent != rehearsal.parent  # two trees, each under its own content digest
    real_config = dataclasses.replace(config.hosts["ct200"], simulated_gpus=False)
    assert not host_spec(dataclasses.replace(config, hosts={**config.hosts, "ct200": real_config}), "ct200").drill


@pytest.mark.timeout(600)  # the fleet run's two windows, on a loaded CI machine
def test_replicas_bring_up_the_real_router_in_front_of_rehearsal_servers(drill_cache: Path, tmp_path: Path):
    need_router()
    from console.drill.fleet import DRAIN_SETTLE_S
    from console.service.router import SGLANG_ROUTER, SMG, Gateway

    layout = DrillLayout.at(tmp_path / "fleet")
    done = _drill_up(layout.dir, "--replicas", "2", "--simulated")
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
        done = _drill_up(layout.dir, "--replicas", "2", "--simulated", "--router", "sglang-router")
        assert done.returncode == 1 and "(2 replicas behind smg, SIMULATED GPUs), not the one asked for (2 " \
            "replicas behind sglang-router, SIMULATED GPUs)" in done.stderr, done.stderr
        assert pid_alive(smg_pid)
        done = _drill_up(layout.dir, "--replicas", "2", "--simulated", "--router", "sglang-router", "--fresh")
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
    Each fault comes as the replica is drained, and the console's watch (every 2 s) sees it
    while the drain's wait, the stop or the wait for the GPUs runs: before the extraction could give
    them back (the drill's first stop of a replica leaves them held 5 s, `vram_wait_s`). Each fault
    runs on this gateway only, for CI's time; the flap comes after the restart, whose QUICK_HEALTH lists
    a stopped replica unhealthy within a second or two (the drill's gateways keep their default checks:
    ~16 s, docs/benchmarks.md). smg's two windows are above; the guard's steps meet both faults on both
    gateways in tests/test_fleet_guard.py, and the whole engine at every crash point over the fake
    router in tests/test_fleet_guard_sweep.py."""
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
    # is seen while the drain's wait, the stop or the wait for the GPUs runs: the watch's pace decides).
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


def test_replicas_must_be_a_positive_count(tmp_path: Path):
    done = _drill_up(tmp_path / "x", "--replicas", "0")
    assert done.returncode == 2 and "--replicas: expected a whole number of replicas, 1 or more, found '0'" in done.stderr
    done = _drill_up(tmp_path / "x", "--replicas", "2", "--router", "nginx")
    assert done.returncode == 2 and "argument --router: invalid choice: 'nginx' (choose from 'smg', 'sglang-router')" in done.stderr


def test_a_hosts_probe_cache_is_shared_by_every_drill_on_this_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A new drill's hosts link the machine's probe cache (its first window probes no torch again);
    a drill made before this keeps its workdir but its own cache directory is replaced by the link."""
    from console.drill.hosts import share_probe_cache

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    first, second = DrillLayout.at(tmp_path / "one"), DrillLayout.at(tmp_path / "two")
    for layout in (first, second):
        layout.workdir("ct129").mkdir(parents=True)
    old = second.workdir("ct129") / "probe-cache"
    old.mkdir()
    (old / "environment-0123.json").write_text("{}")
    for layout in (first, second, first):  # the second call on one drill changes nothing
        share_probe_cache(layout, "ct129")
    shared = tmp_path / "cache" / "probe-cache" / "ct129"
    (first.workdir("ct129") / "probe-cache" / "environment-abcd.json").write_text("{}")
    assert sorted(p.name for p in (second.workdir("ct129") / "probe-cache").iterdir()) == ["environment-abcd.json"]
    assert all((layout.workdir("ct129") / "probe-cache").resolve() == shared.resolve() for layout in (first, second))
    down_dir = first.workdir("ct129") / "probe-cache"
    down_dir.unlink()  # removing a drill's link leaves the machine's cache
    assert (shared / "environment-abcd.json").is_file()


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

    _wait(said, timeout, f"the journal says {words!r}")
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
    said so (and, under --yes, ended the window early) it is started again on the same port, from a
    configuration without the replica out (the others only), with QUICK_HEALTH, and recorded as the
    drill's router (`down` ends it by its pid). (the run's id, the drill's run)"""
    state = json.loads(layout.state_file.read_text())
    router, gateway = state["router_url"], state["router"]
    with _drilling(layout, runs, tmp / "restart", "--router", gateway) as drilled:
        # Once the drain is done (its own last look at the gateway taken: a gateway lost before that fails
        # the drain itself, the replica then left out until `run --resume` finds the gateway back)
        run_id = _journal_says(runs, '"message": "drain: done', drilled.console)
        os.kill(state["router_pid"], signal.SIGTERM)
        _wait(lambda: _refused(router), 30, "the router is gone")
        _wait(lambda: _ended_early(runs, run_id), 60, "the window ended early")
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
    the console said the risk, then continued (SIGCONT) until the gateway lists it healthy again.
    (the other replica's name, the drill's run)"""
    router = json.loads(layout.state_file.read_text())["router_url"]
    gateway = json.loads(layout.state_file.read_text())["router"]
    checks = _journal_count(runs, "the fleet checked again right before the removal")
    risks = _journal_count(runs, "THE FLEET IS AT RISK")
    with _drilling(layout, runs, tmp / "flap", "--router", gateway, "--resume", run_id) as drilled:
        _journal_says(runs, "the fleet checked again right before the removal", drilled.console, checks)
        out = _run_state(runs, run_id)["facts"]["fleet_replica"]
        index, other = next((i, r) for i, r in enumerate(fleet.replicas) if r.name != out)
        pid = drill_service.running_pid(layout.replica_state(index))
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            _wait(lambda: _listed_healthy(router, other.worker_url) is False, 60, f"{other.name} listed unhealthy")
            _journal_says(runs, "THE FLEET IS AT RISK", drilled.console, risks)
        finally:
            os.kill(pid, signal.SIGCONT)
        _wait(lambda: _listed_healthy(router, other.worker_url) is True, 60, f"{other.name} listed healthy again")
    return other.name, drilled


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
    assert _get(out.service.url + "/health") == 200  # serving again
    _wait(lambda: all(_listed_healthy(router, r.worker_url) for r in fleet.replicas), 60,
          "every replica listed healthy in the router")

