"""Service control: the inference server's manager (systemd or user commands), health and readiness.

Managers run their commands through a runner with `Host.run`'s shape
(`await run(argv, check=..., timeout=...) -> CommandResult(exit_status, stdout, stderr)`):
- `SystemdManager`: `systemctl is-active / show / stop / start UNIT` (optionally `sudo -n`),
  `journalctl -u UNIT -f -n 0` for the start-up log and `journalctl -u UNIT -n 20` when a start fails.
- `CommandManager`: the configured start / stop / status commands (a string runs through `sh -c`,
  a list is argv). Status: exit 0 means running; if it prints a number first, that is the main pid.
  The optional log command (e.g. `tail -n +1 -F /var/log/sglang.log`) gives the start-up log.
Health goes through the forwarded port (`console.service.sglang_api`): ready = /health 200, /ready 200
(where the release has it) and a one-token /generate. SGLang's start-up log lines become `StartupProgress`. The `*_argv()` methods are the one
source of every command: the plan (`console.views.plan`) shows exactly what the managers run.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shlex
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from console.config import ServiceConfig
from console.fanout import FanOut
from console.messages import ServiceHealth, ServiceStatus, ServiceView, StartupProgress
from console.service.sglang_api import (
    ServerAnswerError,
    ServerUnreachable,
    SglangClient,
    server_summary,
    sglang_health_check_s,
)
from console.tasks import cancel_and_wait
from console.telemetry import ServiceIdentity

log = logging.getLogger(__name__)

SHOW_PROPERTIES = ("ActiveState", "SubState", "MainPID", "ActiveEnterTimestamp", "ControlGroup", "LoadState", "Result")
COMMAND_TIMEOUT_S = 120.0


class ServiceError(Exception):
    """A service command failed; the message names the command and what it printed."""


class ServiceFailed(ServiceError):
    """The service went down (failed / inactive / stopped) while we waited for it to be ready; the
    message holds its state and the last lines of its log."""

    def __init__(self, message: str, status: ServiceStatus, log_lines: Sequence[str] = ()):
        super().__init__(message)
        self.status = status
        self.log_lines = list(log_lines)


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

    def status_argv(self) -> list[str]:
        """The first of the status commands (`show` follows it for the details)."""
        return self.argv("is-active", self.unit)

    def log_argv(self) -> list[str]:
        """journalctl following the unit from now on: the start-up log of the next start."""
        base = ["journalctl", "-u", self.unit, "-f", "-n", "0", "-o", "cat", "--no-pager"]
        return ["sudo", "-n", *base] if self.sudo else base

    def journal_argv(self, lines: int = 20) -> list[str]:
        """The unit's last `lines` journal lines (why a start failed)."""
        base = ["journalctl", "-u", self.unit, "-n", str(lines), "--no-pager"]
        return ["sudo", "-n", *base] if self.sudo else base

    async def failure_log(self, lines: int = 20) -> list[str]:
        """The journal's last lines for the unit ([] when journalctl cannot be read)."""
        try:
            result = await self.runner.run(self.journal_argv(lines), check=False, timeout=self.timeout)
        except Exception as exc:  # noqa: BLE001 - the failure is reported anyway, with or without its log
            return [f"(`{' '.join(self.journal_argv(lines))}` failed: {exc})"]
        return _output(result).splitlines()[-lines:]

    @staticmethod
    def is_down(status: ServiceStatus) -> bool:
        """A unit that will not come up by itself: failed, or inactive after its start."""
        return status.state in ("failed", "inactive", "not-found")

    async def status(self) -> ServiceStatus:
        # is-active exits non-zero for anything but active: that is an answer, not a failure.
        active = await self.runner.run(self.status_argv(), check=False, timeout=self.timeout)
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

    # --- the unit's history, for the downtime forecast (console.procedure.forecast) ---------------
    # systemd's transition stamps (CLOCK_MONOTONIC usec, 0 when not recorded this boot): InactiveExit
    # (inactive -> activating), ActiveEnter (-> active), ActiveExit (active -> deactivating),
    # InactiveEnter (-> inactive/failed). See org.freedesktop.systemd1(5).
    HISTORY_PROPERTIES = ("Type", "InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic",
                          "ActiveExitTimestampMonotonic", "InactiveEnterTimestampMonotonic")
    READY_LINE = "fired up and ready to roll"  # SGLang's, as parse_startup_line reads it

    @staticmethod
    def durations(props: dict[str, str]) -> dict[str, Any]:
        """The last stop (ActiveExit -> InactiveEnter) and start (InactiveExit -> ActiveEnter) in
        seconds from `systemctl show` properties; None where not recorded or still under way. For a
        Type=simple unit the start is the process's spawn, not the server's readiness (`ready_s`)."""
        def usec(key: str) -> int:
            value = props.get(key, "")
            return int(value) if value.isdigit() else 0

        def span(begin: str, end: str) -> float | None:
            b, e = usec(begin), usec(end)
            return (e - b) / 1e6 if b and e >= b else None

        return {"type": props.get("Type") or None,
                "stop_s": span("ActiveExitTimestampMonotonic", "InactiveEnterTimestampMonotonic"),
                "start_s": span("InactiveExitTimestampMonotonic", "ActiveEnterTimestampMonotonic")}

    async def history(self) -> dict[str, Any]:
        """The unit's last stop and start as systemd and its journal recorded them (this boot):
        {"type", "stop_s", "start_s", "ready_s"}; `ready_s` runs from the last start's InactiveExit to
        the server's ready line in the journal (None when the journal cannot say)."""
        show = await self.runner.run(self.argv("show", self.unit, "-p", ",".join(self.HISTORY_PROPERTIES)),
                                     check=False, timeout=self.timeout)
        if show.exit_status != 0:
            raise ServiceError(f"`{' '.join(self.argv('show', self.unit))}` failed (exit {show.exit_status}): {_output(show)}")
        props = parse_systemctl_show(show.stdout)
        history = {**self.durations(props), "ready_s": None}
        started = int(props.get("InactiveExitTimestampMonotonic") or 0) / 1e6
        base = ["journalctl", "-u", self.unit, "-b", "-g", self.READY_LINE, "-o", "short-monotonic", "-n", "1",
                "--no-pager"]
        journal = await self.runner.run(["sudo", "-n", *base] if self.sudo else base, check=False, timeout=self.timeout)
        match = re.match(r"^\[\s*(\d+\.\d+)\]", (journal.stdout or "").strip()) if journal.exit_status == 0 else None
        if match and started and float(match.group(1)) >= started:  # else: a line of an earlier start
            history["ready_s"] = float(match.group(1)) - started
        history["weights_s"] = None
        if history["ready_s"] is None:  # the last start's weight load, as SGLang logged it (a floor of the start)
            base = ["journalctl", "-u", self.unit, "-b", "-g", "Load weight end", "-o", "short-monotonic", "-n", "1",
                    "--no-pager"]
            journal = await self.runner.run(["sudo", "-n", *base] if self.sudo else base, check=False,
                                            timeout=self.timeout)
            line = (journal.stdout or "").strip() if journal.exit_status == 0 else ""
            match = re.match(r"^\[\s*(\d+\.\d+)\]", line)
            if match and started and float(match.group(1)) >= started:
                history["weights_s"] = weights_elapsed([line])
        return history


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

    def status_argv(self) -> list[str]:
        return command_argv(self.status_command, self.sudo)

    def log_argv(self) -> list[str] | None:
        return command_argv(self.log_command, self.sudo) if self.log_command else None

    async def failure_log(self, lines: int = 20) -> list[str]:
        """Nothing to ask: the log command's lines come from the start-up log follower."""
        return []

    @staticmethod
    def is_down(status: ServiceStatus) -> bool:
        return not status.active

    async def status(self) -> ServiceStatus:
        result = await self.runner.run(self.status_argv(), check=False, timeout=self.timeout)
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

    async def history(self) -> dict[str, Any] | None:
        """User commands keep no record of past stops and starts (systemd's manager has one); the
        server's own log (the `log` command, read for LOG_READ_S) says how long its last start took to
        load the weights: {"weights_s"}, None without a log command or such a line."""
        argv = self.log_argv()
        if argv is None:
            return None
        read = ["sh", "-c", f"timeout {LOG_READ_S:g} {shlex.join(argv)} | tail -n {LOG_LINES}"]
        result = await self.runner.run(read, check=False, timeout=self.timeout)
        weights_s = weights_elapsed((result.stdout or "").splitlines())
        return {"weights_s": weights_s} if weights_s is not None else None

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


