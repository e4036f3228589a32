"""Which service a run addresses, recorded in the run, so that its resume and `r` address the same one.

A run records its config's absolute path and sha256 (`RunState.config`, `config_sha256`) and the
service's identity (`RunState.service_identity`): the service host's name and address, its manager,
the systemd unit, the server's URL. A resume, or `r` on the DOWN banner, under a config that
addresses another service, or under another config file altogether, is refused naming both: the
engine would otherwise ask another server whether it is down, and could mark this run's down service
"ready" because a different server answered. The run's own config file edited since (the same path)
is allowed while it addresses the same service; the engine says so.

A fleet run's identity is the fleet (`[fleet]`): the router's URL and the replicas' set (each name,
host and URL), never the replica of one window: a prompt set larger than one window's budget takes
successive replicas in turn (`steps/fleet.py: next_replica`), each window's replica recorded in the
run's `windows` and `facts.fleet_replica`. A run recorded before the fleet's identity (a replica's
service identity) is still compared by its service, against the replica the config was narrowed to.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from console.config import Config
from console.procedure.state import between_windows, recorded_replica

KEYS = ("host", "address", "manager", "unit", "url")  # what names the service (SSH port and user do not)
FLEET_KEYS = ("router", "replicas")  # what names a fleet: its router and the set of its replicas


def of(config: Config) -> dict[str, Any]:
    """The identity of what `config` addresses: the fleet (its router and replicas' set) on a fleet
    config, else the service."""
    if config.fleet is not None:
        return {"router": config.fleet.router,
                "replicas": sorted(f"{r.name} {r.service.host} {r.worker_url}" for r in config.fleet.replicas)}
    return service_of(config)


def service_of(config: Config) -> dict[str, Any]:
    """The identity of the service `config` addresses (on a fleet: the replica it was narrowed to)."""
    service = config.service
    host = config.hosts.get(service.host)
    return {"host": service.host, "address": host.address if host is not None else None, "manager": service.manager,
            "unit": service.unit if service.manager == "systemd" else None, "url": service.url}


def config_path(config: Config) -> str | None:
    return str(Path(config.source).resolve()) if config.source else None


def config_sha256(config: Config) -> str | None:
    source = config.source
    if not source or not Path(source).exists():
        return None
    return hashlib.sha256(Path(source).read_bytes()).hexdigest()


def describe(identity: dict[str, Any] | None) -> str:
    """"sglang.service on ct129 (10.0.0.5), http://127.0.0.1:30000"."""
    if not identity:
        return "a service not recorded"
    if identity.get("router"):
        return (f"the fleet behind the router {identity['router']} (replicas "
                f"{', '.join(str(r).split(' ')[0] for r in identity.get('replicas') or ())})")
    what = identity.get("unit") or f"the {identity.get('manager')}-managed server"
    where = identity.get("host")
    if identity.get("address") and identity.get("address") != where:
        where = f"{where} ({identity['address']})"
    return f"{what} on {where}, {identity.get('url')}"


def _config_said(path: str | None, sha: str | None) -> str:
    return f"{path or 'no file'}" + (f" (sha256 {sha[:12]})" if sha else "")


def same_service(recorded: dict[str, Any] | None, config: Config) -> bool:
    """Whether `config` addresses the recorded service (True when the run recorded none: it cannot
    be told, and the config file is compared instead)."""
    if not recorded:
        return True
    if recorded.get("router"):  # a fleet run: the same router and the same replicas
        now = of(config)
        return all(recorded.get(k) == now.get(k) for k in FLEET_KEYS)
    now = service_of(config)  # one server, or a fleet run recorded by its replica (before the fleet's identity)
    return all(recorded.get(k) == now.get(k) for k in KEYS)


def refusal(state: Any, config: Config, run_id: str) -> str | None:
    """Why run `run_id` (its `RunState`) must not be resumed or restarted under `config`: another
    service, or another config file (another path and other bytes); None when it is its own."""
    path, sha = config_path(config), config_sha256(config)
    recorded = state.service_identity
    if not same_service(recorded, config):
        return (f"run {run_id} addresses {describe(recorded)} (config {_config_said(state.config, state.config_sha256)}); "
                f"this config addresses {describe(of(config))} ({_config_said(path, sha)}): a resume and `r` "
                f"address the run's own service; use its config: --config {state.config}")
    elsewhere = _other_replica(state, config, run_id)
    if elsewhere is not None:
        return elsewhere
    same_file = state.config is None or path is None or Path(state.config).resolve() == Path(path)
    same_bytes = state.config_sha256 is not None and state.config_sha256 == sha
    if not same_file and not same_bytes:
        return (f"run {run_id} was made with the config {_config_said(state.config, state.config_sha256)}; this "
                f"is {_config_said(path, sha)}: a run is resumed under its own config; use --config {state.config}")
    return None


def _other_replica(state: Any, config: Config, run_id: str) -> str | None:
    """A fleet run's window on one replica is resumed (restarted, rejoined) on that replica only: a
    config narrowed to another is refused, naming both. Between two windows the next one may be on
    any replica (`steps/fleet.py: next_replica`)."""
    name = recorded_replica(state)
    if config.fleet is None or not (state.service_identity or {}).get("router") or name is None \
            or between_windows(state):
        return None
    replica = config.fleet.replica(name)
    if replica is not None and replica.service == config.service:
        return None
    now = next((r.name for r in config.fleet.replicas if r.service == config.service), config.service.url)
    return (f"run {run_id}'s window is on replica {name}; this console addresses replica {now}: its resume and `r` "
            f"address {name} (`dflash-ops run --resume {run_id}` narrows to it)")


def edited(state: Any, config: Config) -> str | None:
    """A line when the run's own config file changed since the run was made (allowed: the same service)."""
    sha = config_sha256(config)
    if state.config_sha256 and sha and sha != state.config_sha256:
        return (f"the config {config_path(config)} changed since the run was made (sha256 {state.config_sha256[:12]} "
                f"-> {sha[:12]}); it addresses the same service ({describe(of(config))})")
    return None
