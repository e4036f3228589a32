"""The fleet behind SGLang's router ([fleet] configs only): the router's health, and per replica its
state (serving / draining / in window / rejoining / DRAINED by run X), the router's listing, its
requests, its host and GPUs. Drawn by `console.views.fleet.fleet_lines`, the text `status` prints."""

from __future__ import annotations

from textual.widgets import Static

from console.messages import FleetView
from console.views.fleet import fleet_lines
from screens.format import update_static


class FleetPanel(Static):
    """The fleet panel; `show` redraws it."""

    DEFAULT_CSS = """
    FleetPanel { height: auto; border: round $primary-darken-1; padding: 0 1; }
    FleetPanel.drained { border: round $error; }
    """

    def __init__(self, router: str) -> None:
        super().__init__(id="fleet")
        self.border_title = "Fleet behind SGLang's router"
        self.router = router

    def show(self, view: FleetView | None) -> None:
        self.set_class(view is not None and any(r.state == "DRAINED" for r in view.replicas), "drained")
        shown = fleet_lines(view)
        update_static(self, shown, tuple(t.markup for t in shown.renderables), len(shown.renderables))
