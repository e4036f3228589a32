"""Issue 17, the console in an operator's hands: each point driven by keys (Pilot) at 120x40 and at
80x24, over the stand-in operator (real message objects on a real bus) and a finished run built
by the real producers."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console
from textual.containers import VerticalScroll
from textual.widgets import Static

from console import messages as m
from console.views.units import duration, memory_pair, size
from screens.app import ConsoleApp, ProcedureEnded
from screens.modals.confirm import ConfirmModal
from screens.modals.events import EventsModal
from screens.modals.holders import HoldersModal
from screens.modals.quit import QuitWhileDownModal
from screens.plan import PlanScreen
from screens.results import PerPromptTable, ResultsScreen, summary_of
from screens.state import ConsoleState, JobView
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.event_log import EventLog, short_paths
from screens.widgets.host_panel import gpu_line
from screens.widgets.job_panel import JobPanel
from screens.widgets.stepper import Stepper, stepper_renderable
from tests.tui.standin import (
    PLAN_STEPS,
    T0,
    StandinOperator,
    extract_progress,
    gpu,
    holders_confirmation,
    holders_found,
    mid_window,
    restart_confirmation,
    stuck_telemetry,
)

SIZES = pytest.mark.parametrize("size", [(120, 40), (80, 24)], ids=["120x40", "80x24"])


class Clock:
    """The console's clock, moved on by the test (the fixed clock of the snapshots, made to tick)."""

    def __init__(self, t: float = T0 + 30) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def plain(renderable) -> str:
    console = Console(width=200, file=io.StringIO(), record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def text_of(widget: Static) -> str:
    content = widget.content
    return content if isinstance(content, str) else plain(content)


async def until(pilot, condition, timeout: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await pilot.pause(0.02)


def on_top(app: ConsoleApp, kind: type) -> bool:
    return isinstance(app.screen, kind) and app.focused is not None and app.focused.screen is app.screen


def footer_keys(app: ConsoleApp) -> set[str]:
    """The keys the footer offers on the screen on top."""
    return {key for key, (_, binding, enabled, _) in app.screen.active_bindings.items() if binding.show and enabled}


@contextlib.asynccontextmanager
async def console(op: StandinOperator, size: tuple[int, int], **kw) -> AsyncIterator[tuple[ConsoleApp, object]]:
    """The console over `op` at `size`, running: (the app, its pilot)."""
    app = ConsoleApp(op, **kw)
    async with app.run_test(size=size) as pilot:
        yield app, pilot


def down_operator() -> StandinOperator:
    op = StandinOperator()
    op.seed(history=30)
    return op


# --- confirmations and the banner ----------------------------------------------------------------


@SIZES
async def test_holders_modal_shows_host_and_command_first_banner_above_and_scrolls_by_keys(size):
    op = down_operator()
    async with console(op, size, clock=Clock()) as (app, pilot):
        await pilot.pause()
        mid_window(op)
        op.publish(stuck_telemetry())
        op.publish(holders_found())
        await until(pilot, lambda: app.state.down_since is not None)
        asyncio.ensure_future(app.decider.decide(holders_confirmation()))
        await until(pilot, lambda: on_top(app, HoldersModal))
        modal = app.screen
        body = modal.query_one(".body", VerticalScroll)
        command = modal.query_one(".command", Static)
        assert "on ct129, runs" in text_of(modal.query(".label").first())
        shown = text_of(command).replace("\n", " ")
        assert "remote.endpids --grace 10 4301:88231 4302:88232" in " ".join(shown.split())  # whole, wrapped
        assert body.region.contains_region(command.region)  # on screen before any scrolling
        banner = modal.query_one(DowntimeBanner)
        await until(pilot, lambda: banner.region.height >= 1)
        assert banner.has_class("down") and banner.region.y == 1 and banner.region.height == 1
        assert "SERVICE DOWN" in text_of(banner) and "r restarts" not in text_of(banner)  # r does not act here
        keys = footer_keys(app)
        # The footer names y and n in the buttons' words (escape refuses too, as help says).
        assert {"y", "n", "down"} <= keys and not keys & {"question_mark", "q", "g"}
        if body.max_scroll_y > 0:  # 80x24: more than fits; the arrows scroll it, the buttons stay
            await pilot.press("down", "down")
            await until(pilot, lambda: body.scroll_y > 0)
            assert app.focused.id == "no"
        await pilot.press("n")
        await until(pilot, lambda: not isinstance(app.screen, HoldersModal))


@SIZES
async def test_the_restart_question_shows_its_impact_and_the_down_count_ticks(size):
    op = down_operator()
    clock = Clock()
    async with console(op, size, clock=clock, tick_s=0.05) as (app, pilot):
        op.publish(m.Downtime(op.run_id, clock.t - 90))
        await until(pilot, lambda: app.state.down_since is not None)
        asyncio.ensure_future(app.decider.decide(restart_confirmation(90)))
        await until(pilot, lambda: on_top(app, ConfirmModal))
        impact = app.screen.query_one(".impact", Static)
        await until(pilot, lambda: impact.region.height >= 1)
        assert "down 1 min 30 s so far" in text_of(impact)
        assert app.screen.query_one(".body").region.contains_region(impact.region)
        banner = app.screen.query_one(DowntimeBanner)
        clock.t += 25
        await until(pilot, lambda: "down 1 min 55 s so far" in text_of(impact))  # not frozen at 90 s
        await until(pilot, lambda: "SERVICE DOWN 1 min 55 s" in text_of(banner))
        await pilot.press("escape")


# --- quitting ------------------------------------------------------------------------------------


@SIZES
async def test_a_second_q_never_leaves_the_service_down(size):
    op = down_operator()
    async with console(op, size, clock=Clock()) as (app, pilot):
        op.publish(m.Downtime(op.run_id, T0))
        await until(pilot, lambda: app.state.down_since is not None)
        await pilot.press("q")
        await until(pilot, lambda: on_top(app, QuitWhileDownModal))
        assert app.focused.id == "restart"
        await pilot.press("q")  # the htop / k9s reflex: stays
        await until(pilot, lambda: not isinstance(app.screen, QuitWhileDownModal))
        assert app.is_running and op.decisions == []
        await pilot.press("q")
        await until(pilot, lambda: on_top(app, QuitWhileDownModal))
        assert "l" in footer_keys(app)
        await pilot.press("l")  # its own key: leave it down
        await until(pilot, lambda: not app.is_running)
    assert op.decisions == [] and app.return_code == 3  # left down: as a run that failed down


class SlowRestart(StandinOperator):
    """The restart is approved and then takes a while (the server loading): it ends when told."""

    def __init__(self) -> None:
        super().__init__()
        self.restarts = 0
        self.ready = asyncio.Event()

    async def restart_service(self, decider) -> None:
        self.restarts += 1
        if not await self._ask(decider, restart_confirmation()):
            return
        self.publish(m.StartupProgress("loading", "Loading safetensors", 1, 4))
        await self.ready.wait()
        self.publish(m.Downtime(self.run_id, None, restarted_at=self.now))


@SIZES
async def test_quit_during_a_restart_waits_until_ready_and_never_restarts_again(size):
    op = SlowRestart()
    op.seed(history=30)
    async with console(op, size, clock=Clock()) as (app, pilot):
        op.publish(m.Downtime(op.run_id, T0))
        await until(pilot, lambda: app.state.down_since is not None)
        await pilot.press("r")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: app.state.startup is not None)
        await pilot.press("q")
        await until(pilot, lambda: on_top(app, QuitWhileDownModal))
        modal = app.screen
        assert "A restart is under way" in " ".join(text_of(w) for w in modal.query(Static))
        assert not modal.query("#restart") and app.focused.id == "wait"
        await pilot.press("r")  # offered nowhere here: does not start another
        await pilot.press("w")
        await until(pilot, lambda: not isinstance(app.screen, QuitWhileDownModal))
        assert app.is_running  # waiting for the service
        op.ready.set()
        await until(pilot, lambda: not app.is_running)
    assert op.restarts == 1 and op.decisions == [("restart", True)]


# --- time ----------------------------------------------------------------------------------------


@SIZES
async def test_the_banner_says_when_the_service_is_back_and_when_the_window_ends(size):
    op = down_operator()
    clock = Clock()
    async with console(op, size, clock=clock) as (app, pilot):
        await pilot.pause()
        mid_window(op)  # extraction at 4/10 prompts, 0.4 prompts/s: 15 s left; the restart ~96 s
        await until(pilot, lambda: app.state.extraction() is not None and app.state.down_since is not None)
        banner = app.screen.query_one(DowntimeBanner)
        await until(pilot, lambda: "(in 1 min 51 s)" in text_of(banner))  # 15 s of extraction + 96 s of restart
        panel = app.screen.query_one(JobPanel)
        await until(pilot, lambda: any("15 s left" in text_of(d) for d in panel.query(".detail")))
        projection = m.WindowProjection(op.run_id, app.state.down_since, clock.t + 300, extract_eta_s=40,
                                        budget_ends_at=clock.t + 600, basis="median of 3 starts on ct129")
        op.publish(projection)
        await until(pilot, lambda: "window ends 09:45:30" in text_of(banner))
        assert "back ~09:40:30 (in 5 min 00 s)" in text_of(banner)


def test_expected_back_falls_back_from_projection_to_rate_forecast_stop_and_plan():
    state = ConsoleState()
    now = T0 + 100
    state.apply(m.PlanReady("r", "window", PLAN_STEPS), now)
    assert state.expected_back(now) is None  # nothing is down
    state.apply(m.Downtime("r", T0), now)
    plan_sum = sum(s.estimate_s for s in PLAN_STEPS if s.name in ("stop", "free-vram", "extract", "restart"))
    assert state.expected_back(now) == (T0 + plan_sum, "the plan's step estimates")
    state.apply(m.DecisionMade(m.Confirmation("stop", "stop", "ct129", (), "", True, 194.0), True, "tui"), now)
    assert state.expected_back(now) == (T0 + 194.0, "the stop's question")
    unknown = m.Forecast("r", 120.0, (m.ForecastPhase("stop", 20.0, "b"), m.ForecastPhase("start", None, "unknown: b")))
    state.apply(unknown, now)  # a floor, said so: never a return passed off as known
    assert state.expected_back(now) == (T0 + 120.0, "forecast, at least (start unknown)")
    state.apply(m.Forecast("r", 150.0, ()), now)
    assert state.expected_back(now) == (T0 + 150.0, "forecast")
    for progress in extract_progress(now):
        state.apply(progress, now)
    assert state.expected_back(now) == (now + 15.0 + 96, "extraction's rate + the restart's estimate")
    state.apply(m.WindowProjection("r", T0, T0 + 400, basis="projected by the engine"), now)
    assert state.expected_back(now) == (T0 + 400, "projected by the engine")
    state.apply(m.Downtime("r", None, restarted_at=now), now)
    assert state.expected_back(now) is None and state.projection is None


@given(done=st.integers(0, 1000), extra=st.integers(0, 1000), rate=st.floats(0.01, 1e4), waited=st.floats(0, 1e5))
def test_the_extraction_eta_is_what_is_left_over_the_rate_and_counts_down(done, extra, rate, waited):
    job = JobView("x", "extract on ct129", worker="extract")
    job.bars["prompts"] = m.JobProgress("x", "extract", "ct129", done, done + extra, "prompts", rate=rate,
                                        key="prompts")
    job.received["prompts"] = T0
    eta = job.eta_s(T0)
    assert eta == pytest.approx(extra / rate)
    later = job.eta_s(T0 + waited)
    assert 0 <= later <= eta and later == pytest.approx(max(0.0, extra / rate - waited), abs=1e-6)


# --- the plan, the steps, the job ----------------------------------------------------------------


class PlanWithFits(StandinOperator):
    async def plan(self) -> m.PlanReady:
        fits = (m.HostFit("ct200", True, "GPU3 has 79 GiB free; the target needs 61 GiB", gpu=3, free_mib=80900,
                          need_mib=62464, model_path="/data/models/Qwen3.6-27B"),
                m.HostFit("ct129", False, "its GPUs serve the target"))
        plan = m.PlanReady(self.run_id, "window", PLAN_STEPS, fits, "zero-downtime: extract on ct200 GPU3",
                           forecast=PLAN_FORECAST)
        self.publish(plan)
        return plan


# The forecast preflight makes (forecast.forecast's words): the extraction unknown on a first window.
PLAN_FORECAST = m.Forecast("r", 87.0, (
    m.ForecastPhase("stop", 11.2, "the unit's last stop on ct129 (systemd)"),
    m.ForecastPhase("free-vram", 10.0, "estimate: the stop's grace ([service] stop_grace_s); no earlier run measured "
                                       "how long VRAM stays held after the stop", estimated=True),
    m.ForecastPhase("extract", None, "unknown: the forward is unknown: no rate measured yet", estimated=True),
    m.ForecastPhase("start", 65.8, "the server's last start on ct129 (systemd: the unit's start to its ready line)")),
    budget_s=None)


@SIZES
async def test_p_shows_the_plan_as_a_screen_every_step_command_and_the_proposal(size):
    op = PlanWithFits()
    op.seed(history=30)
    async with console(op, size, clock=Clock()) as (app, pilot):
        await pilot.press("p")
        await until(pilot, lambda: isinstance(app.screen, PlanScreen))
        shown = " ".join(plain(app.screen.query_one("#plan-table", Static).content).split())
        for step in PLAN_STEPS:
            assert step.name in shown
        assert "$ systemctl stop sglang-qwen" in shown and "$ systemctl start sglang-qwen" in shown
        assert "1 min 36 s" in shown  # the restart's estimate, in the one duration format
        assert "where the target fits" in shown and "79.0 GiB" in shown and "61.0 GiB" in shown
        assert "proposed: zero-downtime: extract on ct200 GPU3" in shown
        # The forecast by phase with its basis, before any run begins (issue 27): unknown, never 0 s.
        assert "forecast downtime: unknown (at least 1 min 27 s)" in shown
        assert "the unit's last stop on ct129 (systemd)" in shown and "[service] stop_grace_s" in shown
        assert "extract │ unknown │ unknown: the forward is unknown" in shown
        assert app.focused is app.screen.query_one("#plan-body")  # the arrows scroll it at once
        await pilot.press("escape")
        await until(pilot, lambda: app.screen.id == "dashboard")


@SIZES
async def test_no_plan_hint_never_shows_while_a_run_is_in_progress(size):
    op = down_operator()
    async with console(op, size, clock=Clock()) as (app, pilot):
        await pilot.pause()
        stepper = app.screen.query_one(Stepper)
        if size[0] >= 110:
            assert "no plan yet" in text_of(stepper)
        app.state.running = True
        app.screen.refresh_part("steps")
        await pilot.pause()
        assert "no plan yet" not in text_of(stepper)


def test_job_panel_note_only_for_the_live_job_and_no_raw_event_dumps():
    from screens.widgets.job_panel import note_of

    state = ConsoleState()
    state.apply(m.JobLog("e1", "extract", "ct129", "info", "bytes=27800000000 tensors=480", kind="staged"))
    assert note_of(state.jobs["e1"]) == "staged: weights in host RAM, waiting for the stop"
    state.apply(m.JobLog("e1", "extract", "ct129", "info", "check", kind="phase"))
    state.apply(m.JobLog("e1", "extract", "ct129", "info", "x", kind="log"))
    state.apply(m.JobProgress("e1", "extract", "ct129", 4, 4, "prompts", key="prompts"))
    state.apply(m.JobExit("e1", "extract", "ct129", 0))
    state.apply(m.JobExit("c1", "check", "ct129", 0))  # ended later, with no bars: the extraction stays shown
    assert state.current_jobs()[0].job_id == "e1" and note_of(state.current_jobs()[0]) == ""  # not "phase check"
    state.apply(m.JobLog("r1", "relay", "console", "info", "evaluate", kind="phase"))
    state.apply(m.RunFinished("r", "done", 0, True, "done", "/runs/r"))
    assert all(job.finished for job in state.jobs.values())  # a job left without its exit is not "going"


# --- results ---------------------------------------------------------------------------------------


@SIZES
async def test_results_pin_the_prompt_column_pick_a_drafter_and_show_provenance(size, runs_root: Path):
    op = StandinOperator(runs_dir=runs_root)
    op.seed()
    async with console(op, size, clock=Clock()) as (app, pilot):
        await pilot.press("o")
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        screen = app.screen
        await until(pilot, lambda: app.focused is not None and app.focused.id == "summary-table")
        summary = plain(screen.query_one("#summary-table Static").content)
        assert "Layer provenance per drafter" in summary and "target_layer_ids" in summary
        summary_table = summary_of(screen.query_one("#summary-table Static").content)
        ratio_styles = [span.style for span in summary_table.columns[2]._cells[0].spans]
        assert "bold red" in ratio_styles  # the random drafter's ratio to the reference is under 1
        await pilot.press("down")
        await until(pilot, lambda: app.focused.scroll_y > 0)  # the focused pane scrolls at once
        await pilot.press("2")
        table = screen.query_one(PerPromptTable)
        await until(pilot, lambda: app.focused is table)
        assert table.fixed_columns == 1 and str(table.ordered_columns[0].label) == "prompt"
        assert table.drafter in (None, "random")  # all where they fit, else the candidate's: never cut
        assert any(str(c.label).startswith("random") for c in table.ordered_columns)
        if size[0] < 110:
            assert table.drafter == "random"
        assert "tokens: prompt + completion" in text_of(screen.query_one(".legend", Static))
        for _ in range(3):  # d goes round: all, the reference, the candidate
            if table.drafter == "copy":
                break
            await pilot.press("d")
            await pilot.pause()
        assert table.drafter == "copy"
        labels = [str(c.label) for c in table.ordered_columns]
        assert labels[:2] == ["prompt", "tokens"] and all(lab.startswith("copy ") for lab in labels[2:])
        await pilot.press("right", "right", "right")  # the prompt column stays pinned
        assert table.fixed_columns == 1
        assert not footer_keys(app) & {"g", "p", "n"}  # nothing acts from the results


# --- help, r, events, palette --------------------------------------------------------------------


@SIZES
async def test_read_only_help_lists_only_keys_that_work_and_r_says_why(size):
    op = StandinOperator(read_only=True)
    op.seed()
    async with console(op, size, clock=Clock()) as (app, pilot):
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.id == "help")
        shown = "\n".join(text_of(w) for w in app.screen.query(Static))
        for key in ("g", "n", "p", "c", "r"):
            assert f"\n{key} " not in f"\n{shown}"
        assert "\no " in f"\n{shown}" and "ctrl+p" in shown
        await pilot.press("escape")
        await until(pilot, lambda: app.screen.id == "dashboard")
        await pilot.press("r")
        await until(pilot, lambda: any("read-only" in str(n.message) for n in app._notifications))


