"""Which messages of the bus are worth telling the people who share the window, and in what words.

The `Watcher` is fed the bus's messages of the runs this console drives and answers the
notifications they make; it does no I/O beyond reading a run's state from the store (what a run left
behind is the store's to say, never a guess from the messages):

    stop-approved  the stop was approved: host, route, forecast downtime (by phase)
    overrun        the downtime passed its forecast by `[notify] overrun_margin_s` (once per window)
    service-back   the server is ready again: the measured downtime, beside its forecast
    run-ended      the run's status, and the headline tau per drafter with the online one beside it (a
                   paused run has not ended: `run --resume` goes on with it)
    fleet-at-risk  a fleet window's replica is out and the others cannot carry its requests (another
                   replica unhealthy, none healthy, the router down): what, and that ending early is offered
    left-down      the run ended or paused with the server down (the store's answer), and how to end it
    console-gone   a watching console saw a run whose console is gone (killed) leave the server down,
                   paused or drained: who held it, since when, and how to give it back (`gone`)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from console import messages as m
from console.config import Config
from console.procedure.forecast import figure, from_state
from console.procedure.state import RunState
from console.procedure.store import Run, left_line, what_next
from console.views.units import duration

# The steps whose approval takes the server away from its users: (title's verb, what it is).
# A degraded run did its work but left the served drafter degraded (its figures and remedy in the message).
ENDED_LEVEL = {"done": "success", "degraded": "warning"}
STOPPING_STEPS = {"stop": ("stopping", "stop"), "pause": ("pausing", "pause")}


@dataclass(frozen=True)
class Notification:
    """One message to every target: `level` is apprise's type (info, success, warning, failure)."""

    event: str
    run_id: str
    title: str
    body: str
    level: str = "info"


@dataclass
class _Window:
    """The down period being watched: when it began and what it was forecast to last."""

    run_id: str
    since: float
    forecast_s: float | None
    overrun_said: bool = False
    paused: bool = False  # the pause route: paused (requests held), never stopped


def _clock(t: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t))


