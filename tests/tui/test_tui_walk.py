"""Issue 28, the console walked again by a new operator: what showed wrong facts or led to a wrong
turn, each driven by keys (Pilot) over the stand-in operator (real messages on a real bus), a run
store written by the real store and the real live-run follower."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import os
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from textual.widgets import Static

from console import messages as m
from console.procedure.follower import write_question
from console.procedure.state import Owner
from console.procedure.store import RunStore
from screens.app import ConsoleApp, ProcedureEnded
from screens.modals.confirm import ConfirmModal
from screens.modals.holders import HoldersModal
from screens.modals.quit import QuitWhileDownModal
from screens.widgets.asked_panel import AskedPanel
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.service_panel import ServicePanel
from screens.widgets.stepper import Stepper
from tests.tui.standin import T0, StandinOperator, restart_confirmation, stop_confirmation
from tests.tui.test_tui_operator import Clock, console, footer_keys, on_top, text_of, until

WIDE = (120, 40)


def serving(**kw) -> StandinOperator:
    op = StandinOperator(**kw)
    op.seed(history=5)
    return op


def banner_text(app: ConsoleApp) -> str:
    return text_of(app.screen.query_one(DowntimeBanner))


def statuses(app: ConsoleApp, *names: str) -> list[str]:
    return [app.state.steps[n].status for n in names]


class GatedRun(StandinOperator):
    """The stand-in whose next run waits at its preflight until the test lets it go on."""

    def __init__(self) -> None:
        super().__init__()
        self.gate: asyncio.Event | None = None

    async def run(self, decider, **kw) -> m.RunFinished:
        if self.gate is not None:
            await self.gate.wait()
        return await super().run(decider, **kw)


# --- 1. the stepper shows the run being driven, never the last one's ticks --------------------------


async def test_a_new_run_shows_its_own_steps_never_the_last_runs():
    op = GatedRun()
    op.seed(history=5)
    ended: list[ProcedureEnded] = []
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        app.message_hook = None
        await pilot.press("g")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: on_top(app, HoldersModal))
        await pilot.press("y")
        await until(pilot, lambda: app.state.finished is not None and not app.state.running)
        assert statuses(app, "stop", "restart", "evaluate") == ["done", "done", "done"]
        op.run_id, op.gate = "20251201-101500-cd34", asyncio.Event()
        await pilot.press("g")  # a new run, still in its preflight
        await until(pilot, lambda: app.state.running)
        await pilot.pause()
        stepper = text_of(app.screen.query_one(Stepper))
        assert "done" not in stepper and statuses(app, "stop", "restart") == ["pending", "pending"]
        op.gate.set()
        await until(pilot, lambda: on_top(app, ConfirmModal))
        assert statuses(app, "restart", "evaluate", "report") == ["pending"] * 3
        await pilot.press("n")  # refuse the stop: the steps after it never ran in this run
        await until(pilot, lambda: app.state.finished is not None and not app.state.running)
        assert app.state.finished.run_id == op.run_id
        assert statuses(app, "stop", "restart", "evaluate", "report") == ["refused", "pending", "pending", "pending"]
        assert "✓ restart" not in text_of(app.screen.query_one(Stepper))
    assert not ended


# --- 2. the DOWN banner projects a return only while something brings it ----------------------------


async def test_the_banner_never_projects_a_return_nothing_is_bringing():
    op = serving()
    clock = Clock()
    async with console(op, WIDE, clock=clock) as (app, pilot):
        # A refused restart: down, no run going, no restart under way.
        op.publish(m.PlanReady(op.run_id, "window", ()))
        op.publish(m.Downtime(op.run_id, clock.t - 48))
        op.publish(m.DecisionMade(stop_confirmation(), True, "tui"))  # the stop's forecast: 3 min 14 s
        await until(pilot, lambda: app.state.down_since is not None)
        clock.t += 400  # well past the forecast
        app.refresh_banners()
        text = banner_text(app)
        assert "no restart under way: r restarts it" in text
        assert "back ~" not in text and "late" not in text
    # A question waits while the service is down: the operator's thinking is never lateness.
    op = serving()
    clock = Clock()
    async with console(op, WIDE, clock=clock) as (app, pilot):
        await pilot.press("g")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: on_top(app, HoldersModal) and app.state.down_since is not None)
        clock.t += 900
        app.refresh_banners()
        text = banner_text(app)
        assert "waiting for your answer" in text and "late" not in text
        await pilot.press("y")
        await until(pilot, lambda: not app.state.running)


# --- 3. one figure per question, its basis in words ---------------------------------------------------


async def test_the_stop_question_gives_one_figure_with_its_basis_in_words():
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        asyncio.ensure_future(app.decider.decide(stop_confirmation()))
        await until(pilot, lambda: on_top(app, ConfirmModal))
        body = " ".join(text_of(w) for w in app.screen.query(Static))
        assert body.count("3 min 14 s") == 1  # the forecast, once: never a second figure beside it
        assert "estimated)" not in body and "earlier windows" not in body
        assert "extract: median of 2 earlier runs on ct129" in " ".join(body.split())
        await pilot.press("n")


# --- 4. quitting with the service down -------------------------------------------------------------


async def test_quit_while_down_says_why_no_restart_and_leaves_a_last_line(tmp_path: Path):
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await pilot.press("g")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: on_top(app, HoldersModal) and app.state.down_since is not None)
        await pilot.press("ctrl+q")  # the run goes on, the service is down: the quit asks
        await until(pilot, lambda: on_top(app, QuitWhileDownModal))
        said = " ".join(" ".join(text_of(w) for w in app.screen.query(Static)).split())
        assert "Restart it first?" not in said
        assert "The run restarts the service itself once the extraction is done" in said
        assert not app.screen.query("#restart") and app.focused.id == "stay"
        said = []
        exit_ = app.exit
        app.exit = lambda *a, message=None, **kw: (said.append(message), exit_(*a, message=message, **kw))[1]
        await pilot.press("l")
        await until(pilot, lambda: not app.is_running)
    assert [str(m) for m in said] == [app.farewell]  # Textual prints it once the screen is gone
    assert app.farewell == f"ct129 DOWN since 09:35:{int(app.state.down_since - T0):02d} (run {op.run_id}); " \
                          "restart: dflash-ops run --resume"


def test_the_last_line_names_a_config_that_is_not_the_default(tmp_path: Path):
    op = serving()
    op.config = dataclasses.replace(op.config, source=tmp_path / "drill.toml")
    app = ConsoleApp(op, clock=Clock())
    app.state.apply(m.Downtime("20251202-025000-0660", T0))
    assert app.left_down_line() == (f"ct129 DOWN since 09:35:00 (run 20251202-025000-0660); "
                                    f"restart: dflash-ops run --resume --config {tmp_path / 'drill.toml'}")


# --- 5. one quit path, in the console's words ------------------------------------------------------


async def test_ctrl_c_and_ctrl_q_take_the_consoles_own_quit_from_every_screen():
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        asyncio.ensure_future(app.decider.decide(restart_confirmation()))
        app.state.running = True  # a run asks: quitting must ask first, over the question too
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("ctrl+c")
        await until(pilot, lambda: app.screen.id == "quit-while-running")
        assert not app._notifications  # never Textual's "press ctrl+q to quit"
        await pilot.press("n")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("n")
        app.state.running = False
        commands = list(app.get_system_commands(app.screen))
        quits = [c for c in commands if c.title == "Quit"]
        assert len(quits) == 1 and "asks first" in quits[0].help and "as soon as possible" not in quits[0].help
        await pilot.press("ctrl+q")
        await until(pilot, lambda: not app.is_running)


# --- 6. the read-only console: who drives, what it waits on, when it ended ---------------------------


async def test_the_read_only_console_names_the_driver_its_question_and_the_end(tmp_path: Path):
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    state = run.state
    state.status, state.owner = "running", Owner.this_process()
    state.route = "window"
    state.service.stopped_at, state.service.down = T0, True
    for name in ("preflight", "stage", "cache", "stop", "free-vram", "extract"):
        state.step(name).status, state.step(name).started_at, state.step(name).ended_at = "done", T0 - 60, T0 - 50
    state.step("restart").status, state.step("restart").started_at = "running", T0 + 10
    run.save()
    write_question(run.dir, restart_confirmation(), T0 + 10)
    op = serving(runs_dir=store.root, read_only=True)
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await until(pilot, lambda: app.state.live is not None and app.state.down_since is not None)
        await until(pilot, lambda: "waiting for an answer" in banner_text(app))
        text = banner_text(app)
        assert f"run {run.run_id} by {state.owner.describe()}" in text
        assert "waiting for an answer: start the service on ct129" in text and "$" not in text
        assert f"stopped by run {run.run_id}" in text_of(app.screen.query_one(ServicePanel))
        assert "$ systemctl start sglang-qwen" in text_of(app.screen.query_one(AskedPanel))
        stepper = text_of(app.screen.query_one(Stepper))
        assert "p plans" not in stepper and "+N" not in stepper and "waiting for your answer" not in stepper
        assert "p" not in footer_keys(app) and "g" not in footer_keys(app)
        # The run ends (the restart done, the rest after it): the follower's last look shows it.
        os.unlink(run.dir / "question.json")
        state.service.down, state.service.ready_at = False, T0 + 40
        for name in ("restart", "evaluate", "report", "crosscheck"):
            state.step(name).status, state.step(name).ended_at = "done", T0 + 50
        state.status = "done"
        run.save()
        await until(pilot, lambda: app.state.steps["crosscheck"].status == "done")
        await until(pilot, lambda: app.state.down_since is None)
        await until(pilot, lambda: app.screen.query_one(AskedPanel).has_class("idle"))  # answered: gone
        assert "running" not in text_of(app.screen.query_one(Stepper))
        assert app.state.live.status == "done"


async def test_an_empty_read_only_console_offers_no_key_it_lacks():
    op = serving(read_only=True)
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await pilot.pause()
        text = " ".join(text_of(app.screen.query_one(Stepper)).split())
        assert "p plans" not in text and "g runs" not in text and "this console watches" in text


# --- 7. legends belong in help ------------------------------------------------------------------------


async def test_the_steps_panel_has_no_legend_help_says_what_plus_means():
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await pilot.press("g")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: on_top(app, HoldersModal))
        await pilot.press("y")
        await until(pilot, lambda: not app.state.running)
        op.publish(m.StepUpdate(op.run_id, "stop", "done", T0, T0 + 20, work_s=1.0, decision_s=19.0))
        await until(pilot, lambda: app.state.steps["stop"].decision_s == 19.0)
        await pilot.pause()
        stepper = text_of(app.screen.query_one(Stepper))
        assert "+19s" in stepper.replace(" ", "") and "waiting for your answer" not in stepper
        await pilot.press("question_mark")
        await until(pilot, lambda: app.screen.id == "help")
        helped = " ".join(" ".join(text_of(w) for w in app.screen.query(Static)).split())
        assert "a dim +N beside it is how long its questions waited" in helped
        assert "1..7" in helped and "into the run directory" in helped


# --- 11. the footer and the buttons say the same, and what n leaves behind ------------------------------


async def test_every_question_says_what_n_leaves_behind_in_the_buttons_words():
    op = serving()
    async with console(op, (80, 24), clock=Clock()) as (app, pilot):
        op.publish(m.Downtime(op.run_id, T0))
        asyncio.ensure_future(app.decider.decide(restart_confirmation()))
        await until(pilot, lambda: on_top(app, ConfirmModal))
        footer = {b.description for _, b, enabled, _ in app.screen.active_bindings.values() if b.show and enabled}
        assert {"Proceed", "Cancel"} <= footer and not {"Yes", "No"} & footer
        refusal = text_of(app.screen.query_one(".refusal", Static)).strip()
        assert refusal == "Cancel (n): the service stays down; r restarts it"
        await until(pilot, lambda: app.screen.query_one(".refusal").region.height > 0)  # laid out (a loaded CI)
        assert app.screen.query_one(".refusal").region.height == 1  # on screen at 80 x 24, above the buttons
        await pilot.press("n")


# --- found on the walk itself ---------------------------------------------------------------------------


async def test_two_questions_at_once_are_asked_in_turn():
    """A refused restart, and the run's compensation asking the restart again at once: two questions
    in flight (the walk crashed here: 'a widget with ID confirm already exists')."""
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        first = asyncio.ensure_future(app.decider.decide(restart_confirmation()))
        second = asyncio.ensure_future(app.decider.decide(restart_confirmation(95)))
        await until(pilot, lambda: on_top(app, ConfirmModal))
        asked_first = app.screen
        await pilot.press("n")
        await until(pilot, lambda: first.done())
        await until(pilot, lambda: on_top(app, ConfirmModal) and app.screen is not asked_first)
        assert "down 1 min 35 s so far" in text_of(app.screen.query_one(".impact", Static))
        await pilot.press("y")
        await until(pilot, lambda: second.done())
        assert (first.result(), second.result()) == (False, True)
        assert not app.query("ErrorModal") and not any(s.id == "error" for s in app.screen_stack)


async def test_a_run_this_console_drove_is_never_shown_as_another_consoles(tmp_path: Path):
    """After this console's run ends with the service down, its follower no longer calls the run
    ours (nothing drives it): the banner still must not name this console as another's."""
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        op.publish(m.Downtime(op.run_id, T0))
        op.publish(m.RunFinished(op.run_id, "failed", 3, False, "refused", str(tmp_path)))
        op.publish(m.LiveRun(op.run_id, "failed", "op@ws1 pid 4242 since 09:30:00", False, True, ours=False))
        await until(pilot, lambda: app.state.live is not None and app.state.finished is not None)
        app.refresh_banners()
        text = banner_text(app)
        assert " by op@ws1" not in text and "no restart under way" in text


