"""`dflash-ops status [--watch]`: each host's link and GPUs, and the service's state and health.

Read-only: it connects (one supervisor per host), streams the telemetry agent, asks the service
manager for its state and the server for its health through a forwarded port. It never stops or
starts anything (it does ship the worker code, which the agent needs, into the host's workdir).

A drill host whose workdir holds `simulated-gpu.json` (`remote.drill.simgpu`) is read through that file and
shown SIMULATED. One snapshot by default (exit 0 when every host is connected and the service is
ready, else 1); `--watch` redraws every second until Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from urllib.parse import urlsplit

from rich.console import Console, RenderableType
from rich.live import Live

from console.config import Config, load_config
from console.messages import HostState, ServiceView, TelemetryUpdate
from console.service.control import ServiceMonitor, manager_from_config, service_identity
from console.service.sglang_api import SglangClient
from console.ssh.host_specs import host_spec
from console.ssh.hosts import Host, HostError
from console.ssh.jobs import JobRunner
from console.ssh.supervisor import HostSupervisor
from console.telemetry import TelemetryStream
from console.views.status import status_view

SIMULATED_GPU_FILE = "simulated-gpu.json"  # in a host's workdir: the host is a drill host
FIRST_SAMPLE_WAIT_S = 15.0  # the first agent start may ship the worker code first
SERVICE_INTERVAL_S = 5.0  # like the dashboard: a one-token generation every few seconds, no more
REFRESH_S = 1.0


def service_name(config: Config) -> str:
    return config.service.unit if config.service.manager == "systemd" else "server (command-managed)"


class ServiceWatch:
    """Checks the service over the service host's current connection, with a port forward to its URL
    made anew for each connection (a forward dies with the connection that carried it)."""

    def __init__(self, config: Config, supervisor: HostSupervisor):
        self.config = config
        self.supervisor = supervisor
        self.last: ServiceView | None = None
        self._host: Host | None = None
        self._monitor: ServiceMonitor | None = None
        self._forward_error: str | None = None

    async def _monitor_for(self, host: Host) -> ServiceMonitor:
        if host is self._host and self._monitor is not None and self._forward_error is None:
            return self._monitor
        service = self.config.service
        url = urlsplit(service.url)
        port = url.port or (443 if url.scheme == "https" else 80)
        client = None
        try:
            local = await host.forward_local_port(url.hostname or "127.0.0.1", port)
            client = SglangClient(f"{url.scheme}://127.0.0.1:{local}{url.path.rstrip('/')}")
            self._forward_error = None
        except HostError as exc:  # the manager can still be asked; health waits for the next try
            self._forward_error = f"no health check: {exc}"
        self._host = host
        self._monitor = ServiceMonitor(manager_from_config(service, host), client)
        return self._monitor

    async def check(self) -> ServiceView:
        """One look: manager status, and health while it runs. Never raises."""
        host = self.supervisor.host
        if host is None:
            state = self.supervisor.state
            why = state.last_error or state.status
            view = ServiceView(None, None, time.time(), error=f"{self.config.service.host} is not connected ({why})")
        else:
            view = await (await self._monitor_for(host)).check()
            if self._forward_error and view.status is not None:
                view = ServiceView(view.status, view.health, view.checked_at, error=self._forward_error)
        self.last = view
        return view


class StatusWatcher:
    """Supervisors, telemetry streams and the service watch of every configured host."""

    def __init__(self, config: Config):
        self.config = config
        self.supervisors = {name: HostSupervisor(host_spec(config, name), backoff=(0.5, 10.0)) for name in config.hosts}
        self.streams = {name: TelemetryStream(sup, self._code_dir(name), python=sup.spec.python, interval=1.0)
                        for name, sup in self.supervisors.items()}
        self.service = ServiceWatch(config, self.supervisors[config.service.host])

    def _code_dir(self, name: str):
        async def prepare(host: Host) -> str:
            runner = JobRunner(host)
            code = await runner.ensure_code()
            simulated = f"{await runner.workdir()}/{SIMULATED_GPU_FILE}"
            sftp = await host.sftp()
            with host.errors(f"looking for {simulated}"):
                # Decided per connection, before the agent starts: a drill host reads its file.
                self.streams[name].simulate = simulated if await sftp.exists(simulated) else None
            return code
        return prepare

    def start(self) -> None:
        for supervisor in self.supervisors.values():
            supervisor.start()
        for stream in self.streams.values():
            stream.start()

    async def stop(self) -> None:
        for stream in self.streams.values():
            await stream.stop()
        for supervisor in self.supervisors.values():
            await supervisor.stop()

    async def wait_first_states(self) -> None:
        """Until every host has connected or failed once (its connect timeout bounds the wait)."""
        deadline = time.monotonic() + max(h.connect_timeout for h in self.config.hosts.values()) + 2
        while time.monotonic() < deadline and any(s.state.status == "connecting" for s in self.supervisors.values()):
            await asyncio.sleep(0.05)

    async def wait_first_samples(self, timeout: float) -> None:
        """Until every connected host's agent has sent a sample (or `timeout`)."""
        waits = [stream.wait_for(lambda s: True, timeout) for name, stream in self.streams.items()
                 if self.supervisors[name].state.status == "connected" and stream.telemetry.latest is None]
        for result in await asyncio.gather(*waits, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, TimeoutError):
                raise result

    async def check_service(self) -> ServiceView:
        view = await self.service.check()
        if view.status is not None:  # so telemetry can mark the service's GPU processes
            self.streams[self.config.service.host].set_service(service_identity(view.status))
        return view

    def states(self) -> dict[str, HostState]:
        return {name: sup.state for name, sup in self.supervisors.items()}

    def telemetry(self) -> dict[str, TelemetryUpdate | None]:
        return {name: (s.telemetry.update(s.streaming, s.error) if s.telemetry.latest or s.error else None)
                for name, s in self.streams.items()}

    def render(self) -> RenderableType:
        return status_view(self.states(), self.telemetry(), service_name(self.config), self.config.service.host,
                           self.service.last)

    def all_well(self) -> bool:
        view = self.service.last
        hosts_up = all(s.status == "connected" for s in self.states().values())
        return hosts_up and view is not None and view.health is not None and view.health.ready


