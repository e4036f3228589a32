"""The drill's fleet: SGLang's real router (`sglang-router` from PyPI, the `fleet` extra) in front of
the rehearsal servers, on loopback.

The router is started as `python -m sglang_router.launch_router` (its own launcher). Two of its
defaults are changed, and why (docs/sglang.md, "Router"): it binds 0.0.0.0 (here 127.0.0.1), and it
opens a Prometheus exporter on port 29000 whatever else runs (a second router on the machine then
panics "Address already in use"): each drill's router gets a free port for it; and its policy
(`POLICY`). Its process retitles
itself `sglang::router` (setproctitle): it is found and ended by pid, never by name.
"""

from __future__ import annotations

import importlib.util

ROUTER_MODULE = "sglang_router.launch_router"
HEALTH_CHECK_INTERVAL_S = 1  # the router's default is 60 s: a drill wants a dead replica seen quickly
# The router's default, cache_aware, sent every short prompt of the drill to one replica (8 of 8 in a
# row, random prefixes): round_robin spreads the drill's load so that every replica carries some.
POLICY = "round_robin"


class RouterMissing(Exception):
    """sglang-router is not installed in this Python."""


def router_installed() -> bool:
    return importlib.util.find_spec("sglang_router") is not None


def router_command(python: str, port: int, prometheus_port: int, worker_urls: list[str],
                   *extra: str) -> list[str]:
    """The argv that starts the router on 127.0.0.1:`port` with these workers."""
    return [python, "-m", ROUTER_MODULE, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            "--health-check-interval-secs", str(HEALTH_CHECK_INTERVAL_S), "--policy", POLICY,
            "--worker-urls", *worker_urls, *extra]
