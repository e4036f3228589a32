"""The drill's fleet: SGLang's real router (`sglang-router` from PyPI, the `fleet` extra) in front of
the rehearsal servers, on loopback.

The router is started as `python -m sglang_router.launch_router` (its own launcher). Two of its
defaults are changed, and why (docs/sglang.md, "Router"): it binds 0.0.0.0 (here 127.0.0.1), and it
opens a Prometheus exporter on port 29000 whatever else runs (a second router on the machine then
panics "Address already in use"): each drill's router gets a free port for it; and its policy
(`POLICY`). Its process retitles
itself `sglang::router` (setproctitle, which also overwrites what /proc/PID/environ shows, so the
drill's mark does not find it): it is ended by the pid and start time the drill's state records,
never by name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from console.drill.config import service_commands
from console.drill.layout import INFERENCE_HOST, DrillLayout
from remote.endpids import end_processes
from remote.procstat import start_time

ROUTER_MODULE = "sglang_router.launch_router"
HEALTH_CHECK_INTERVAL_S = 1  # the router's default is 60 s: a drill wants a dead replica seen quickly
# The router's default, cache_aware, sent every short prompt of the drill to one replica (8 of 8 in a
# row, random prefixes): round_robin spreads the drill's load so that every replica carries some.
POLICY = "round_robin"


class RouterMissing(Exception):
    """sglang-router is not installed in this Python."""


def router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def router_command(python: str, port: int, prometheus_port: int, worker_urls: list[str],
                   *extra: str) -> list[str]:
    """The argv that starts the router on 127.0.0.1:`port` with these workers."""
    return [python, "-m", ROUTER_MODULE, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S), "--policy", POLICY,
            "--worker-urls", *worker_urls, *extra]


class FleetError(Exception):
    """The drill's fleet did not come up; the message says what and ends with the router's log."""


@dataclass
class DrillFleet:
    """The running fleet of a drill: the router's process and URL, each replica's URL, and the service
    commands of the replicas after the first (the first is the drill's own service)."""

    router: subprocess.Popen
    router_url: str
    replica_urls: list[str]
    extra_commands: list[dict[str, list[str]]] = field(default_factory=list)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listing(url: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(url + "/workers", timeout=5) as answer:
        return json.loads(answer.read())["workers"]


def wait_router(router_url: str, replica_urls: list[str], proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until the router lists every replica healthy (it registers its workers in the background)."""
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FleetError(f"the router exited with status {proc.returncode}; {log} ends with:\n"
                             f"{log.read_text(errors='replace')[-2000:]}")
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            seen = _listing(router_url)
            if set(replica_urls) <= {w["url"] for w in seen if w.get("is_healthy")}:
                return
        time.sleep(0.2)
    listed = ", ".join(f"{w.get('url')} {'healthy' if w.get('is_healthy') else 'unhealthy'}" for w in seen) or "none"
    raise FleetError(f"the router at {router_url} did not list {', '.join(replica_urls)} healthy within {timeout_s:g} s "
                     f"(listed: {listed}); {log} ends with:\n{log.read_text(errors='replace')[-2000:]}")


def start_fleet(layout: DrillLayout, python: str, replica_ports: list[int], router_port: int,
                run_command: Callable[[DrillLayout, list[str]], str], wait_health: Callable[[str, float, Path], None],
                log: Callable[[str], None], timeout_s: float) -> DrillFleet:
    """Start the replicas after the first (already serving) and then the router in front of them all;
    return once the router lists every replica healthy. Each replica holds its own GPUs of ct129's
    simulated file (laid out for all of them by `prepare_hosts`)."""
    if not router_installed():
        raise RouterMissing("--replicas needs SGLang's router: pip install 'dflash-ops[fleet]' (sglang-router==0.3.2)")
    urls = [f"http://127.0.0.1:{port}" for port in replica_ports]
    extra = []
    for index, port in enumerate(replica_ports[1:], 1):
        commands = service_commands(layout, python, port, index)
        log(f"{INFERENCE_HOST}: starting replica r{index + 1}: {run_command(layout, commands['start'])}")
        extra.append(commands)
    for index, url in enumerate(urls[1:], 1):
        wait_health(url, timeout_s, layout.replica_state(index))
        log(f"{INFERENCE_HOST}: replica r{index + 1} answers /health 200 at {url}")
    argv = router_command(python, router_port, _free_port(), urls)
    with layout.router_log.open("ab") as out:  # the router inherits the drill's mark: `down` ends it too
        router = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                  start_new_session=True)
    router_url = f"http://127.0.0.1:{router_port}"
    log(f"router pid {router.pid} at {router_url} (log: {layout.router_log})")
    fleet = DrillFleet(router, router_url, urls, extra)
    try:
        wait_router(router_url, urls, router, layout.router_log, timeout_s)
    except FleetError:
        stop_router(fleet)
        raise
    log(f"router lists {len(urls)} replicas healthy")
    return fleet


def stop_router(fleet: DrillFleet, grace_s: float = 5.0) -> None:
    """End the router by its pid (TERM, then KILL)."""
    if fleet.router.poll() is None:
        fleet.router.terminate()
        try:
            fleet.router.wait(grace_s)
        except subprocess.TimeoutExpired:
            fleet.router.kill()
            fleet.router.wait()


def end_recorded_router(state: dict[str, Any], grace_s: float = 2.0) -> list[dict]:
    """End the router a drill's state names, if it is still that process (pid and start time). The
    drill's mark cannot find it: setproctitle rewrites the memory /proc/PID/environ is read from."""
    pid, started = state.get("router_pid"), state.get("router_start")
    if not isinstance(pid, int) or not isinstance(started, int) or start_time(pid) != started:
        return []
    return end_processes([(pid, started)], grace_s, gpu_check="off")
