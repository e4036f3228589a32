"""`[hosts.<name>]`: the machines the console reaches over SSH (an address or a `~/.ssh/config` alias)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from console.config.checks import Checker, describe, is_bool, is_int, is_positive_number, is_text

# Host names become TOML keys, field paths and run-directory names: keep them plain.
HOST_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")


@dataclass(frozen=True)
class HostConfig:
    """A machine reached over SSH. Unset fields are left to `~/.ssh/config` and asyncssh's defaults."""

    name: str
    address: str
    user: str | None = None
    port: int | None = None
    python: str = "python3"
    workdir: str = "~/dflash-ops"
    # Where the host lock (`dflash-ops.lock`: one window per inference host) lives: a directory every
    # operator's account reaches, so that two operators' consoles meet at the same lock. /var/tmp is
    # root's, sticky and 1777 on every distribution, and kept across a reboot (a host rebooted in the
    # middle of a window still says who left it down); /tmp and /run/lock are emptied then, and
    # /var/lock is root's alone on RHEL. A directory of our own making would belong to its first
    # operator, who could remove anyone's lock in it. console/procedure/host_lock.py.
    lock_dir: str = "/var/tmp"
    identity_file: str | None = None
    known_hosts: str | None = None
    ssh_config: str | None = None  # an ssh_config file to read instead of ~/.ssh/config (drill hosts: an empty one)
    connect_timeout: float = 10
    keepalive_interval: float = 15
    # A drill host whose GPUs are simulated: telemetry reads `simulated-gpu.json` in its workdir and it
    # receives the drill's workers (remote/drill/) too. Set by the drill's config, never inferred.
    simulated_gpus: bool = False


HOST_KEYS = tuple(f.name for f in fields(HostConfig) if f.name != "name")


def parse_hosts(c: Checker, data: Mapping[str, Any]) -> dict[str, HostConfig]:
    """Check the `[hosts.<name>]` tables; raise the first problem."""
    table = c.table(data, "hosts", "hosts", required=True)
    assert table is not None
    if not table:
        raise c.fail("hosts", "at least one [hosts.<name>] table", "an empty table")
    hosts = {}
    for name, raw in table.items():
        path = f"hosts.{name}"
        if not HOST_NAME_RE.match(name):
            raise c.fail(path, "a host name of letters, digits, '-' or '_'", describe(name))
        if not isinstance(raw, dict):
            raise c.wrong(path, "a table ([hosts.<name>] describes one host, e.g. [hosts.ct129])", raw)
        c.keys(raw, path, HOST_KEYS)
        hosts[name] = HostConfig(
            name=name,
            address=c.get(raw, "address", path, is_text, "a host name, IP address or ~/.ssh/config alias", required=True),
            user=c.get(raw, "user", path, is_text, "a user name"),
            port=c.get(raw, "port", path, lambda v: is_int(v) and 1 <= v <= 65535, "a port number (1-65535)"),
            python=c.get(raw, "python", path, is_text, "a Python interpreter (name or path)", "python3"),
            workdir=c.get(raw, "workdir", path, is_text, "a directory path", "~/dflash-ops"),
            lock_dir=c.get(raw, "lock_dir", path, lambda v: is_text(v) and v.startswith("/"),
                           "an absolute directory path every operator's account reaches (e.g. /var/tmp)", "/var/tmp"),
            identity_file=c.get(raw, "identity_file", path, is_text, "a key file path"),
            known_hosts=c.get(raw, "known_hosts", path, is_text, "a known_hosts file path"),
            ssh_config=c.get(raw, "ssh_config", path, is_text, "an ssh_config file path"),
            connect_timeout=c.get(raw, "connect_timeout", path, is_positive_number, "a positive number of seconds", 10),
            keepalive_interval=c.get(
                raw, "keepalive_interval", path, is_positive_number, "a positive number of seconds", 15
            ),
            simulated_gpus=c.get(raw, "simulated_gpus", path, is_bool, "true or false", False),
        )
    return hosts
