"""The red banner on every screen while this console holds the service down."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from screens.format import clock, duration, update_static


class DowntimeBanner(Static):
    DEFAULT_CSS = """
    DowntimeBanner { height: 1; background: $error; color: $text; text-style: bold;
                     display: none; content-align: center middle; }
    DowntimeBanner.down { display: block; }
    """

    def __init__(self) -> None:
        super().__init__(classes="downtime-banner")

    def show(self, down_since: float | None, now: float, can_restart: bool) -> None:
        self.set_class(down_since is not None, "down")
        if down_since is None:
            return
        text = Text(f"SERVICE DOWN {duration(now - down_since)} (stopped {clock(down_since)} by this run)")
        if can_restart:
            text.append("   r restarts it")
        update_static(self, text, text.markup, 1)
