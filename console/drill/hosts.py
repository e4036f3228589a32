"""The drill's rehearsal hosts, in a background process of their own: `up`, `down`, `status`.

`up(dir)` builds the assets if the cache has none (`console.drill.assets`), then starts
`python -m console.drill.hosts serve --dir DIR ...` detached (its own session, stdin from /dev/null,
output to DIR/hosts.log). That process is the two hosts of the story on this machine:

- ct129, the inference host: an embedded SSH server (`console.ssh.embedded_server`) whose home holds
  the tiny target, a workdir with a simulated GPU file (2 x 48 GB) and the rehearsal server
  (`remote.drill.standin`) run as a command-managed service (`remote.drill.service`), started here
  and ready (/health 200) before `up` returns;
- ct200, the training host: another embedded SSH server whose home holds the two drafter
  checkpoints, and 8 simulated GPUs of which 7 are held by a simulated training run
  (`remote.drill.trainer`) and 1 is free.

Each server has its own host key, client key, known_hosts and an empty ssh_config under DIR/<host>/ssh;
the config names them all explicitly. The process writes DIR/dflash-ops.toml, DIR/drill.json (state
"ready") and DIR/drill.pid, then serves until SIGTERM, when it stops the service and the training
run, closes the servers and ends every process the drill started (`console.drill.procs`).

The console can be killed and started again against these hosts as against real ones: they live
on until `down(dir)`. `up` on a drill that is up returns the same config path (idempotent); a new
drill (after `down`, or `up(fresh=True)`) re-arms the stuck-VRAM episode of the first stop.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import getpass
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from console.drill import fleet, procs
from console.drill.assets import DrillAssets, cache_root, ensure_assets, find_assets
from console.drill.config import HOST_NAMES, service_commands, write_drill_config
from console.drill.layout import GPUS_PER_REPLICA, HOSTS, INFERENCE_HOST, TRAINING_HOST, DrillLayout, describe
from console.ssh.embedded_server import EmbeddedSSHServer
from remote.artifacts import write_json_atomic
from remote.drill import service as drill_service
from remote.drill import simgpu
from remote.drill.locks import locked
from remote.procstat import pid_alive, start_time

READY_TIMEOUT_S = 120.0
GPU_READY_TIMEOUT_S = 300.0  # the GPU drill's server loads a few GB onto the GPU
STOP_TIMEOUT_S = 30.0
SERVICE_HEALTH_TIMEOUT_S = 240.0
INFERENCE_GPUS = {"count": GPUS_PER_REPLICA, "name": "NVIDIA RTX 6000 Ada Generation (SIMULATED)", "total_mib": 49140}
TRAINING_GPUS = {"count": 8, "name": "NVIDIA RTX PRO 6000 Blackwell (SIMULATED)", "total_mib": 97887}
TRAINING_BUSY_GPUS = [0, 1, 2, 3, 4, 5, 6]  # GPU 7 stays free
TRAINING_MIB = 91000


PASSED_ENV = ("PYTHONPATH", "TRITON_CACHE_DIR", "CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
              "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "HF_HUB_OFFLINE",
              "OMP_NUM_THREADS", "MKL_NUM_THREADS")  # the threads per worker: both hosts share these cores


class DrillError(Exception):
    """The drill could not be brought up (or down); the message says why, with the log's tail."""


