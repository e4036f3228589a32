"""SSH servers for the integration tests: the embedded asyncssh server and OpenSSH's sshd.

`ssh_target` is parametrised over both, so every test that takes it runs against each. The sshd
leg starts `/usr/sbin/sshd -D -e -f <generated config>` on a free loopback port as the current
user, with its own host key, client key and authorized_keys in a temp dir (never ~/.ssh). Under
CI=true a missing sshd fails the tests; elsewhere they skip, saying why.
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncssh
import pytest

from console.ssh.embedded_server import EmbeddedSSHServer
from console.ssh.hosts import Host, HostSpec
from tests.cli_hosts import ThreadedHosts
from tests.standin_helpers import free_port

SSHD = Path("/usr/sbin/sshd")


def write_key(path: Path, key: asyncssh.SSHKey) -> None:
    path.write_bytes(key.export_private_key())
    path.chmod(0o600)
    path.with_suffix(".pub").write_bytes(key.export_public_key())


class OpenSSHServer:
    """sshd on 127.0.0.1 with generated keys, run in the foreground as the current user."""

    def __init__(self, root: Path):
        self.root = root
        self.port = 0
        self._proc: subprocess.Popen | None = None
        self.host_key = asyncssh.generate_private_key("ssh-ed25519")
        write_key(root / "host_key", self.host_key)
        self.client_key_path = root / "client_key"
        client_key = asyncssh.generate_private_key("ssh-ed25519")
        write_key(self.client_key_path, client_key)
        (root / "authorized_keys").write_bytes(client_key.export_public_key())
        (root / "ssh_config").touch()

    @property
    def known_hosts_path(self) -> Path:
        return self.root / "known_hosts"

    def _config(self) -> str:
        sftp = next((p for p in ("/usr/lib/openssh/sftp-server", "/usr/libexec/sftp-server")
                     if Path(p).exists()), "internal-sftp")
        return "\n".join([
            f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {self.root / 'host_key'}",
            f"PidFile {self.root / 'sshd.pid'}", f"AuthorizedKeysFile {self.root / 'authorized_keys'}",
            "StrictModes no", "UsePAM no", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
            "PubkeyAuthentication yes", "PermitRootLogin prohibit-password", "AllowTcpForwarding yes",
            "ClientAliveInterval 5", "MaxSessions 50", "MaxStartups 50", f"Subsystem sftp {sftp}",
            "LogLevel ERROR", "",
        ])

    def start(self) -> None:
        with contextlib.suppress(PermissionError):  # sshd's privilege separation directory
            Path("/run/sshd").mkdir(exist_ok=True)
        for _ in range(5):  # the free port may be taken between probing and binding
            self.port = free_port()
            config = self.root / "sshd_config"
            config.write_text(self._config())
            with open(self.root / "sshd.log", "ab") as log:  # sshd keeps its own copy of the fd
                self._proc = subprocess.Popen([str(SSHD), "-D", "-e", "-f", str(config)],
                                              stdout=log, stderr=log, stdin=subprocess.DEVNULL)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and self._proc.poll() is None:
                try:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                        break
                except OSError:
                    time.sleep(0.05)
            if self._proc.poll() is None:
                pub = self.host_key.export_public_key().decode().strip()
                self.known_hosts_path.write_text(f"[127.0.0.1]:{self.port} {pub}\n")
                return
        raise RuntimeError(f"sshd did not start: {(self.root / 'sshd.log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            self._proc.wait(10)
            self._proc = None

    def spec(self, name: str, **overrides: Any) -> HostSpec:
        fields: dict[str, Any] = {
            "name": name, "address": "127.0.0.1", "port": self.port, "user": getpass.getuser(),
            "identity_file": str(self.client_key_path), "known_hosts": str(self.known_hosts_path),
            "ssh_config": str(self.root / "ssh_config"), "connect_timeout": 5.0,
        }
        fields.update(overrides)
        return HostSpec(**fields)


@pytest.fixture(scope="session")
def openssh_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OpenSSHServer]:
    """OpenSSH's sshd on loopback for the session; fails under CI=true when sshd is missing."""
    if not SSHD.exists():
        reason = f"OpenSSH's sshd is not installed at {SSHD} (apt-get install openssh-server)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    server = OpenSSHServer(tmp_path_factory.mktemp("sshd"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
async def embedded_server(tmp_path: Path) -> AsyncIterator[EmbeddedSSHServer]:
    """An embedded SSH server whose home is tmp_path/home."""
    server = EmbeddedSSHServer(tmp_path / "home", tmp_path / "embedded-ssh", python=sys.executable)
    await server.start()
    yield server
    await server.stop()


@dataclass
class SSHTarget:
    """One server under test, whatever its kind: how to reach it and how to drop a connection."""

    kind: str  # "embedded" | "openssh"
    server: Any
    workdir: Path  # a fresh workdir (absolute), private to the test
    hosts: list[Host] = field(default_factory=list)

    def spec(self, name: str = "testhost", **overrides: Any) -> HostSpec:
        fields = {"python": sys.executable, "workdir": str(self.workdir), **overrides}
        return self.server.spec(name, **fields)

    async def connect(self, name: str = "testhost", **overrides: Any) -> Host:
        host = Host(self.spec(name, **overrides))
        await host.connect()
        self.hosts.append(host)
        return host

    async def drop(self, host: Host | None) -> None:
        """Break the link: the embedded server restarts (same port and key); for sshd the client's
        transport is aborted, which sshd sees as a vanished client."""
        if self.kind == "embedded":
            await self.server.stop()
            await self.server.start()
        elif host is not None and host.connection is not None:
            host.connection.abort()


@pytest.fixture(params=["embedded", "openssh"])
async def ssh_target(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SSHTarget]:
    """Each test using this runs twice: against the embedded server and against OpenSSH's sshd."""
    if request.param == "embedded":
        server: Any = EmbeddedSSHServer(tmp_path / "home", tmp_path / "embedded-ssh", python=sys.executable)
        await server.start()
    else:
        server = request.getfixturevalue("openssh_server")
    target = SSHTarget(request.param, server, tmp_path / "work")
    yield target
    for host in target.hosts:
        await host.close()
    if request.param == "embedded":
        await server.stop()
    shutil.rmtree(tmp_path / "work", ignore_errors=True)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[ThreadedHosts]:
    """Two embedded SSH hosts, ct129 and ct200, on a loop of their own so that `console.cli.main`
    can run in the test's thread (tests/cli_hosts.py)."""
    rig = ThreadedHosts(tmp_path, ["ct129", "ct200"])
    yield rig
    rig.close()
