"""The `[fleet]` table: several SGLang replicas behind SGLang's router (issue 29).

    [fleet]
    router = "http://127.0.0.1:30000"    # the router's URL (seen from router_host, or from the console)
    router_host = "gateway"              # optional: the host the URL is seen from (a port is forwarded)
    api_key_env = "SGLANG_ROUTER_KEY"    # optional: the console's variable holding an admin key
    drain_timeout_s = 600                # how long a drained replica's requests may take to finish

    [[fleet.replicas]]                   # one per replica: a name, then what [service] holds
    name = "r1"
    host = "ct129"
    unit = "sglang.service"
    url = "http://127.0.0.1:30001"        # as seen from its host, as [service] url
    router_url = "http://10.0.0.5:30001"  # optional: the URL the router lists it under (default: url)

Each URL is reached from the host it is seen from, through a port forwarded over that host's SSH
connection (console/session/fleet_reach.py); a router without `router_host` from the console itself.
A fleet has no `[service]` table of its own: each replica is a service, validated exactly as
`[service]` is (`service_table`, console/config/service.py). A config without `[fleet]` is a
one-server config, unchanged. What the router's API is: docs/sglang.md, "Router".
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from console.config.checks import (
    Checker,
    describe,
    is_env_name,
    is_http_url,
    is_positive_number,
    is_text,
    key_from_env,
)
from console.config.hosts import HostConfig
from console.config.service import ServiceConfig, service_table
from console.config.toml_writer import table_dict

FLEET_KEYS = ("router", "router_host", "api_key_env", "drain_timeout_s", "replicas")
REPLICA_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # names runs, views and journal lines
DEFAULT_DRAIN_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica: its name and its service (the form of [service])."""

    name: str
    service: ServiceConfig
    router_url: str = ""  # the URL the router knows it by; "" means the service's own URL

    @property
    def worker_url(self) -> str:
        """The URL the router lists this replica under (what its /workers routes take)."""
        return self.router_url or self.service.url


@dataclass(frozen=True)
class FleetConfig:
    """The router and the replicas behind it."""

    router: str
    replicas: tuple[ReplicaConfig, ...]
    router_host: str | None = None
    api_key_env: str | None = None
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def replica(self, name: str) -> ReplicaConfig | None:
        return next((r for r in self.replicas if r.name == name), None)

    def api_key(self) -> str | None:
        """The router's admin key from the console's environment (None when no api_key_env is set);
        ConfigError when the variable named is not set."""
        return key_from_env(self.api_key_env, "fleet")


def _same_url(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/")


def parse_fleet(c: Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> FleetConfig:
    """Check `[fleet]` (and that no `[service]` sits beside it); raise the first problem."""
    raw = c.table(data, "fleet", "fleet", required=True)
    assert raw is not None
    if "service" in data:
        raise c.fail("service", "no [service] table with [fleet] (each replica is a service: [[fleet.replicas]])",
                     describe(data["service"]))
    p = "fleet"
    c.keys(raw, p, FLEET_KEYS)
    router = c.get(raw, "router", p, is_http_url, "the router's http:// or https:// URL", required=True)
    router_host = None
    if "router_host" in raw:
        router_host = c.host_ref(c.get(raw, "router_host", p, is_text, "a host name"), f"{p}.router_host", hosts)
    api_key_env = c.get(raw, "api_key_env", p, is_env_name,
                        "the name of an environment variable (letters, digits and _, not starting with a digit)")
    drain = c.get(raw, "drain_timeout_s", p, is_positive_number, "a positive number of seconds", DEFAULT_DRAIN_TIMEOUT_S)
    listed = raw.get("replicas")
    if listed is None:
        raise c.missing(f"{p}.replicas", "the replicas behind the router ([[fleet.replicas]] tables)")
    if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
        raise c.wrong(f"{p}.replicas", "an array of tables ([[fleet.replicas]])", listed)
    if len(listed) < 2:
        raise c.fail(f"{p}.replicas", "at least two replicas (a fleet of one cannot take one out: use [service])",
                     f"{len(listed)}")
    replicas: list[ReplicaConfig] = []
    for i, item in enumerate(listed):
        rp = f"{p}.replicas[{i}]"
        name = c.get(item, "name", rp, lambda v: isinstance(v, str) and bool(REPLICA_NAME_RE.match(v)),
                     "a replica name of letters, digits, '.', '-' or '_'", required=True)
        if any(r.name == name for r in replicas):
            raise c.fail(f"{rp}.name", "a name no other replica has", f"{describe(name)}, already used")
        service = service_table(c, {k: v for k, v in item.items() if k not in ("name", "router_url")}, rp, hosts)
        if "url" not in item:
            raise c.missing(f"{rp}.url", "the replica's URL (each replica has its own)")
        router_url = c.get(item, "router_url", rp, is_http_url, "the http:// or https:// URL the router lists it under", "")
        replica = ReplicaConfig(name=name, service=service, router_url=router_url)
        where = f"{rp}.router_url" if router_url else f"{rp}.url"
        for other in replicas:
            if _same_url(other.worker_url, replica.worker_url):
                raise c.fail(where, "a URL no other replica has (the router knows each worker by its URL)",
                             f"{describe(replica.worker_url)}, the URL of replica {other.name!r} too")
        if _same_url(replica.worker_url, router):
            raise c.fail(where, "the replica's own URL, not the router's", describe(replica.worker_url))
        replicas.append(replica)
    return FleetConfig(router=router, replicas=tuple(replicas), router_host=router_host, api_key_env=api_key_env,
                       drain_timeout_s=drain)


def fleet_to_dict(fleet: FleetConfig) -> dict[str, Any]:
    """`fleet` as its TOML table (what `parse_fleet` reads back to an equal FleetConfig)."""
    out: dict[str, Any] = {"router": fleet.router}
    if fleet.router_host is not None:
        out["router_host"] = fleet.router_host
    if fleet.api_key_env is not None:
        out["api_key_env"] = fleet.api_key_env
    out["drain_timeout_s"] = fleet.drain_timeout_s
    out["replicas"] = [{"name": r.name, **table_dict(r.service), **({"router_url": r.router_url} if r.router_url else {})}
                       for r in fleet.replicas]
    return out
