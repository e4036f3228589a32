"""The service: what its manager says, how it answers (health, model, requests), its uptime, or a red
DOWN timer while this console holds it down; start-up progress while it comes back. While a run holds
the server paused (the pause route): PAUSED, since when, by which run and what memory it released,
and no alarm about /health (SGLang answers 503 for the whole pause: it is not stuck). A fleet's replica
down for its window says the fleet's state under its timer ('r1 out of the router, r2 serving'), in
the warning colour while another replica serves, in red only when none does (issue 41)."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from console.messages import Downtime, LiveRun, ServiceView, StartupProgress
from console.views.fleet import FleetServing
from console.views.tables import bar
from console.views.units import duration
from screens.format import clock, update_static
from screens.widgets.event_log import short_paths


def service_renderable(view: ServiceView | None, downtime: Downtime | None, startup: StartupProgress | None,
                       now: float, by: str = "this run", live: LiveRun | None = None,
                       unseen: str = "not checked yet", fleet: FleetServing | None = None) -> Group:
    """`by`: the run holding it down or paused ("this run", "run X"); `live`: the live run, whose
    released memory tags are named while it holds the server paused; `fleet`: the fleet's state while
    this replica is down or paused for its window."""
    lines: list[Text] = []
    down_since = downtime.down_since if downtime is not None else None
    paused = down_since is not None and downtime.paused
    if paused:
        lines.append(Text(f" PAUSED {duration(now - down_since)} ", style="bold black on yellow"))
        lines.append(Text(f"paused by {by} since {clock(down_since)}", style="yellow"))
        released = live.released if live is not None and live.run_id == downtime.run_id else ()
        if released:
            lines.append(Text(f"released: {', '.join(released)}", style="yellow"))
    elif down_since is not None and fleet is not None and fleet.serving:  # the users are served meanwhile
        lines.append(Text(f" {fleet.replica} DOWN {duration(now - down_since)} ", style="bold black on yellow"))
        lines.append(Text(f"stopped by {by} at {clock(down_since)}", style="yellow"))
    elif down_since is not None:
        lines.append(Text(f" DOWN {duration(now - down_since)} ", style="bold white on red"))
        lines.append(Text(f"stopped by {by} at {clock(down_since)}", style="red"))
    if down_since is not None and fleet is not None:
        lines.append(Text(fleet.words, style="green" if fleet.serving else "bold red"))
    if view is None:
        lines.append(Text(unseen, style="yellow"))
        return Group(*lines)
    back = downtime.restarted_at if downtime is not None and down_since is None and not downtime.paused else None
    seen_ready = view.status is not None and view.status.active and view.health is not None and view.health.ready
    if back is not None and view.checked_at < back and not seen_ready:
        # The last look predates the restart's ready (its own health check and generation): never a
        # stale NOT RUNNING / starting for a server that is ready (issue 41: a fleet's rejoin showed it).
        lines.append(Text(f"ready at {clock(back)} (the run's own check); the service is read again", style="green"))
        return Group(*lines)
    status = view.status
    if status is None:
        lines.append(Text(f"unknown: {view.error}", style="bold red"))
        return Group(*lines)
    if status.active:
        state = Text(status.state + (f" ({status.sub_state})" if status.sub_state else ""), style="green")
        if status.main_pid:
            state.append(f", pid {status.main_pid}")
        lines.append(state)
        if status.since and down_since is None:
            lines.append(Text(f"up {duration(now - status.since)}", style="dim"))
    else:
        lines.append(Text(f"NOT RUNNING ({status.state})", style="bold red"))
        if status.detail and status.detail.splitlines()[0].strip() != status.state:
            lines.append(Text(status.detail.splitlines()[0], style="red"))
    health = view.health
    # Paused, SGLang answers /health 503 (or only after its own check's wait) until the continue: a
    # probe made before this console knew of the pause says so, never the essay on a stuck scheduler.
    paused_unhealthy = paused and health is not None and health.health_status != 200
    health_error = health.error if health is not None and (health.health_status is None or paused_unhealthy) else None
    if view.error and view.error != health_error:  # the health line below says that one, once
        lines.append(Text(view.error, style="yellow"))
    if startup is not None:
        line = Text(f"starting: {startup.stage.replace('_', ' ')}", style="yellow")
        if startup.done is not None and startup.total:
            line.append(" ")
            line.append(bar(startup.done / startup.total, 12), style="yellow on grey23")
            line.append(f" {startup.done}/{startup.total}")
        lines.append(line)
    if view.not_probed and paused:  # who paused it is said above
        lines.append(Text("/health not probed while paused (503 until the continue)", style="yellow"))
    elif view.not_probed:
        lines.append(Text(f"paused by {view.not_probed}: /health not probed", style="yellow"))
    elif paused_unhealthy:
        answer = health.health_status or "no answer"
        lines.append(Text(f"health: {answer} while paused (expected until the continue)", style="yellow"))
    elif health is not None:
        if health.health_status is None and startup is not None:  # expected while it loads: no alarm, no essay
            lines.append(Text("health: no answer yet (starting)", style="yellow"))
        elif health.health_status is None:
            lines.append(Text(f"health: no answer ({health.error})", style="bold red"))
        else:
            line = Text("health ")
            line.append(f"{health.health_status}", style="green" if health.health_status == 200 else "yellow")
            line.append(", ready" if health.ready else ", NOT READY", style="green" if health.ready else "bold yellow")
            lines.append(line)
            if health.model:
                # A model path, as the events write one: its last two parts, whole (never cut mid-name).
                lines.append(Text(f"model {short_paths(health.model)}", overflow="ellipsis", no_wrap=True))
            if health.running_requests is not None or health.queued_requests is not None:
                lines.append(Text(f"requests {health.running_requests or 0:.0f} running, "
                                  f"{health.queued_requests or 0:.0f} queued"))
    return Group(*lines)


class ServicePanel(Static):
    """The service panel; `show` redraws it."""

    DEFAULT_CSS = """
    ServicePanel { height: auto; border: round $primary-darken-1; padding: 0 1; }
    """

    def __init__(self, name: str, host: str) -> None:
        super().__init__(id="service")
        self.name_it(name, host)
        self.unseen = "not checked yet"  # what it says before the first look (a replay says why there is none)

    def name_it(self, name: str, host: str) -> None:
        """Its title: the service and where (a fleet run's next window moves it to another replica)."""
        title = f"Service {name} on {host}"
        if self.border_title != title:
            self.border_title = title

    def show(self, view: ServiceView | None, downtime: Downtime | None, startup: StartupProgress | None,
             now: float, by: str = "this run", live: LiveRun | None = None, fleet: FleetServing | None = None) -> None:
        held = downtime is not None and downtime.down_since is not None
        served = fleet is not None and fleet.serving  # a fleet's other replicas carry the requests
        self.set_class(held and not downtime.paused and not served, "down")
        self.set_class(held and (downtime.paused or served), "paused")
        shown = service_renderable(view, downtime, startup, now, by, live, self.unseen, fleet)
        width = max(1, self.content_region.width or 40)
        # The rows it takes, wrapped lines counted: a layout pass only when that changes.
        rows = sum(max(1, -(-t.cell_len // width)) if not t.no_wrap else 1 for t in shown.renderables)
        update_static(self, shown, tuple(t.markup for t in shown.renderables), rows)
