"""`dflash-ops replay`: the console over a past run's recording instead of live hosts.

The same app, dashboard and panels as `console --read-only` (nothing acts on a host): the messages
come from `console.procedure.replay` (the run's store, in time order) and are folded into the same
`ConsoleState`; the app's clock is the run's time being shown, so the DOWN timer, the steps'
durations and the ages read as they did then. A bar above the panels says where the playback stands,
the last question asked with its answer, and any damage to the store (file and line).

Keys: space pause/play, `.` the next event, `]` / `[` the next / previous step, `+` / `-` the
speed; `o` the results (opened by themselves at the end). A step is also a command in the palette.
"""

from __future__ import annotations

import time
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Group
from rich.text import Text
from textual.app import ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import ModalScreen, Screen
from textual.widgets import Static

from console import messages as m
from console.procedure.replay import Event, Player, Recording, damage_report
from console.session.bus import MessageBus
from console.views.units import duration
from screens.app import ConsoleApp
from screens.dashboard import DashboardScreen
from screens.format import clock, update_static
from screens.state import ConsoleState
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.service_panel import ServicePanel

FRAME_S = 0.1  # how often the playback moves on (real seconds)


@dataclass
class _Service:
    host: str
    manager: str = "command"
    unit: str | None = None


@dataclass(frozen=True)
class _Fleet:
    router: str
    replicas: tuple = ()  # (no replica is this console's service: the panel names each)


@dataclass
class ReplayConfig:
    """The part of `Config` the dashboard reads, from the recording (the run's config file may be
    gone, or changed since): its hosts, the service's host (the one the stop was asked on), and a
    fleet run's router (its fleet panel: console/procedure/replay_fleet.py)."""

    hosts: dict[str, None]
    service: _Service
    fleet: _Fleet | None = None


def config_of(recording: Recording) -> ReplayConfig:
    hosts = recording.hosts()
    plan = next((e.message for e in recording.events if isinstance(e.message, m.PlanReady)), None)
    stop = next((s.host for s in plan.steps if s.name == "stop" and s.host), None) if plan else None
    asked = next((e.message.confirmation.host for e in recording.events if isinstance(e.message, m.DecisionMade)
                  and e.message.confirmation.step == "stop"), None)
    service_host = stop or asked or next(iter(hosts), "?")
    fleet = next((_Fleet(e.message.router) for e in recording.events if isinstance(e.message, m.FleetView)), None)
    return ReplayConfig(dict.fromkeys(live_order(recording, service_host)), _Service(service_host), fleet)


def live_order(recording: Recording, service_host: str) -> list[str]:
    """The hosts in the live console's order, which is its config's: the run's config file's when it
    is still there, else the service's host first (as the example config and the drill list them),
    then the others as the run first heard of them (telemetry's order is whichever agent spoke first)."""
    heard = [service_host, *(h for h in recording.hosts() if h != service_host)]
    config = recording.state.config if recording.state is not None else None
    try:
        listed = list(tomllib.loads(Path(config).read_text(encoding="utf-8")).get("hosts", {})) if config else []
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError, AttributeError):
        listed = []  # gone, or no longer a config: the convention above
    return sorted(heard, key=lambda h: listed.index(h) if h in listed else len(listed))  # (stable)


class ReplaySession:
    """The sparklines' memory history, up to the moment shown."""

    def __init__(self, recording: Recording, now: Callable[[], float]):
        self.recording, self.now = recording, now

    def history(self, host: str, gpu: int, seconds: float | None = None) -> list[float | None]:
        return self.recording.history(host, gpu, self.now(), seconds)