async def test_a_run_left_down_shows_the_banner_when_the_console_opens_to_resume_it(tmp_path: Path):
    """`run --resume` of a run that left the service down: the banner from the first second, before
    the engine speaks (the walk showed none while the restart question waited)."""
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    run.state.status, run.state.service.stopped_at, run.state.service.down = "failed", T0 - 240, True
    run.save()
    op = serving(runs_dir=store.root)
    app = ConsoleApp(op, clock=Clock(), autostart=True, resume=run.run_id)
    op.run = lambda decider, **kw: asyncio.Event().wait()  # the engine is not what is tested here
    async with app.run_test(size=WIDE) as pilot:
        await until(pilot, lambda: app.state.down_since == T0 - 240)
        await until(pilot, lambda: "SERVICE DOWN 4 min 30 s" in banner_text(app))


def test_the_service_panel_says_a_health_error_once():
    from rich.console import Console

    from screens.widgets.service_panel import service_renderable

    error = "http://127.0.0.1:34881/health: no answer (the server closed the connection without answering)"
    view = m.ServiceView(m.ServiceStatus("command", "server", True, "running", None, main_pid=23640),
                         m.ServiceHealth(None, False, error=error), T0, error=error)
    out = Console(width=44, record=True, file=io.StringIO())
    out.print(service_renderable(view, None, None, T0))
    assert " ".join(out.export_text().split()).count("closed the connection") == 1