async def test_r_says_why_when_nothing_is_down():
    op = down_operator()
    async with console(op, (80, 24), clock=Clock()) as (app, pilot):
        await pilot.press("r")
        await until(pilot, lambda: any("not down because of this run" in str(n.message)
                                       for n in app._notifications))
        assert op.decisions == []


@SIZES
async def test_slash_filters_the_events_and_shows_them_whole(size):
    op = down_operator()
    app = ConsoleApp(op, clock=Clock())
    long = "/root/dflash-ops/runs/20251201-093500-ab12/results/results.json"
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        op.publish(m.JournalEntry(T0, op.run_id, "report", f"wrote {long}"))
        op.publish(m.JournalEntry(T0 + 1, op.run_id, "stop", "sglang-qwen stopped", host="ct129"))
        await until(pilot, lambda: app.state.journal_count == 2)
        await pilot.press("slash")
        await until(pilot, lambda: isinstance(app.screen, EventsModal))
        whole = text_of(app.screen.query_one("#events-text", Static))
        assert long in whole.replace("\n", "")
        await pilot.press(*"stopped")
        await until(pilot, lambda: "wrote" not in text_of(app.screen.query_one("#events-text", Static)))
        await pilot.press("enter")
        await until(pilot, lambda: app.screen.id == "dashboard")
        log = app.screen.query_one(EventLog)
        assert log.word == "stopped"
        if size[0] >= 110:  # the log is shown there (the narrow layout leaves it to / and the journal)
            lines = [strip.text for strip in log.lines]
            assert any("sglang-qwen stopped" in line for line in lines) and not any("wrote" in x for x in lines)


