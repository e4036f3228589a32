"""The console's behaviour, driven by keys (Pilot), asserting on the messages seen (harlequin style)
and on what is on screen. The operator is the stand-in: real message objects on a real bus."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import pytest
from rich.console import Console
from textual.message import Message
from textual.widgets import Sparkline, Static

from console import messages as m
from console.procedure.store import RunStore
from console.ssh.hosts import CommandFailed
from screens.app import ConsoleApp, CoreMessage, ErrorShown, ProcedureEnded
from screens.decider import DecisionAnswered, DecisionAsked
from screens.modals.confirm import ConfirmModal, QuestionModal
from screens.modals.error import ErrorModal
from screens.modals.holders import HoldersModal
from screens.modals.quit import QuitWhileDownModal
from screens.results import ResultsScreen
from screens.runs import RunsScreen
from screens.state import ConsoleState
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.host_panel import GpuRow, HostPanel
from screens.widgets.service_panel import ServicePanel
from tests.tui.standin import (
    T0,
    StandinOperator,
    fixed_clock,
    holders_confirmation,
    service_view,
    serving_telemetry,
    stop_confirmation,
)

SIZE = (120, 40)


class Seen:
    """The message hook: every message dispatched, in order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def __call__(self, message: Message) -> None:
        self.messages.append(message)

    def of(self, kind: type) -> list:
        return [x for x in self.messages if isinstance(x, kind)]

    def core(self, kind: type) -> list:
        return [x.payload for x in self.of(CoreMessage) if isinstance(x.payload, kind)]


def text_of(widget: Static) -> str:
    """What a Static shows, as plain text (rich renderables rendered 200 columns wide)."""
    content = widget.content
    if isinstance(content, str):
        return content
    console = Console(width=200, file=io.StringIO(), record=True, color_system=None)
    console.print(content)
    return console.export_text()


def app_for(op: StandinOperator, **kw) -> ConsoleApp:
    return ConsoleApp(op, clock=fixed_clock, **kw)


async def wait_for(pilot, condition, timeout: float = 20.0) -> None:  # a loaded CI machine is slow
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await pilot.pause(0.02)


def modal_up(app: ConsoleApp, kind: type) -> bool:
    """The modal is on top, composed and focused (its on_mount ran)."""
    return isinstance(app.screen, kind) and app.focused is not None and app.focused.screen is app.screen


@pytest.fixture
def op() -> StandinOperator:
    operator = StandinOperator()
    operator.seed(history=30)
    return operator


# --- dashboard ---------------------------------------------------------------------------------


async def test_dashboard_shows_every_host_its_gpus_holders_and_the_service(op: StandinOperator):
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.pause()
        assert op.started
        panels = {p.host: p for p in app.screen.query(HostPanel)}
        assert set(panels) == {"ct129", "ct200"}
        assert len(panels["ct129"].query(GpuRow)) == 2 and len(panels["ct200"].query(GpuRow)) == 8
        assert "connected, 1.2 ms" in str(panels["ct129"].border_title)
        holders = text_of(panels["ct129"].query_one(".holders", Static))
        row = next(line for line in holders.splitlines() if "4242" in line)  # one row per process
        assert "0,1" in row and "88200" in row and "root" in row and "sglang.launch_server" in row
        assert panels["ct129"].query(Sparkline).first().data[-1] > 0  # the history reached the sparkline
        service = text_of(app.screen.query_one(ServicePanel))
        assert "active (running)" in service and "model Qwen3.6-27B" in service
        assert "3 running, 1 queued" in service and "up 3 d 2 h" in service
        await pilot.press("q")
    assert op.stopped


async def test_telemetry_burst_collapses_to_the_newest_sample(op: StandinOperator):
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.pause()
        before = len(seen.core(m.TelemetryUpdate))
        for seq in range(200):  # a burst published at once: the queue keeps the newest per host
            for update in serving_telemetry(t=T0 + seq, seq=seq):
                op.publish(update)
        await pilot.pause()
        delivered = seen.core(m.TelemetryUpdate)[before:]
        assert len(delivered) < 50
        assert {u.host: u.sample.seq for u in delivered[-2:]} == {"ct129": 199, "ct200": 199}
        assert app.state.telemetry["ct200"].sample.seq == 199


