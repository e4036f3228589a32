"""`~/.ssh/config` support: an alias with HostName/Port/User/IdentityFile, ProxyJump, and known_hosts
that stays enforced even when a config tries to switch it off. Generated configs, embedded servers."""

from __future__ import annotations

import getpass
import sys
from pathlib import Path

import pytest

from console.ssh.embedded_server import EmbeddedSSHServer
from console.ssh.hosts import Host, HostSpec, UnknownHostKey


def alias_block(alias: str, server: EmbeddedSSHServer, known_hosts: Path, extra: str = "") -> str:
    return (f"Host {alias}\n  HostName 127.0.0.1\n  Port {server.port}\n  User {getpass.getuser()}\n"
            f"  IdentityFile {server.client_key_path}\n  UserKnownHostsFile {known_hosts}\n{extra}\n")


async def test_alias_from_ssh_config(embedded_server: EmbeddedSSHServer, tmp_path: Path) -> None:
    config = tmp_path / "ssh_config"
    config.write_text(alias_block("gpu-box", embedded_server, embedded_server.known_hosts_path))
    host = Host(HostSpec("inference", "gpu-box", ssh_config=str(config)))
    await host.connect()
    try:
        result = await host.run(["sh", "-c", 'echo "$HOME"'])
        assert result.stdout.strip() == str(embedded_server.home)
    finally:
        await host.close()


async def test_proxyjump_goes_through_the_jump_host(embedded_server: EmbeddedSSHServer, tmp_path: Path) -> None:
    target = EmbeddedSSHServer(tmp_path / "target-home", tmp_path / "target-ssh", python=sys.executable)
    await target.start()
    known = tmp_path / "known_hosts"
    known.write_text(embedded_server.known_hosts_line() + target.known_hosts_line())
    config = tmp_path / "ssh_config"
    config.write_text(alias_block("bastion", embedded_server, known)
                      + alias_block("trainer", target, known, extra="  ProxyJump bastion"))
    host = Host(HostSpec("training", "trainer", ssh_config=str(config)))
    try:
        await host.connect()
        result = await host.run(["sh", "-c", 'echo "$HOME"'])
        assert result.stdout.strip() == str(target.home)
        assert embedded_server.forwarded == [("127.0.0.1", target.port)]  # the jump carried it
    finally:
        await host.close()
        await target.stop()


async def test_config_cannot_switch_host_key_checking_off(embedded_server: EmbeddedSSHServer,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # so "the default known_hosts" is an empty one here
    config = tmp_path / "ssh_config"
    config.write_text(f"Host lax\n  HostName 127.0.0.1\n  Port {embedded_server.port}\n"
                      f"  IdentityFile {embedded_server.client_key_path}\n"
                      "  UserKnownHostsFile none\n  StrictHostKeyChecking no\n")
    host = Host(HostSpec("lax", "lax", user=getpass.getuser(), ssh_config=str(config)))
    with pytest.raises(UnknownHostKey, match="ssh-keyscan"):
        await host.connect()


async def test_a_missing_identity_file_is_named(embedded_server: EmbeddedSSHServer, tmp_path: Path) -> None:
    from console.ssh.hosts import HostError

    host = Host(embedded_server.spec("inference", identity_file=str(tmp_path / "no_such_key")))
    with pytest.raises(HostError, match="no_such_key"):
        await host.connect()


async def test_a_broken_ssh_config_is_named(embedded_server: EmbeddedSSHServer, tmp_path: Path) -> None:
    from console.ssh.hosts import HostError

    config = tmp_path / "ssh_config"
    config.write_text("Host gpu-box\n  Port not-a-number\n")
    host = Host(HostSpec("inference", "gpu-box", ssh_config=str(config)))
    with pytest.raises(HostError, match="ssh_config line 2: Invalid Port"):
        await host.connect()
