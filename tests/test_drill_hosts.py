"""The drill's rehearsal hosts and assets: real processes, real SSH, the real workers.

One drill (module scope) serves the tests that only look or cycle the service; the test of `down`
brings up its own. The assets come from the machine's drill cache, as the console's do (built once,
rebuilt when their code changes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.config import Config, load_config
from console.drill import procs
from console.drill.assets import CACHE_ENV, cache_root, ensure_assets, find_assets, version_key
from console.drill.hosts import down, status, up
from console.drill.layout import DrillLayout
from console.drill.rearm import rearm
from console.service.control import manager_from_config
from console.ssh.host_specs import host_spec
from console.ssh.hosts import Host, HostSpec, UnknownHostKey
from remote.drill import service as drill_service
from remote.drill import simgpu
from remote.procstat import pid_alive
from tests.drill_helpers import ENTRY_POINT, ROOT, drill_up, http_status, wait_for


@pytest.fixture(scope="module")
def drill(drill_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DrillLayout]:
    layout = DrillLayout.at(tmp_path_factory.mktemp("drill"))
    done = drill_up(layout.dir)
    assert done.returncode == 0, done.stderr
    yield layout
    down(layout.dir)


def _spec(layout: DrillLayout, name: str) -> tuple[Config, HostSpec]:
    config = load_config(layout.config)
    # The drill's own empty ssh_config: nothing of the user's ~/.ssh/config applies.
    return config, dataclasses.replace(host_spec(config, name), ssh_config=str(layout.ssh_dir(name) / "ssh_config"))


def _holders(layout: DrillLayout) -> list[dict]:
    return simgpu.live_view(simgpu.read(layout.simulated_gpus("ct129")))["processes"]


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

    again = drill_up(drill.dir)
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
                assert await asyncio.to_thread(http_status, f"http://127.0.0.1:{local}/health") == 200
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
        wait_for(lambda: not _holders(drill), 20, "the memory is free once its holder is ended")

        await manager.start()
        wait_for(lambda: _holders(drill) and status(drill.dir).service_health == 200, 60, "the server is back")
        second_holder = _holders(drill)[0]["pid"]
        await manager.stop()
        # The worker releases its memory, then exits: both, by themselves, with nobody ending it.
        wait_for(lambda: not _holders(drill), 20, "a later stop releases the memory by itself")
        wait_for(lambda: not pid_alive(second_holder), 20, "the holder ends by itself after its release")
    finally:
        # Leave the drill as it was found, serving, whatever failed above: the tests after this one
        # in the module share it.
        if not (await manager.status()).active:
            await manager.start()
        wait_for(lambda: status(drill.dir).service_health == 200, 60, "the server is back")
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
    wait_for(lambda: bool(_holders(drill)), 20, "the first stop leaves the VRAM held")
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
        wait_for(lambda: not pid_alive(holder), 10, "the holder the stop left is ended")
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
        wait_for(lambda: bool(_holders(drill)), 20, "the re-armed episode: the next stop holds the VRAM again")
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
        wait_for(lambda: any(root.glob(f".{key}.build-*/target/config.json")), 90, "the build has begun")
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


def test_replicas_must_be_a_positive_count(tmp_path: Path):
    done = drill_up(tmp_path / "x", "--replicas", "0")
    assert done.returncode == 2 and "--replicas: expected a whole number of replicas, 1 or more, found '0'" in done.stderr
    done = drill_up(tmp_path / "x", "--replicas", "2", "--router", "nginx")
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