_WEIGHTS_END = re.compile(r"Load weight end\. elapsed=\s*(\d+(?:\.\d+)?)\s*s")
LOG_READ_S = 0.5  # the `log` command (a `tail -F`, which never ends by itself) is read this long
LOG_LINES = 5000  # of which the last lines are kept: the last start's are at the end


def weights_elapsed(lines: Sequence[str]) -> float | None:
    """The last `Load weight end. elapsed=9.20 s, ...` of SGLang's start-up log (model_runner.py), in
    seconds; None when no line says it."""
    found = None
    for line in lines:
        match = _WEIGHTS_END.search(line)
        if match:
            found = float(match.group(1))
    return found


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


class StartupLog:
    """The manager's start-up log, followed across one start: only what that start writes counts.

    A log command may replay old lines first (`tail -n +1 -F log` prints the last start's lines,
    "ready" included). So the follower attaches before the start, waits until that replay has
    drained (no line for `quiet_s`, at most `attach_timeout_s`), and parses only lines that arrive
    after `mark_start()`, which the caller calls just before issuing the start. journalctl's
    `-f -n 0` replays nothing; the quiet wait then only gives it time to attach. The last lines since
    the start are kept for the error when the start fails.
    """

    def __init__(self, host: Any, manager: SystemdManager | CommandManager,
                 on_progress: Callable[[StartupProgress], Any] | None = None, quiet_s: float = 0.3,
                 attach_timeout_s: float = 10.0, keep_lines: int = 20):
        self.host = host
        self.argv = manager.log_argv()
        self.on_progress = on_progress
        self.quiet_s = quiet_s
        self.attach_timeout_s = attach_timeout_s
        self.replayed = 0  # lines dropped as written before the start
        self.error: str | None = None  # why the log command ended, if it failed
        self._lines: deque[str] = deque(maxlen=keep_lines)
        self._live = False
        self._last_line_at = 0.0
        self._task: asyncio.Task | None = None

    async def attach(self) -> None:
        """Start the log command and return once what it replays from before has drained."""
        if not self.argv or self._task is not None:
            return
        began = self._last_line_at = time.monotonic()
        self._task = asyncio.create_task(self._follow(), name="startup-log")
        while not self._task.done():
            now = time.monotonic()
            quiet_for = now - self._last_line_at
            if quiet_for >= self.quiet_s:
                return
            if now - began >= self.attach_timeout_s:
                log.warning("start-up log `%s` still replaying after %.0f s: later lines are taken as new",
                            " ".join(self.argv), self.attach_timeout_s)
                return
            await asyncio.sleep(self.quiet_s - quiet_for)

    def mark_start(self) -> None:
        """From now on lines are the new start's (call it just before issuing the start)."""
        self._live = True

    def tail(self) -> list[str]:
        """The last lines seen since `mark_start`."""
        return list(self._lines)

    async def settled_tail(self, timeout: float = 3.0) -> list[str]:
        """The last lines, once some came and the log has been quiet for `quiet_s` (at most
        `timeout`): what a dying server wrote last may still be on its way (`tail -F` polls a new
        file once a second) when its manager already says stopped."""
        deadline = time.monotonic() + timeout
        while self._task is not None and not self._task.done() and time.monotonic() < deadline:
            quiet_for = time.monotonic() - self._last_line_at
            if self._lines and quiet_for >= self.quiet_s:
                break
            await asyncio.sleep(max(0.05, self.quiet_s - quiet_for))
        return self.tail()

    async def _follow(self) -> None:
        try:
            async for line in self.host.stream(self.argv):
                self._last_line_at = time.monotonic()
                if not self._live:
                    self.replayed += 1
                    continue
                self._lines.append(line)
                progress = parse_startup_line(line)
                if progress is not None and self.on_progress is not None:
                    self.on_progress(progress)
        except Exception as exc:  # noqa: BLE001 - a log that ends or fails only means less progress shown
            self.error = str(exc) or type(exc).__name__

    async def close(self) -> None:
        """Stop the log command."""
        await cancel_and_wait(self._task)


