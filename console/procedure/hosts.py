"""What the engine does to the hosts, in one narrow interface (`WindowHosts`).

The engine never touches a connection, an SFTP handle or a systemctl line itself: it asks this
interface, so that every decision it makes can be tested in seconds over small named fakes
(`tests/engine_fakes.py`) and the same engine runs over the live session (`SessionHosts`, here) on
the drill and in production. Each method is one thing an operator would name: run a command on a
host, read a file, start or find or follow a job, ask the service manager, wait for telemetry.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from console.messages import (
    EndOutcome,
    ServiceHealth,
    ServiceStatus,
    ServiceView,
    StartupProgress,
    VramHolder,
)
from console.procedure import remote_files
from console.service.control import start_and_wait, wait_ready
from console.service.sglang_api import MEMORY_TIMEOUT_S, ServerUnreachable
from console.service.vram import end_holders, endpids_argv
from console.session import Session
from console.session.bus import MessageBus
from console.session.fleet_reach import reconnect_wait
from console.ssh.hosts import HostError
from console.ssh.jobs import JobHandle, JobRunner, JobStatus, follow_with_reconnect

Progress = Callable[[int, int], None]
JOB_POLL_S = 0.2  # how often an idle job's events file is read
# The extractor's events open and end the window (its `gpu_released` begins the restart or the
# give-back): read five times as often, so the console's notice is not part of the downtime.
EXTRACT_POLL_S = 0.04


class ServiceManager(Protocol):
    """The service's manager as the engine needs it (systemd unit or user commands)."""

    name: str

    def stop_argv(self) -> list[str]: ...
    def start_argv(self) -> list[str]: ...
    async def status(self) -> ServiceStatus: ...
    async def stop(self) -> None: ...
    async def history(self) -> dict[str, Any] | None: ...


class TelemetryWatch(Protocol):
    """One host's telemetry stream: the newest sample and a wait for a matching one."""

    telemetry: Any  # .latest, .host, .received_at, .seen_service_pids
    error: str | None

    async def wait_for(self, predicate: Callable[[Any], bool], timeout: float, after: float | None = None,
                       eager: bool = False) -> Any: ...


class WindowHosts(Protocol):
    bus: MessageBus

    def simulated(self, host: str) -> bool: ...
    def link_state(self, host: str) -> str: ...
    async def connect(self, host: str, timeout: float) -> None: ...
    async def workdir(self, host: str) -> str: ...
    async def code_dir(self, host: str) -> str: ...
    async def run(self, host: str, argv: list[str], timeout: float | None = None) -> None: ...
    async def read_text(self, host: str, path: str) -> str: ...
    async def write_text(self, host: str, path: str, text: str) -> None: ...
    async def lock_file(self, host: str, op: str, args: list[str]) -> dict: ...
    async def manifest_complete(self, host: str, path: str) -> bool: ...
    async def relay_file(self, src: str, src_path: str, dst: str, dst_path: str, progress: Progress) -> None: ...
    async def relay_tree(self, src: str, src_path: str, dst: str, progress: Progress) -> tuple[str, int]: ...
    async def export_heads(self, host: str, model_path: str, out: str) -> None: ...
    async def fetch_tree(self, host: str, remote_dir: str, local_dir: Path, progress: Progress) -> None: ...
    async def start_job(self, host: str, worker: str, args: list[str], env: dict[str, str] | None,
                        job_id: str) -> JobHandle: ...
    async def find_job(self, host: str, job_id: str) -> JobHandle | None: ...
    async def job_status(self, handle: JobHandle) -> JobStatus: ...
    async def cancel_job(self, handle: JobHandle, grace: float) -> JobStatus: ...
    def follow_job(self, handle: JobHandle, offset: int, connect_timeout: float) -> AsyncIterator[tuple[int, dict]]: ...
    async def stderr_tail(self, handle: JobHandle) -> str: ...
    async def service_manager(self, timeout: float) -> ServiceManager: ...
    async def start_service_and_wait(self, timeout: float, on_progress: Callable[[StartupProgress], Any]) -> ServiceHealth: ...
    async def wait_service_ready(self, timeout: float) -> ServiceHealth: ...
    async def check_service(self) -> ServiceView: ...
    def poke_service(self) -> None: ...
    def telemetry(self, host: str) -> TelemetryWatch: ...
    async def wait_first_samples(self, timeout: float) -> None: ...
    async def endpids_argv(self, host: str, holders: Sequence[VramHolder], grace_s: float, sudo: bool) -> list[str]: ...
    async def end_holders(self, host: str, holders: Sequence[VramHolder], grace_s: float, sudo: bool) -> list[EndOutcome]: ...
    async def crosscheck(self, config: Any, run_dir: Path, run_id: str, facts: dict[str, Any]) -> Any: ...
    async def server(self) -> Any: ...  # the SGLang client (`SglangClient`'s calls): the pause route's requests


