"""The fleet's URLs reached as [fleet] says they are seen (console/config/fleet.py): a replica's `url`
from its `host`, the router's from `router_host` when given, each through that host's SSH connection
(a forwarded port: console/session/forwards.py, the one way [service] url is reached too); a router
without `router_host` is reached from the console directly.

`FleetReach` gives the clients the fleet steps and views ask for (`router_client`, `replica_client`:
the `via` of console/procedure/steps/fleet_choice.py). The session owns one over its supervisors;
`standalone` connects only the fleet's hosts, for a choice made before any session (`run` choosing
the replica, console/request.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from console.service.router import RouterClient
from console.service.sglang_api import DEFAULT_TIMEOUT_S, SglangClient
from console.session.forwards import Forward, Reached
from console.ssh.supervisor import HostSupervisor

INFERENCE_TIMEOUT_S = 60.0  # a request sent through the router (the rejoin's probes)


def reconnect_wait(config: Any) -> float:
    """How long a step waits for a dropped host to be back: three connection attempts' worth (the
    hosts' `connect_timeout`), between 10 s and a minute."""
    longest = max((h.connect_timeout for h in config.hosts.values()), default=10.0)
    return min(max(3 * longest, 10.0), 60.0)


def fleet_hosts(fleet: Any) -> list[str]:
    """The hosts the fleet's URLs are seen from: each replica's, and `router_host` when given."""
    names = [r.service.host for r in fleet.replicas] + ([fleet.router_host] if fleet.router_host else [])
    return list(dict.fromkeys(names))


class FleetReach:
    """The router's and the replicas' clients of one fleet, over the hosts' supervisors."""

    def __init__(self, fleet: Any, supervisors: Mapping[str, HostSupervisor], connect_s: float):
        self.fleet = fleet
        self.supervisors = supervisors
        self.connect_s = connect_s
        self._forwards: dict[tuple[str, str], Forward] = {}

    def forward(self, host: str, url: str) -> Forward:
        """The one forward to `url` seen from `host` (kept: one listener per connection, not per call)."""
        key = (host, url.rstrip("/"))
        if key not in self._forwards:
            self._forwards[key] = Forward(self.supervisors[host], url)
        return self._forwards[key]

    def router_client(self, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
        """The router at [fleet] router: through `router_host`'s connection when given (its `inference`:
        requests sent through it), else from the console."""
        fleet = self.fleet
        key = fleet.api_key()
        if fleet.router_host is None:
            return RouterClient(fleet.router, timeout=timeout, api_key=key)
        forward = self.forward(fleet.router_host, fleet.router)
        router = Reached(forward, lambda base: RouterClient(base, timeout=timeout, api_key=key), RouterClient,
                         self.connect_s)
        router.inference = Reached(forward, lambda base: SglangClient(base, timeout=INFERENCE_TIMEOUT_S),
                                   SglangClient, self.connect_s)
        return router

    def replica_client(self, replica: Any, timeout: float = DEFAULT_TIMEOUT_S) -> Any:
        """Replica `replica`'s own server: its `url` as seen from its `host`, through that connection."""
        service = replica.service
        return Reached(self.forward(service.host, service.url), lambda base: SglangClient(base, timeout=timeout),
                       SglangClient, self.connect_s)


@contextlib.asynccontextmanager
async def standalone(config: Any) -> AsyncIterator[FleetReach | None]:
    """A `FleetReach` over connections of its own to the fleet's hosts only (closed on leaving)."""
    from console.ssh.host_specs import host_spec

    if config.fleet is None:
        yield None  # one server: no fleet to reach
        return
    supervisors = {name: HostSupervisor(host_spec(config, name)) for name in fleet_hosts(config.fleet)}
    for supervisor in supervisors.values():
        supervisor.start()
    try:
        yield FleetReach(config.fleet, supervisors, reconnect_wait(config))
    finally:
        for supervisor in supervisors.values():
            await supervisor.stop()
