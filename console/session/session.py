"""The session: the live connections every view shares, publishing what it sees on one bus.

It owns one `HostSupervisor` per configured host, one telemetry stream per host, the service watch
(the manager's status, and health through a port forward made anew for each connection) and job
runners over the current connections. Views (`dflash-ops status`, `run --headless`, the TUI) and the
procedure engine use it; none of them opens a connection of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from console.config import Config, ConfigError
from console.messages import FleetView, HostState, ServiceView, TelemetryUpdate
from console.service.control import (
    CommandManager,
    ServiceMonitor,
    SystemdManager,
    manager_from_config,
    service_identity,
)
from console.service.sglang_api import SglangClient
from console.session.bus import MessageBus
from console.session.fleet_reach import FleetReach, reconnect_wait
from console.session.forwards import Forward
from console.ssh.host_specs import host_spec
from console.ssh.hosts import Host, HostError
from console.ssh.jobs import JobRunner
from console.ssh.supervisor import HostSupervisor
from console.tasks import cancel_and_wait
from console.telemetry import TelemetryStream

SIMULATED_GPU_FILE = "simulated-gpu.json"  # in the workdir of a host configured with `simulated_gpus`
SERVICE_INTERVAL_S = 5.0  # a one-token generation every few seconds, no more


def service_name(config: Config) -> str:
    return config.service.unit if config.service.manager == "systemd" else "server (command-managed)"


class ServiceWatch:
    """The service over the service host's current connection, with a port forward to its URL made
    anew for each connection (a forward dies with the connection that carried it)."""

    def __init__(self, config: Config, supervisor: HostSupervisor):
        self.config = config
        self.supervisor = supervisor
        self.last: ServiceView | None = None
        self._host: Host | None = None
        self._monitor: ServiceMonitor | None = None
        self._client: SglangClient | None = None
        self._forward = Forward(supervisor, config.service.url)  # [service] url as seen from its host
        self._forward_error: str | None = None

    async def _monitor_for(self, host: Host) -> ServiceMonitor:
        if host is self._host and self._monitor is not None and self._forward_error is None:
            return self._monitor
        service = self.config.service
        self._client = None
        try:
            self._client = SglangClient(await self._forward.local_url(host),
                                        api_key=service.api_key())  # [service] api_key_env, if any
            self._forward_error = None
        except (HostError, ConfigError) as exc:  # the manager can still be asked; health waits for the next try
            self._forward_error = f"no health check: {exc}"
        self._host = host
        self._monitor = ServiceMonitor(manager_from_config(service, host), self._client)
        return self._monitor

    async def manager(self, timeout: float | None = None) -> SystemdManager | CommandManager:
        """The service manager over the current connection (waits for one)."""
        host = await self.supervisor.wait_connected(timeout)
        return (await self._monitor_for(host)).manager

    async def client(self, timeout: float | None = None) -> SglangClient:
        """The SGLang client through the current connection's forward; HostError when none can be made."""
        host = await self.supervisor.wait_connected(timeout)
        await self._monitor_for(host)
        if self._client is None:
            raise HostError(self.config.service.host, self._forward_error or "no port forward to the server")
        return self._client

    async def check(self, paused_by: str | None = None) -> ServiceView:
        """One look: manager status, and health while it runs (not while `paused_by`, the run that
        holds the server paused: `ServiceMonitor.check`). Never raises."""
        host = self.supervisor.host
        if host is None:
            state = self.supervisor.state
            why = state.last_error or state.status
            view = ServiceView(None, None, time.time(), error=f"{self.config.service.host} is not connected ({why})")
        else:
            view = await (await self._monitor_for(host)).check(paused_by)
            if self._forward_error and view.status is not None:
                view = ServiceView(view.status, view.health, view.checked_at, error=self._forward_error,
                                   not_probed=view.not_probed)
        self.last = view
        return view


