"""From the config's `[hosts.<name>]` tables to the `HostSpec`s that `console.ssh.hosts` connects with."""

from __future__ import annotations

from pathlib import Path

from console.config import Config
from console.ssh.hosts import HostSpec


def _local_path(value: str | None, base: Path) -> str | None:
    """A local file named in the config: `~` expanded, a relative path taken from the config's folder."""
    if value is None:
        return None
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else base / path)


def host_spec(config: Config, name: str, python: str | None = None) -> HostSpec:
    """How to reach host `name` of `config`; `python` overrides the host's interpreter (the target's)."""
    host = config.hosts[name]
    base = config.base_dir()
    return HostSpec(
        name=name,
        address=host.address,
        user=host.user,
        port=host.port,
        python=python or host.python,
        workdir=host.workdir,
        identity_file=_local_path(host.identity_file, base),
        known_hosts=_local_path(host.known_hosts, base),
        ssh_config=_local_path(host.ssh_config, base),
        connect_timeout=float(host.connect_timeout),
        keepalive_interval=float(host.keepalive_interval),
        drill=host.simulated_gpus,
    )


def probe_python(config: Config, name: str) -> str:
    """The interpreter whose environment matters on host `name`: the target's on the target host
    (that is what extracts), else the host's."""
    if name == config.target.host and config.target.python:
        return config.target.python
    return config.hosts[name].python
