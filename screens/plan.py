"""`p`: the plan as a screen of its own, built from the engine's `PlanReady`: every step, its host,
the literal command, whether it acts or why not, its estimate, and where the target fits without
the serving GPUs (the zero-downtime proposal with its fit table). The same renderable as
`run --plan` prints, so the console and the terminal say the same thing."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Header, Static

from console.messages import PlanReady
from console.views.plan import plan_view
from screens.errors import StaysUp
from screens.widgets.downtime_banner import DowntimeBanner

if TYPE_CHECKING:
    from screens.window import ConsoleWindow


class PlanScreen(StaysUp, Screen):
    app: ConsoleWindow
    DEFAULT_CSS = """
    PlanScreen #plan-body { height: 1fr; }
    """
    BINDINGS = [Binding("escape", "back", "Dashboard"), Binding("p", "back", "Close", show=False)]

    def __init__(self, plan: PlanReady) -> None:
        super().__init__()  # no id: shown again, it replaces itself (ConsoleApp.show_screen)
        self.plan = plan

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        yield DowntimeBanner()
        with VerticalScroll(id="plan-body"):
            yield Static(plan_view(self.plan, commands_whole=False), id="plan-table")
        yield Footer()

    def on_mount(self) -> None:
        self.sub_title = f"plan of {self.plan.run_id} ({self.plan.route} route)"
        self.query_one("#plan-body").focus()  # the arrows and PageUp/Down scroll it at once

    def action_back(self) -> None:
        self.app.pop_screen()