class Session:
    """Supervisors, telemetry streams, the service watch and job runners of one config's hosts."""

    def __init__(self, config: Config, bus: MessageBus | None = None, telemetry_interval: float = 1.0,
                 service_interval: float = SERVICE_INTERVAL_S, backoff: tuple[float, float] = (0.5, 10.0)):
        self.config = config
        self.bus = bus or MessageBus()
        self.service_interval = service_interval
        self.supervisors = {name: HostSupervisor(host_spec(config, name), backoff=backoff) for name in config.hosts}
        self.streams = {name: TelemetryStream(sup, self._code_dir(name), python=sup.spec.python,
                                              interval=telemetry_interval)
                        for name, sup in self.supervisors.items()}
        self.service = ServiceWatch(config, self.supervisors[config.service.host])
        self.simulated: dict[str, bool] = {name: host.simulated_gpus for name, host in config.hosts.items()}
        self._code: dict[tuple[str, int], str] = {}
        self._unsubscribe: list[Callable[[], None]] = []
        self._poller: asyncio.Task | None = None
        self._service_wake = asyncio.Event()
        self.fleet: FleetView | None = None  # [fleet]: the router and its replicas, last looked at
        # [fleet]: the router's and the replicas' URLs, each reached from the host it is seen from
        self.fleet_reach = (FleetReach(config.fleet, self.supervisors, reconnect_wait(config))
                            if config.fleet is not None else None)
        self._fleet_poller: asyncio.Task | None = None
        # The run that holds the server paused, as the run store says ("run X by alice@ct pid 12 ..."):
        # its /health is not probed meanwhile (`paused_by`). Set by whoever reads the store.
        self.paused_by: str | None = None

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, watch_service: bool = True) -> None:
        """Connect every host and start its telemetry; with `watch_service`, poll the service too."""
        for supervisor in self.supervisors.values():
            self._unsubscribe.append(supervisor.subscribe(self.bus.publish))
            supervisor.start()
        for stream in self.streams.values():
            self._unsubscribe.append(stream.subscribe(self.bus.publish))
            stream.start()
        if watch_service:
            self._poller = asyncio.create_task(self._poll_service(), name="session-service")
            if self.config.fleet is not None:
                self._fleet_poller = asyncio.create_task(self._poll_fleet(), name="session-fleet")

    async def stop(self) -> None:
        await cancel_and_wait(self._poller)
        await cancel_and_wait(self._fleet_poller)
        self._poller = self._fleet_poller = None
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        self._unsubscribe.clear()
        for stream in self.streams.values():
            await stream.stop()
        for supervisor in self.supervisors.values():
            await supervisor.stop()

    async def __aenter__(self) -> Session:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    # --- hosts and jobs -----------------------------------------------------------------------

    async def host(self, name: str, timeout: float | None = None) -> Host:
        """Host `name` once connected (waits up to `timeout`; TimeoutError past it)."""
        return await self.supervisors[name].wait_connected(timeout)

    async def runner(self, name: str, timeout: float | None = None) -> JobRunner:
        """A job runner over host `name`'s current connection."""
        return JobRunner(await self.host(name, timeout))

    def _code_dir(self, name: str):
        async def prepare(host: Host) -> str:
            key = (name, id(host))
            if key in self._code:
                return self._code[key]
            runner = JobRunner(host)
            code = await runner.ensure_code()
            # The config says which hosts are drill hosts with simulated GPUs (`simulated_gpus`);
            # a file found in a workdir never makes a real host's telemetry simulated.
            if self.simulated[name]:
                self.streams[name].simulate = f"{await runner.workdir()}/{SIMULATED_GPU_FILE}"
            self._code = {k: v for k, v in self._code.items() if k[0] != name} | {key: code}
            return code
        return prepare

    async def code_dir(self, name: str, timeout: float | None = None) -> str:
        """The worker code's directory on host `name` (shipped if the host lacks this tree)."""
        return await self._code_dir(name)(await self.host(name, timeout))

    # --- service ------------------------------------------------------------------------------

    async def check_service(self) -> ServiceView:
        """Ask the manager and the server now; published, and used to mark the service's GPU processes."""
        view = await self.service.check(self.paused_by)
        if view.status is not None:
            self.streams[self.config.service.host].set_service(service_identity(view.status))
        self.bus.publish(view)
        return view

    def address(self, config: Config) -> None:
        """Address another replica of the fleet as the service (a run's next window on it, issue 29):
        its own service watch (manager, port forward, health); the hosts and their streams stay."""
        if config.service.host not in self.supervisors:
            raise ConfigError(f"the replica's host {config.service.host} is not among [hosts]")
        self.config = config
        self.service = ServiceWatch(config, self.supervisors[config.service.host])
        self.poke_service()

    def held_paused(self, by: str | None) -> None:
        """A run holds the server paused (`by` names it) or no longer (None): checked again at once,
        so the panel stops saying the one or the other without waiting for the next interval."""
        if by != self.paused_by:
            self.paused_by = by
            last = self.service.last
            if by is not None and last is not None and last.status is not None and last.status.active:
                # At once: the health read before the pause is not the server's now, and a probe
                # already under way waits out SGLang's own check (20 s) before the next look.
                self.bus.publish(ServiceView(last.status, None, time.time(), not_probed=by))
            self.poke_service()

    def poke_service(self) -> None:
        """Check the service again now rather than at the next interval (after a stop or a start)."""
        self._service_wake.set()

    async def _poll_service(self) -> None:
        await self.wait_first_states()
        while True:  # the next check is armed when the last one finished: never piled up
            # Cleared before the check, never after: a poke that comes while a check is under way (the
            # restart's "ready" while the last check still read the server starting) is a check more at
            # once. Cleared after, it was lost, and the panel said NOT RUNNING / starting for a replica
            # that was ready and rejoining, until the next interval (issue 41).
            self._service_wake.clear()
            view = await self.check_service()
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancel that arrives as the
            # wake-up does (a poke right before stop()), and this loop would then never end.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.service_interval if view.status is not None else 1.0):
                    await self._service_wake.wait()

    # --- the fleet ([fleet]: replicas behind SGLang's router) ----------------------------------

    async def check_fleet(self) -> FleetView | None:
        """Look at the router and every replica now (console/service/fleet_watch.py); published.
        None without [fleet]."""
        if self.config.fleet is None:
            return None
        from console.service.fleet_watch import look

        self.fleet = await look(self.config.fleet, self.fleet_reach)
        self.bus.publish(self.fleet)
        return self.fleet

    async def _poll_fleet(self) -> None:
        while True:
            await self.check_fleet()
            await asyncio.sleep(self.service_interval)

    # --- snapshots for views ------------------------------------------------------------------

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

    def states(self) -> dict[str, HostState]:
        return {name: sup.state for name, sup in self.supervisors.items()}

    def telemetry(self) -> dict[str, TelemetryUpdate | None]:
        return {name: (s.telemetry.update(s.streaming, s.error) if s.telemetry.latest or s.error else None)
                for name, s in self.streams.items()}

    def all_well(self) -> bool:
        view = self.service.last
        hosts_up = all(s.status == "connected" for s in self.states().values())
        return hosts_up and view is not None and view.health is not None and view.health.ready

    def history(self, host: str, gpu: int, seconds: float | None = None) -> list[float | None]:
        """A GPU's used-memory history (MiB), oldest first: the dashboard's sparkline."""
        return self.streams[host].telemetry.history(gpu, "mem_used_mib", seconds)
