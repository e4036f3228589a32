"""`[service]`: the inference server whose GPUs the window borrows, and how it is stopped and
started (`systemd`, or the operator's own commands). A fleet's replica is a service table too
(console/config/fleet.py reads each one with `service_table`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from console.config.checks import (
    Checker,
    Command,
    describe,
    is_bool,
    is_env_name,
    is_http_url,
    is_positive_int,
    is_positive_number,
    is_text,
    key_from_env,
)
from console.config.hosts import HostConfig

Manager = Literal["systemd", "command"]
MANAGERS: tuple[str, ...] = ("systemd", "command")


@dataclass(frozen=True)
class ServiceConfig:
    """The inference server whose GPUs the window borrows."""

    host: str
    manager: Manager = "systemd"
    unit: str | None = None
    sudo: bool = False
    start: Command | None = None
    stop: Command | None = None
    status: Command | None = None
    log: Command | None = None  # manager "command": prints the server's log (start-up progress)
    url: str = "http://127.0.0.1:30000"
    ready_timeout_s: float = 900
    vram_free_mib: int = 1024
    stop_grace_s: float = 10
    vram_wait_s: float = 30  # after a stop: how long VRAM may stay held before its holders are offered to end
    gpus: tuple[int, ...] = ()
    # Which [[drafters]] NAME the server drafts with (speculative decoding), for the online cross-check;
    # None: matched by the draft model path /server_info reports.
    drafter: str | None = None
    # The NAME of an environment variable on the console's side holding the server's --api-key (the
    # key itself never goes in the file, a log or the journal).
    api_key_env: str | None = None

    def api_key(self) -> str | None:
        """The server's API key from the console's environment (None when no api_key_env is set);
        ConfigError when the variable named is not set."""
        return key_from_env(self.api_key_env, "service")


SERVICE_KEYS = tuple(f.name for f in fields(ServiceConfig))


def parse_service(c: Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> ServiceConfig:
    """Check the `[service]` table; raise the first problem."""
    raw = c.table(data, "service", "service", required=True)
    assert raw is not None
    return service_table(c, raw, "service", hosts)


def service_table(c: Checker, raw: Mapping[str, Any], p: str, hosts: Mapping[str, HostConfig]) -> ServiceConfig:
    """One service's table at field path `p` ([service], or a fleet's replica)."""
    c.keys(raw, p, SERVICE_KEYS)
    host = c.host_ref(c.get(raw, "host", p, is_text, "a host name", required=True), f"{p}.host", hosts)
    manager = c.get(raw, "manager", p, lambda v: v in MANAGERS, '"systemd" or "command"', "systemd")
    unit = c.get(raw, "unit", p, is_text, "a systemd unit name", required=manager == "systemd")
    start, stop, status, log = (c.command(raw, k, p) for k in ("start", "stop", "status", "log"))
    if manager == "systemd":
        for key in ("start", "stop", "status", "log"):
            if key in raw:
                used = "journalctl -u is used" if key == "log" else "systemctl is used"
                raise c.fail(f"{p}.{key}", f'no command with manager = "systemd" ({used})', describe(raw[key]))
    else:
        if unit is not None:
            raise c.fail(f"{p}.unit", 'no unit with manager = "command" (start/stop/status are used)', describe(unit))
        for key, value in (("start", start), ("stop", stop), ("status", status)):
            if value is None:
                raise c.missing(f"{p}.{key}", 'a command (required with manager = "command")')
    gpus = c.int_list(raw, "gpus", p, 0, "GPU indices")
    return ServiceConfig(
        host=host,
        manager=manager,
        unit=unit,
        sudo=c.get(raw, "sudo", p, is_bool, "true or false", False),
        start=start,
        stop=stop,
        status=status,
        log=log,
        url=c.get(raw, "url", p, is_http_url, "an http:// or https:// URL with a host", "http://127.0.0.1:30000"),
        ready_timeout_s=c.get(raw, "ready_timeout_s", p, is_positive_number, "a positive number of seconds", 900),
        vram_free_mib=c.get(raw, "vram_free_mib", p, is_positive_int, "a positive integer (MiB per GPU)", 1024),
        stop_grace_s=c.get(raw, "stop_grace_s", p, is_positive_number, "a positive number of seconds", 10),
        vram_wait_s=c.get(raw, "vram_wait_s", p, is_positive_number, "a positive number of seconds", 30),
        gpus=gpus or (),
        drafter=c.get(raw, "drafter", p, is_text, "the name of one of the [[drafters]]"),
        api_key_env=c.get(raw, "api_key_env", p, is_env_name,
                          "the name of an environment variable (letters, digits and _, not starting with a digit)"),
    )