async def test_quit_while_the_restart_question_waits_never_says_a_restart_is_under_way():
    op = serving()
    async with console(op, (80, 24), clock=Clock()) as (app, pilot):
        op.publish(m.Downtime(op.run_id, T0))
        op.publish(m.StepUpdate(op.run_id, "restart", "running", T0 + 20))
        app.state.running = True  # the run asks the restart (its step is running while it asks)
        asyncio.ensure_future(app.decider.decide(restart_confirmation()))
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("ctrl+q")
        await until(pilot, lambda: on_top(app, QuitWhileDownModal))
        said = " ".join(" ".join(text_of(w) for w in app.screen.query(Static)).split())
        assert "A restart is under way" not in said and not app.screen.query("#wait")
        assert "The run is asking to restart it: stay and answer its question (y)" in said
        await pilot.press("escape")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("n")
        app.state.running = False


async def test_a_finished_job_with_nothing_to_show_leaves_no_empty_box_and_an_ended_run_names_no_driver():
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        op.publish(m.JobLog("extract-9", "extract", "ct129", "info", "go", kind="phase"))
        op.publish(m.JobExit("extract-9", "extract", "ct129", 0))
        await until(pilot, lambda: "extract-9" in app.state.jobs and app.state.jobs["extract-9"].finished)
        await pilot.pause()
        panel = app.screen.query_one("#job")
        assert panel.border_title == "Job" and app.screen.query_one(".job-idle", Static).display
        # Another console's run that ended with the service down: its console is no longer the news.
        op.publish(m.Downtime("20251201-080000-ee11", T0))
        op.publish(m.LiveRun("20251201-080000-ee11", "refused", "op@ws2 pid 77 since 08:00:00", False, True, False))
        await until(pilot, lambda: app.state.live is not None)
        app.refresh_banners()
        text = banner_text(app)
        assert "run 20251201-080000-ee11 (refused: run --resume restarts it)" in text and "pid 77" not in text


