"""The drill's fleet: SGLang's real router in front of the rehearsal servers, on loopback. The router
is `smg` 1.13.0 (the Shepherd Model Gateway, what SGLang's router became) by default, or the older
`sglang-router` 0.3.2 (`drill up --replicas N --router sglang-router`); both come with the `fleet`
extra, and the console detects which one it talks to (console/service/router.py).

Each is started by its own launcher: `python -m smg launch`, `python -m sglang_router.launch_router`.
What is changed from their defaults, and why (docs/sglang.md, "Router"): they bind 0.0.0.0 (here
127.0.0.1); they open a Prometheus exporter on port 29000 whatever else runs (a second router on the
machine then fails "Address already in use"): each drill's router gets a free port for it; the
policy (`POLICY`) and the health-check interval. For smg also: `--shutdown-grace-period-secs`
(`SHUTDOWN_GRACE_S`: its SIGTERM holds the listener open min(grace/2, 5 s) and then waits for
requests in flight up to the rest: 180 s and a ~7 s stop by default), and each replica is registered
through `POST /workers` with a per-worker `health.drain_settle_secs` (`DRAIN_SETTLE_S`: smg keeps a
removed worker draining that long; 5 s by default, and its launcher has no flag for it), which the
console gives back on every rejoin. The processes retitle themselves (`smg::router`,
`sglang::router`: setproctitle, which also overwrites what /proc/PID/environ shows, so the drill's
mark does not find them): a router is ended by the pid and start time the drill's state records,
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

SMG, SGLANG_ROUTER = "smg", "sglang-router"
GATEWAYS = (SMG, SGLANG_ROUTER)  # the first is the default
MODULES = {SMG: "smg", SGLANG_ROUTER: "sglang_router"}  # what each one's installed package is called
PINS = {SMG: "smg==1.13.0", SGLANG_ROUTER: "sglang-router==0.3.2"}
HEALTH_CHECK_INTERVAL_S = 1  # the router's default is 60 s: a drill wants a dead replica seen quickly
# The router's default, cache_aware, sent every short prompt of the drill to one replica (8 of 8 in a
# row, random prefixes): round_robin spreads the drill's load so that every replica carries some.
POLICY = "round_robin"
SHUTDOWN_GRACE_S = 1  # smg: a real graceful stop (readiness off, in-flight requests waited for) in ~1 s
DRAIN_SETTLE_S = 1  # smg: how long a removed replica stays draining before smg lets it go


class RouterMissing(Exception):
    """The router asked for is not installed in this Python."""


def router_installed(gateway: str = SMG) -> bool:
    return importlib.util.find_spec(MODULES[gateway]) is not None


def missing_line(gateway: str) -> str:
    """What to say when `gateway` is not installed."""
    return f"--replicas needs SGLang's router: pip install 'dflash-ops[fleet]' ({PINS[gateway]})"


def router_command(python: str, port: int, prometheus_port: int, worker_urls: list[str], *extra: str,
                   gateway: str = SMG) -> list[str]:
    """The argv that starts the router on 127.0.0.1:`port`. sglang-router takes its workers on the
    command line; smg starts with none (`register_workers` adds them with their settle)."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
              "--prometheus-port", str(prometheus_port), "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S),
              "--policy", POLICY]
    if gateway == SMG:
        return [python, "-m", "smg", "launch", *common, "--shutdown-grace-period-secs", str(SHUTDOWN_GRACE_S), *extra]
    return [python, "-m", "sglang_router.launch_router", *common, "--worker-urls", *worker_urls, *extra]


def register_workers(router_url: str, worker_urls: list[str], gateway: str, key: str | None = None) -> None:
    """smg: POST each replica with its drain settle (`DRAIN_SETTLE_S`); sglang-router has them from its
    command line. The adds land in the background (`wait_router` waits for them)."""
    if gateway != SMG:
        return
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    for url in worker_urls:
        body = json.dumps({"url": url, "health": {"drain_settle_secs": DRAIN_SETTLE_S}}).encode()
        request = urllib.request.Request(router_url + "/workers", body, headers, method="POST")
        with urllib.request.urlopen(request, timeout=10) as answer:
            answer.read()


class FleetError(Exception):
    """The drill's fleet did not come up; the message says what and ends with the router's log."""


@dataclass
class DrillFleet:
    """The running fleet of a drill: the router's process and URL, which gateway it is, each replica's
    URL, and the service commands of the replicas after the first (the first is the drill's own
    service)."""

    router: subprocess.Popen
    router_url: str
    replica_urls: list[str]
    extra_commands: list[dict[str, list[str]]] = field(default_factory=list)
    gateway: str = SMG


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listing(url: str, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(url + "/workers", headers=headers), timeout=5) as answer:
        return json.loads(answer.read())["workers"]


def _log_tail(log: Path) -> str:
    return log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"


