"""What the console reads of the fleet ([fleet] configs): the session's last look at the router and
its replicas, each replica's state from the run store (the one source `status` and `runs` read), and
the run that left a replica DRAINED, which `r` resumes to put it back (console/service/fleet_watch.py)."""

from __future__ import annotations

import contextlib
from typing import Any

from console.messages import FleetView
from console.service.fleet_watch import drained_run, with_runs


def fleet_view(app: Any) -> FleetView | None:
    """The fleet as the session last saw it, each replica's state as the runs' states say."""
    seen = app.state.fleet
    if seen is None:
        return None
    states: list = []
    with contextlib.suppress(Exception):  # an unreadable store is said elsewhere (the resume offer)
        states = [run.state for run in reversed(app.operator.store.readable())]
    view = with_runs(seen, states)
    app.fleet_drained = drained_run(view)  # what `r` reads between two looks (never the store per key)
    return view


def drained_by(app: Any) -> str | None:
    """The run that left a replica out of the router with no console driving it (as the fleet panel
    last showed it), or None."""
    return getattr(app, "fleet_drained", None)


def replica_name(config: Any) -> str | None:
    """The replica whose window this console runs (its config's service), or None (one server)."""
    fleet = getattr(config, "fleet", None)
    if fleet is None:
        return None
    return next((r.name for r in fleet.replicas if r.service == config.service), None)
