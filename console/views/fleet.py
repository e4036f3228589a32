"""The fleet as `status` prints it and the console's fleet panel draws it: the router's health, then a
row per replica (state, whether the router lists it healthy, its requests, its host and GPUs).
Pure: built from a `FleetView` (console/service/fleet_watch.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from console.messages import FleetView, ReplicaView

STATE_STYLES = {"serving": "green", "draining": "bold yellow", "in window": "bold yellow", "rejoining": "yellow",
                "DRAINED": "bold white on red", "unhealthy": "bold red", "out of the router": "bold red",
                "unknown": "yellow"}


def gpus_text(gpus: tuple[int, ...]) -> str:
    """(0, 1, 2, 3, 5) -> '0-3,5'; () -> 'all' (the service's [service] gpus not set)."""
    if not gpus:
        return "all"
    runs: list[list[int]] = []
    for i in sorted(set(gpus)):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


def router_line(view: FleetView) -> Text:
    """'router http://…:30000 (smg 1.13.0) up, 2 of 2 replicas healthy' (or why it cannot be read)."""
    if view.error is not None:
        return Text(f"router {view.router}: {view.error}", style="bold red")
    text = Text(f"router {view.router} ")
    if view.gateway:
        text.append(f"({view.gateway}) ", style="bold")
    text.append("up" if view.router_up else "DOWN", style="green" if view.router_up else "bold red")
    healthy, total = view.healthy_count, len(view.replicas)
    text.append(f", {healthy} of {total} replicas healthy", style="green" if healthy == total else "yellow")
    return text


def state_text(replica: ReplicaView) -> Text:
    """'serving', 'in window (run X)', 'DRAINED by run X'."""
    style = STATE_STYLES.get(replica.state, "")
    if replica.state == "DRAINED":
        return Text(f"DRAINED by run {replica.run_id}", style=style)
    if replica.run_id is not None:
        return Text(f"{replica.state} (run {replica.run_id})", style=style)
    return Text(replica.state, style=style)


def requests_text(replica: ReplicaView) -> str:
    if replica.running is None:
        return "?"
    return f"{replica.running} running, {replica.queued or 0} queued"


def replica_rows(view: FleetView) -> list[list[Text | str]]:
    rows: list[list[Text | str]] = []
    for r in view.replicas:
        listed = "healthy" if r.listed and r.healthy else "not listed" if not r.listed else \
            "draining" if r.router_status == "draining" else "UNHEALTHY"
        if view.error is not None:
            listed = "?"
        rows.append([r.name, state_text(r), Text(listed, style="green" if listed == "healthy" else "yellow"),
                     requests_text(r), f"{r.host} GPU {gpus_text(r.gpus)}" if r.host else "host not recorded"])
    return rows


def fleet_renderable(view: FleetView | None) -> Group:
    """The router line, the replicas' table, and each replica's reading error on a line of its own."""
    if view is None:
        return Group(Text("fleet: not checked yet", style="yellow"))
    table = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for name in ("replica", "state", "router", "requests", "GPUs"):
        table.add_column(name, no_wrap=name != "state")
    for row in replica_rows(view):
        table.add_row(*row)
    errors = [Text(f"{r.name}: {r.error}", style="yellow") for r in view.replicas if r.error]
    return Group(router_line(view), table, *errors)


def fleet_lines(view: FleetView | None) -> Group:
    """The console's fleet panel: the router line, then per replica its state on one line and its
    router listing, requests, host and GPUs on the next (a narrow column keeps every value whole)."""
    if view is None:
        return Group(Text("not checked yet", style="yellow"))
    lines = [router_line(view)]
    for replica, row in zip(view.replicas, replica_rows(view), strict=True):
        head = Text(f"{replica.name}  ", style="bold")
        head.append_text(state_text(replica))
        lines.append(head)
        detail = Text("  router ", style="dim")
        detail.append_text(row[2] if isinstance(row[2], Text) else Text(str(row[2])))
        detail.append(f" · {requests_text(replica)} · {row[4]}", style="dim")
        lines.append(detail)
        if replica.error:
            lines.append(Text(f"  {replica.error}", style="yellow"))
    return Group(*lines)


@dataclass(frozen=True)
class FleetServing:
    """While a fleet window's replica is down: the fleet in words ('out of the router, r2 serving')
    and whether the router still serves through another replica (issue 41: the console said SERVICE
    DOWN in red while the router served through r2)."""

    replica: str
    state: str  # 'out of the router, r2 serving' (the replica's own name not repeated)
    serving: bool

    @property
    def words(self) -> str:
        return f"{self.replica} {self.state}"


def fleet_serving(view: FleetView | None, replica: str | None) -> FleetServing | None:
    """`replica`'s window as the fleet's last look says it; None without [fleet] or before that look."""
    if view is None or replica is None:
        return None
    mine = next((r for r in view.replicas if r.name == replica), None)
    where = ("out of the router" if mine is None or not mine.listed else
             "draining" if mine.router_status == "draining" else
             "listed healthy" if mine.healthy else "unhealthy in the router")
    if view.error is not None or not view.router_up:
        return FleetServing(replica, f"{where}, the router {'cannot be read' if view.error else 'DOWN'}", False)
    others = [r.name for r in view.replicas if r.name != replica and r.listed and r.healthy]
    if others:
        return FleetServing(replica, f"{where}, {', '.join(others)} serving", True)
    return FleetServing(replica, f"{where}, no other replica serving", False)
