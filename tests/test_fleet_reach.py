"""The fleet's URLs as the config documents them (issue 41 section 2; console/session/fleet_reach.py):
a replica's `url` is seen from its `host`, the router's from `router_host`, each reached through that
host's SSH connection (a forwarded port), never from the console's own machine.

Two embedded SSH hosts (ct129 for the replicas, ct200 as `router_host`) in front of the real smg and two
real rehearsal servers (tests/router_helpers.py). Every URL in the config uses a name only its host
resolves (`EmbeddedSSHServer.names`, as the host's /etc/hosts would): the console cannot reach them
directly (asserted), so an answer proves the request went through the host, and the host's record of
the forwards asked for (`forwarded`) says which. Waits are on events with deadlines."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from console.config import dump_toml, parse_config
from console.procedure.hosts import SessionHosts
from console.procedure.steps.fleet import fleet_config
from console.procedure.steps.fleet_choice import measure
from console.service.replica_loads import read_loads
from console.service.router import RouterClient
from console.service.sglang_api import ServerUnreachable, SglangClient
from console.session import Session
from console.session.fleet_reach import FleetReach, standalone
from console.ssh.embedded_server import EmbeddedSSHServer
from tests.router_helpers import need_router
from tests.standin_helpers import free_port
from tests.test_config_fleet import one_server

need_router()

DEADLINE_S = 30.0
REPLICA_HOST, ROUTER_HOST = "ct129", "ct200"


def _host_only(url: str, name: str) -> str:
    """`url` with its host part `name` (a name only one SSH host resolves)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{name}:{parts.port}"


def _config(servers: dict[str, EmbeddedSSHServer], router: str, urls: list[str], router_host: str | None) -> Any:
    data = one_server()
    service = data.pop("service")
    data["hosts"] = {name: {"address": "127.0.0.1", "port": s.port, "user": s.user, "python": sys.executable,
                            "identity_file": str(s.client_key_path), "known_hosts": str(s.known_hosts_path),
                            "ssh_config": str(s.state_dir / "ssh_config"), "workdir": str(s.home / "work"),
                            "lock_dir": str(s.home / "locks"), "connect_timeout": 5, "simulated_gpus": True}
                     for name, s in servers.items()}
    replicas = [{"name": f"r{i + 1}", **service, "host": REPLICA_HOST, "gpus": [i],
                 "url": _host_only(url, f"replica{i + 1}.ct129.internal"), "router_url": url}
                for i, url in enumerate(urls)]
    data["fleet"] = {"router": _host_only(router, "router.ct200.internal") if router_host else router,
                     "replicas": replicas, **({"router_host": router_host} if router_host else {})}
    return parse_config(dump_toml(data), "fleet.toml")


@pytest.fixture
async def hosts(tmp_path: Path, router_fleet: tuple[str, list[str]]) -> AsyncIterator[dict[str, EmbeddedSSHServer]]:
    """ct129 resolves the replicas' names, ct200 the router's; the console resolves neither."""
    router, urls = router_fleet
    servers = {name: EmbeddedSSHServer(tmp_path / name / "home", tmp_path / name / "ssh", python=sys.executable)
               for name in (REPLICA_HOST, ROUTER_HOST)}
    servers[REPLICA_HOST].names = {f"replica{i + 1}.ct129.internal": urlsplit(u).hostname for i, u in enumerate(urls)}
    servers[ROUTER_HOST].names = {"router.ct200.internal": urlsplit(router).hostname}
    for server in servers.values():
        await server.start()
    yield servers
    for server in servers.values():
        await server.stop()


@pytest.fixture
async def session(hosts: dict[str, EmbeddedSSHServer], router_fleet: tuple[str, list[str]]) -> AsyncIterator[Session]:
    """A session over the config (its hosts connected; no telemetry, no service poll)."""
    router, urls = router_fleet
    made = Session(_config(hosts, router, urls, ROUTER_HOST))
    for supervisor in made.supervisors.values():
        supervisor.start()
    yield made
    for supervisor in made.supervisors.values():
        await supervisor.stop()


async def test_the_console_cannot_reach_the_host_only_names(session: Session) -> None:
    """The premise: from the console's own machine, the config's URLs lead nowhere."""
    fleet = session.config.fleet
    with pytest.raises(ServerUnreachable):
        await SglangClient(fleet.replicas[0].service.url, timeout=5).get("/health")
    with pytest.raises(ServerUnreachable):
        await RouterClient(fleet.router, timeout=5).health()


async def test_the_fleet_view_reads_router_and_replicas_from_their_hosts(
        session: Session, hosts: dict[str, EmbeddedSSHServer]) -> None:
    view = await session.check_fleet()
    assert view is not None and view.error is None, view
    assert view.router_up and view.gateway
    assert [(r.name, r.listed, r.healthy, r.running is not None, r.error) for r in view.replicas] == [
        ("r1", True, True, True, None), ("r2", True, True, True, None)]
    fleet = session.config.fleet
    router = urlsplit(fleet.router)
    assert (router.hostname, router.port) in hosts[ROUTER_HOST].forwarded
    for replica in fleet.replicas:
        url = urlsplit(replica.service.url)
        assert (url.hostname, url.port) in hosts[REPLICA_HOST].forwarded
        assert (url.hostname, url.port) not in hosts[ROUTER_HOST].forwarded  # each from its own host


