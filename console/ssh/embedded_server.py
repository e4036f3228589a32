"""An SSH server inside the console's process, for the drill and the tests.

It is asyncssh's real server on 127.0.0.1: a generated host key (recorded in a known_hosts file of
its own) and a generated client key (the only one it accepts); exec runs the command through the
current user's shell with HOME and the working directory set to a given home directory; SFTP
(relative paths from that home); direct-tcpip forwarding, with names of its own (`names`: what only
this host resolves, as its /etc/hosts would). It never reads or writes the real ~/.ssh.

It can be stopped and started again on the same port with the same host key, which is how the
tests drop a connection in the middle of a job.
"""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import os
import pwd
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

import asyncssh

from console.ssh.hosts import HostSpec


class _HomeSFTPServer(asyncssh.SFTPServer):
    """SFTP whose relative paths start at the user's home, like OpenSSH's sftp-server."""

    home: bytes = b"/"

    def map_path(self, path: bytes) -> bytes:
        return os.path.join(self.home, path)


class EmbeddedSSHServer:
    """An asyncssh server on loopback acting as one host whose home is `home`."""

    def __init__(self, home: Path, state_dir: Path | None = None, port: int = 0,
                 user: str | None = None, python: str = "python3"):
        self.home = Path(home).resolve()
        self.state_dir = Path(state_dir) if state_dir else Path(tempfile.mkdtemp(prefix="dflash-ssh-"))
        self.user = user or getpass.getuser()
        self.python = python
        self._port = port
        self._acceptor: asyncssh.SSHAcceptor | None = None
        self._connections: set[asyncssh.SSHServerConnection] = set()
        self._children: set[asyncio.subprocess.Process] = set()
        self.forwarded: list[tuple[str, int]] = []  # direct-tcpip destinations asked for, in order
        self.names: dict[str, str] = {}  # host names only this host resolves -> the address they name
        self.on_forward: Callable[[str, int], None] | None = None  # told of each direct-tcpip request
        self.home.mkdir(parents=True, exist_ok=True)
        self.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._host_key = self._load_or_make_key(self.state_dir / "host_key")
        client_key = self._load_or_make_key(self.client_key_path)
        self.client_key_path.with_suffix(".pub").write_bytes(client_key.export_public_key())
        self._authorized = asyncssh.import_authorized_keys(client_key.export_public_key().decode())

    @property
    def client_key_path(self) -> Path:
        return self.state_dir / "client_key"

    @property
    def known_hosts_path(self) -> Path:
        return self.state_dir / "known_hosts"

    @property
    def port(self) -> int:
        """The listening port (known once started; kept across restarts)."""
        return self._port

    @staticmethod
    def _load_or_make_key(path: Path) -> asyncssh.SSHKey:
        if path.exists():
            return asyncssh.read_private_key(str(path))
        key = asyncssh.generate_private_key("ssh-ed25519")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key.export_private_key())
        return key

    def spec(self, name: str, **overrides: object) -> HostSpec:
        """A HostSpec that connects to this server with its own key and known_hosts."""
        fields: dict = {
            "name": name, "address": "127.0.0.1", "port": self.port, "user": self.user,
            "identity_file": str(self.client_key_path), "known_hosts": str(self.known_hosts_path),
            "ssh_config": str(self.state_dir / "ssh_config"), "python": self.python,
            "workdir": str(self.home / "dflash-ops"), "connect_timeout": 5.0,
        }
        fields.update(overrides)
        return HostSpec(**fields)

    def known_hosts_line(self, host: str = "127.0.0.1") -> str:
        return f"[{host}]:{self.port} {self._host_key.export_public_key().decode().strip()}\n"

    async def start(self) -> None:
        """Listen on 127.0.0.1 (the same port as before on a restart) and write known_hosts."""
        server = self

        class _Server(asyncssh.SSHServer):
            def connection_made(self, conn: asyncssh.SSHServerConnection) -> None:
                self._conn = conn
                server._connections.add(conn)

            def connection_lost(self, exc: Exception | None) -> None:
                server._connections.discard(self._conn)

            def begin_auth(self, username: str) -> bool:
                return True

            def password_auth_supported(self) -> bool:
                return False

            def connection_requested(self, dest_host: str, dest_port: int, orig_host: str,
                                     orig_port: int) -> bool:
                server.forwarded.append((dest_host, dest_port))
                if server.on_forward is not None:
                    server.on_forward(dest_host, dest_port)
                if dest_host in server.names:  # a name only this host resolves
                    return self._conn.forward_connection(server.names[dest_host], dest_port)
                return True  # direct-tcpip: asyncssh forwards the bytes

        def sftp_factory(chan: asyncssh.SSHServerChannel) -> asyncssh.SFTPServer:
            sftp = _HomeSFTPServer(chan)
            sftp.home = os.fsencode(self.home)
            return sftp

        self._acceptor = await asyncssh.listen(
            "127.0.0.1", self._port, server_factory=_Server, server_host_keys=[self._host_key],
            authorized_client_keys=self._authorized, process_factory=self._handle_process,
            sftp_factory=sftp_factory, allow_scp=False, reuse_address=True, encoding=None,
            line_editor=False)
        self._port = self._acceptor.get_port()
        self.known_hosts_path.write_text(self.known_hosts_line())
        # An empty ssh config of its own keeps the real ~/.ssh/config out of the tests.
        (self.state_dir / "ssh_config").touch()

    async def stop(self) -> None:
        """Stop listening and drop every connection (detached jobs keep running)."""
        if self._acceptor is not None:
            self._acceptor.close()
            await self._acceptor.wait_closed()
            self._acceptor = None
        await self.drop_connections()

    async def drop_connections(self) -> None:
        """Close every client connection from the server side, as a network drop would."""
        for conn in list(self._connections):
            conn.abort()
        self._connections.clear()
        children = list(self._children)
        for child in children:
            self._hang_up(child)
        if children:  # let them end inside the loop, so their pipes close cleanly
            await asyncio.wait([asyncio.ensure_future(c.wait()) for c in children], timeout=5)
        await asyncio.sleep(0)

    @staticmethod
    def _hang_up(child: asyncio.subprocess.Process) -> None:
        """End a command whose client is gone: SIGHUP to its process group (the shell and what it
        runs in the foreground). Detached jobs (setsid) are in groups of their own and live on."""
        if child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGHUP)

    def _environment(self) -> dict[str, str]:
        shell = self._shell()
        env = {"HOME": str(self.home), "USER": self.user, "LOGNAME": self.user, "SHELL": shell,
               "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "PWD": str(self.home)}
        for name in ("LANG", "LC_ALL", "TMPDIR"):
            if name in os.environ:
                env[name] = os.environ[name]
        return env

    def _shell(self) -> str:
        try:
            return pwd.getpwnam(self.user).pw_shell or "/bin/sh"
        except KeyError:
            return "/bin/sh"

    @staticmethod
    async def _pump_stdin(process: asyncssh.SSHServerProcess, child: asyncio.subprocess.Process) -> None:
        """Copy the client's stdin to the command until EOF, then close the command's stdin."""
        assert child.stdin is not None
        try:
            while data := await process.stdin.read(65536):
                child.stdin.write(data)
                await child.stdin.drain()
        except (asyncssh.Error, OSError):
            pass  # the command or the client went away
        finally:
            child.stdin.close()

    async def _handle_process(self, process: asyncssh.SSHServerProcess) -> None:
        """Run an exec request through the user's shell in the home directory."""
        command = process.command
        if command is None:
            process.stderr.write(b"this embedded server runs commands only, no interactive shell\n")
            process.exit(1)
            return
        child = await asyncio.create_subprocess_exec(
            self._shell(), "-c", command, cwd=self.home, env=self._environment(), start_new_session=True,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        self._children.add(child)
        code: int | None = None
        stdin_pump: asyncio.Future | None = None
        try:
            # send_eof=False: an EOF after stdout ends would cut off stderr still in flight;
            # exit() below ends the channel once both are drained.
            await process.redirect(stdout=child.stdout, stderr=child.stderr, send_eof=False)
            stdin_pump = asyncio.ensure_future(self._pump_stdin(process, child))
            exited = asyncio.ensure_future(child.wait())
            gone = asyncio.ensure_future(process.channel.wait_closed())
            await asyncio.wait({exited, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if exited.done():
                code = exited.result()
                await process.stdout.drain()
                await process.stderr.drain()
            else:  # the client closed the channel or went away
                self._hang_up(child)
        except (asyncssh.Error, OSError):  # the client went away mid-command
            self._hang_up(child)
        finally:
            self._children.discard(child)
            if stdin_pump is not None:
                stdin_pump.cancel()
        if code is not None and code < 0:
            process.exit_with_signal(signal.Signals(-code).name.removeprefix("SIG"))
        elif code is not None:
            process.exit(code)
        with contextlib.suppress(Exception):  # also runs asyncssh's clean-up of the redirects
            await asyncio.wait_for(process.wait_closed(), 5)
