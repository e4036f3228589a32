"""A fleet run's replay (console/procedure/replay.py): the fleet panel as the live console drew it, the
drained replica out of the router from its drain to its rejoin and the others serving.

The live panel is the session's look at the router (`fleet_watch.look`) with each replica's state
from the runs (`fleet_watch.with_runs`): "draining (run X)" while the drain step runs, "in window"
once it is done, "rejoining" while the rejoin runs, "serving" once it is done, and "DRAINED by run X"
for a replica left out when the run ended. A run's store keeps no look at the router; what it keeps
is enough to draw the same states at the same moments:

    journal.jsonl   the drain's and rejoin's steps (their changes of status, with times), the replica
                    each one takes ("approved: take replica r1 out of the router", "r1 (URL) is out of
                    the router ROUTER (GATEWAY ...)", "r1 back in the router (added) after 66.0 s out"),
                    the preflight's verdict per replica ("fleet window on r2: fits: ...": the fleet's
                    replicas when nothing else names them)
    state.json      the replica recorded (`facts.fleet_replica`, `service.drained`), the fleet's
                    replicas (`facts.fleet_fits`), whether the replica was still out at the run's end
    the config      its [fleet] (router, each replica's host and GPUs), while the run's config file is
                    still there and still lists the replica; else the router and names from the above

Every replica is listed healthy at the drain's start (the drain is refused otherwise,
steps/fleet.py `choose`), so that is the first view shown. The replicas' own request counts are never
kept: they read "?"; without the config, a replica's host and GPUs read "host not recorded". One
event per change, each a `FleetView` at the time of its journal line.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from console import messages as m
from console.procedure.state import STEP_ENDED, RunState

_FLEET_STEP = re.compile(r"^(?P<step>drain|rejoin): (?P<status>running|" + "|".join(STEP_ENDED) + r")\b")
_ASKED = re.compile(r"^(?:approved|refused): (?:take|put) replica (?P<name>\S+) (?:out of|back in) the router$")
_OUT = re.compile(r"^(?P<name>\S+) \((?P<url>[^)]*)\) is out of the router (?P<router>\S+) \((?P<gateway>[^:,)]+)")
_BACK = re.compile(r"^(?P<name>\S+) back in the router \(")
_FITS = re.compile(r"^fleet window on (?P<name>\S+): ")
_PLANNED = re.compile(r"^take (?P<name>\S+) out of the router (?P<router>\S+?);")


def _replica_named(entry: m.JournalEntry) -> str | None:
    for pattern in (_ASKED, _OUT, _BACK):
        found = pattern.match(entry.message)
        if found:
            return found["name"]
    return None


def _step_change(entry: m.JournalEntry) -> tuple[str, str] | None:
    """(drain | rejoin, its new status) when the entry says a fleet step changed (tagged or not)."""
    if entry.kind == "step" and entry.step in ("drain", "rejoin") and entry.status:
        return entry.step, entry.status
    if entry.kind is None and entry.step in ("drain", "rejoin"):
        found = _FLEET_STEP.match(entry.message)
        if found and found["step"] == entry.step:
            return entry.step, found["status"]
    return None


def _config_fleet(state: RunState | None) -> dict[str, Any]:
    """The run's config file's [fleet] table, when the file is still there and readable; else {}."""
    try:
        data = tomllib.loads(Path(state.config).read_text(encoding="utf-8")) if state and state.config else {}
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, TypeError):
        return {}
    fleet = data.get("fleet")
    return fleet if isinstance(fleet, dict) else {}


def fleet_events(run_id: str, entries: list[tuple[int, m.JournalEntry]],
                 state: RunState | None) -> Iterable[tuple[float, m.FleetView, str]]:
    """The fleet panel's views of a fleet run, as (t, view, source): `replay.Event`'s fields (none for
    a one-server run)."""

    changes = [(number, entry, _step_change(entry)) for number, entry in entries]
    if not any(change for *_, change in changes):
        return []  # no drain nor rejoin journalled: one server, or a run that never got there
    facts = state.facts if state is not None else {}
    drained = (state.service.drained or {}) if state is not None else {}
    table = _config_fleet(state)
    configured = [r for r in table.get("replicas") or [] if isinstance(r, dict) and isinstance(r.get("name"), str)]
    named = [_replica_named(e) for _, e in entries]
    names = dict.fromkeys(r["name"] for r in configured)
    if not set(n for n in named if n) <= set(names):  # the config no longer describes this run's fleet
        names, configured = {}, []
    for name in [*(facts.get("fleet_fits") or {}), *(_FITS.match(e.message)[1] for _, e in entries
                                                     if e.step == "preflight" and _FITS.match(e.message)),
                 *(n for n in named if n), facts.get("fleet_replica"), drained.get("replica")]:
        if isinstance(name, str):
            names.setdefault(name)
    where = {r["name"]: (str(r.get("host", "")), tuple(g for g in r.get("gpus") or () if isinstance(g, int)))
             for r in configured}
    if not names:
        return []  # drain and rejoin left out ("one server"): no fleet to draw
    router, gateway = _router(table, drained, [e for _, e in entries], state)

    listed = dict.fromkeys(names, True)
    held: dict[str, str] = {}  # replica -> its state while the run holds it
    events: list[tuple[float, m.FleetView, str]] = []

    def view(t: float, where_from: str) -> None:
        replicas = tuple(m.ReplicaView(name, *where.get(name, ("", ())), listed=listed[name], healthy=listed[name],
                                       router_load=None, running=None, queued=None,
                                       state=held.get(name, "serving" if listed[name] else "out of the router"),
                                       run_id=run_id if name in held else None)
                         for name in names)
        events.append((t, m.FleetView(router, True, replicas, t, None, gateway), where_from))

    current = facts.get("fleet_replica") or drained.get("replica")
    for index, (number, entry, change) in enumerate(changes):
        name = _replica_named(entry)
        source = f"journal.jsonl:{number}"
        if change is not None and change[1] == "running":
            ahead = next((n for _, e, c in changes[index + 1:] if (n := _replica_named(e))
                          or (c is not None and c[0] == change[0] and c[1] != "running")), None)
            current = ahead or current
        elif name is not None:
            current = name
        if current not in listed:
            continue
        if change is not None:
            step, status = change
            if step == "drain" and status == "running":
                held[current] = "draining"
            elif step == "drain" and listed[current] and status != "done":
                held.pop(current, None)  # never taken out (refused, failed before), or back already
            elif step == "drain":
                listed[current], held[current] = False, "in window"
            elif status == "running":
                held[current] = "rejoining"
            elif status in ("done", "skipped"):
                listed[current] = True
                held.pop(current, None)
            else:
                held[current] = "in window"  # not put back: out until the compensation or a resume does
            view(entry.t, source)
        elif _OUT.match(entry.message):
            listed[current] = False
            view(entry.t, source)
        elif _BACK.match(entry.message):
            listed[current] = True
            view(entry.t, source)
    out = drained.get("replica")
    if state is not None and state.finished and out in listed and events:
        end = next((e.t for _, e in reversed(entries) if e.step is None and e.exit is not None), events[-1][0])
        listed[out], held[out] = False, "DRAINED"
        view(max(end, events[-1][0]), "state.json")
    return events


def _router(table: dict[str, Any], drained: dict[str, Any], entries: list[m.JournalEntry],
            state: RunState | None) -> tuple[str, str | None]:
    """The router's URL and which gateway answered, from the config, the state, or the journal."""
    router = table.get("router") if isinstance(table.get("router"), str) else drained.get("router")
    gateway = None
    for entry in entries:
        out = _OUT.match(entry.message)
        if out:
            router, gateway = router or out["router"], out["gateway"].strip()
            break
    if not router and state is not None:
        planned = next((p.get("why", "") for p in state.plan if p.get("name") == "drain"), "")
        found = _PLANNED.match(planned)
        router = found["router"] if found else None
    return router or "(the router)", gateway
