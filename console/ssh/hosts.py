"""SSH hosts: one connection per host and the operations the console needs on it.

asyncssh does the SSH. This module adds what the console relies on around it:

- `~/.ssh/config` is honoured (aliases, HostName, Port, User, IdentityFile, ProxyJump), agent keys
  are used, keepalive is on and connecting has a timeout;
- host keys are always checked against known_hosts, never skipped: an unknown or changed key is
  refused with the exact command that trusts it;
- remote commands are argv lists joined with `shlex.join`, so an argument is never pasted into a
  shell line;
- failures become `HostError` subclasses whose message names the host and what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import asyncssh

Progress = Callable[[int, int], None]  # (bytes done, bytes total)

STDERR_TAIL_CHARS = 2000
_BLOCK = 64 * 1024  # SFTP request size: progress is reported once per block


@dataclass(frozen=True)
class HostSpec:
    """How to reach one host. `address` may be an alias of the ssh config; None means "ask the
    ssh config" for user and port, and the default files for known_hosts and ssh_config."""

    name: str
    address: str
    user: str | None = None
    port: int | None = None
    python: str = "python3"
    workdir: str = "~/dflash-ops"
    identity_file: str | Path | None = None
    known_hosts: str | Path | None = None
    ssh_config: str | Path | None = None
    connect_timeout: float = 10.0
    keepalive_interval: float = 15.0
    # Receives the drill's workers (remote/drill/) with the worker code. `host_spec` sets it from the
    # config's `simulated_gpus`, so a configured real host never gets them; a spec built by hand is a
    # rehearsal host (the embedded server's, the tests').
    drill: bool = True


@dataclass(frozen=True)
class CommandResult:
    """What a finished remote command returned. `exit_status` is negative for a signal."""

    exit_status: int
    stdout: str
    stderr: str


class HostError(Exception):
    """A host-level failure the operator can act on; the message names the host."""

    def __init__(self, host: str, msg: str):
        super().__init__(f"{host}: {msg}")
        self.host = host
        self.msg = msg


class UnknownHostKey(HostError):
    """The host's key is not in known_hosts (or differs from the one recorded there)."""

    def __init__(self, host: str, msg: str, changed: bool = False, fingerprint: str | None = None):
        super().__init__(host, msg)
        self.changed = changed
        self.fingerprint = fingerprint


class HostUnreachable(HostError):
    """No SSH connection could be made (refused, timed out, name not found, proxy failed)."""


class AuthFailed(HostError):
    """The server refused every key offered."""


class HostDisconnected(HostError):
    """The connection was lost (or was never opened) while an operation needed it."""


class RemotePathError(HostError):
    """An SFTP operation failed on a remote path (missing, not permitted, ...)."""


class CommandFailed(HostError):
    """A remote command exited non-zero (or timed out); carries argv, exit status and stderr tail."""

    def __init__(self, host: str, argv: list[str], exit_status: int | None, stderr: str,
                 timeout: float | None = None):
        tail = tail_text(stderr)
        how = f"timed out after {timeout:g} s" if timeout is not None else f"exited with status {exit_status}"
        msg = f"`{shlex.join(argv)}` {how}"
        if tail:
            msg += f"; stderr ends with:\n{tail}"
        super().__init__(host, msg)
        self.argv = list(argv)
        self.exit_status = exit_status
        self.stderr_tail = tail


def tail_text(text: str, limit: int = STDERR_TAIL_CHARS) -> str:
    """The last `limit` characters of `text`, cut at a line start when possible, stripped."""
    text = text.rstrip()
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    newline = cut.find("\n")
    return cut[newline + 1:] if 0 <= newline < limit // 2 else cut


def command_line(argv: list[str]) -> str:
    """The shell line for argv: every argument quoted, so it reaches the program as one literal word."""
    if isinstance(argv, str) or not all(isinstance(a, str) for a in argv):
        raise TypeError(f"argv must be a list of str, got {argv!r}")
    return shlex.join(argv)


async def resolve_python(host: Any, python: str) -> str:
    """`python` as an argv word on `host`: a `~` path is expanded with `host.expand` (the remote
    home), anything else is returned as it is, without touching the host."""
    return await host.expand(python) if python.startswith("~") else python