# --- 9. values whole ---------------------------------------------------------------------------------------


@settings(max_examples=100)
@given(st.lists(st.integers(0, 15), max_size=16))
def test_a_holders_gpus_are_written_whole_as_ranges(gpus):
    from screens.widgets.host_panel import gpu_ranges

    text = gpu_ranges(gpus)
    back = set()
    for part in text.split(","):
        if part == "-":
            continue
        first, _, last = part.partition("-")
        back |= set(range(int(first), int(last or first) + 1))
    assert back == set(gpus) and "…" not in text
    assert gpu_ranges(list(range(7))) == "0-6" and gpu_ranges([0, 1]) == "0,1"


async def test_the_online_tab_keeps_every_prompt_name_and_tau_whole_at_80x24(runs_root: Path):
    """The walk read `linked_list_reve…`, `online…`, `to…` on the Online tab at 80 x 24: the table
    keeps its width and scrolls sideways; only the sentences fold."""
    from console.procedure.crosscheck import CrossCheck, PromptCheck, save
    from screens.results import ResultsScreen

    run_dir = runs_root / "20251130-170000-cd34"
    names = ["linked_list_reverse", "async_rate_limiter", "trie_autocomplete"]
    prompts = [PromptCheck(n, 300 + i, 100, (300 + i) / 100, 3.01 + i / 100, True) for i, n in enumerate(names)]
    save(run_dir, CrossCheck("checked", "replayed 3 prompts", drafter="z-lab", tau=3.02, ci=[2.9, 3.1],
                             per_request_mean=3.02, offline_tau=3.02, offline_ci=[2.95, 3.08], agrees=True,
                             prompts=prompts))
    op = serving(runs_dir=runs_root)
    async with console(op, (80, 24), clock=Clock()) as (app, pilot):
        app.open_results(run_dir)
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        await pilot.press("7")
        await pilot.pause()
        table = app.screen.query_one(".online-prompts", Static)
        await until(pilot, lambda: table.region.width > 0)
        shown = text_of(table)
        assert all(n in shown for n in names), shown
        natural = max(len(line.rstrip()) for line in shown.splitlines())  # drawn at 200 columns: whole
        assert natural > 76 and table.region.width >= natural  # wider than the screen: it scrolls, never cut