@dataclass
class ReplayOperator:
    """`Operator`'s surface over a recording: nothing to start, no store to look at, nothing that acts."""

    recording: Recording
    config: ReplayConfig
    session: ReplaySession
    bus: MessageBus = field(default_factory=MessageBus)
    read_only: bool = True

    def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def unfinished_run(self) -> str | None:
        return None

    def left_down(self) -> None:
        return None

    def runs(self) -> list[Any]:
        return []

    async def follow_live_run(self) -> None:
        return None

    async def run(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a replay runs nothing")

    async def plan(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a replay plans nothing")

    async def restart_service(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("a replay restarts nothing")

    def cancel(self, leave_down: bool = False) -> None:
        pass


def question_lines(decision: m.DecisionMade | m.Confirmation | None) -> list[Text]:
    """'asked: stop the service on ct129 · approved (--yes)' (or '· waiting for an answer' while the
    replay stands between the question and its answer), its impact and estimate when the store kept
    them, then its command: '$ systemctl stop sglang'."""
    if decision is None:
        return [Text("no question asked yet", style="dim")]
    q = decision.confirmation if isinstance(decision, m.DecisionMade) else decision
    asked = Text(f"asked: {q.action} on {q.host} · ", style="bold")
    if isinstance(decision, m.DecisionMade):
        asked.append(f"{'approved' if decision.approved else 'refused'} ({decision.by})",
                     style="green" if decision.approved else "bold red")
    else:
        asked.append("waiting for an answer", style="bold yellow")
    lines = [asked]
    if q.impact:  # one row, cut at the width: the estimate first (the impact is whole in the event log)
        apart = q.estimate_apart()  # the stop's forecast is in its impact already: one figure per question
        estimate = f"estimate {duration(apart)} ({q.estimate_basis}) · " if apart is not None else ""
        impact = Text(f"  {'DESTRUCTIVE · ' if q.destructive else ''}{estimate}{q.impact}")
        impact.no_wrap, impact.overflow = True, "ellipsis"
        lines.append(impact)
    return [*lines, Text(f"  $ {' '.join(q.argv)}")] if q.argv else lines  # the literal command whole


class ReplayBar(Static):
    """Where the playback stands, the last question and its answer, and the store's damage."""

    DEFAULT_CSS = """
    ReplayBar { height: auto; background: $boost; padding: 0 1; }
    """

    def show(self, player: Player, question: m.DecisionMade | m.Confirmation | None, damage: list[str],
             ended: bool = False) -> None:
        """`ended`: the run has ended at the moment shown, and its last question with it: the bar
        keeps only where the playback stands (at 80 x 24 the question took half the screen)."""
        rec = player.recording
        head = Text(f"REPLAY {rec.run_id}  ", style="bold")
        head.append("▶ playing" if player.playing else ("■ end" if player.at_end else "❚❚ paused"),
                    style="green" if player.playing else "yellow")
        head.append(f"  ×{player.speed:g}  {clock(player.now)}  "
                    f"{duration(player.elapsed_s)} / {duration(rec.end - rec.start)}")
        step = player.current_step()
        if step:
            head.append(f"  step {step}")
        # (the keys are in the footer) where it stands, the question and its command, the damage: whole,
        # wrapped between words; only the impact is one row, cut (the event log has it whole)
        lines = [head, *([] if ended else question_lines(question)), *(Text(line, style="bold red") for line in damage)]
        key = tuple(t.plain for t in lines)
        shown = Group(*lines)
        update_static(self, shown, key, len(lines))


def asked_text(state: ConsoleState, now: float, question: m.Confirmation) -> Text:
    """The DOWN banner while the replayed run's question waits: what it asked ('SERVICE DOWN 3 min 10 s
    · the restart is asked: waiting for an answer'). The run waited on its operator then, not on
    whoever watches the replay: never 'your answer', nor the live console's 'no restart under way'."""
    paused = state.downtime is not None and state.downtime.paused
    asked = "the restart is asked" if question.step == "restart" else f"asked: {question.action}"
    text = Text(f"{'SERVER PAUSED' if paused else 'SERVICE DOWN'} {duration(now - (state.down_since or now))}"
                f" · {asked}: waiting for an answer")
    ends = state.window_ends()
    if ends is not None:
        text.append(f" · window ends {clock(ends)}")
    return text


class ReplayBanner(DowntimeBanner):
    """The DOWN banner of a replay: while the replayed run's question waits, what it asked."""

    app: ReplayApp

    def show(self, state: ConsoleState, now: float, can_restart: bool) -> None:
        question = self.app.question
        if state.down_since is None or not isinstance(question, m.Confirmation):
            super().show(state, now, can_restart)
            return
        self.set_class(True, "down")
        text = asked_text(state, now, question)
        width = max(1, self.size.width or self.app.size.width)
        update_static(self, text, text.markup, max(1, -(-text.cell_len // width)))  # two lines when narrow


class ReplayDashboard(DashboardScreen):
    """The dashboard, with the replay's bar on top and its own DOWN banner."""

    def compose(self) -> ComposeResult:
        yield ReplayBar(id="replay-bar")
        for widget in super().compose():
            if isinstance(widget, ServicePanel):  # the live console's look at the service is not recorded
                widget.unseen = "not recorded: the run's journal holds only what it did to the service"
            yield ReplayBanner() if type(widget) is DowntimeBanner else widget


class ReplayApp(ConsoleApp):
    """The console playing a recording back (read-only)."""

    # Short names, the speed and the console's o and / left to `?` (REPLAY_KEYS): at 80 columns the
    # footer then shows every key that moves through the recording, and Help and Quit.
    BINDINGS = [
        Binding("space", "replay_toggle", "Play/pause", priority=True),
        Binding("left_square_bracket", "replay_previous_step", "Back", key_display="["),
        Binding("right_square_bracket", "replay_next_step", "Step", key_display="]"),
        Binding("full_stop", "replay_next", "Event", key_display="."),
        Binding("plus,equals_sign", "replay_faster", "Faster", key_display="+", show=False),
        Binding("minus", "replay_slower", "Slower", key_display="-", show=False),
        Binding("o", "open_results", "Results", show=False),
        Binding("slash", "events", "Events", key_display="/", show=False),
    ]
    REPLAY_KEYS = [
        ("space", "play or pause the recording"),
        ("[  ]", "back to the step before / on to the next step"),
        (".", "the next event"),
        ("+  -", "faster / slower"),
        ("o", "the run's results, as they were at its end"),
        ("/", "filter the events by a word"),
    ]
    REPLAY_ACTIONS = {"replay_toggle", "replay_next", "replay_next_step", "replay_previous_step",
                      "replay_faster", "replay_slower"}

    def __init__(self, recording: Recording, speed: float = 1.0, clock: Callable[[], float] = time.monotonic,
                 playing: bool = True, frame_s: float = FRAME_S) -> None:
        self.player = Player(recording, speed=speed, clock=clock, playing=playing)
        session = ReplaySession(recording, lambda: self.player.now)
        operator = ReplayOperator(recording, config_of(recording), session)
        super().__init__(operator, clock=lambda: self.player.now, start_operator=False)
        self.recording = recording
        self.frame_s = frame_s
        self.question: m.DecisionMade | m.Confirmation | None = None  # the last question, or the one waiting
        self.damage = damage_report(recording)
        self.results_shown = False
        # the hosts are the panels' titles: at 80 columns they cut the run's name short here
        self.sub_title = f"read-only replay of {recording.run_id}"

    def on_mount(self, event: Any) -> None:
        event.prevent_default()  # not the live console's start: no operator, no live run, no resume offer
        self.show_screen(ReplayDashboard(id="dashboard"))
        self.set_interval(self.frame_s, self._frame)
        self.set_interval(self.tick_s, self._tick)
        self.call_after_refresh(self._show_bar)
        if self.damage:
            self.notify("\n".join(self.damage), title="the run's store is damaged", severity="error", timeout=20)

    # --- playback -------------------------------------------------------------------------------

    def _frame(self) -> None:
        if self.player.playing:
            self.show_events(self.player.tick())

    def show_events(self, events: Iterable[Event]) -> None:
        """Fold the events into the state (a fresh one after a seek back) and repaint what changed."""
        if self.player.reset:
            self.state = ConsoleState()
            self.question = None
        kinds: set[str] = set()
        for event in events:
            message = event.message
            kind = self.state.apply(message, event.t)
            if kind:
                kinds.add(kind)
            if isinstance(message, m.DecisionMade | m.Confirmation):  # asked, then answered
                self.question = message
                kinds.add("question")
        dashboard = self._dashboard()
        if dashboard is not None:
            if self.player.reset or len(kinds) > 2:
                dashboard.refresh_all()
            else:
                for kind in kinds - {"question"}:
                    dashboard.refresh_part(kind)
                dashboard.refresh_part("host")  # the sparklines follow the moment shown
        self.refresh_banners()
        self._show_bar()
        if self.player.at_end and not self.results_shown:
            self.results_shown = True
            # the results as the run fetched them (a store damaged before that never gets there)
            if self.state.results is not None and not isinstance(self.screen, ModalScreen):
                self.open_results(self.recording.run_dir)

    def _dashboard(self) -> DashboardScreen | None:
        return next((s for s in self.screen_stack if isinstance(s, DashboardScreen)), None)

    def _show_bar(self) -> None:
        dashboard = self._dashboard()
        if dashboard is not None and dashboard.is_mounted:
            dashboard.query_one(ReplayBar).show(self.player, self.question, self.damage,
                                                ended=self.state.finished is not None)

    def restarting(self) -> bool:
        """The replayed run brings the service back itself while it goes (the live console's running
        run): its banner says when it is expected back, never 'no restart under way'. A run that ended
        with the service down restarts nothing (`run --resume` does)."""
        return self.state.finished is None and self.player.current_step() is not None

    async def action_quit(self) -> None:
        """At once: a replay holds nothing down (the service it shows down was the run's, then), and
        the live console's "leave it down / wait for the restart" has nothing to ask here."""
        await self._quit_now()

    def help_first(self) -> tuple[str, list[tuple[str, str]]]:
        return "Replay", self.REPLAY_KEYS

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in self.REPLAY_ACTIONS:
            return not isinstance(self.screen, ModalScreen)
        if action == "runs":
            return False  # the store's other runs: `dflash-ops runs`, then a replay of each
        return super().check_action(action, parameters)

    def action_replay_toggle(self) -> None:
        self.player.toggle()
        self._show_bar()

    def action_replay_next(self) -> None:
        self.show_events(self.player.step())

    def action_replay_next_step(self) -> None:
        self.show_events(self.player.next_step())

    def action_replay_previous_step(self) -> None:
        self.show_events(self.player.previous_step())

    def seek_step(self, name: str) -> None:
        self.show_events(self.player.seek_step(name))

    def action_replay_faster(self) -> None:
        self.player.faster()
        self._show_bar()

    def action_replay_slower(self) -> None:
        self.player.slower()
        self._show_bar()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        for name, t in self.recording.step_starts():
            yield SystemCommand(f"Go to step {name}", f"the replay at {clock(t)}, when {name} began",
                                lambda name=name: self.seek_step(name))
        yield from super().get_system_commands(screen)


def run_replay(recording: Recording, speed: float = 1.0) -> int:
    """Open the console on `recording`, playing at `speed`; 0 when closed."""
    ReplayApp(recording, speed=speed).run()
    return 0
