"""The red banner on every screen, modals included, while the service is down because of a run: for
how long, who holds it down when another console drives the run, when it is expected back (only while
something is bringing it back: a run going, a restart under way), and when the window's budget ends.
While a question waits it says so, rather than counting the operator's thinking as lateness. A
server a run holds paused (the pause route) reads SERVER PAUSED, since when and the memory released.
A fleet's replica down for its window while the router serves through the others reads REPLICA r1
DOWN and the fleet's state ('out of the router, r2 serving'), on the warning colour; SERVICE DOWN in
red only while no other replica serves (issue 41)."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.views.fleet import FleetServing, fleet_serving
from console.views.units import duration
from screens.fleet import replica_name
from screens.format import clock, update_static
from screens.state import ConsoleState


def downtime_text(state: ConsoleState, now: float, can_restart: bool, asking: bool = False,
                  restarting: bool = False, fleet: FleetServing | None = None) -> Text:
    """'SERVICE DOWN 1 min 30 s · back ~09:38:10 (in 1 min 40 s) · window ends 09:45:00', or
    'SERVICE DOWN 48 s · no restart under way: r restarts it', or '... · waiting for your answer', or
    'SERVER PAUSED 12 s since 09:31:02 · run X by ... · released: kv_cache, weights · back ~...'."""
    down_since = state.down_since
    paused = state.downtime is not None and state.downtime.paused  # the pause route: requests held, never stopped
    what = "SERVER PAUSED" if paused else f"REPLICA {fleet.replica} DOWN" if fleet and fleet.serving else "SERVICE DOWN"
    text = Text(f"{what} {duration(now - (down_since or now))}")
    if paused and down_since is not None:
        text.append(f" since {clock(down_since)}")
    if fleet is not None:  # who carries the users' requests meanwhile
        text.append(f" · {fleet.state if fleet.serving and not paused else fleet.words}")
    elsewhere = state.driven_elsewhere()
    if elsewhere is not None:  # who holds it down: the run and the console that drives it
        text.append(f" · run {elsewhere.run_id}")
        if elsewhere.console_gone:
            text.append(" (its console is gone: run --resume restarts it)")
        elif elsewhere.status != "running" and elsewhere.question:  # ended, and its console asks (r) now
            text.append(f" ({elsewhere.status}: its console asks to restart it)")
        elif elsewhere.status != "running":  # ended: whoever drove it is no longer the question
            text.append(f" ({elsewhere.status}: run --resume restarts it)")
        elif elsewhere.owner:
            text.append(f" by {elsewhere.owner}")
    live = state.live
    if paused and live is not None and live.run_id == state.downtime.run_id and live.released:
        text.append(f" · released: {', '.join(live.released)}")
    driving = live is not None and live.status == "running" and not live.console_gone  # a run is going
    asked = elsewhere is not None and elsewhere.question and not elsewhere.console_gone  # a run's, or `r`'s
    if asking or asked:
        # What is asked and where; its literal command, too long for the banner's rows, is whole in the
        # block under it (asked_panel.py).
        text.append(" · waiting for your answer" if asking else f" · waiting for an answer: {elsewhere.question.what}")
    elif not (state.running or restarting or driving):
        act, does = ("resume", "resumes") if paused else ("restart", "restarts")  # r gives a paused server back
        text.append(f" · no {act} under way" + (f": r {does} it" if can_restart else ""))
    else:
        _expected(text, state, now)
    ends = state.window_ends()
    if ends is not None:
        text.append(f" · window ends {clock(ends)}")
    return text


def _expected(text: Text, state: ConsoleState, now: float) -> None:
    back = state.expected_back(now)
    if back is not None:
        ready_at, _basis = back
        text.append(f" · back ~{clock(ready_at)}")
        text.append(f" ({duration(now - ready_at)} late)" if ready_at < now else f" (in {duration(ready_at - now)})")
        return
    job = state.extraction()
    eta = job.eta_s(now) if job is not None else None
    if eta is not None:  # no estimate of the restart yet: at least when the extraction ends
        text.append(f" · extraction ~{duration(eta)} left")


class DowntimeBanner(Static):
    DEFAULT_CSS = """
    DowntimeBanner { height: auto; max-height: 3; background: $error; color: $text; text-style: bold;
                     display: none; content-align: center middle; text-align: center; }
    DowntimeBanner.down { display: block; }
    DowntimeBanner.fleet-serving { background: $warning; color: $text; }
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
        app = self.app
        decider = getattr(app, "decider", None)
        restarting = getattr(app, "restarting", None)
        config = getattr(getattr(app, "operator", None), "config", None)
        fleet = fleet_serving(state.fleet, replica_name(config))
        self.set_class(fleet is not None and fleet.serving, "fleet-serving")
        text = downtime_text(state, now, can_restart, asking=getattr(decider, "asking", None) is not None,
                             restarting=bool(restarting()) if callable(restarting) else False, fleet=fleet)
        width = max(1, self.size.width or self.app.size.width)
        update_static(self, text, text.markup, max(1, -(-text.cell_len // width)))  # two lines when narrow