async def test_simulated_badge_stale_age_and_reconnecting_host(op: StandinOperator):
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        ct129, ct200 = serving_telemetry(simulated=True)
        op.publish(ct129)
        op.publish(m.TelemetryUpdate("ct200", ct200.sample, 14.0, True, False, error="agent stream closed"))
        op.publish(m.HostState("ct200", "reconnecting", T0 + 18, last_error="ct200: connection lost"))
        panels = {p.host: p for p in app.screen.query(HostPanel)}
        # each panel takes its messages on its own loop's turn: waited for, on a loaded machine too
        await wait_for(pilot, lambda: "SIMULATED" in str(panels["ct129"].border_title)
                       and bool(panels["ct200"].query(".host-note")))
        assert "SIMULATED" in str(panels["ct129"].border_title)
        assert panels["ct200"].has_class("stale")
        assert "STALE: last sample 14 s ago" in str(panels["ct200"].border_subtitle)
        assert "reconnecting for 12 s" in str(panels["ct200"].border_title)  # the clock says T0 + 30
        note = text_of(panels["ct200"].query_one(".host-note", Static))
        assert "connection lost" in note and "agent stream closed" in note


# --- the window by keys ------------------------------------------------------------------------


async def test_window_by_keys_banner_while_down_and_gone_after_ready(op: StandinOperator):
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.press("g")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))
        modal = app.screen
        assert modal.confirmation.step == "stop"
        assert app.focused.id == "no"  # destructive: Cancel has the focus
        assert "$ systemctl stop sglang-qwen" in text_of(modal.query_one(".command", Static))
        banner = app.screen_stack[1].query_one(DowntimeBanner)
        assert not banner.has_class("down")
        await pilot.press("y")
        await wait_for(pilot, lambda: modal_up(app, HoldersModal))
        await wait_for(pilot, lambda: banner.has_class("down"))  # the stop happened: red banner
        holders = app.screen
        await wait_for(pilot, lambda: holders.query_one(DowntimeBanner).has_class("down"))  # above the modal too
        table = text_of(holders.query_one(".holders-table", Static))
        assert "4301" in table and "4302" in table and "40000" in table
        assert "remote.endpids --grace 10 4301:88231 4302:88232" in text_of(holders.query(".command").last())
        await pilot.press("y")
        await wait_for(pilot, lambda: seen.of(ProcedureEnded))
        await wait_for(pilot, lambda: not banner.has_class("down"))  # ready again: the banner has gone
    assert op.decisions == [("stop", True), ("free-vram", True)]
    assert [d.confirmation.step for d in seen.of(DecisionAsked)] == ["stop", "free-vram"]
    assert [d.approved for d in seen.of(DecisionAnswered)] == [True, True]
    assert seen.of(ProcedureEnded)[0].finished.status == "done"
    downtimes = seen.core(m.Downtime)
    assert downtimes[0].down_since is not None and downtimes[-1].down_since is None


@pytest.mark.parametrize("key", ["n", "escape", "enter"])
async def test_refusing_the_stop_changes_nothing(op: StandinOperator, key: str):
    """n, escape, and a stray Enter (Cancel has the focus) all refuse."""
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.press("g")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))
        await pilot.press(key)
        await wait_for(pilot, lambda: seen.of(ProcedureEnded))
        assert seen.of(ProcedureEnded)[0].finished.status == "refused"
        assert not seen.core(m.Downtime)
        assert app.state.service.status.active
        assert not app.screen.query_one(DowntimeBanner).has_class("down")
    assert op.decisions == [("stop", False)]