# --- the job's bars stay on screen -------------------------------------------------------------------


async def test_one_servers_drain_and_rejoin_rows_never_crowd_the_jobs_bars_out():
    """The walk (and a replay) showed an empty `Job extract on ct129` box at 120 x 40: the plan's
    drain and rejoin rows (left out: one server) and their two notes pushed the job's counters below
    the screen. Without a fleet they are no rows at all; the extraction's counters show."""
    from screens.widgets.job_panel import JobPanel
    from tests.tui.standin import PLAN_STEPS, extract_progress, mid_window

    op = serving()
    engine_plan = (*PLAN_STEPS[:3], m.PlannedStep("drain", False, "left out: one server (no [fleet] router)"),
                   *PLAN_STEPS[3:7], m.PlannedStep("rejoin", False, "left out: one server (no [fleet] router)"),
                   *PLAN_STEPS[7:], m.PlannedStep("crosscheck", True, "online tau beside the offline one"))
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await pilot.pause()
        mid_window(op)
        op.publish(m.PlanReady(op.run_id, "window", engine_plan))
        op.publish(m.StepUpdate(op.run_id, "drain", "skipped", T0, T0, "one server: no router to leave"))
        for p in extract_progress(op.now):
            op.publish(p)
        await until(pilot, lambda: app.state.steps.get("extract") is not None and app.state.jobs)
        await pilot.pause()
        assert "drain" not in app.state.steps and "rejoin" not in app.state.steps
        panel = app.screen.query_one(JobPanel)

        def counter() -> Static | None:
            return next((w for w in panel.query(Static) if "prompts 4/10" in text_of(w) and w.region.height), None)

        await until(pilot, lambda: counter() is not None)
        assert app.screen.region.contains_region(counter().region), (counter().region, app.screen.region)


# --- polish: no toast over the steps, no `(0 of 0)` ---------------------------------------------------


