"""Service control: the inference server's manager (systemd or user commands), health and readiness.

Managers run their commands through a runner with `Host.run`'s shape
(`await run(argv, check=..., timeout=...) -> CommandResult(exit_status, stdout, stderr)`):
- `SystemdManager`: `systemctl is-active / show / stop / start UNIT` (optionally `sudo -n`), and
  `journalctl -u UNIT -f` for the start-up log.
- `CommandManager`: the configured start / stop / status commands (a string runs through `sh -c`,
  a list is argv). Status: exit 0 means running; if it prints a number first, that is the main pid.
  The optional log command (e.g. `tail -n +1 -F /var/log/sglang.log`) gives the start-up log.
Health goes through the forwarded port (`console.service.sglang_api`): ready = /health 200 and a one-token
/generate. SGLang's start-up log lines become `StartupProgress`.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from console.config import ServiceConfig
from console.messages import ServiceHealth, ServiceStatus, ServiceView, StartupProgress
from console.service.sglang_api import ServerAnswerError, ServerUnreachable, SglangClient, server_summary
from console.tasks import cancel_and_wait
from console.telemetry import ServiceIdentity

SHOW_PROPERTIES = ("ActiveState", "SubState", "MainPID", "ActiveEnterTimestamp", "ControlGroup", "LoadState", "Result")
COMMAND_TIMEOUT_S = 120.0


class ServiceError(Exception):
    """A service command failed; the message names the command and what it printed."""


class Runner(Protocol):
    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None) -> Any: ...


def parse_systemctl_show(text: str) -> dict[str, str]:
    """`systemctl show -p A,B UNIT` output (KEY=VALUE lines) -> dict; values keep their '=' signs."""
    props: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip():
            props[key.strip()] = value.strip()
    return props


def parse_systemd_timestamp(text: str | None) -> float | None:
    """'Sun 2026-11-29 09:20:43 UTC' -> unix time; '', 'n/a' or an unknown shape -> None.

    The zone is an abbreviation that Python cannot always resolve; UTC is read exactly, any other
    zone as the console's local time (systemctl prints the host's local zone, usually the same).
    """
    if not text or text.strip() in ("n/a", "0"):
        return None
    match = re.match(r"^(?:\w{3} )?(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})(?:\.\d+)?(?: (\S+))?$", text.strip())
    if not match:
        return None
    stamp = datetime.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")
    if match.group(2) in ("UTC", "GMT", "Z"):
        return stamp.replace(tzinfo=UTC).timestamp()
    return stamp.timestamp()


def status_from_show(unit: str, props: dict[str, str], is_active: str | None = None) -> ServiceStatus:
    """A `ServiceStatus` from `systemctl show` properties (and `is-active`'s word, when known)."""
    state = props.get("ActiveState") or (is_active or "unknown")
    if props.get("LoadState") == "not-found":
        return ServiceStatus("systemd", unit, False, "not-found", detail=f"unit {unit} not found on the host")
    try:
        main_pid = int(props.get("MainPID", "0")) or None
    except ValueError:
        main_pid = None
    detail = f"result: {props['Result']}" if props.get("Result") not in (None, "", "success") else None
    return ServiceStatus(
        manager="systemd",
        name=unit,
        active=state == "active",
        state=state,
        sub_state=props.get("SubState") or None,
        main_pid=main_pid,
        since=parse_systemd_timestamp(props.get("ActiveEnterTimestamp")),
        cgroup=props.get("ControlGroup") or None,
        detail=detail,
    )


def _output(result: Any) -> str:
    return ((result.stdout or "") + (result.stderr or "")).strip()


class SystemdManager:
    """A systemd unit, controlled with systemctl (optionally through `sudo -n`)."""

    kind = "systemd"

    def __init__(self, runner: Runner, unit: str, sudo: bool = False, timeout: float = COMMAND_TIMEOUT_S):
        self.runner = runner
        self.unit = unit
        self.sudo = sudo
        self.timeout = timeout

    @property
    def name(self) -> str:
        return self.unit

    def argv(self, *words: str) -> list[str]:
        """The exact command for a systemctl verb (shown in the confirm modal before it runs)."""
        base = ["systemctl", *words]
        return ["sudo", "-n", *base] if self.sudo else base

    def stop_argv(self) -> list[str]:
        return self.argv("stop", self.unit)

    def start_argv(self) -> list[str]:
        return self.argv("start", self.unit)

    def log_argv(self) -> list[str]:
        """journalctl following the unit from now on: the start-up log of the next start."""
        base = ["journalctl", "-u", self.unit, "-f", "-n", "0", "-o", "cat", "--no-pager"]
        return ["sudo", "-n", *base] if self.sudo else base

    async def status(self) -> ServiceStatus:
        # is-active exits non-zero for anything but active: that is an answer, not a failure.
        active = await self.runner.run(self.argv("is-active", self.unit), check=False, timeout=self.timeout)
        show = await self.runner.run(
            self.argv("show", self.unit, "-p", ",".join(SHOW_PROPERTIES)), check=False, timeout=self.timeout
        )
        if show.exit_status != 0:
            raise ServiceError(f"`{' '.join(self.argv('show', self.unit))}` failed (exit {show.exit_status}): {_output(show)}")
        return status_from_show(self.unit, parse_systemctl_show(show.stdout), active.stdout.strip() or None)

    async def _verb(self, argv: list[str]) -> None:
        result = await self.runner.run(argv, check=False, timeout=self.timeout)
        if result.exit_status != 0:
            hint = " (sudo needs a password: allow it in sudoers with NOPASSWD, or run as root)" if (
                self.sudo and "password" in _output(result).lower()) else ""
            raise ServiceError(f"`{' '.join(argv)}` failed (exit {result.exit_status}): {_output(result)}{hint}")

    async def stop(self) -> None:
        await self._verb(self.stop_argv())

    async def start(self) -> None:
        await self._verb(self.start_argv())


def command_argv(command: str | Sequence[str], sudo: bool = False) -> list[str]:
    """A configured command as argv: a string runs through `sh -c`, a list is taken as it is."""
    argv = ["sh", "-c", command] if isinstance(command, str) else list(command)
    return ["sudo", "-n", *argv] if sudo else argv


class CommandManager:
    """A server controlled by user-given start / stop / status commands."""

    kind = "command"

    def __init__(self, runner: Runner, start: str | Sequence[str], stop: str | Sequence[str],
                 status: str | Sequence[str], name: str = "server", sudo: bool = False,
                 log: str | Sequence[str] | None = None, timeout: float = COMMAND_TIMEOUT_S):
        self.runner = runner
        self.start_command = start
        self.stop_command = stop
        self.status_command = status
        self.log_command = log
        self.name = name
        self.sudo = sudo
        self.timeout = timeout

    def stop_argv(self) -> list[str]:
        return command_argv(self.stop_command, self.sudo)

    def start_argv(self) -> list[str]:
        return command_argv(self.start_command, self.sudo)

    def log_argv(self) -> list[str] | None:
        return command_argv(self.log_command, self.sudo) if self.log_command else None

    async def status(self) -> ServiceStatus:
        result = await self.runner.run(command_argv(self.status_command, self.sudo), check=False, timeout=self.timeout)
        words = result.stdout.split()
        main_pid = int(words[0]) if words and words[0].isdigit() else None
        running = result.exit_status == 0
        return ServiceStatus(
            manager="command",
            name=self.name,
            active=running,
            state="running" if running else "stopped",
            main_pid=main_pid if running else None,
            detail=_output(result)[:200] or None,
        )

    async def _run(self, argv: list[str]) -> None:
        result = await self.runner.run(argv, check=False, timeout=self.timeout)
        if result.exit_status != 0:
            raise ServiceError(f"`{' '.join(argv)}` failed (exit {result.exit_status}): {_output(result)}")

    async def stop(self, wait_s: float = 60.0, poll_s: float = 0.2) -> None:
        """Run the stop command, then wait until the status command says stopped (a stop command
        such as `kill` returns at once; systemctl stop would have waited)."""
        await self._run(self.stop_argv())
        deadline = time.monotonic() + wait_s
        while (await self.status()).active:
            if time.monotonic() >= deadline:
                raise ServiceError(f"{self.name} still running {wait_s:.0f} s after `{' '.join(self.stop_argv())}`")
            await asyncio.sleep(poll_s)

    async def start(self) -> None:
        await self._run(self.start_argv())


def service_identity(status: ServiceStatus) -> ServiceIdentity:
    """How telemetry recognises the service's processes, from what its manager reports."""
    return ServiceIdentity(main_pid=status.main_pid if status.active else None,
                           cgroup=status.cgroup if status.active else None)


def manager_from_config(service: ServiceConfig, runner: Runner) -> SystemdManager | CommandManager:
    """The manager for the configured service (`[service]`), running its commands through `runner`."""
    if service.manager == "systemd":
        return SystemdManager(runner, service.unit, sudo=service.sudo)
    return CommandManager(runner, service.start, service.stop, service.status, name=f"{service.host} server",
                          sudo=service.sudo, log=service.log)


_SHARDS = re.compile(r"Loading safetensors checkpoint shards:\s*(\d+)% Completed \|\s*(\d+)/(\d+)")


def parse_startup_line(line: str) -> StartupProgress | None:
    """Turn one SGLang start-up log line into progress; None for lines that say nothing of it."""
    if "fired up and ready to roll" in line:
        return StartupProgress("ready", line)
    if "Load weight end" in line:
        return StartupProgress("weights_loaded", line)
    match = _SHARDS.search(line)
    if match:
        return StartupProgress("loading", line, done=int(match.group(2)), total=int(match.group(3)))
    if "Load weight begin" in line:
        return StartupProgress("loading", line, done=0, total=None)
    return None


async def follow_startup_log(host: Any, manager: SystemdManager | CommandManager,
                             on_progress: Callable[[StartupProgress], Any]) -> None:
    """Follow the manager's start-up log over `host.stream` and report progress until "ready"."""
    argv = manager.log_argv()
    if not argv:
        return
    async for line in host.stream(argv):
        progress = parse_startup_line(line)
        if progress is not None:
            on_progress(progress)
            if progress.stage == "ready":
                return


async def probe_health(client: SglangClient, want_metrics: bool = True) -> ServiceHealth:
    """One look at the server: /health, model, version, metrics, and readiness (health + one token)."""
    try:
        status = await client.health()
    except ServerUnreachable as exc:
        return ServiceHealth(None, False, error=str(exc))
    fields: dict[str, Any] = {}
    error = None
    try:
        info = await client.model_info()
        fields["model"] = info.get("served_model_name") or info.get("model_path")
        fields["model_path"] = info.get("model_path")
        server = await client.server_info()
        fields["version"] = server.get("version")
        if want_metrics:
            fields.update(server_summary(await client.metrics()))
    except (ServerAnswerError, ServerUnreachable) as exc:
        error = str(exc)
    ready = False
    if status == 200:
        try:
            ready = await client.generates_one_token()
        except (ServerAnswerError, ServerUnreachable) as exc:
            error = error or f"/health is 200 but a one-token /generate failed: {exc}"
    return ServiceHealth(status, ready, error=error, **fields)


class ReadyTimeout(Exception):
    """The server did not become ready in time; the message holds the last thing seen."""


async def wait_ready(client: SglangClient, timeout: float, poll_s: float = 0.5,
                     on_health: Callable[[ServiceHealth], Any] | None = None,
                     clock: Callable[[], float] = time.monotonic) -> ServiceHealth:
    """Poll until ready (/health 200 and a one-token /generate), publishing each look.

    A 200 from /health alone is not trusted: health can flap while the server warms up, so the
    generation must succeed too. Raises ReadyTimeout with the last health seen.
    """
    deadline = clock() + timeout
    last: ServiceHealth | None = None
    while True:
        last = await probe_health(client, want_metrics=False)
        if on_health is not None:
            on_health(last)
        if last.ready:
            return last
        if clock() >= deadline:
            seen = f"/health {last.health_status}" if last.health_status else "no answer"
            raise ReadyTimeout(f"not ready after {timeout:.0f} s (last: {seen}; {last.error or 'no error'})")
        await asyncio.sleep(poll_s)


async def start_and_wait(manager: SystemdManager | CommandManager, client: SglangClient, timeout: float,
                         host: Any | None = None, on_progress: Callable[[StartupProgress], Any] | None = None,
                         on_health: Callable[[ServiceHealth], Any] | None = None) -> ServiceHealth:
    """Start the service and wait until ready, following its start-up log meanwhile when it has one."""
    follower = None
    if host is not None and on_progress is not None and manager.log_argv():
        follower = asyncio.create_task(follow_startup_log(host, manager, on_progress))
        await asyncio.sleep(0.2)  # let `journalctl -f` attach before the first line is written
    try:
        await manager.start()
        return await wait_ready(client, timeout, on_health=on_health)
    finally:
        if follower is not None:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await follower


class ServiceMonitor:
    """Watches the service: manager status, and health through the forwarded port while it runs.

    Checks never overlap: the next one is armed when the last has finished (a slow server is polled
    less often, never piled up). Each check is published as a `ServiceView`.
    """

    def __init__(self, manager: SystemdManager | CommandManager, client: SglangClient | None,
                 interval: float = 5.0, want_metrics: bool = True):
        self.manager = manager
        self.client = client
        self.interval = interval
        self.want_metrics = want_metrics
        self.last: ServiceView | None = None
        self._subscribers: list[Callable[[ServiceView], Any]] = []
        self._task: asyncio.Task | None = None

    def subscribe(self, callback: Callable[[ServiceView], Any]) -> Callable[[], None]:
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    async def check(self) -> ServiceView:
        """One check, published."""
        try:
            status = await self.manager.status()
        except Exception as exc:  # noqa: BLE001 - a lost link or a failing status command: show it
            view = ServiceView(None, None, time.time(), error=str(exc) or type(exc).__name__)
        else:
            health = await probe_health(self.client, self.want_metrics) if status.active and self.client else None
            view = ServiceView(status, health, time.time())
        self.last = view
        for callback in list(self._subscribers):
            callback(view)
        return view

    async def run(self) -> None:
        while True:
            await self.check()
            await asyncio.sleep(self.interval)

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"service-{self.manager.name}")
        return self._task

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