async def test_quit_while_down_asks_and_restart_key_ends_the_downtime(op: StandinOperator):
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.press("g")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))
        await pilot.press("y")
        await wait_for(pilot, lambda: modal_up(app, HoldersModal))
        await pilot.press("n")  # leave the holders: the run ends with the service down
        await wait_for(pilot, lambda: seen.of(ProcedureEnded))
        assert seen.of(ProcedureEnded)[0].finished.exit_code == 3
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorModal) or app.state.down_since is not None)
        assert app.state.down_since is not None
        while isinstance(app.screen, ErrorModal | QuestionModal):
            await pilot.press("escape")
        await pilot.press("q")
        await wait_for(pilot, lambda: modal_up(app, QuitWhileDownModal))
        await pilot.press("escape")  # stay
        await pilot.pause()
        assert app.is_running and not isinstance(app.screen, QuitWhileDownModal)
        assert app.check_action("restart_service", ()) is True
        await pilot.press("r")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))
        assert app.screen.confirmation.step == "restart" and app.focused.id == "yes"  # not destructive
        await pilot.press("y")
        await wait_for(pilot, lambda: app.state.down_since is None)
        await pilot.press("q")  # up again: quits without asking
        await pilot.pause()
    assert not any(isinstance(s, QuitWhileDownModal) for s in app.screen_stack)
    assert op.decisions[-1] == ("restart", True)
    assert app.return_code == 1  # the run failed; the service is up again


async def test_quit_while_down_restart_first_then_quits(op: StandinOperator):
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        op.publish(m.Downtime(op.run_id, T0))
        await pilot.pause()
        await pilot.press("q")
        await wait_for(pilot, lambda: modal_up(app, QuitWhileDownModal))
        await pilot.press("r")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))
        await pilot.press("y")
        await wait_for(pilot, lambda: not app.is_running)
    assert op.decisions == [("restart", True)] and op.stopped


# --- errors, read-only, resume -----------------------------------------------------------------


async def test_worker_and_host_errors_share_one_modal_with_the_stderr_tail(op: StandinOperator):
    async def failing_plan() -> m.PlanReady:
        raise CommandFailed("ct129", ["python3", "-m", "remote.probe"], 1,
                            "Traceback (most recent call last):\n  File x\nImportError: no module named torch")

    op.plan = failing_plan
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.press("p")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorModal))
        op.publish(m.HostState("ct200", "down", T0, last_error="ct200: host key not in known_hosts"))
        await wait_for(pilot, lambda: len(seen.of(ErrorShown)) == 2)
        await pilot.pause()
        modals = [s for s in app.screen_stack if isinstance(s, ErrorModal)]
        assert len(modals) == 1 and len(modals[0].reports) == 2
        shown = "\n".join(text_of(w) for w in modals[0].query(Static))
        assert "the plan failed" in shown and "ImportError: no module named torch" in shown
        assert "ct200 is down" in shown and "known_hosts" in shown
        assert "Traceback" not in shown.split("stderr")[0] or "File x" in shown  # the tail, as the host wrote it
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, ErrorModal)


async def test_read_only_offers_no_key_that_acts():
    op = StandinOperator(read_only=True)
    op.seed()
    op.publish(m.Downtime(op.run_id, T0))
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        for action in ("run_procedure", "plan", "restart_service", "cancel_run"):
            assert app.check_action(action, ()) is False
        await pilot.press("g", "p", "r")
        await pilot.pause()
        assert [w.group for w in app.workers] == ["follow"] and op.decisions == []  # only watching the live run
        offered = {key for key, active in app.active_bindings.items() if active.enabled}
        assert "q" in offered and not offered & {"g", "p", "r", "c"}
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Run the procedure" not in titles and "Restart the service" not in titles
        assert "r restarts" not in text_of(app.screen.query_one(DowntimeBanner))
        assert "read-only" in app.sub_title