async def test_a_run_done_is_said_under_the_steps_never_in_a_toast_over_them():
    """The walk's toasts covered the crosscheck line (the steps' last rows) and the results table: a
    run done here is said under its steps, in the panel, for as long as it is the news."""
    op = serving()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await pilot.press("g")
        await until(pilot, lambda: on_top(app, ConfirmModal))
        await pilot.press("y")
        await until(pilot, lambda: on_top(app, HoldersModal))
        await pilot.press("y")
        await until(pilot, lambda: app.state.finished is not None and not app.state.running)
        app.screen.refresh_part("steps")
        await until(pilot, lambda: f"run {op.run_id} done: o opens the results" in text_of(
            app.screen.query_one(Stepper)))
        assert not [n for n in app._notifications if "done" in str(n.message)]


async def test_a_fresh_consoles_events_say_none_yet_not_0_of_0():
    from screens.modals.events import EventsModal

    op = serving()
    async with console(op, (80, 24), clock=Clock()) as (app, pilot):
        await pilot.press("slash")
        await until(pilot, lambda: isinstance(app.screen, EventsModal))
        box = app.screen.query_one("Vertical")
        assert box.border_title == "Events: none yet"
        assert "no event yet" in text_of(app.screen.query_one("#events-text", Static))
        await pilot.press("escape")
        op.publish(m.JournalEntry(T0, op.run_id, "stop", "sglang-qwen stopped", host="ct129"))
        await until(pilot, lambda: app.state.journal_count == 1)
        await pilot.press("slash")
        await until(pilot, lambda: isinstance(app.screen, EventsModal))
        assert app.screen.query_one("Vertical").border_title == "Events (1)"
        await pilot.press(*"zzz")
        await until(pilot, lambda: app.screen.query_one("Vertical").border_title == "Events matching 'zzz': 0 of 1")


def test_while_the_service_starts_its_unanswered_health_is_no_alarm():
    """The walk: while the restart loaded the server, the service panel read `health: no answer
    (http://…/health: no answer (the server closed …); SGLang answers /health within …)` in red over
    five lines, pushing the job's bars off screen. Starting, that is expected: one line says so. Up,
    a health that does not answer is still said whole, in red."""
    from screens.widgets.service_panel import service_renderable

    status = m.ServiceStatus("command", "server", True, "running", None, main_pid=21945)
    silent = m.ServiceHealth(None, False, error="http://127.0.0.1:36789/health: no answer (the server closed it)")
    view = m.ServiceView(status, silent, T0)
    starting = "\n".join(t.plain for t in service_renderable(
        view, m.Downtime("r1", T0 - 50), m.StartupProgress("weights_loaded", "weights loaded"), T0).renderables)
    assert "health: no answer yet (starting)" in starting and "closed" not in starting
    up = "\n".join(t.plain for t in service_renderable(view, None, None, T0).renderables)
    assert "health: no answer (http://127.0.0.1:36789/health: no answer (the server closed it))" in up


async def test_the_read_only_console_shows_the_restart_r_asks_for_a_finished_run(tmp_path: Path):
    """The walk's known gap (docs/walks a10): a run that ended refused with the service down, restarted
    with `r` in the console that drove it: a watching console said "no restart under way" while the
    other one asked. The engine writes question.json whoever asks; the follower shows it for a
    finished run too, while that console lives."""
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    state = run.state
    state.status, state.owner, state.route = "refused", Owner.this_process(), "window"
    state.service.stopped_at, state.service.down = T0, True
    run.save()
    write_question(run.dir, restart_confirmation(), T0 + 10)
    op = serving(runs_dir=store.root, read_only=True)
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await until(pilot, lambda: app.state.live is not None and app.state.down_since is not None)
        await until(pilot, lambda: "waiting for an answer: start the service on ct129" in banner_text(app))
        assert "no restart under way" not in banner_text(app)
        assert "$ systemctl start sglang-qwen" in text_of(app.screen.query_one(AskedPanel))


# The drill's restart command, as the walk's watching console met it: longer than the banner's rows.
DRILL_START = ("/work/main/.venv/bin/python3", "-m", "remote.drill.service", "start", "--state",
               "/root/.local/state/dflash-ops/drill/ct129/home/standin", "--", "--model",
               "/root/.local/state/dflash-ops/drill/ct129/home/models/tiny-qwen3.5-hybrid", "--port", "36789",
               "--host", "127.0.0.1", "--mem-fraction-static", "0.8")