async def test_the_fleet_steps_choose_through_the_hosts(session: Session) -> None:
    """What the drain's preflight and recheck read (`measure`, over the window's hosts), and the
    choice `run` makes before any session (`standalone`), both through the hosts."""
    loads = await measure(session.config.fleet, SessionHosts(session))
    assert [(r.name, r.listed, r.healthy, r.running is not None) for r in loads] == [
        ("r1", True, True, True), ("r2", True, True, True)]
    async with standalone(session.config) as via:
        placed, why = await fleet_config(session.config, via=via)
    assert placed.service.host == REPLICA_HOST and why is not None


async def test_the_forward_is_made_again_after_a_reconnect(session: Session,
                                                           hosts: dict[str, EmbeddedSSHServer]) -> None:
    reach = session.fleet_reach
    assert reach is not None
    replica = session.config.fleet.replicas[0]
    client = reach.replica_client(replica)
    assert (await read_loads(client)).running is not None
    supervisor = session.supervisors[REPLICA_HOST]
    old = supervisor.host
    back = asyncio.Event()
    unsubscribe = supervisor.subscribe(
        lambda state: back.set() if state.status == "connected" and supervisor.host not in (None, old) else None)
    try:
        asked = len(hosts[REPLICA_HOST].forwarded)
        await hosts[REPLICA_HOST].drop_connections()
        async with asyncio.timeout(DEADLINE_S):
            await back.wait()
        assert (await read_loads(client)).running is not None  # the same client, over the new connection
        url = urlsplit(replica.service.url)
        assert (url.hostname, url.port) in hosts[REPLICA_HOST].forwarded[asked:]
    finally:
        unsubscribe()


async def test_errors_name_the_host_and_the_url(session: Session) -> None:
    """A URL its host cannot reach either: the error says the URL as configured and the host it is
    seen from, never the console's local port."""
    reach = session.fleet_reach
    assert reach is not None
    replica = session.config.fleet.replicas[0]
    gone = f"http://127.0.0.1:{free_port()}"
    moved = dataclasses.replace(replica, service=dataclasses.replace(replica.service, url=gone))
    with pytest.raises(ServerUnreachable) as info:
        await read_loads(reach.replica_client(moved, timeout=5))
    said = str(info.value)
    assert said.startswith(f"{REPLICA_HOST}: {gone}/v1/loads"), said
    # the router seen from ct200 by a name ct200 resolves, at a port nothing listens on
    fleet = dataclasses.replace(session.config.fleet, router=f"http://router.ct200.internal:{free_port()}")
    router = FleetReach(fleet, session.supervisors, 10.0).router_client(timeout=5)
    with pytest.raises(ServerUnreachable) as info:
        await router.health()
    said = str(info.value)
    assert said.startswith(f"{ROUTER_HOST}: {fleet.router}/health"), said
    assert "127.0.0.1" not in said  # never the console's local port


def test_a_router_without_router_host_is_reached_from_the_console() -> None:
    """As documented: no `router_host`, the router's URL is the console's own."""
    config = parse_config(dump_toml(_plain_fleet()), "fleet.toml")
    reach = FleetReach(config.fleet, session_free_supervisors(config), 10.0)
    router = reach.router_client()
    assert isinstance(router, RouterClient) and router.base_url == "http://10.0.0.9:30000"
    # r1 and r2 have one `url` (127.0.0.1:30000), each its own host's: two forwards, one per host
    r1, r2 = (reach.replica_client(r) for r in config.fleet.replicas)
    assert (r1.base_url, r2.base_url) == ("http://127.0.0.1:30000 (seen from ct129)",
                                          "http://127.0.0.1:30000 (seen from ct200)")
    assert reach.forward("ct129", "http://127.0.0.1:30000") is not reach.forward("ct200", "http://127.0.0.1:30000")


def session_free_supervisors(config: Any) -> dict[str, Any]:
    """Supervisors never started (nothing is connected: only what the clients are is looked at)."""
    from console.ssh.host_specs import host_spec
    from console.ssh.supervisor import HostSupervisor

    return {name: HostSupervisor(host_spec(config, name)) for name in config.hosts}


def _plain_fleet() -> dict[str, Any]:
    data = one_server()
    service = data.pop("service")
    data["fleet"] = {"router": "http://10.0.0.9:30000", "replicas": [
        {"name": "r1", **service},
        {"name": "r2", **service, "host": "ct200", "router_url": "http://10.0.0.7:30000"}]}
    return data


async def test_a_host_gone_is_named_with_the_url_seen_from_it(session: Session,
                                                              hosts: dict[str, EmbeddedSSHServer]) -> None:
    replica = session.config.fleet.replicas[0]
    reach = FleetReach(session.config.fleet, session.supervisors, 2.0)  # waits 2 s for the host
    assert (await read_loads(reach.replica_client(replica))).running is not None
    await hosts[REPLICA_HOST].stop()  # ct129 gone: no connection, no forward
    with pytest.raises(ServerUnreachable) as info:
        await read_loads(reach.replica_client(replica))
    said = str(info.value)
    assert REPLICA_HOST in said and replica.service.url in said, said