async def test_a_resize_under_another_screen_lays_the_dashboard_out_for_the_new_width(op: StandinOperator):
    """Issue 43.11: resized to 80 x 24 on the runs list, the dashboard came back in the wide layout,
    crushed (Textual restyles only the screen on top). Back on it: the narrow layout, side panels above."""
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("h")
        await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen))
        await pilot.resize_terminal(80, 24)
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.screen.id == "dashboard")
        await pilot.pause()
        assert app.screen.query_one("#main").styles.layout.name == "vertical"
        assert app.screen.query_one("#side").region.width == 80


async def test_decider_refuses_in_read_only_without_a_modal():
    op = StandinOperator(read_only=True)
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        assert await app.decider.decide(stop_confirmation()) is False
        assert not isinstance(app.screen, ConfirmModal)


async def test_unfinished_run_is_offered_for_resume(op: StandinOperator):
    op.unfinished = "20251130-170000-cd34"
    calls: list = []
    original = op.run

    async def run(decider, resume=None, route=None, no_restart=False, one_step=False):
        calls.append(resume)
        return await original(decider, resume=resume)

    op.run = run
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, QuestionModal) and app.screen.id == "resume")
        assert "20251130-170000-cd34" in app.screen.title_text
        await pilot.press("y")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))
        await pilot.press("n")
    assert calls == ["20251130-170000-cd34"]


async def test_holders_modal_marks_exactly_the_pids_the_command_names(op: StandinOperator):
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        from tests.tui.standin import holders_found

        found = holders_found()
        extra = m.VramHolder(7777, 900, (0,), "python other.py", "alice", 1, False)
        op.publish(m.HoldersFound(found.host, (*found.holders, extra), found.used, found.threshold_mib))
        await pilot.pause()
        asked = asyncio.ensure_future(app.decider.decide(holders_confirmation()))
        await wait_for(pilot, lambda: modal_up(app, HoldersModal))
        table = text_of(app.screen.query_one(".holders-table", Static))
        row = next(line for line in table.splitlines() if "7777" in line)
        assert row.split()[0] == "no" and "alice" in row
        assert "End them" in str(app.screen.query_one("#yes").label) and app.focused.id == "no"
        await pilot.press("n")
        assert await asyncio.wait_for(asked, 5) is False


# --- results and runs --------------------------------------------------------------------------


async def test_results_screen_and_export(runs_root: Path):
    op = StandinOperator(runs_dir=runs_root)
    op.seed()
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("o")
        await wait_for(pilot, lambda: isinstance(app.screen, ResultsScreen))
        screen = app.screen
        assert screen.data.run_dir.name == "20251201-093500-ab12"  # the newest run
        summary = text_of(screen.query_one("#summary-table Static"))
        assert "copy (reference)" in summary and "random" in summary and "16.00" in summary
        for key, pane in (("2", "per-prompt"), ("3", "acceptance"), ("4", "parity"), ("5", "kernels"),
                          ("6", "window-pane")):
            await pilot.press(key)
            await pilot.pause()
            assert screen.query_one("TabbedContent").active == pane
        assert "-1.000000000000" in text_of(screen.query_one("#parity-table Static"))
        strip = text_of(screen.query_one(".strip", Static))
        assert "down 3 min 14 s" in strip
        await pilot.press("e")
        await pilot.pause()
        run_dir = runs_root / "20251201-093500-ab12"
        assert (run_dir / "report.md").is_file()
        assert json.loads((run_dir / "report.json").read_text())["format"] == "dflash-ops.report/1"
        # what it wrote, in a line of its own under the tabs, each path whole (a toast split one and
        # covered the table)
        exported = text_of(screen.query_one("#exported", Static)).splitlines()
        assert any(str(run_dir / "report.md") in line for line in exported)
        assert any(str(run_dir / "report.json") in line for line in exported)
        assert not list(app._notifications)
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen.id == "dashboard"


async def test_incomplete_results_go_to_the_error_modal(runs_root: Path):
    for run in runs_root.iterdir():
        (run / "results" / "manifest.json").unlink()
    op = StandinOperator(runs_dir=runs_root)
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        app.open_results(runs_root / "20251201-093500-ab12")
        await wait_for(pilot, lambda: isinstance(app.screen, ErrorModal) and app.screen.query(Static))
        assert "manifest" in "\n".join(text_of(w) for w in app.screen.query(Static))