def test_long_paths_are_shortened_to_their_last_two_parts():
    assert short_paths("wrote /root/dflash-ops/runs/x/results/results.json") == "wrote …/results/results.json"
    assert short_paths("PYTHONPATH=/root/dflash-ops/code/3f9a python") == "PYTHONPATH=…/code/3f9a python"
    assert short_paths("/tmp/x and ./a/b/c and 10 s") == "/tmp/x and ./a/b/c and 10 s"


async def test_the_palette_has_help_but_not_textual_keys():
    op = down_operator()
    async with console(op, (120, 40), clock=Clock()) as (app, pilot):
        await pilot.pause()
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert titles.count("Help") == 1 and "Keys" not in titles


def test_a_step_shows_its_own_work_and_the_wait_for_the_operators_answer_apart():
    """The stop took 0.1 s; its question waited 19 s for the operator: the stepper must not say
    the stop took 19 s (the engine's StepUpdate carries both)."""
    state = ConsoleState()
    state.apply(m.StepUpdate("r1", "stop", "done", started_at=100.0, ended_at=119.2, detail="stopped in 0.1 s",
                             work_s=0.1, decision_s=19.1))
    state.apply(m.StepUpdate("r1", "extract", "done", started_at=120.0, ended_at=131.0, work_s=11.0, decision_s=0.0))
    text = plain(stepper_renderable(state.steps, True, 200.0))
    lines = {line.split()[1]: line for line in text.splitlines() if len(line.split()) > 1}
    assert "0s +19s" in lines["stop"] and "19s" not in lines["stop"].replace("+19s", "")
    assert "11s" in lines["extract"] and "+" not in lines["extract"]
    assert "waiting for your answer" not in text  # the legend is in help (issue 28), not on the panel