def _guard_sftp_tasks() -> None:
    """Retrieve the exceptions of asyncssh's parallel SFTP request tasks on this loop.

    asyncssh's parallel reader/writer (file reads, get, put) raises the first failed request and
    leaves its siblings unretrieved when the link drops with requests in flight (ConnectionLost
    is neither OSError nor SFTPError there), so asyncio prints "Task exception was never
    retrieved" later. The failure itself reaches the caller through the awaited call; these
    siblings only repeat it. Installed once per loop, wrapping any task factory already set.
    """
    loop = asyncio.get_running_loop()
    previous = loop.get_task_factory()
    if getattr(previous, "guards_sftp_tasks", False):
        return

    def factory(loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Future:
        task = previous(loop, coro, **kwargs) if previous is not None else asyncio.Task(coro, loop=loop, **kwargs)
        if getattr(coro, "__qualname__", "").startswith("_SFTPParallelIO."):
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    factory.guards_sftp_tasks = True  # type: ignore[attr-defined]
    loop.set_task_factory(factory)


class _HostKeyRecorder(asyncssh.SSHClient):
    """Remembers the key the server offered when known_hosts did not vouch for it (for the message)."""

    def __init__(self) -> None:
        self.offered: tuple[str, str, int, str] | None = None  # host, addr, port, fingerprint

    def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        self.offered = (host, addr, port, key.get_fingerprint())
        return False  # trust comes from known_hosts only


class Host:
    """One SSH connection to a host, with run / stream / SFTP / port-forward operations."""

    def __init__(self, spec: HostSpec):
        self.spec = spec
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._sftp_lock = asyncio.Lock()
        self._home: str | None = None
        self._listeners: list[asyncssh.SSHListener] = []

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def connection(self) -> asyncssh.SSHClientConnection | None:
        """The underlying asyncssh connection (None before connect / after close)."""
        return self._conn

    @property
    def is_connected(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    def _where(self, host: str, port: int, user: str | None) -> str:
        who = f"{user}@" if user else ""
        return f"{who}{host}:{port}"

    async def _options(self) -> tuple[dict, str, int, str | None, str]:
        """asyncssh keyword arguments, plus the resolved host, port, user and known_hosts path."""
        spec = self.spec
        kwargs: dict = {
            "connect_timeout": spec.connect_timeout,
            "keepalive_interval": spec.keepalive_interval,
        }
        if spec.ssh_config is not None:
            kwargs["config"] = [str(Path(spec.ssh_config).expanduser())]
        if spec.user:
            kwargs["username"] = spec.user
        if spec.port:
            kwargs["port"] = spec.port
        if spec.identity_file:
            kwargs["client_keys"] = [str(Path(spec.identity_file).expanduser())]
        # Resolve the ssh config as asyncssh will, to learn the real host, port and known_hosts.
        resolved = await asyncssh.SSHClientConnectionOptions.construct(host=spec.address, **kwargs)
        if spec.known_hosts is not None:
            paths = [Path(spec.known_hosts).expanduser()]
        elif isinstance(resolved.known_hosts, list) and resolved.known_hosts:
            paths = [Path(p).expanduser() for p in resolved.known_hosts]
        else:
            # Also when the config says `UserKnownHostsFile none`: keys are always checked.
            paths = [Path("~/.ssh/known_hosts").expanduser()]
        existing = [str(p) for p in paths if p.is_file()]
        # An empty known-hosts object trusts nothing (b"" or None would fall back or skip the check).
        kwargs["known_hosts"] = existing or asyncssh.import_known_hosts("")
        known_path = str(paths[0])
        return kwargs, resolved.host, resolved.port, resolved.username, known_path

    async def connect(self) -> None:
        """Open the connection; raises UnknownHostKey, AuthFailed or HostUnreachable."""
        if self.is_connected:
            return
        _guard_sftp_tasks()
        try:
            kwargs, host, port, user, known_path = await self._options()
        except (OSError, ValueError, asyncssh.KeyImportError) as exc:
            # A missing or unreadable identity file, or an ssh config that does not parse: the
            # message names the file (and line).
            raise HostError(self.name, f"cannot prepare the SSH connection: {exc}") from None
        where = self._where(host, port, user)
        recorder = _HostKeyRecorder()
        try:
            self._conn = await asyncssh.connect(
                self.spec.address, client_factory=lambda: recorder, **kwargs)
        except asyncssh.HostKeyNotVerifiable as exc:
            raise self._key_error(recorder, host, port, known_path, str(exc)) from None
        except asyncssh.PermissionDenied:
            keys = f"key {self.spec.identity_file}" if self.spec.identity_file else "the agent's and default keys"
            raise AuthFailed(self.name, f"{where} refused {keys} (check User and IdentityFile "
                             f"in the ssh config, or ssh-add the key)") from None
        except TimeoutError:
            raise HostUnreachable(self.name, f"no SSH answer from {where} within "
                                  f"{self.spec.connect_timeout:g} s") from None
        except asyncssh.Error as exc:
            raise HostUnreachable(self.name, f"SSH to {where} failed: {exc.reason}") from None
        except OSError as exc:
            if isinstance(exc, socket.gaierror):
                reason = f"name not found ({exc.strerror})"
            else:  # asyncio's strerror is "Connect call failed (...)": the errno says more
                reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise HostUnreachable(self.name, f"cannot reach {where}: {reason}") from None

    def _key_error(self, recorder: _HostKeyRecorder, host: str, port: int, known_path: str,
                   detail: str) -> UnknownHostKey:
        entry = host if port == 22 else f"[{host}]:{port}"
        keyscan = f"ssh-keyscan -p {port} {shlex.quote(host)} >> {shlex.quote(known_path)}"
        if recorder.offered is None:  # e.g. a ProxyJump hop refused its key: asyncssh says which
            return UnknownHostKey(self.name, f"host key not trusted ({detail}). Check the key's "
                                  f"fingerprint, then add it to known_hosts, e.g. `{keyscan}`.")
        o_host, o_addr, o_port, fingerprint = recorder.offered
        changed = False
        with contextlib.suppress(Exception):  # an unreadable known_hosts just means "unknown"
            trusted = asyncssh.read_known_hosts(known_path).match(o_host, o_addr, o_port if o_port != 22 else None)
            changed = bool(trusted[0])
        if changed:
            msg = (f"the host key of {entry} CHANGED: it now offers {fingerprint}, which does not match "
                   f"{known_path}. This can be an attack. If the host was really reinstalled, remove the "
                   f"old entry with `ssh-keygen -R {shlex.quote(entry)} -f {shlex.quote(known_path)}` "
                   f"and add the new one with `{keyscan}`.")
        else:
            msg = (f"unknown host key for {entry} ({fingerprint}), not in {known_path}. After checking "
                   f"that fingerprint with the host's owner, trust it with `{keyscan}` "
                   f"(or connect once with `ssh -p {port} {shlex.quote(host)}`).")
        return UnknownHostKey(self.name, msg, changed=changed, fingerprint=fingerprint)

    async def close(self) -> None:
        """Close listeners, SFTP and the connection. Safe to call twice."""
        for listener in self._listeners:
            listener.close()
        self._listeners.clear()
        if self._sftp is not None:
            self._sftp.exit()
            self._sftp = None
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(Exception):
                await self._conn.wait_closed()
            self._conn = None

    async def wait_closed(self) -> None:
        """Return when the connection has closed, for whatever reason."""
        if self._conn is not None:
            await self._conn.wait_closed()

    def _require(self) -> asyncssh.SSHClientConnection:
        if self._conn is None or self._conn.is_closed():
            raise HostDisconnected(self.name, "not connected")
        return self._conn

    @contextlib.contextmanager
    def errors(self, what: str) -> Iterator[None]:
        """Turn asyncssh and socket errors of an operation into HostError with the host's name."""
        try:
            yield
        except HostError:
            raise
        except asyncssh.SFTPError as exc:
            if self._conn is None or self._conn.is_closed():
                raise HostDisconnected(self.name, f"connection lost during {what}") from None
            raise RemotePathError(self.name, f"{what}: {exc.reason}") from None
        except (asyncssh.DisconnectError, asyncssh.ChannelOpenError, BrokenPipeError,
                ConnectionError) as exc:
            raise HostDisconnected(self.name, f"connection lost during {what} ({exc})") from None

    async def sftp(self) -> asyncssh.SFTPClient:
        """The connection's SFTP session, opened on first use and reused."""
        conn = self._require()
        async with self._sftp_lock:
            if self._sftp is None:
                with self.errors("opening SFTP"):
                    self._sftp = await conn.start_sftp_client()
            return self._sftp

    async def home(self) -> str:
        """The remote user's home directory (the SFTP session starts there)."""
        if self._home is None:
            sftp = await self.sftp()
            with self.errors("finding the home directory"):
                self._home = await sftp.realpath(".")
        return self._home

    async def expand(self, path: str) -> str:
        """An absolute remote path: `~`, `~/x` and relative paths are taken from the home directory."""
        if path.startswith("/"):
            return path
        if path == "~" or path.startswith("~/"):
            rest = path[2:]
        elif path.startswith("~"):
            raise RemotePathError(self.name, f"cannot expand {path!r}: only ~ and ~/ are supported")
        else:
            rest = path
        home = await self.home()
        return str(PurePosixPath(home) / rest) if rest else home

    async def resolve_python(self, python: str | None = None) -> str:
        """The host's Python as the command that runs it (`python`, default the spec's): `~` and
        `~/x` become absolute paths, since argv reaches the program without a shell to expand
        them. The one place a host's interpreter is resolved (jobs, telemetry, endpids)."""
        return await resolve_python(self, self.spec.python if python is None else python)

    def _check_ended(self, returncode: int | None, command: str) -> None:
        """No exit status and no signal, and the link is gone: the command's channel ended with the
        connection (a drop), which is not the command failing."""
        if returncode is None and not self.is_connected:
            raise HostDisconnected(self.name, f"connection lost during `{command}`")

    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None,
                  input: str | None = None) -> CommandResult:
        """Run argv (quoted with shlex.join) and wait; raises CommandFailed on non-zero exit if check."""
        command = command_line(argv)
        conn = self._require()
        with self.errors(f"`{command}`"):
            try:
                proc = await conn.run(command, check=False, timeout=timeout, input=input, errors="replace")
            except asyncssh.TimeoutError as exc:
                raise CommandFailed(self.name, argv, None, str(exc.stderr or ""), timeout=timeout) from None
        self._check_ended(proc.returncode, command)
        status = proc.returncode if proc.returncode is not None else -1
        result = CommandResult(status, str(proc.stdout or ""), str(proc.stderr or ""))
        if check and status != 0:
            raise CommandFailed(self.name, argv, status, result.stderr)
        return result

    async def stream(self, argv: list[str], stdin: Callable[[Callable[[str], None] | None], None] | None = None,
                     ) -> AsyncIterator[str]:
        """Yield argv's stdout lines (without newline) as they come; CommandFailed on non-zero exit.
        `stdin`: called with a function that writes to the command's stdin once it runs (and with None
        once it ends); without it the command's stdin is closed at once."""
        command = command_line(argv)
        conn = self._require()
        stderr_parts: list[str] = []

        async def drain_stderr(proc: asyncssh.SSHClientProcess) -> None:
            # Read stderr alongside stdout: an unread stderr would stall the channel's window.
            async for chunk in proc.stderr:
                stderr_parts.append(chunk)
                if len(stderr_parts) > 200:
                    stderr_parts[:] = [tail_text("".join(stderr_parts))]

        with self.errors(f"`{command}`"):
            proc = await conn.create_process(command, errors="replace")
        if stdin is None:
            proc.stdin.write_eof()
        else:
            stdin(lambda text: None if proc.is_closing() else proc.stdin.write(text))
        drainer = asyncio.create_task(drain_stderr(proc))
        # When the link drops, stderr fails too (ConnectionLost) while the stdout error is the one
        # raised. Fetch the drainer's outcome as it ends: a generator dropped without being closed
        # never runs its `finally`, and asyncio would log "Task exception was never retrieved".
        drainer.add_done_callback(lambda task: task.cancelled() or task.exception())
        try:
            with self.errors(f"`{command}`"):
                async for line in proc.stdout:
                    if line:  # asyncssh ends with "" at EOF; an empty line is "\n"
                        yield line.rstrip("\n")
                await drainer
                completed = await proc.wait()
        finally:  # also when the caller stops early: close the channel, stop reading stderr
            if stdin is not None:
                stdin(None)
            drainer.cancel()
            if not proc.is_closing():
                proc.close()
        self._check_ended(completed.returncode, command)
        status = completed.returncode if completed.returncode is not None else -1
        if status != 0:
            raise CommandFailed(self.name, argv, status, "".join(stderr_parts))

    async def put(self, local: str | Path, remote: str, progress: Progress | None = None) -> None:
        """Upload a file; it appears under its final name only when complete (temp name + rename)."""
        sftp = await self.sftp()
        remote = await self.expand(remote)
        tmp = f"{remote}.part-{uuid.uuid4().hex[:8]}"
        handler = (lambda _s, _d, done, total: progress(done, total)) if progress else None
        with self.errors(f"upload of {local} to {remote}"):
            try:
                await sftp.put(str(local), tmp, block_size=_BLOCK, progress_handler=handler)
                await sftp.posix_rename(tmp, remote)
            except BaseException:
                with contextlib.suppress(Exception):
                    await sftp.remove(tmp)
                raise

    async def get(self, remote: str, local: str | Path, progress: Progress | None = None) -> None:
        """Download a file; the local file appears only when complete (temp name + rename)."""
        sftp = await self.sftp()
        remote = await self.expand(remote)
        local = Path(local)
        tmp = local.with_name(f".{local.name}.part-{uuid.uuid4().hex[:8]}")
        handler = (lambda _s, _d, done, total: progress(done, total)) if progress else None
        with self.errors(f"download of {remote}"):
            try:
                await sftp.get(remote, str(tmp), block_size=_BLOCK, progress_handler=handler)
                os.replace(tmp, local)
            finally:
                tmp.unlink(missing_ok=True)

    async def forward_local_port(self, remote_host: str, remote_port: int) -> int:
        """Listen on a free 127.0.0.1 port that tunnels to remote_host:remote_port as seen from the host."""
        conn = self._require()
        with self.errors(f"forwarding to {remote_host}:{remote_port}"):
            listener = await conn.forward_local_port("127.0.0.1", 0, remote_host, remote_port)
        self._listeners.append(listener)
        return listener.get_port()

    async def ping(self) -> float:
        """Round-trip time of one SFTP request, in seconds."""
        sftp = await self.sftp()
        start = time.perf_counter()
        with self.errors("ping"):
            await sftp.stat(".")
        return time.perf_counter() - start
