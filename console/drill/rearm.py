"""A drill that is up, brought back to how `up` left it without starting its hosts again.

`up(fresh=True)` ends the hosts and starts them again: seconds of imports, SSH servers and a
rehearsal server loading its model. Between two rehearsals on the same hosts (the tests share one
drill per process this way) most of that is still as `up` left it. `rearm(dir)`:

- ends every process the drill started for a window (the console's workers, agents, a VRAM holder
  left by a stop, a staged extractor) and any console still driving it, by the drill's mark and
  its config's path; the hosts' process and the simulated training run stay;
- empties the hosts' run directories and host locks, installs the assets again and rewrites the
  config (what a rehearsal edited is undone), and re-arms the stuck-VRAM episode (the rehearsal
  server's holder decides at the stop: `remote.drill.service`);
- keeps the rehearsal server when it serves as `up` started it (healthy, its own command line, not
  paused, nothing released, no request in flight), else starts it again and waits for /health.

A drill that is not up, or not the simulated one-server drill, is started fresh (`up(fresh=True)`).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console.drill import hosts, procs
from console.drill.assets import find_assets
from console.drill.config import service_commands, write_drill_config
from console.drill.layout import HOSTS, INFERENCE_HOST, SIMULATED_GPU_FILE, DrillLayout
from remote.drill import service as drill_service
from remote.endpids import end_processes
from remote.procstat import pid_alive, start_time

# Deployed code, the GPUs' file, and the probe's environment facts: kept under a fingerprint of the
# interpreter, its paths and installs and the probe's code (remote/probe.py), so a rehearsal that
# changes any of them is probed anew, and the next one skips ~10 CPU seconds per host.
KEPT_IN_WORKDIR = {"code", SIMULATED_GPU_FILE, f"{SIMULATED_GPU_FILE}.lock", "probe-cache"}


def rearm(dir: str | Path, say: Callable[[str], None] = hosts.say_line) -> Path:
    """The drill at `dir` as `up` leaves it; returns its config's path."""
    layout = hosts.DrillLayout.at(dir)
    with hosts.drill_lock(layout):
        state = hosts.running_state(layout)
        assets = find_assets(Path(state["assets"]).parent, Path(state["assets"]).name) if state else None
        reusable = (state is not None and assets is not None and not state.get("gpu")
                    and state.get("replicas", 1) == 1 and state.get("memory_saver", True)
                    and state.get("python") and pid_alive(state.get("trainer_pid") or 0))
        if reusable:
            _rearm_locked(layout, state, assets, say)
            return layout.config
    return hosts.up(layout.dir, fresh=True, say=say)


def _rearm_locked(layout: DrillLayout, state: dict[str, Any], assets: Any, say: Callable[[str], None]) -> None:
    python, port = state["python"], state["service_port"]
    commands = service_commands(layout, python, port)
    server = drill_service.running_pid(layout.service_state)
    info = _server_info(state["service_url"]) if server is not None else None
    serving = info is not None and _as_started(server, info, commands["start"])
    keep = {state["pid"], state["trainer_pid"]}
    if serving:
        keep |= {server, info.get("gpu_worker_pid")}
    _end(layout, keep, say)
    for name in HOSTS:
        shutil.rmtree(layout.lock_dir(name), ignore_errors=True)  # a fresh rehearsal: no run holds the host
        workdir = layout.workdir(name)
        for entry in (workdir.iterdir() if workdir.is_dir() else ()):
            if entry.name not in KEPT_IN_WORKDIR:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
    hosts.install_assets(layout, assets)
    write_drill_config(layout, state["ports"], port, state["user"], python)
    (layout.service_state / drill_service.STUCK_MARKER).unlink(missing_ok=True)
    if not serving:
        say(f"{INFERENCE_HOST}: starting the service again: {hosts.run_service_command(layout, commands['start'])}")
        hosts.wait_health(state["service_url"], hosts.SERVICE_HEALTH_TIMEOUT_S, layout.service_state)


def _as_started(pid: int, info: dict[str, Any], start_argv: list[str]) -> bool:
    """The server `up` started, serving: its pid, its command line (a rehearsal may have started it
    with a fault's flags), nothing paused or released, no request in flight."""
    standin_args = start_argv[start_argv.index("--") + 1:]
    cmdline = hosts.cmdline_of(pid).split()
    requests = info.get("requests") or {}
    return (info.get("pid") == pid and cmdline[cmdline.index("remote.drill.standin") + 1:][:len(standin_args)] == standin_args
            and not info.get("paused") and not info.get("released")
            and not any(requests.get(k) for k in ("running", "waiting", "held")))


def _server_info(url: str) -> dict[str, Any] | None:
    """/server_info when /health passes, else None."""
    if hosts.health_status(url) != 200:
        return None
    try:
        with urllib.request.urlopen(f"{url}/server_info", timeout=5) as answer:
            data = json.loads(answer.read())
    except (OSError, ValueError, urllib.error.HTTPError):
        return None
    return data if isinstance(data, dict) else None


def _end(layout: DrillLayout, keep: set[Any], say: Callable[[str], None]) -> None:
    """Every process of this drill but `keep`: marked ones, and consoles naming its config or dir."""
    for _ in range(3):  # a dying parent may start a child meanwhile
        pids = [pid for pid in {*procs.marked_pids(layout.dir), *_consoles(layout)} if pid not in keep]
        if not pids:
            return
        say(f"ending {len(pids)} process(es) left by the last rehearsal")
        end_processes([(pid, start_time(pid)) for pid in pids], 2.0)


def _consoles(layout: DrillLayout) -> list[int]:
    """dflash-ops commands driving this drill (`--config <its config>`, `--dir <it>`), not our own."""
    needles = {str(layout.config), str(layout.dir)}
    skip = procs.ancestors()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) not in skip:
            argv = hosts.cmdline_of(int(entry.name)).split()
            if any(word.rsplit("/", 1)[-1] == "dflash-ops" for word in argv[:2]) and needles & set(argv):
                found.append(int(entry.name))
    return found