# --- units ---------------------------------------------------------------------------------------


def test_gpu_rows_say_when_util_temp_power_are_not_reported():
    reported = plain(gpu_line(gpu(0, 44950, util=62, temp=61, power=231)))
    assert "43.9/48.0 GiB" in reported and "62%" in reported and "61°C" in reported and "231 W" in reported
    silent = plain(gpu_line(m.GpuReading(0, "sim", None, 1024, 49140, None, None, None)))
    assert "1.0/48.0 GiB" in silent and "util/temp/power n/a" in silent


def parse_duration(text: str) -> int:
    parts = text.split()
    scale = {"s": 1, "min": 60, "h": 3600, "d": 86400}
    return sum(int(n) * scale[u] for n, u in zip(parts[::2], parts[1::2], strict=True))


@given(st.floats(0, 10 * 86400, allow_nan=False))
def test_duration_reads_back_to_its_precision(seconds):
    text = duration(seconds)
    precision = 1 if seconds < 3600 else 60 if seconds < 86400 else 3600
    assert abs(parse_duration(text) - seconds) <= precision
    compact = duration(seconds, compact=True)
    assert " " not in compact and len(compact) <= 7 or seconds >= 100 * 3600


@given(st.floats(0, 86400, allow_nan=False))
def test_duration_to_a_tenth_under_ten_seconds_and_as_usual_above(seconds):
    text = duration(seconds, tenths=True)
    if text.count(" ") == 1 and "." in text:
        assert seconds < 10 and abs(float(text.split()[0]) - seconds) <= 0.05
    else:
        assert text == duration(seconds) and seconds >= 9.95