@dataclass(frozen=True)
class DrillStatus:
    """What `status` found. `leftovers`: live processes of a drill that is not up (a crashed one)."""

    dir: Path
    up: bool
    config: Path | None = None
    pid: int | None = None
    ports: dict[str, int] = field(default_factory=dict)
    service_url: str | None = None
    service_pid: int | None = None
    service_health: int | None = None
    trainer_pid: int | None = None
    since: float | None = None
    leftovers: tuple[int, ...] = ()
    starting: bool = False
    gpu: bool = False  # REAL GPU (this machine's, shared by both hosts) rather than SIMULATED ones
    memory_saver: bool = True  # the rehearsal server runs with SGLang's memory saver
    router_url: str | None = None  # --replicas: SGLang's router in front of the replicas
    replica_urls: tuple[str, ...] = ()
    router: str | None = None  # which one: smg or sglang-router (a drill state from before it was recorded: the old one)

    def lines(self) -> list[str]:
        """The status as a few lines for the terminal."""
        if self.starting:
            return [f"drill at {self.dir}: starting (pid {self.pid}; `dflash-ops drill up` waits for it)"]
        if not self.up:
            out = [f"drill at {self.dir}: down"]
            if self.leftovers:
                out.append(f"  leftover processes of an earlier drill: {', '.join(map(str, self.leftovers))} "
                           "(`dflash-ops drill down` ends them)")
            return out
        since = time.strftime("%H:%M:%S", time.localtime(self.since)) if self.since else "?"
        hosts = ", ".join(f"{name} 127.0.0.1:{port}" for name, port in self.ports.items())
        if self.service_pid is not None:
            health = f"/health {self.service_health}" if self.service_health else "no answer on /health"
            service = f"running, pid {self.service_pid}, {health}"
        else:
            service = "stopped"
        service += ", memory saver on" if self.memory_saver else ", no memory saver"
        training = (f"shares the GPU with {INFERENCE_HOST}" if self.gpu else
                    f"training run pid {self.trainer_pid}" if self.trainer_pid else "training run not running")
        fleet_line = ([f"  router ({self.router or 'sglang-router'}) {self.router_url} in front of {len(self.replica_urls)} replicas on {INFERENCE_HOST}: "
                       f"{', '.join(self.replica_urls)} (the service above is the first)"] if self.router_url else [])
        return [f"drill at {self.dir}: up since {since} (pid {self.pid}), {'REAL GPU' if self.gpu else 'SIMULATED GPUs'}",
                f"  hosts: {hosts}", f"  service on {INFERENCE_HOST}: {service} ({self.service_url})", *fleet_line,
                f"  {TRAINING_HOST}: {training}", f"  config: {self.config}"]