async def snapshot(config: Config, console: Console) -> int:
    """Print one status view; 0 when every host is connected and the service ready, else 1."""
    watcher = StatusWatcher(config)
    watcher.start()
    try:
        await watcher.wait_first_states()
        await asyncio.gather(watcher.check_service(), watcher.wait_first_samples(FIRST_SAMPLE_WAIT_S))
        console.print(watcher.render(), soft_wrap=True)  # an error line stays one line
        return 0 if watcher.all_well() else 1
    finally:
        await watcher.stop()


async def watch(config: Config, console: Console) -> None:
    """Redraw every second until cancelled (Ctrl-C); the service is checked every few seconds."""
    watcher = StatusWatcher(config)
    watcher.start()

    async def poll_service() -> None:
        await watcher.wait_first_states()
        while True:  # the next check is armed when the last one finished: never piled up
            view = await watcher.check_service()
            # No answer from the manager yet (host still connecting): look again soon.
            await asyncio.sleep(SERVICE_INTERVAL_S if view.status is not None else REFRESH_S)

    poller = asyncio.create_task(poll_service())
    try:
        with Live(watcher.render(), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(REFRESH_S)
                live.update(watcher.render())
    finally:
        poller.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await poller
        await watcher.stop()


def run(args: argparse.Namespace) -> int:
    """`dflash-ops status [--watch]`."""
    config = load_config(args.config)
    console = Console()
    if not args.watch:
        return asyncio.run(snapshot(config, console))
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a watch ends
        asyncio.run(watch(config, console))
    return 0
