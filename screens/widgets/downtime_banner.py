"""The red banner on every screen, modals included, while this console holds the service down: for
how long, when it is expected back (and on what that rests), when the window's budget ends."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.views.units import duration
from screens.format import clock, update_static
from screens.state import ConsoleState


def downtime_text(state: ConsoleState, now: float, can_restart: bool) -> Text:
    """'SERVICE DOWN 1 min 30 s · back ~09:38:10 (in 1 min 40 s) · window ends 09:45:00 · r restarts it'."""
    down_since = state.down_since
    text = Text(f"SERVICE DOWN {duration(now - (down_since or now))}")
    back = state.expected_back(now)
    if back is not None:
        ready_at, _basis = back
        late = ready_at < now
        text.append(f" · back ~{clock(ready_at)}")
        text.append(f" ({duration(now - ready_at)} late)" if late else f" (in {duration(ready_at - now)})")
    else:
        job = state.extraction()
        eta = job.eta_s(now) if job is not None else None
        if eta is not None:  # no estimate of the restart yet: at least when the extraction ends
            text.append(f" · extraction ~{duration(eta)} left")
    ends = state.window_ends()
    if ends is not None:
        text.append(f" · window ends {clock(ends)}")
    if can_restart:
        text.append(" · r restarts it")
    return text


class DowntimeBanner(Static):
    DEFAULT_CSS = """
    DowntimeBanner { height: 1; background: $error; color: $text; text-style: bold;
                     display: none; content-align: center middle; }
    DowntimeBanner.down { display: block; }
    """

    def __init__(self) -> None:
        super().__init__(classes="downtime-banner")

    def on_mount(self) -> None:
        refresh = getattr(self.app, "refresh_banners", None)  # shown at once, not at the next tick
        if refresh is not None:
            refresh()

    def show(self, state: ConsoleState, now: float, can_restart: bool) -> None:
        down = state.down_since is not None
        self.set_class(down, "down")
        if not down:
            return
        text = downtime_text(state, now, can_restart)
        update_static(self, text, text.markup, 1)