def wait_router(router_url: str, replica_urls: list[str], proc: subprocess.Popen, log: Path, timeout_s: float,
                key: str | None = None) -> None:
    """Until the router lists every replica healthy (it registers its workers in the background)."""
    deadline = time.monotonic() + timeout_s
    seen: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FleetError(f"the router exited with status {proc.returncode}; {log} ends with:\n{_log_tail(log)}")
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            seen = _listing(router_url, key)
            if set(replica_urls) <= {w["url"] for w in seen if w.get("is_healthy")}:
                return
        time.sleep(0.2)
    listed = ", ".join(f"{w.get('url')} {'healthy' if w.get('is_healthy') else 'unhealthy'}" for w in seen) or "none"
    raise FleetError(f"the router at {router_url} did not list {', '.join(replica_urls)} healthy within {timeout_s:g} s "
                     f"(listed: {listed}); {log} ends with:\n{_log_tail(log)}")


def wait_listening(router_url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until the router answers GET /health (smg's workers are added through its API: it must listen)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FleetError(f"the router exited with status {proc.returncode}; {log} ends with:\n{_log_tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(router_url + "/health", timeout=2) as answer:
            if answer.status == 200:
                return
        time.sleep(0.1)
    raise FleetError(f"the router at {router_url} did not answer /health within {timeout_s:g} s; {log} ends "
                     f"with:\n{_log_tail(log)}")


def launch_router(gateway: str, python: str, port: int, worker_urls: list[str], log: Path, timeout_s: float,
                  *extra: str, key: str | None = None, cwd: Path | None = None) -> tuple[subprocess.Popen, str]:
    """Start `gateway` on 127.0.0.1:`port` in front of `worker_urls` and return (process, URL) once it
    lists every one healthy (read with the admin `key` when it has control-plane keys); FleetError
    (the router ended first) with its log's tail otherwise."""
    if not router_installed(gateway):
        raise RouterMissing(missing_line(gateway))
    argv = router_command(python, port, _free_port(), worker_urls, *extra, gateway=gateway)
    with log.open("ab") as out:  # the router inherits the caller's environment (the drill's mark)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=cwd)
    url = f"http://127.0.0.1:{port}"
    try:
        if gateway == SMG:
            wait_listening(url, proc, log, timeout_s)
            register_workers(url, worker_urls, gateway, key)
        wait_router(url, worker_urls, proc, log, timeout_s, key)
    except (FleetError, OSError) as exc:
        stop_process(proc)
        if isinstance(exc, FleetError):
            raise
        raise FleetError(f"registering the replicas with the router at {url} failed: {exc}; {log} ends with:\n"
                         f"{_log_tail(log)}") from None
    return proc, url


def start_fleet(layout: DrillLayout, python: str, replica_ports: list[int], router_port: int,
                run_command: Callable[[DrillLayout, list[str]], str], wait_health: Callable[[str, float, Path], None],
                log: Callable[[str], None], timeout_s: float) -> DrillFleet:
    """Start the replicas after the first (already serving) and then the router (`layout.router`) in
    front of them all; return once the router lists every replica healthy. Each replica holds its own
    GPUs of ct129's simulated file (laid out for all of them by `prepare_hosts`)."""
    gateway = layout.router
    if not router_installed(gateway):
        raise RouterMissing(missing_line(gateway))
    urls = [f"http://127.0.0.1:{port}" for port in replica_ports]
    extra = []
    for index, port in enumerate(replica_ports[1:], 1):
        commands = service_commands(layout, python, port, index)
        log(f"{INFERENCE_HOST}: starting replica r{index + 1}: {run_command(layout, commands['start'])}")
        extra.append(commands)
    for index, url in enumerate(urls[1:], 1):
        wait_health(url, timeout_s, layout.replica_state(index))
        log(f"{INFERENCE_HOST}: replica r{index + 1} answers /health 200 at {url}")
    router, router_url = launch_router(gateway, python, router_port, urls, layout.router_log, timeout_s)
    log(f"router ({gateway}) pid {router.pid} at {router_url} (log: {layout.router_log})")
    log(f"router lists {len(urls)} replicas healthy")
    return DrillFleet(router, router_url, urls, extra, gateway)


def stop_process(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End a router's process (TERM: its graceful stop, then KILL past `grace_s`)."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stop_router(fleet: DrillFleet, grace_s: float = 5.0) -> None:
    """End the router by its pid (TERM, then KILL)."""
    stop_process(fleet.router, grace_s)


def end_recorded_router(state: dict[str, Any], grace_s: float = 2.0) -> list[dict]:
    """End the router a drill's state names, if it is still that process (pid and start time). The
    drill's mark cannot find it: setproctitle rewrites the memory /proc/PID/environ is read from."""
    pid, started = state.get("router_pid"), state.get("router_start")
    if not isinstance(pid, int) or not isinstance(started, int) or start_time(pid) != started:
        return []
    return end_processes([(pid, started)], grace_s, gpu_check="off")