class Watcher:
    """Turns the bus's messages into notifications; `run_of(run_id)` opens a run of the store (None
    when it cannot be read)."""

    def __init__(self, config: Config, run_of: Callable[[str], Run | None], service: str):
        self.config = config
        self.run_of = run_of
        self.service = service  # "sglang.service on ct129"
        self.margin_s = config.notify.overrun_margin_s
        self.run_id: str | None = None  # the run the last step update was about (a question names its own)
        self.window: _Window | None = None

    def _state(self, run_id: str) -> RunState | None:
        run = self.run_of(run_id)
        return run.state if run is not None else None

    # --- what the messages say ----------------------------------------------------------------

    def on(self, message: Any) -> list[Notification]:
        if isinstance(message, m.StepUpdate | m.PlanReady):
            self.run_id = message.run_id
        elif isinstance(message, m.DecisionMade):
            return self._decided(message)
        elif isinstance(message, m.Downtime):
            return self._downtime(message)
        elif isinstance(message, m.RunFinished):
            return self._finished(message)
        elif isinstance(message, m.FleetAtRisk):
            return [Notification(
                "fleet-at-risk", message.run_id, f"dflash-ops: the fleet is at risk while {message.replica} is out",
                f"{message.why} ({_clock(message.t)}, run {message.run_id}). The console offers to end the window "
                f"early and put {message.replica} back in the router.", "failure")]
        return []

    def gone(self, live: m.LiveRun) -> list[Notification]:
        """Another console's run whose console is gone while the run holds the server (down, paused or
        drained): nobody will give it back unless told. The store's words, as `left-down` says them."""
        if live.ours or not live.console_gone:
            return []
        run = self.run_of(live.run_id)
        left = run.state.service.left_as() if run is not None else None
        if run is None or left is None:
            return []
        return [Notification(
            "console-gone", live.run_id, f"dflash-ops: {self.service} LEFT {left.upper()}: the console of run "
            f"{live.run_id} is gone",
            f"The console driving run {live.run_id} ({live.owner or 'owner unknown'}) is gone, and the run holds "
            f"{self.service}: {left_line(run)}.\nNext: {what_next(run)}.", "failure")]

    def _decided(self, made: m.DecisionMade) -> list[Notification]:
        asked = made.confirmation
        run_id = made.run_id or self.run_id  # the engine names the run that asked
        if not made.approved or asked.step not in STOPPING_STEPS or run_id is None:
            return []
        state = self._state(run_id)
        route = (state.route if state else None) or "window"
        said = f"forecast downtime {duration(asked.estimate_s)}" if asked.estimate_s is not None else "no forecast"
        if state is not None and state.forecast:  # state.json's forecast, as the engine wrote it before asking
            told = from_state(run_id, state.forecast)
            said = (f"forecast downtime {figure(told)} ("
                    + ", ".join(f"{p.name} {duration(p.seconds) if p.seconds is not None else 'unknown'}"
                                for p in told.phases) + ")")
        doing, what = STOPPING_STEPS[asked.step]
        return [Notification(
            "stop-approved", run_id, f"dflash-ops: {doing} {self.service}",
            f"Run {run_id} ({route} route): the {what} of {self.service} was approved "
            f"({made.by}); {said}.\nCommand: {' '.join(asked.argv)}", "warning")]

    def _forecast_s(self, state: RunState | None) -> float | None:
        return (state.forecast or {}).get("downtime_s") if state is not None else None

    def _downtime(self, down: m.Downtime) -> list[Notification]:
        if down.down_since is not None:
            if self.window is None or self.window.run_id != down.run_id or self.window.since != down.down_since:
                self.window = _Window(down.run_id, down.down_since, self._forecast_s(self._state(down.run_id)),
                                      paused=down.paused)
            return []
        window = self.window if self.window and self.window.run_id == down.run_id else None
        self.window = None
        if down.restarted_at is None:
            return []
        state = self._state(down.run_id)
        since = window.since if window else (state.service.stopped_at or state.service.paused_at) if state else None
        if since is None:
            return []
        paused = window.paused if window else bool(state and state.service.stopped_at is None)
        forecast = window.forecast_s if window else self._forecast_s(state)
        against = f" (forecast {duration(forecast)})" if forecast is not None else ""
        back, was = ("takes requests again", "paused") if paused else ("is ready again", "down")
        return [Notification(
            "service-back", down.run_id, f"dflash-ops: {self.service} is back",
            f"{self.service} {back} at {_clock(down.restarted_at)}: {was} {duration(down.restarted_at - since)}"
            f"{against}, since {_clock(since)} (run {down.run_id}).", "success")]

    def _finished(self, finished: m.RunFinished) -> list[Notification]:
        run = self.run_of(finished.run_id)
        state = run.state if run is not None else None
        headline = dict(state.headline) if state else {}
        online = state.facts.get("headline_online") if state else None
        online = online if isinstance(online, dict) else {}
        taus = [f"{name}: tau {tau:.2f}" + (f" (online {online[name]:.2f})" if online.get(name) is not None else "")
                for name, tau in headline.items() if isinstance(tau, int | float)]
        results = ("\n" + "\n".join(taus)) if taus else "\nNo drafter was evaluated."
        notes = []
        if finished.status != "paused":  # a paused run has not ended: `run --resume` goes on with it
            notes.append(Notification(
                "run-ended", finished.run_id, f"dflash-ops: run {finished.run_id} {finished.status}",
                f"Run {finished.run_id} ended {finished.status} (exit {finished.exit_code}): {finished.message}"
                f"{results}", ENDED_LEVEL.get(finished.status, "failure")))
        # How the run left the server is the store's answer ("down", or "paused" on the pause route),
        # said in the words every view uses.
        left = state.service.left_as() if state else (None if finished.service_up else "down")
        if left is not None:
            said = f"{left_line(run)}. Next: {what_next(run)}." if run is not None else \
                f"Run {finished.run_id} left {self.service} DOWN: `dflash-ops run --resume {finished.run_id}`."
            notes.append(Notification(
                "left-down", finished.run_id, f"dflash-ops: {self.service} LEFT {left.upper()} by run {finished.run_id}",
                f"Run {finished.run_id} {finished.status} and left {self.service} {left}.\n{said}", "failure"))
        return notes  # a window left open is still watched: its overrun, and the server back

    # --- the overrun, on a timer ---------------------------------------------------------------

    def overrun_due(self) -> float | None:
        """When the current window passes its forecast by the margin (epoch seconds), if one is due."""
        window = self.window
        if window is None or window.forecast_s is None or window.overrun_said:
            return None
        return window.since + window.forecast_s + self.margin_s

    def overrun(self, now: float) -> list[Notification]:
        """The overrun notification, once, if the window is still open and past its forecast + margin."""
        window = self.window
        due = self.overrun_due()
        if window is None or due is None or now < due:
            return []
        window.overrun_said = True
        was = "paused" if window.paused else "down"
        return [Notification(
            "overrun", window.run_id, f"dflash-ops: {self.service} {was} longer than forecast",
            f"{self.service} has been {was} {duration(now - window.since)} (since {_clock(window.since)}): past its "
            f"forecast of {duration(window.forecast_s)} by more than the {duration(self.margin_s)} margin "
            f"(run {window.run_id}).", "warning")]