async def test_runs_list_compares_two_runs(runs_root: Path):
    op = StandinOperator(runs_dir=runs_root)
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("h")
        await wait_for(pilot, lambda: isinstance(app.screen, RunsScreen))
        await pilot.press("space", "down", "space", "c")
        await pilot.pause()
        table = text_of(app.screen.query_one("#compare-table", Static))
        assert "20251130-170000-cd34" in table and "20251201-093500-ab12" in table
        assert "tau vanilla copy" in table and "+0.40" in table  # the later run is 0.4 better
        await pilot.press("enter")
        await wait_for(pilot, lambda: isinstance(app.screen, ResultsScreen))


async def test_command_palette_offers_the_console_commands(op: StandinOperator):
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for title in ("Run the procedure", "Plan", "Open results", "Compare runs", "Read-only", "Help"):
            assert title in titles
        assert "Restart the service" not in titles  # nothing is down
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"read-only")
        await pilot.pause(0.3)
        await pilot.press("enter")
        await pilot.pause()
        assert app.read_only and app.check_action("run_procedure", ()) is False


# --- the state, on its own ---------------------------------------------------------------------


def test_state_keeps_step_progress_across_a_replanned_run():
    state = ConsoleState()
    plan = m.PlanReady("r1", "window", (m.PlannedStep("preflight", True, ""), m.PlannedStep("stage", False, "no RAM")))
    state.apply(plan)
    assert state.steps["stage"].status == "left-out"
    state.apply(m.StepUpdate("r1", "preflight", "done", 1.0, 3.0))
    state.apply(plan)  # read back on resume: the done step stays done
    assert state.steps["preflight"].status == "done" and state.steps["preflight"].ended_at == 3.0
    assert state.apply(m.Downtime("r1", 5.0)) == "downtime" and state.down_since == 5.0


# --- small parts -------------------------------------------------------------------------------


def test_console_command_needs_a_terminal(capsys: pytest.CaptureFixture[str]):
    from console.cli.main import main

    assert main(["console", "--config", "nowhere.toml"]) == 2  # pytest's stdin is no terminal
    assert "needs a terminal" in capsys.readouterr().err


def test_holders_modal_reads_the_pids_from_the_command():
    from screens.modals.holders import targeted_pids

    assert targeted_pids(holders_confirmation().argv) == {4301, 4302}
    assert targeted_pids(("systemctl", "stop", "x:y", "12:")) == set()


def test_counter_text_joins_tensors_and_bytes():
    from screens.widgets.job_panel import counter_text
    from tests.tui.standin import extract_progress

    weights, weights_bytes, prompts = extract_progress()
    nb = "\u00a0"  # a value and its unit never wrap apart
    assert counter_text(weights, weights_bytes) == (f"weights 480/480{nb}tensors",
                                                    f"25.9{nb}GiB / 25.9{nb}GiB, 2.0{nb}GiB/s")
    assert counter_text(prompts, eta_s=15) == ("prompts 4/10", f"async_rate_limiter: 1536 tokens, 0.4{nb}prompts/s, "
                                                               f"15{nb}s{nb}left")


async def test_quit_during_a_run_asks_first(op: StandinOperator):
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("g")
        await wait_for(pilot, lambda: modal_up(app, ConfirmModal))  # the run waits on the stop
        app.pop_screen()  # the question stays open in the engine; the dashboard comes back on top
        await pilot.pause()
        await pilot.press("q")
        await wait_for(pilot, lambda: app.screen.id == "quit-while-running")
        assert "A run is in progress (stop)" in app.screen.title_text
        await pilot.press("n")
        await pilot.pause()
        assert app.is_running
        await pilot.press("q")
        await wait_for(pilot, lambda: app.screen.id == "quit-while-running")
        await pilot.press("y")
        await wait_for(pilot, lambda: not app.is_running)
    assert op.stopped


