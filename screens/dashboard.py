"""The dashboard: a panel per host, the service, the steps, the current job and the event log."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.css.query import NoMatches
from textual.screen import Screen
from textual.widgets import Footer, Header

from console.views.fleet import fleet_serving
from screens.errors import StaysUp
from screens.fleet import fleet_view, replica_name
from screens.widgets.asked_panel import AskedPanel
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.event_log import EventLog
from screens.widgets.fleet_panel import FleetPanel
from screens.widgets.host_panel import HISTORY_S, HostPanel
from screens.widgets.job_panel import JobPanel
from screens.widgets.service_panel import ServicePanel
from screens.widgets.stepper import Stepper

if TYPE_CHECKING:
    from screens.window import ConsoleWindow


class DashboardScreen(StaysUp, Screen):
    """Redrawn from `app.state`: `refresh_part(kind)` for one kind of change, `refresh_all` on resume."""

    app: ConsoleWindow

    def compose(self) -> ComposeResult:
        app = self.app
        service = app.operator.config.service
        yield Header(show_clock=False, icon="")
        yield DowntimeBanner()
        yield AskedPanel()  # another console's open question, its command whole, the screen's width
        with Horizontal(id="main"):
            with VerticalScroll(id="hosts"):
                fleet = getattr(app.operator.config, "fleet", None)
                if fleet is not None:  # the router and its replicas, above the hosts
                    yield FleetPanel(fleet.router)
                for host in app.operator.config.hosts:
                    yield HostPanel(host, self._history)
            with Vertical(id="side"):
                yield ServicePanel(app.service_name, service.host)
                yield Stepper()
                yield JobPanel()
        yield EventLog()
        yield Footer()

    def _history(self, host: str, gpu: int) -> list[float | None]:
        try:
            return self.app.operator.session.history(host, gpu, HISTORY_S)
        except (KeyError, AttributeError):
            return []

    def on_mount(self) -> None:
        self.refresh_all()
        self.query_one("#hosts").focus()  # the arrows scroll the hosts at once; tab goes to the events

    def on_screen_resume(self) -> None:
        self.refresh_all()

    def refresh_all(self) -> None:
        for kind in ("host", "service", "fleet", "steps", "job", "downtime", "journal"):
            self.refresh_part(kind)

    def refresh_part(self, kind: str, payload: object = None) -> None:
        """Repaint what `kind` of change concerns (the state already holds it)."""
        if not self.is_mounted:  # a tick or a message before the panels are composed: on_mount draws all
            return
        with contextlib.suppress(NoMatches):  # the panels are being removed (the app is closing): nothing to draw
            self._repaint(kind, payload)

    def _repaint(self, kind: str, payload: object) -> None:
        state, now = self.app.state, self.app.now()
        if kind == "host":
            hosts = [payload.host] if payload is not None and hasattr(payload, "host") else None
            for panel in self.query(HostPanel):
                if hosts is None or panel.host in hosts:
                    panel.show(state.hosts.get(panel.host), state.telemetry.get(panel.host), now,
                               state.received.get(panel.host))
        elif kind in ("service", "downtime"):
            elsewhere = state.driven_elsewhere()
            panel = self.query_one(ServicePanel)
            panel.name_it(self.app.service_name, self.app.operator.config.service.host)  # a fleet's next replica
            panel.show(state.service, state.downtime, state.startup, now,
                       f"run {elsewhere.run_id}" if elsewhere else "this run", state.live,
                       fleet_serving(state.fleet, replica_name(self.app.operator.config)))
            # The question another console waits on (never a gone console's): its command, whole.
            asked = elsewhere.question if elsewhere is not None and not elsewhere.console_gone else None
            self.query_one(AskedPanel).show(asked, elsewhere.run_id if elsewhere else None)
            self.query_one(DowntimeBanner).show(state, now, self.app.can_restart())
        elif kind == "fleet" or (kind == "steps" and getattr(payload, "step", None) in ("drain", "rejoin")):
            for panel in self.query(FleetPanel):  # a drain or rejoin moves a replica's state at once
                panel.show(fleet_view(self.app))
            if kind == "fleet":
                self.app.refresh_bindings()  # r rejoins a DRAINED replica
                if state.down_since is not None:  # the banner and the service panel say who serves meanwhile
                    self._repaint("service", None)
                return
        if kind == "steps":
            self.query_one(Stepper).show(state.steps, state.planned, state.run_id, state.route, now,
                                         compact=self.app.has_class("narrow"), running=state.running,
                                         read_only=self.app.read_only, finished=state.finished)
        elif kind == "job":
            self.query_one(JobPanel).show(state.current_jobs(), now)
        elif kind == "journal":
            self.query_one(EventLog).catch_up(state.journal, state.journal_count)

    def tick(self) -> None:
        """Once a second: the clocks that move without a message (ages, timers, durations)."""
        self.refresh_part("service")
        self.refresh_part("steps")
        if self.app.state.extraction() is not None:  # its time left counts down between reports
            self.refresh_part("job")
        state, now = self.app.state, self.app.now()
        for panel in self.query(HostPanel):  # a host whose samples flow repaints with the next one anyway
            host, received = state.hosts.get(panel.host), state.received.get(panel.host)
            late = received is not None and now - received > 2.5
            if (host is not None and host.status != "connected") or late:
                panel.show(host, state.telemetry.get(panel.host), now, received)