async def follow_startup_log(host: Any, manager: SystemdManager | CommandManager,
                             on_progress: Callable[[StartupProgress], Any]) -> None:
    """Follow the manager's start-up log from now on (what it replays from before is skipped) and
    report progress until "ready"."""
    ready = asyncio.Event()

    def report(progress: StartupProgress) -> None:
        on_progress(progress)
        if progress.stage == "ready":
            ready.set()

    startup = StartupLog(host, manager, report)
    try:
        await startup.attach()
        startup.mark_start()
        if startup._task is not None:
            waiter = asyncio.ensure_future(ready.wait())
            try:
                await asyncio.wait({startup._task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                await cancel_and_wait(waiter)
    finally:
        await startup.close()


async def probe_health(client: SglangClient, want_metrics: bool = True) -> ServiceHealth:
    """One look at the server: /health, model, version, metrics, and readiness (health + one token).

    Never raises for anything the server does: each failure is the health's `error`."""
    try:
        status = await client.health()
    except ServerUnreachable as exc:  # waited as long as SGLang's own check: not even its 503 came
        return ServiceHealth(None, False, error=f"{exc}; SGLang answers /health within its own check "
                                                 f"({sglang_health_check_s():g} s), so the server is not answering")
    except ServerAnswerError as exc:
        return ServiceHealth(None, False, error=str(exc))
    fields: dict[str, Any] = {}
    error = None
    if status == 503:  # what the server said: starting, or its scheduler gave its own check no answer
        error = (f"/health answered 503: SGLang's own health check got no answer from its scheduler within "
                 f"{sglang_health_check_s():g} s (stuck or busy), or the server is still starting")
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
        # SGLang 0.5.23's /ready (503 while starting, unhealthy or paused); older releases have none (404).
        try:
            ready_status: int | None = await client.ready()
        except (ServerAnswerError, ServerUnreachable) as exc:
            ready_status, error = None, error or f"/health is 200 but /ready gave no answer: {exc}"
        if ready_status not in (200, 404, None):
            error = error or f"/health is 200 but /ready is {ready_status} (starting, unhealthy or paused)"
        elif ready_status is not None:
            try:
                ready = await client.generates_one_token()
            except (ServerAnswerError, ServerUnreachable) as exc:
                error = error or f"/health is 200 but a one-token /generate failed: {exc}"
    return ServiceHealth(status, ready, error=error, **fields)


class ReadyTimeout(Exception):
    """The server did not become ready in time; the message holds the last thing seen."""


async def _down_while_starting(manager: SystemdManager | CommandManager,
                               log_tail: Callable[[], Awaitable[list[str]]] | None) -> ServiceFailed | None:
    """A ServiceFailed when the manager says the service is down (failed, inactive, stopped)."""
    try:
        status = await manager.status()
    except Exception as exc:  # noqa: BLE001 - a status that cannot be read is no verdict: keep waiting
        log.warning("%s: status while starting: %s", manager.name, exc)
        return None
    if not manager.is_down(status):
        return None
    lines = (await log_tail() if log_tail is not None else []) or await manager.failure_log()
    state = status.state + (f" ({status.sub_state})" if status.sub_state else "")
    detail = f"; {status.detail}" if status.detail else ""
    message = f"{manager.name} is {state} after its start: it will not become ready{detail}"
    if lines:
        message += "\nlast log lines:\n" + "\n".join(lines)
    return ServiceFailed(message, status, lines)


async def wait_ready(client: SglangClient, timeout: float, poll_s: float = 0.5,
                     on_health: Callable[[ServiceHealth], Any] | None = None,
                     clock: Callable[[], float] = time.monotonic,
                     manager: SystemdManager | CommandManager | None = None,
                     log_tail: Callable[[], Awaitable[list[str]]] | None = None) -> ServiceHealth:
    """Poll until ready (/health 200 and a one-token /generate), publishing each look.

    A 200 from /health alone is not trusted: health can flap while the server warms up, so the
    generation must succeed too. Every request ends by the deadline, so the wait ends on time even
    when the server answers slowly. With `manager`, each poll also asks it: a unit that failed (or a
    command-managed server that stopped) raises ServiceFailed at once, with the journal's last lines
    (systemd) or `await log_tail()` (the start-up log's lines since the start). Raises ReadyTimeout with
    the last health seen.
    """
    deadline = clock() + timeout
    last: ServiceHealth | None = None
    while True:
        budget = max(deadline - clock(), 0.1)
        last = await probe_health(client.within(budget), want_metrics=False)
        if on_health is not None:
            on_health(last)
        if last.ready:
            return last
        if manager is not None:
            failure = await _down_while_starting(manager, log_tail)
            if failure is not None:
                raise failure
        if clock() >= deadline:
            seen = f"/health {last.health_status}" if last.health_status else "no answer"
            raise ReadyTimeout(f"not ready after {timeout:.0f} s (last: {seen}; {last.error or 'no error'})")
        await asyncio.sleep(max(0.0, min(poll_s, deadline - clock())))


async def start_and_wait(manager: SystemdManager | CommandManager, client: SglangClient, timeout: float,
                         host: Any | None = None, on_progress: Callable[[StartupProgress], Any] | None = None,
                         on_health: Callable[[ServiceHealth], Any] | None = None) -> ServiceHealth:
    """Start the service and wait until ready, following its start-up log meanwhile when it has one
    (`host` given): progress from the new start's lines only, and its last lines if it fails."""
    startup = StartupLog(host, manager, on_progress) if host is not None and manager.log_argv() else None
    try:
        if startup is not None:
            await startup.attach()
            startup.mark_start()
        await manager.start()
        return await wait_ready(client, timeout, on_health=on_health, manager=manager,
                                log_tail=startup.settled_tail if startup is not None else None)
    finally:
        if startup is not None:
            await startup.close()


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
        self._subscribers = FanOut("service view")
        self._task: asyncio.Task | None = None

    def subscribe(self, callback: Callable[[ServiceView], Any]) -> Callable[[], None]:
        """Call `callback(view)` after every check; returns an unsubscribe. A subscriber that raises
        is logged and skipped, never the end of the monitor."""
        return self._subscribers.subscribe(callback)

    async def check(self, paused_by: str | None = None) -> ServiceView:
        """One check, published. Never raises for what the manager or the server does: it becomes
        the view's `error`. `paused_by` ("run X"): a run holds the server paused, so /health is not
        asked: SGLang answers 503 for the whole pause, and each probe would wait out its own health
        check first and then read as a stuck server."""
        try:
            status = await self.manager.status()
        except Exception as exc:  # noqa: BLE001 - a lost link or a failing status command: show it
            view = ServiceView(None, None, time.time(), error=str(exc) or type(exc).__name__)
        else:
            health, error = None, None
            not_probed = paused_by if status.active else None
            if status.active and self.client and not not_probed:
                try:
                    health = await probe_health(self.client, self.want_metrics)
                    error = health.error
                except Exception as exc:  # noqa: BLE001 - whatever the server did, say it and go on
                    log.exception("health check of %s failed", self.manager.name)
                    error = f"health check failed: {type(exc).__name__}: {exc}"
            view = ServiceView(status, health, time.time(), error=error, not_probed=not_probed)
        self.last = view
        self._publish(view)
        return view

    def _publish(self, view: ServiceView) -> None:
        self._subscribers.publish(view)

    async def run(self) -> None:
        """Check until cancelled; the next check is armed when the last one has finished."""
        while True:
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - check() should not raise; if it does, keep watching
                log.exception("service check of %s failed", self.manager.name)
            await asyncio.sleep(self.interval)

    def start(self) -> asyncio.Task:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self.run(), name=f"service-{self.manager.name}")
        return self._task

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