class _FreshClient:
    """The SGLang client taken anew for every request: a reconnect during a long model load makes a
    new port forward, and a client bound once would keep asking the dead one."""

    def __init__(self, session: Session, timeout: float):
        self._session = session
        self._timeout = timeout

    def within(self, budget: float) -> Any:
        return _Deferred(self._session, self._timeout, budget)


class _Deferred:
    def __init__(self, session: Session, timeout: float, budget: float):
        self._session, self._timeout, self._budget = session, timeout, budget

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                client = await self._session.service.client(min(self._timeout, self._budget))
            except (HostError, TimeoutError) as exc:  # no connection or forward now: this poll had no answer
                raise ServerUnreachable(f"no way to the server right now: {exc}") from None
            return await getattr(client.within(self._budget), name)(*args, **kwargs)
        return call


class SessionHosts:
    """`WindowHosts` over the live session's connections (the drill's hosts and real ones alike)."""

    def __init__(self, session: Session):
        self.session = session
        self.bus = session.bus
        self.connect_s = reconnect_wait(session.config)

    def address(self, config: Any) -> None:
        """A fleet run's next window: the service is now that replica (its manager and server)."""
        self.session.address(config)

    async def _connection(self, host: str, wait: Callable[[str, float], Any]) -> Any:
        """What `wait` gives for `host`; a host not back in time is a HostError naming it."""
        try:
            return await wait(host, self.connect_s)
        except TimeoutError:
            raise HostError(host, f"not connected within {self.connect_s:.0f} s ({self.link_state(host)})") from None

    def simulated(self, host: str) -> bool:
        return bool(self.session.simulated.get(host))

    def link_state(self, host: str) -> str:
        state = self.session.supervisors[host].state
        return state.last_error or state.status

    def router_client(self) -> Any:
        """[fleet]'s router, reached from `router_host` when given (console/session/fleet_reach.py)."""
        return self._fleet_reach().router_client()

    def replica_client(self, replica: Any) -> Any:
        """A replica's own server: its `url` as seen from its `host`, through that host's connection."""
        return self._fleet_reach().replica_client(replica)

    def _fleet_reach(self) -> Any:
        reach = self.session.fleet_reach
        if reach is None:
            raise HostError("console", "this config has no [fleet]: no router or replica to reach")
        return reach

    async def connect(self, host: str, timeout: float) -> None:
        await self.session.host(host, timeout)

    async def _host(self, host: str) -> Any:
        return await self._connection(host, self.session.host)

    async def _runner_on(self, host: str) -> JobRunner:
        return await self._connection(host, self.session.runner)

    async def workdir(self, host: str) -> str:
        return await (await self._runner_on(host)).workdir()

    async def code_dir(self, host: str) -> str:
        return await self._connection(host, self.session.code_dir)

    async def run(self, host: str, argv: list[str], timeout: float | None = None) -> None:
        await (await self._host(host)).run(argv, timeout=timeout)

    async def read_text(self, host: str, path: str) -> str:
        return await remote_files.read_text(await self._host(host), path)

    async def write_text(self, host: str, path: str, text: str) -> None:
        await remote_files.write_text(await self._host(host), path, text)

    async def lock_file(self, host: str, op: str, args: list[str]) -> dict:
        return await remote_files.lock_file(await self._host(host), op, args)

    async def manifest_complete(self, host: str, path: str) -> bool:
        code = await self.code_dir(host)
        return await remote_files.manifest_complete(await self._host(host), code, path)

    async def relay_file(self, src: str, src_path: str, dst: str, dst_path: str, progress: Progress) -> None:
        await remote_files.relay_file(await self._host(src), src_path, await self._host(dst), dst_path, progress=progress)

    async def relay_tree(self, src: str, src_path: str, dst: str, progress: Progress) -> tuple[str, int]:
        src_host = await self._host(src)
        dst_root = f"{await self.workdir(dst)}/relayed"
        return await remote_files.relay_tree(src_host, await src_host.expand(src_path), await self._host(dst), dst_root,
                                             progress=progress)

    async def export_heads(self, host: str, model_path: str, out: str) -> None:
        await remote_files.export_heads(await self._host(host), await self.code_dir(host), model_path, out)

    async def fetch_tree(self, host: str, remote_dir: str, local_dir: Path, progress: Progress) -> None:
        await remote_files.fetch_tree(await self._host(host), remote_dir, local_dir, progress=progress)

    async def start_job(self, host: str, worker: str, args: list[str], env: dict[str, str] | None,
                        job_id: str) -> JobHandle:
        return await (await self._runner_on(host)).start(worker, args, env=env, job_id=job_id)

    async def find_job(self, host: str, job_id: str) -> JobHandle | None:
        runner = await self._runner_on(host)
        try:
            return await runner.attach(job_id)
        except (FileNotFoundError, KeyError, LookupError):
            return None

    async def _runner(self, handle: JobHandle) -> JobRunner:
        return await self._runner_on(handle.host)

    async def job_status(self, handle: JobHandle) -> JobStatus:
        return await (await self._runner(handle)).status(handle)

    async def cancel_job(self, handle: JobHandle, grace: float) -> JobStatus:
        return await (await self._runner(handle)).cancel(handle, grace=grace)

    async def follow_job(self, handle: JobHandle, offset: int, connect_timeout: float) -> AsyncIterator[tuple[int, dict]]:
        supervisor = self.session.supervisors[handle.host]
        poll = EXTRACT_POLL_S if handle.worker == "extract" else JOB_POLL_S
        async for item in follow_with_reconnect(supervisor, handle, offset=offset, connect_timeout=connect_timeout,
                                                poll_interval=poll):
            yield item

    async def stderr_tail(self, handle: JobHandle) -> str:
        with contextlib.suppress(Exception):
            return await (await self._runner(handle)).stderr_tail(handle)
        return ""

    async def service_manager(self, timeout: float) -> ServiceManager:
        host = self.session.config.service.host
        try:
            return await self.session.service.manager(timeout)
        except TimeoutError:
            raise HostError(host, f"not connected within {timeout:.0f} s ({self.link_state(host)}): the service "
                                  f"manager cannot be asked") from None

    async def start_service_and_wait(self, timeout: float, on_progress: Callable[[StartupProgress], Any]) -> ServiceHealth:
        manager = await self.service_manager(self.connect_s)
        host = await self._host(self.session.config.service.host)
        return await start_and_wait(manager, _FreshClient(self.session, self.connect_s), timeout, host=host,
                                    on_progress=on_progress)

    async def wait_service_ready(self, timeout: float) -> ServiceHealth:
        manager = await self.service_manager(self.connect_s)
        return await wait_ready(_FreshClient(self.session, self.connect_s), timeout, manager=manager)

    async def check_service(self) -> ServiceView:
        return await self.session.check_service()

    def poke_service(self) -> None:
        self.session.poke_service()

    def telemetry(self, host: str) -> TelemetryWatch:
        return self.session.streams[host]

    async def wait_first_samples(self, timeout: float) -> None:
        await self.session.wait_first_samples(timeout)

    async def endpids_argv(self, host: str, holders: Sequence[VramHolder], grace_s: float, sudo: bool) -> list[str]:
        h = await self._host(host)
        return endpids_argv(await h.resolve_python(), await self.code_dir(host), holders, grace_s, sudo=sudo)

    async def end_holders(self, host: str, holders: Sequence[VramHolder], grace_s: float, sudo: bool) -> list[EndOutcome]:
        h = await self._host(host)
        return await end_holders(h, await h.resolve_python(), await self.code_dir(host), holders, grace_s, sudo=sudo)

    async def server(self) -> Any:
        """The SGLang server's client, taken anew for every request (through the session's forward),
        with room for the slowest control request (releasing weights to their CPU backup)."""
        return _FreshClient(self.session, self.connect_s).within(MEMORY_TIMEOUT_S + self.connect_s)

    async def crosscheck(self, config: Any, run_dir: Path, run_id: str, facts: dict[str, Any]) -> Any:
        """The online cross-check over the session's service client (`console/procedure/crosscheck.py`)."""
        from console.procedure.crosscheck import crosscheck_run

        return await crosscheck_run(self.session, config, run_dir, run_id, facts, self.connect_s)