async def test_help_lists_the_keys(op: StandinOperator):
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: app.screen.id == "help")
        shown = "\n".join(text_of(w) for w in app.screen.query(Static))
        for key in ("g", "p", "c", "r", "o", "h", "ctrl+p", "q", "1..7", "e"):
            assert f"\n{key} " in f"\n{shown}" or f" {key} " in shown
        await pilot.press("escape")
        await pilot.pause()
        assert app.screen.id == "dashboard"


async def test_events_that_came_under_a_modal_reach_the_log(op: StandinOperator):
    from screens.widgets.event_log import EventLog

    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        await wait_for(pilot, lambda: app.screen.id == "help")
        for i in range(3):
            op.publish(m.JournalEntry(T0 + i, op.run_id, "cache", f"completion {i} cached", host="ct129"))
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        lines = [strip.text for strip in app.screen.query_one(EventLog).lines]
        assert [line.split("ct129: ")[1] for line in lines if "cached" in line] == [
            "completion 0 cached", "completion 1 cached", "completion 2 cached"]


async def test_an_unfinished_run_that_left_the_service_down_shows_the_banner_at_start(tmp_path: Path):
    run = RunStore(tmp_path).create(None, None)  # written by the store itself, as the engine does
    run.state.service.down, run.state.service.stopped_at = True, T0 - 600
    run.save()
    run_id = run.run_id
    op = StandinOperator(runs_dir=tmp_path)
    op.unfinished = run_id
    app = app_for(op)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: modal_up(app, QuestionModal) and app.screen.id == "resume")
        assert "left the service DOWN since 09:25:00" in app.screen.title_text
        await pilot.press("n")
        await wait_for(pilot, lambda: app.screen.query(DowntimeBanner) and
                       app.screen.query_one(DowntimeBanner).has_class("down"))
        assert "SERVICE DOWN 10 min 30 s" in text_of(app.screen.query_one(DowntimeBanner))
        op.publish(m.ServiceView(None, None, T0))  # not known yet: stays down
        await pilot.pause()
        assert app.state.down_since is not None
        op.seed()  # someone started it by hand: ready
        await wait_for(pilot, lambda: app.state.down_since is None)


async def test_the_service_panel_follows_a_fleet_run_to_its_next_replica():
    """A fleet run cut at its budget goes on to the next replica (`Session.address` moves the
    operator's config there): the service panel names that replica from its next check on."""
    from console.operator import Operator
    from console.procedure.steps.fleet import on_replica
    from tests.test_fleet_steps import fleet_config

    fleet = fleet_config("http://127.0.0.1:9", ["http://127.0.0.1:10", "http://127.0.0.1:11"])
    first, second = (on_replica(fleet, replica) for replica in fleet.fleet.replicas)
    real = Operator(first)  # the real operator follows its session (nothing connects until start)
    real.session.address(second)
    assert real.config is second and real.session.config is second
    op = StandinOperator(first)
    seen = Seen()
    app = app_for(op)
    async with app.run_test(size=SIZE, message_hook=seen) as pilot:
        await pilot.pause()
        panel = app.screen.query_one(ServicePanel)
        assert "(replica r1)" in str(panel.border_title)
        op.config = second  # as Session.address leaves the operator's config
        op.publish(service_view(True, T0 + 5))
        await pilot.pause()
        assert seen.core(m.ServiceView)[-1].checked_at == T0 + 5
        assert "(replica r2)" in str(panel.border_title) and "(replica r1)" not in str(panel.border_title)


def test_a_host_panel_not_composed_yet_draws_nothing_and_raises_nothing():
    """The dashboard's tick redraws a host whose samples stopped (or that is down) every second, and
    can reach a panel before its rows are composed: that once ended a pilot run with "No nodes match
    '.host-note'" (a loaded machine, 1 run in 25). The panel draws nothing until it is mounted."""
    panel = HostPanel("ct129", lambda host, gpu: [])
    panel.show(None, None, T0)
    assert not panel.is_mounted and not panel.children