def say_line(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _read_state(layout: DrillLayout) -> dict[str, Any]:
    try:
        data = json.loads(layout.state_file.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def cmdline_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _is_hosts_process(layout: DrillLayout, pid: Any) -> bool:
    return (isinstance(pid, int) and pid_alive(pid) and "console.drill.hosts" in cmdline_of(pid)
            and str(layout.dir) in cmdline_of(pid))


def _hosts_pid(layout: DrillLayout) -> int | None:
    """The hosts' process of this drill while it lives (a reused pid is not it)."""
    try:
        pid = int(layout.pid_file.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pid = _read_state(layout).get("pid")  # still starting: no pid file yet
    return pid if _is_hosts_process(layout, pid) else None


def running_state(layout: DrillLayout) -> dict[str, Any] | None:
    pid = _hosts_pid(layout)
    state = _read_state(layout)
    if pid is not None and state.get("state") == "ready" and state.get("pid") == pid and layout.config.is_file():
        return state
    return None


@contextlib.contextmanager
def drill_lock(layout: DrillLayout) -> Iterator[None]:
    """One `up` / `down` of a drill at a time."""
    layout.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    with locked(layout.dir / ".lock"):
        yield


def _log_tail(layout: DrillLayout, chars: int = 3000) -> str:
    try:
        return layout.log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def cuda_present() -> bool:
    """Whether this machine has a CUDA GPU the drill can use (torch says so; no torch: no). Without
    an NVIDIA device node torch is not asked: importing it costs seconds of CPU on every `drill`."""
    if not any(Path("/dev").glob("nvidia[0-9]*")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def up(dir: str | os.PathLike | None = None, fresh: bool = False, python: str = sys.executable,
       say: Callable[[str], None] = say_line, timeout_s: float = READY_TIMEOUT_S, gpu: bool = False,
       memory_saver: bool = True, replicas: int = 1, router: str = fleet.SMG, crowded: bool = False,
       replace: bool = True) -> Path:
    """Bring the drill up (or find it up) and return its config's path.

    `fresh`: end a drill that is up and start a new one (the stuck-VRAM episode re-armed).
    A drill up with other settings (below) is ended first, saying so; with `replace` False (`drill up`
    and `drill` on the command line) it is refused instead, naming what runs and how to replace it
    (`--fresh`, or `drill down`): another console's run may be on it.
    `gpu`: the drill on this machine's CUDA GPU (REAL GPU); a drill up in the other mode is ended first.
    `memory_saver`: the rehearsal server runs with SGLang's memory saver (the pause route's case); a
    drill up with the other setting is ended first.
    `replicas`: more than one rehearsal server, behind SGLang's real router (console/drill/fleet.py):
    `router`, smg (the default) or sglang-router; a drill up with another count or router is ended first.
    `crowded` (with `gpu`): the card left too little room for the extraction beside the server's weights
    (the pause route releases them too); a drill up with the other setting is ended first.
    """
    if replicas < 1:
        raise DrillError(f"--replicas {replicas}: at least one rehearsal server")
    if router not in fleet.GATEWAYS:
        raise DrillError(f"--router {router}: expected one of {', '.join(fleet.GATEWAYS)}")
    if replicas > 1 and not fleet.router_installed(router):
        raise DrillError(fleet.missing_line(router))
    if crowded and not gpu:
        raise DrillError("--crowded crowds this machine's CUDA GPU: it needs --gpu")
    if gpu and not cuda_present():
        raise DrillError("--gpu: this machine has no CUDA GPU that torch can use (torch.cuda.is_available() is False)")
    if gpu and memory_saver and importlib.util.find_spec("torch_memory_saver") is None:
        raise DrillError("--gpu: the rehearsal server's memory saver needs torch_memory_saver (pip install "
                         "'dflash-ops[gpu]'), or pass --no-memory-saver")
    layout = DrillLayout.at(dir, gpu, memory_saver, replicas, router, crowded)
    with drill_lock(layout):
        running = running_state(layout)
        if running is not None:
            if (not fresh and bool(running.get("gpu")) == gpu
                    and bool(running.get("memory_saver", True)) == memory_saver
                    and bool(running.get("crowded")) == crowded
                    and running.get("replicas", 1) == replicas
                    and (replicas == 1 or running.get("router", fleet.SGLANG_ROUTER) == router)):
                return layout.config
            there, asked = describe(running), describe({"gpu": gpu, "memory_saver": memory_saver, "crowded": crowded,
                                                        "replicas": replicas, "router": router})
            if not fresh and not replace:
                raise DrillError(f"a drill is up at {layout.dir} ({there}), not the one asked for ({asked}); it is "
                                 f"left running: `dflash-ops drill down` ends it, `drill up --fresh` replaces it")
            say(f"ending the drill up at {layout.dir} ({there}) to start "
                + ("a fresh one (--fresh)" if fresh else f"the one asked for ({asked})"))
            _down_locked(layout, say)
        if procs.marked_pids(layout.dir):  # what a crashed drill left running
            say("ending processes left by an earlier drill")
            procs.end_marked(layout.dir)
        fleet.end_recorded_router(_read_state(layout))  # and its router, which the mark cannot find
        assets = ensure_assets(python, say=say, gpu=gpu)
        return _start_hosts(layout, assets, python, say, timeout_s if not gpu else max(timeout_s, GPU_READY_TIMEOUT_S))


def _start_hosts(layout: DrillLayout, assets: DrillAssets, python: str, say: Callable[[str], None],
                 timeout_s: float) -> Path:
    layout.pid_file.unlink(missing_ok=True)
    write_json_atomic(layout.state_file, {**_read_state(layout), "state": "starting", "pid": None})
    argv = [python, "-m", "console.drill.hosts", "serve", "--dir", str(layout.dir), "--assets", str(assets.root),
            "--python", python, *(["--gpu"] if layout.gpu else []),
            *([] if layout.memory_saver else ["--no-memory-saver"]), *(["--crowded"] if layout.crowded else []),
            "--replicas", str(layout.replicas),
            "--router", layout.router]
    env = {**os.environ, procs.MARK_ENV: procs.mark_value(layout.dir)}
    say(f"starting the rehearsal hosts (log: {layout.log})")
    with layout.log.open("ab") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True, close_fds=True, cwd=Path(procs.__file__).parents[2])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise DrillError(f"the rehearsal hosts exited with status {proc.returncode} before they were ready; "
                             f"{layout.log} ends with:\n{_log_tail(layout)}")
        state = _read_state(layout)
        if state.get("state") == "ready" and state.get("pid") == proc.pid:
            return layout.config
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGTERM)
    raise DrillError(f"the rehearsal hosts were not ready after {timeout_s:g} s; {layout.log} ends with:\n"
                     f"{_log_tail(layout)}")


def down(dir: str | os.PathLike | None = None, say: Callable[[str], None] = say_line) -> list[dict]:
    """Stop the hosts, the service, the training run and every process the drill started.

    Returns what became of each process that was still running at the end (`remote.endpids` outcomes).
    """
    layout = DrillLayout.at(dir)
    with drill_lock(layout):
        return _down_locked(layout, say)


def _down_locked(layout: DrillLayout, say: Callable[[str], None]) -> list[dict]:
    pid = _hosts_pid(layout)
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if pid_alive(pid):
            say(f"the rehearsal hosts (pid {pid}) did not end within {STOP_TIMEOUT_S:g} s: killing them")
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    outcomes = procs.end_marked(layout.dir)  # anything the hosts' own shutdown missed
    outcomes += fleet.end_recorded_router(_read_state(layout))  # the router: by its recorded pid
    layout.pid_file.unlink(missing_ok=True)
    if layout.state_file.exists():
        write_json_atomic(layout.state_file, {**_read_state(layout), "state": "down", "pid": None,
                                              "down_at": time.time()})
    return outcomes


def health_status(url: str | None, timeout: float = 2.0) -> int | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def running_config(dir: str | os.PathLike | None = None) -> Path | None:
    """The config of the drill that is up (its hosts' process alive and ready), else None: read-only,
    nothing asked of its hosts."""
    layout = DrillLayout.at(dir)
    return layout.config if running_state(layout) is not None else None


def status(dir: str | os.PathLike | None = None) -> DrillStatus:
    """Whether the drill is up, where, and its service's state (read-only)."""
    layout = DrillLayout.at(dir)
    state = running_state(layout)
    if state is None:
        starting = _read_state(layout)
        if starting.get("state") == "starting" and _is_hosts_process(layout, starting.get("pid")):
            return DrillStatus(layout.dir, up=False, starting=True, pid=starting["pid"])
        return DrillStatus(layout.dir, up=False, leftovers=tuple(procs.marked_pids(layout.dir)))
    service_pid = drill_service.running_pid(layout.service_state)
    trainer = state.get("trainer_pid")
    return DrillStatus(
        layout.dir, up=True, config=layout.config, pid=state["pid"], ports=dict(state.get("ports", {})),
        service_url=state.get("service_url"), service_pid=service_pid,
        service_health=health_status(state.get("service_url")) if service_pid else None,
        trainer_pid=trainer if isinstance(trainer, int) and pid_alive(trainer) else None, since=state.get("ready_at"),
        gpu=bool(state.get("gpu")), memory_saver=bool(state.get("memory_saver", True)),
        router_url=state.get("router_url"), replica_urls=tuple(state.get("replica_urls") or ()),
        router=state.get("router"),
    )


# ----------------------------------------------------------------------------------------------
# The hosts' process


class DrillSSHServer(EmbeddedSSHServer):
    """An embedded SSH server whose commands carry the drill's mark in their environment."""

    def __init__(self, *args: Any, mark: str, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.mark = mark

    def _environment(self) -> dict[str, str]:
        # The hosts are this machine: its workers see the Python packages and GPU settings the drill
        # was started with (the fast kernels may live on PYTHONPATH; the GPU machine's NVLink
        # multicast must stay off in every process).
        passed = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
        return {**super()._environment(), **passed, procs.MARK_ENV: self.mark}


def _log(msg: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {msg}", flush=True)


def _free_port(preferred: int | None) -> int:
    """`preferred` when it can be bound (the same port as the last drill), else any free one."""
    for port in ([preferred] if preferred else []) + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise DrillError("no free port on 127.0.0.1")


LINK_ABOVE_BYTES = 1 << 20  # weights are linked, small files copied


def _link_or_copy(src: str, dst: str) -> None:
    if os.path.getsize(src) < LINK_ABOVE_BYTES:  # configs and tokenizers are edited in place by tests
        shutil.copy2(src, dst)  # and operators: a hard link would change the cache under every drill
        return
    try:
        os.link(src, dst)  # the GPU drill's target is a few GB: a hard link costs nothing
    except OSError:  # another filesystem
        shutil.copy2(src, dst)


def _install(source: Path, dest: Path) -> None:
    """Put an asset directory into a host's home, replacing what was there (the cache's files are
    never written again: a hard link shares them safely)."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, dest, copy_function=_link_or_copy)


def _simulated_layout(spec: dict[str, Any]) -> dict[str, Any]:
    return simgpu.default_layout(spec["count"], spec["total_mib"], spec["name"])


def install_assets(layout: DrillLayout, assets: DrillAssets) -> None:
    """The target, its copy on the training host, the drafters and the prompts, as the cache has them
    (what a test or an operator edited in a host's home is replaced)."""
    _install(assets.target, layout.target)
    _install(assets.target, layout.target_copy)
    _install(assets.reference, layout.reference)
    _install(assets.candidate, layout.candidate)
    shutil.copyfile(assets.prompts, layout.prompts)


PROBE_CACHE = "probe-cache"  # in a host's workdir: where the preflight keeps its environment facts


def share_probe_cache(layout: DrillLayout, host: str) -> None:
    """The host's probe cache: a link to one kept beside the assets, for every drill on this machine.

    The drill's hosts are this machine with this Python, so what the probe found of a host's
    environment holds for every drill here while its fingerprint is unchanged (the probe checks that
    at each use). Kept per drill, each fresh drill probed torch, packages and kernels again on both
    hosts before its first window (about 6 CPU-seconds a host)."""
    shared = cache_root() / PROBE_CACHE / host
    shared.mkdir(parents=True, exist_ok=True, mode=0o700)
    link = layout.workdir(host) / PROBE_CACHE
    if link.is_symlink() and link.resolve() == shared.resolve():
        return
    if link.is_symlink() or link.is_file():
        link.unlink()
    elif link.is_dir():  # a drill made before the cache was shared: its facts are probed again once
        shutil.rmtree(link)
    link.symlink_to(shared, target_is_directory=True)


def prepare_hosts(layout: DrillLayout, assets: DrillAssets) -> None:
    """Homes, workdirs, assets on their hosts, empty simulated GPUs, the stuck-VRAM episode re-armed."""
    for name in HOSTS:
        layout.workdir(name).mkdir(parents=True, exist_ok=True, mode=0o700)
        layout.ssh_dir(name).mkdir(parents=True, exist_ok=True, mode=0o700)
        share_probe_cache(layout, name)
    install_assets(layout, assets)
    layout.service_state.mkdir(parents=True, exist_ok=True)
    (layout.service_state / drill_service.STUCK_MARKER).unlink(missing_ok=True)
    if layout.gpu:  # the real GPU: nothing to simulate, and no file that says otherwise
        for name in HOSTS:
            layout.simulated_gpus(name).unlink(missing_ok=True)
        return
    # A fleet's replicas share ct129, each on its own GPUs (`DrillLayout.replica_gpu_indices`).
    inference = _simulated_layout({**INFERENCE_GPUS, "count": GPUS_PER_REPLICA * max(1, layout.replicas)})
    simgpu.update(layout.simulated_gpus(INFERENCE_HOST), lambda d: d.update(inference, processes=[]), inference)
    simgpu.update(layout.simulated_gpus(TRAINING_HOST), lambda d: d.update(_simulated_layout(TRAINING_GPUS), processes=[]),
                  _simulated_layout(TRAINING_GPUS))


async def _start_server(layout: DrillLayout, name: str, python: str, preferred: int | None) -> DrillSSHServer:
    mark = procs.mark_value(layout.dir)
    for port in ([preferred] if preferred else []) + [0]:
        server = DrillSSHServer(layout.home(name), layout.ssh_dir(name), port=port, python=python, mark=mark)
        server.names = dict(HOST_NAMES.get(name, {}))  # what only this host resolves (a fleet's router)
        server.on_forward = lambda host, port, name=name: _log(f"{name}: forwarding to {host}:{port}")
        try:
            await server.start()
        except OSError as exc:
            _log(f"{name}: port {port} is taken ({exc.strerror}); taking another")
            continue
        return server
    raise DrillError(f"{name}: cannot listen on 127.0.0.1")


def run_service_command(layout: DrillLayout, argv: list[str], timeout: float = 30.0) -> str:
    """A service command run as the SSH server would run it: in ct129's home, with the drill's mark."""
    home = layout.home(INFERENCE_HOST)
    env = {**os.environ, "HOME": str(home), procs.MARK_ENV: procs.mark_value(layout.dir)}
    done = subprocess.run(argv, cwd=home, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)
    if done.returncode != 0:
        raise DrillError(f"`{' '.join(argv)}` exited with {done.returncode}: {(done.stdout + done.stderr).strip()}")
    return done.stdout.strip()


def wait_health(url: str, timeout_s: float, service_state: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if health_status(url) == 200:
            return
        if drill_service.running_pid(service_state) is None:
            log = service_state / drill_service.LOG_FILE
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            raise DrillError(f"the rehearsal server exited before it was ready; its log ends with:\n{tail}")
        time.sleep(0.2)
    raise DrillError(f"the rehearsal server did not answer /health 200 within {timeout_s:g} s")


async def serve(layout: DrillLayout, assets: DrillAssets, python: str) -> int:
    """Run the rehearsal hosts until SIGTERM; 0 after a clean shutdown."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    previous = _read_state(layout)
    servers: dict[str, DrillSSHServer] = {}
    drops: set[asyncio.Task] = set()

    def drop_links() -> None:
        # SIGUSR1: every SSH connection is cut, as a network blip would (the rehearsal of a dropped link).
        _log("SIGUSR1: dropping every SSH connection")
        for server in servers.values():
            task = asyncio.ensure_future(server.drop_connections())
            drops.add(task)
            task.add_done_callback(drops.discard)
    loop.add_signal_handler(signal.SIGUSR1, drop_links)
    trainer: subprocess.Popen | None = None
    commands: dict[str, list[str]] | None = None
    running_fleet: fleet.DrillFleet | None = None
    code = 0
    write_json_atomic(layout.state_file, {**previous, "state": "starting", "pid": os.getpid()})
    try:
        _log(f"preparing {layout.dir} from {assets.root}")
        prepare_hosts(layout, assets)
        for name in HOSTS:
            servers[name] = await _start_server(layout, name, python, previous.get("ports", {}).get(name))
            _log(f"{name}: SSH on 127.0.0.1:{servers[name].port}, home {layout.home(name)}")
        if layout.gpu:
            # Both hosts share this machine's GPU: the training host's free GPU is its free memory.
            _log(f"{TRAINING_HOST}: shares the GPU with {INFERENCE_HOST} (REAL GPU; no simulated training run)")
        else:
            with layout.training_log.open("ab") as out:
                trainer = subprocess.Popen(
                    [python, "-m", "remote.drill.trainer", "--gpu-file", str(layout.simulated_gpus(TRAINING_HOST)),
                     "--gpus", ",".join(map(str, TRAINING_BUSY_GPUS)), "--mib", str(TRAINING_MIB)],
                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                    cwd=layout.home(TRAINING_HOST))
            _log(f"{TRAINING_HOST}: simulated training run pid {trainer.pid} on GPUs {TRAINING_BUSY_GPUS}")
        service_port = _free_port(previous.get("service_port"))
        ports = {name: server.port for name, server in servers.items()}
        user = getpass.getuser()
        replica_ports = [service_port, *(_free_port(None) for _ in range(layout.replicas - 1))]
        router_port = _free_port(None) if layout.replicas > 1 else None
        write_drill_config(layout, ports, service_port, user, python, replica_ports, router_port)
        commands = service_commands(layout, python, service_port)
        _log(f"config written: {layout.config}")
        _log(f"{INFERENCE_HOST}: starting the service: {run_service_command(layout, commands['start'])}")
        url = f"http://127.0.0.1:{service_port}"
        await asyncio.to_thread(wait_health, url, SERVICE_HEALTH_TIMEOUT_S, layout.service_state)
        _log(f"{INFERENCE_HOST}: the service answers /health 200 at {url}")
        if layout.crowded:  # the card is filled once the server is up: the drill is ready when it is
            _log(f"{INFERENCE_HOST}: {await asyncio.to_thread(drill_service.wait_crowded, layout.service_state)}")
        if router_port is not None:  # --replicas: the others, then SGLang's router in front of them all
            running_fleet = await asyncio.to_thread(
                fleet.start_fleet, layout, python, replica_ports, router_port, run_service_command, wait_health,
                _log, SERVICE_HEALTH_TIMEOUT_S)
        write_json_atomic(layout.state_file, {
            "state": "ready", "pid": os.getpid(), "started_at": previous.get("started_at") or time.time(),
            "ready_at": time.time(), "ports": ports, "user": user, "service_port": service_port, "service_url": url,
            "trainer_pid": trainer.pid if trainer else None, "config": str(layout.config), "assets": str(assets.root),
            "python": python,
            "fit_taus": assets.fit_taus, "gpu": layout.gpu, "memory_saver": layout.memory_saver,
            "crowded": layout.crowded,
            "replicas": layout.replicas, "router_url": running_fleet.router_url if running_fleet else None,
            "router": running_fleet.gateway if running_fleet else None,
            "router_pid": running_fleet.router.pid if running_fleet else None,
            "router_start": start_time(running_fleet.router.pid) if running_fleet else None,
            "replica_urls": running_fleet.replica_urls if running_fleet else [url],
        })
        layout.pid_file.write_text(f"{os.getpid()}\n")
        await stop.wait()
        _log("stopping")
    except Exception as exc:  # noqa: BLE001 - logged for `up`, which reports the log's tail
        _log(f"failed: {type(exc).__name__}: {exc}")
        write_json_atomic(layout.state_file, {**_read_state(layout), "state": "failed", "pid": os.getpid(),
                                              "error": str(exc)})
        code = 1
    finally:
        if running_fleet is not None:  # the router first: it stops sending requests to replicas going down
            fleet.stop_router(running_fleet)
            for extra in running_fleet.extra_commands:
                with contextlib.suppress(DrillError, subprocess.TimeoutExpired):
                    _log(f"{INFERENCE_HOST}: stopping a replica: {run_service_command(layout, extra['stop'])}")
        await _shutdown(layout, servers, trainer, commands)
    return code


async def _shutdown(layout: DrillLayout, servers: dict[str, DrillSSHServer], trainer: subprocess.Popen | None,
                    commands: dict[str, list[str]] | None) -> None:
    if commands is not None:
        try:
            _log(f"{INFERENCE_HOST}: stopping the service: {run_service_command(layout, commands['stop'])}")
        except (DrillError, subprocess.TimeoutExpired) as exc:
            _log(f"{INFERENCE_HOST}: stopping the service failed ({exc}); its process is ended below")
    if trainer is not None and trainer.poll() is None:
        trainer.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            trainer.wait(5)
    for name, server in servers.items():
        with contextlib.suppress(Exception):
            await server.stop()
        _log(f"{name}: SSH closed")
    ended = procs.end_marked(layout.dir)
    for outcome in ended:
        _log(f"ended pid {outcome['pid']}: {outcome['outcome']} ({outcome['detail']})")
    if trainer is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            trainer.wait(1)
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    layout.pid_file.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m console.drill.hosts", description=__doc__.splitlines()[0])
    actions = parser.add_subparsers(dest="action", required=True)
    run = actions.add_parser("serve", help="run the rehearsal hosts in this process until SIGTERM")
    run.add_argument("--dir", required=True, type=Path)
    run.add_argument("--assets", required=True, type=Path, help="a complete assets directory (console.drill.assets)")
    run.add_argument("--python", default=sys.executable, help="the hosts' Python")
    run.add_argument("--gpu", action="store_true", help="the hosts share this machine's CUDA GPU (REAL GPU)")
    run.add_argument("--no-memory-saver", action="store_true", help="the rehearsal server without SGLang's memory saver")
    run.add_argument("--crowded", action="store_true", help="with --gpu: no room for the extraction beside the weights")
    run.add_argument("--replicas", type=int, default=1, help="rehearsal servers; more than one behind SGLang's router")
    run.add_argument("--router", choices=fleet.GATEWAYS, default=fleet.SMG, help="which router a fleet runs")
    args = parser.parse_args(argv)
    layout = DrillLayout.at(args.dir, args.gpu, not args.no_memory_saver, args.replicas, args.router, args.crowded)
    assets = find_assets(args.assets.parent, args.assets.name)
    if assets is None:
        print(f"{args.assets}: not a complete drill assets directory", file=sys.stderr)
        return 2
    if os.environ.get(procs.MARK_ENV) != procs.mark_value(layout.dir):
        os.environ[procs.MARK_ENV] = procs.mark_value(layout.dir)  # what it starts carries the mark
    return asyncio.run(serve(layout, assets, args.python))


if __name__ == "__main__":
    sys.exit(main())