def test_duration_examples():
    assert [duration(s, tenths=True) for s in (0.04, 4.24, 9.96, 75)] == ["0.0 s", "4.2 s", "10 s", "1 min 15 s"]


@given(st.floats(0, 1 << 50, allow_nan=False))
def test_size_is_binary_and_reads_back(nbytes):
    number, unit = size(nbytes).split()
    scale = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}[unit]
    assert float(number) * scale == pytest.approx(nbytes, rel=0.06, abs=0.5)
    assert unit == "B" or unit == "TiB" or 1 <= float(number) < 1024


@given(st.integers(0, 200_000), st.integers(1, 200_000))
def test_memory_pair_writes_both_in_the_totals_unit(used, total):
    pair = memory_pair(used, total)
    numbers, unit = pair.split()
    shown_used, shown_total = (float(x) for x in numbers.split("/"))
    scale = {"MiB": 1, "GiB": 1024, "KiB": 1 / 1024}[unit]
    assert shown_total * scale == pytest.approx(total, rel=0.06, abs=0.06 * scale)
    assert shown_used * scale == pytest.approx(used, rel=0.06, abs=0.06 * scale)


async def test_the_window_by_keys_still_ends_with_the_banner_gone():
    """The whole stand-in window at 80x24: every question answered with y from the modal it came in."""
    op = down_operator()
    app = ConsoleApp(op, clock=Clock())
    ended: list = []
    async with app.run_test(size=(80, 24), message_hook=lambda x: ended.append(x)
                            if isinstance(x, ProcedureEnded) else None) as pilot:
        await pilot.press("g")
        for kind in (ConfirmModal, HoldersModal):
            await until(pilot, lambda kind=kind: on_top(app, kind))
            await pilot.press("y")
        await until(pilot, lambda: ended)
        assert ended[0].finished.status == "done" and app.state.down_since is None