def shown_in(app: ConsoleApp, widget) -> list[str]:
    """The rows of `widget`'s content as the terminal shows them (the compositor's lines): what a
    container's edge or a max-height cuts is not there."""
    from tests.tui.test_tui_values_whole import screen_text

    region = widget.content_region
    rows = screen_text(app).splitlines()[region.y:region.y + region.height]
    return [row[region.x:region.x + region.width] for row in rows]


async def test_the_watching_console_shows_the_question_whole_at_both_sizes(tmp_path: Path):
    """Item 6, the walk's c5: the banner (three rows at most) ended in the drill's command, cut at 80 x
    24. The banner says what is asked and where; the block under it shows the literal command whole."""
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    state = run.state
    state.status, state.owner, state.route = "running", Owner.this_process(), "window"
    state.service.stopped_at, state.service.down = T0, True
    for name in ("preflight", "stage", "cache", "stop", "free-vram", "extract"):
        state.step(name).status, state.step(name).started_at, state.step(name).ended_at = "done", T0 - 60, T0 - 50
    state.step("restart").status, state.step("restart").started_at = "running", T0 + 10
    run.save()
    write_question(run.dir, dataclasses.replace(restart_confirmation(), argv=DRILL_START), T0 + 10)
    command = " ".join(DRILL_START)
    assert len(command) > 200
    op = serving(runs_dir=store.root, read_only=True)
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        for size in (WIDE, (80, 24)):
            await pilot.resize_terminal(*size)
            await until(pilot, lambda: "waiting for an answer" in banner_text(app))
            await pilot.pause()
            banner = " ".join(row.strip() for row in shown_in(app, app.screen.query_one(DowntimeBanner)))
            assert "waiting for an answer: start the service on ct129" in banner, (size, banner)
            assert "$" not in banner and "remote.drill" not in banner, (size, banner)
            panel = shown_in(app, app.screen.query_one(AskedPanel))
            # Wrapped (and folded inside a path longer than the panel), in order, nothing left out.
            assert "".join(command.split()) in "".join("".join(panel).split()), (size, "\n".join(panel))
            assert any(f"{run.run_id}'s console asks: start the service on ct129" in row for row in panel), panel


async def test_a_second_console_never_starts_a_run_over_the_live_one_nor_wipes_its_steps(tmp_path: Path):
    """Issue 43 item 8: in a second read-write console, `g` during another console's window showed a
    modal titled "the procedure failed" and wiped this console's step table. While another live
    console drives, `g`, `n` and `z` are not offered; pressed, they say who drives and do nothing."""
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    state = run.state
    state.status, state.owner, state.route = "running", Owner.this_process(), "window"
    state.service.stopped_at, state.service.down = T0, True
    for name in ("preflight", "stage", "cache", "stop"):
        state.step(name).status, state.step(name).started_at, state.step(name).ended_at = "done", T0 - 60, T0 - 50
    state.step("extract").status, state.step("extract").started_at = "running", T0 + 5
    run.save()
    op = serving(runs_dir=store.root)
    started: list[dict] = []
    op.run = lambda decider, **kw: started.append(kw) or asyncio.Event().wait()
    async with console(op, WIDE, clock=Clock()) as (app, pilot):
        await until(pilot, lambda: app.state.live is not None and app.state.steps["extract"].status == "running")
        assert not {"g", "n", "z"} & set(footer_keys(app))
        for key in ("g", "n", "z"):
            await pilot.press(key)
            await pilot.pause()
        assert started == [] and not app.state.running
        assert not isinstance(app.screen, ConfirmModal) and type(app.screen).__name__ == "DashboardScreen"
        assert statuses(app, "stop", "extract") == ["done", "running"]  # the live run's steps, kept
        assert f"run {run.run_id} by {state.owner.describe()}" in banner_text(app)  # who drives, said
        keyed = [n.message for n in app._notifications]  # g and n (z is no key of the dashboard)
        assert len(keyed) == 2 and all(f"run {run.run_id} is driven by {state.owner.describe()}: this console "
                                       f"follows it" in line for line in keyed), keyed
        # Reached some other way (the command palette runs an action by name): it says who drives.
        for action in (app.action_run_procedure, app.action_next_step, app.action_zero_downtime):
            action()
        await pilot.pause()
        assert started == [] and statuses(app, "stop", "extract") == ["done", "running"]
        said = [n.message for n in app._notifications][len(keyed):]
        assert len(said) == 3 and all(f"run {run.run_id} is driven by {state.owner.describe()}: this console "
                                      f"follows it" in line for line in said), said
