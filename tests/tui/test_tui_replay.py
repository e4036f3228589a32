"""`dflash-ops replay` by keys (Pilot): the console over a store the real engine wrote (a headless
drill, tests/data/replay). Playback starts paused on a clock the test moves, and `frame_s` is an
hour, so only the keys and the test's own frames move it: no sleeps, nothing timed."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from textual.widgets import Static

from console import messages as m
from console.procedure.replay import Event, read_recording
from console.procedure.store import JOURNAL
from screens.dashboard import DashboardScreen
from screens.modals.base import ConsoleModal
from screens.replay import ReplayApp, ReplayBar, config_of
from screens.results import ResultsScreen
from screens.widgets.downtime_banner import DowntimeBanner
from screens.widgets.host_panel import HostPanel
from screens.widgets.job_panel import JobPanel
from screens.widgets.stepper import Stepper
from tests.tui.test_tui_console import text_of

RECORDED = Path(__file__).parents[1] / "data" / "replay" / "20261202-041120-520a"
SIZE = (120, 40)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def replay(path: Path = RECORDED) -> tuple[ReplayApp, Clock]:
    clock = Clock()
    return ReplayApp(read_recording(path), playing=False, clock=clock, frame_s=3600), clock


async def until(pilot, condition, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await pilot.pause()


def bar(app: ReplayApp) -> str:
    return text_of(app.screen.query_one(ReplayBar))


def step_line(app: ReplayApp, name: str) -> str:
    return next(line for line in text_of(app.screen.query_one(Stepper)).splitlines() if f" {name} " in f" {line} ")


async def test_steps_the_down_banner_and_the_questions_with_their_answers():
    app, _ = replay()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "paused" in bar(app))
        assert "no question asked yet" in bar(app) and "read-only" in app.sub_title
        await pilot.press(*"]]]]")  # preflight, stage, cache: to the stop's start
        await until(pilot, lambda: app.player.current_step() == "stop")
        assert "running" in step_line(app, "stop") and "done" in step_line(app, "cache")
        assert "pending" in step_line(app, "extract")
        banner = app.screen.query_one(DowntimeBanner)
        assert not banner.has_class("down")
        for _ in range(10):  # event by event: the question is answered, the service goes down
            await pilot.press("full_stop")
            if app.state.down_since is not None:
                break
        await until(pilot, lambda: banner.has_class("down"))
        assert "SERVICE DOWN" in text_of(banner) and "r restarts" not in text_of(banner)
        assert "asked: stop the service on ct129 · approved (--yes)" in bar(app)
        assert "\n  $ " in bar(app) and "-m remote.drill.service stop --state" in bar(app)  # the literal command
        await pilot.press("]")  # free-vram: the leftover process is ended, as approved
        await until(pilot, lambda: app.player.current_step() == "free-vram")
        await pilot.press("]")
        await until(pilot, lambda: "asked: end 1 process holding VRAM" in bar(app))
        while app.player.current_step() != "extract":
            await pilot.press("]")
            await pilot.pause()
        extraction = next(j for j in app.state.jobs.values() if j.job_id.endswith("-extract"))
        while "prompts" not in extraction.bars:  # event by event to the GPUs' release
            await pilot.press("full_stop")
            await pilot.pause()
        # the extraction's counters as its worker reported them on releasing the GPUs
        jobs = app.screen.query_one(JobPanel)
        await until(pilot, lambda: "prompts 4/4" in " ".join(text_of(w) for w in jobs.query(Static)))
        assert "tokens 284/284" in " ".join(text_of(w) for w in jobs.query(Static))
        while app.player.current_step() != "evaluate":
            await pilot.press("]")
            await pilot.pause()
        await until(pilot, lambda: not banner.has_class("down"))  # the server was ready again
        assert "done" in step_line(app, "restart") and "asked: start the service on ct129" in bar(app)
        while "evaluate on ct129" not in str(jobs.border_title):  # its job starts a moment after the step
            await pilot.press("full_stop")
            await pilot.pause()
        assert "evaluate" in app.state.jobs[next(reversed(app.state.jobs))].job_id
        await pilot.press("left_square_bracket")  # into a step: back to its start
        await until(pilot, lambda: app.player.now == dict(app.recording.step_starts())["evaluate"])
        assert app.state.jobs == {} or "evaluate" not in " ".join(app.state.jobs)
        await pilot.press("left_square_bracket")  # at a step's start: the one before, folded again from the start
        await until(pilot, lambda: app.player.current_step() == "restart")
        assert "pending" in step_line(app, "evaluate") and "running" in step_line(app, "restart")
        assert banner.has_class("down")


async def test_play_pause_and_the_speed_on_the_clock():
    app, clock = replay()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("space")
        assert app.player.playing
        clock.t += 5
        app._frame()
        await pilot.press("plus")
        clock.t += 5
        app._frame()  # 5 s at x1, then 5 s at x2
        await until(pilot, lambda: "×2" in bar(app))
        assert abs(app.player.elapsed_s - 15) < 1e-6
        await pilot.press("space")
        clock.t += 100
        app._frame()  # paused: the run's time stands still
        await until(pilot, lambda: "paused" in bar(app))
        assert abs(app.player.elapsed_s - 15) < 1e-6
        # 15 s in: both hosts' telemetry drawn, as the run saw it then (SIMULATED drill GPUs)
        assert set(app.state.telemetry) == {"ct129", "ct200"}
        for panel in app.screen.query(HostPanel):
            assert "connected" in str(panel.border_title) and "SIMULATED" in str(panel.border_title)
        assert app.state.steps["preflight"].status == "done"  # it took 14 s
        await pilot.press("minus", "minus")
        assert app.player.speed == 0.5


async def test_the_results_screen_at_the_end():
    app, _ = replay()
    async with app.run_test(size=SIZE) as pilot:
        while not app.player.at_end:
            await pilot.press("]")
            await pilot.pause()
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        assert app.screen.data.run_dir == RECORDED and app.state.finished.status == "done"
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, DashboardScreen))
        assert "■ end" in bar(app) and all(s.status == "done" for s in app.state.steps.values())


async def test_at_80x24_the_restart_asked_then_under_way_and_the_question_gone_at_the_end():
    """Issue 43.12: the banner said "no restart under way" while the restart's question waited and
    after its approval; after the end the last question stayed pinned over half of an 80 x 24 screen;
    the hosts came in the other order than the live console's (ct129, the service's, first).
    (The recorded store predates the time a question is asked: it is put in, half a second before
    its answer, as the engine journals it now.)"""
    recording = read_recording(RECORDED)
    answer = next(e for e in recording.events if isinstance(e.message, m.DecisionMade)
                  and e.message.confirmation.step == "restart")
    recording.events.append(Event(answer.t - 0.5, answer.message.confirmation, "asked"))
    recording.events.sort(key=lambda e: e.t)
    app = ReplayApp(recording, playing=False, clock=Clock(), frame_s=3600)
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "paused" in bar(app))
        assert [p.host for p in app.screen.query(HostPanel)] == ["ct129", "ct200"]
        banner = app.screen.query_one(DowntimeBanner)
        app.show_events(app.player.seek(answer.t - 0.5))
        await until(pilot, lambda: "the restart is asked: waiting for an answer" in text_of(banner))
        app.show_events(app.player.seek(answer.t))  # approved: under way, with when it is expected back
        await until(pilot, lambda: "· back ~" in text_of(banner))
        assert "no restart under way" not in text_of(banner)
        app.show_events(app.player.seek(recording.end))  # the end: the results open by themselves
        await until(pilot, lambda: isinstance(app.screen, ResultsScreen))
        await pilot.press("escape")
        await until(pilot, lambda: isinstance(app.screen, DashboardScreen) and "■ end" in bar(app))
        assert "asked:" not in bar(app) and app.screen.query_one(ReplayBar).size.height == 1


async def test_q_quits_a_replay_at_once_while_the_replayed_service_is_down():
    """The live console's quit asks to leave the service down or wait for its restart; a replay holds
    nothing down (the replayed run's restart under way is its own, then): no dialog, it quits."""
    app, _ = replay()
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "paused" in bar(app))
        stop = next(e for e in app.recording.events if isinstance(e.message, m.DecisionMade)
                    and e.message.confirmation.step == "stop")
        app.show_events(app.player.seek(stop.t + 1))
        await until(pilot, lambda: app.state.down_since is not None)
        await pilot.press("q")
        await until(pilot, lambda: app.return_code is not None)
        assert not isinstance(app.screen, ConsoleModal)


def test_the_hosts_in_the_order_of_the_runs_config_while_it_is_there(tmp_path: Path):
    """The live console lists the hosts as its config does; a replay takes that order from the run's
    config file when it is still there (here ct200 first), else the service's host first."""
    recording = read_recording(RECORDED)
    assert list(config_of(recording).hosts) == ["ct129", "ct200"]
    config = tmp_path / "dflash-ops.toml"
    config.write_text('[hosts.ct200]\naddress = "b"\n\n[hosts.ct129]\naddress = "a"\n')
    recording.state.config = str(config)
    assert list(config_of(recording).hosts) == ["ct200", "ct129"]


async def test_keys_that_act_elsewhere_do_nothing():
    app, _ = replay()
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press(*"]]]]..")  # the stop's question answered: a live console would offer r here
        await until(pilot, lambda: app.state.down_since is not None)
        at, shown = app.player.position, list(app.state.steps.items())
        await pilot.press("r", "g", "p", "c", "n", "s", "h")
        await until(pilot, lambda: any("read-only" in str(n.message) for n in app._notifications))
        assert [w for w in app.workers if w.group in ("procedure", "service")] == []
        assert len(app.screen_stack) == 2 and isinstance(app.screen, DashboardScreen)
        assert app.player.position == at and list(app.state.steps.items()) == shown
        offered = {key for key, active in app.active_bindings.items() if active.enabled}
        assert not offered & {"g", "p", "r", "c", "n", "h"}
        titles = [c.title for c in app.get_system_commands(app.screen)]
        assert "Go to step extract" in titles and "Restart the service" not in titles


async def test_a_damaged_store_plays_to_the_damage_and_says_where(tmp_path: Path):
    copy = Path(shutil.copytree(RECORDED, tmp_path / RECORDED.name))
    journal = (copy / JOURNAL).read_text().splitlines(keepends=True)
    (copy / JOURNAL).write_text("".join(journal[:44]) + journal[44][:30])  # line 45 cut: during the extract
    app, _ = replay(copy)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "damaged: journal.jsonl line 45: cut mid-write" in bar(app))
        assert "replayed up to the damage" in bar(app)
        assert any("damaged" in str(n.message) for n in app._notifications)
        while not app.player.at_end:
            await pilot.press("]")
            await pilot.pause()
        assert app.player.current_step() == "extract" and app.state.finished is None
        assert not isinstance(app.screen, ResultsScreen | ConsoleModal)  # it never got to its results
        assert not [e for e in app.recording.events if isinstance(e.message, m.RunFinished)]


async def test_an_interrupted_run_ends_with_the_service_down_and_no_results():
    app, _ = replay(RECORDED.parent / "20261202-042648-ad7a")  # killed after the stop ran
    async with app.run_test(size=SIZE) as pilot:
        while not app.player.at_end:
            await pilot.press("]")
            await pilot.pause()
        banner = app.screen.query_one(DowntimeBanner)
        await until(pilot, lambda: "■ end" in bar(app) and banner.has_class("down"))
        assert "running" in step_line(app, "stop") and "pending" in step_line(app, "free-vram")
        assert isinstance(app.screen, DashboardScreen) and app.state.finished is None
        await pilot.press("o")  # no results: the run never got to them
        await until(pilot, lambda: any("no run with results" in str(n.message) for n in app._notifications))


async def test_a_question_as_it_was_asked_then_answered(window, monkeypatch) -> None:
    """A store the engine writes now (over its fakes, the world's clock in the store too): the stop's
    question is in the bar from the moment it was asked, with its impact and estimate, waiting; the
    next event is its answer, as long after as the operator took."""
    import console.procedure.store as store_module
    from tests.engine_fakes import ScriptedDecider, _TimeModule

    monkeypatch.setattr(store_module, "time", _TimeModule(window.world.clock))
    finished = await window.console(decider=ScriptedDecider(window.world.clock, think_s=7.0))
    assert finished.exit_code == 0, finished.message
    recording = read_recording(window.store.root / window.run_id)
    asked = next(e for e in recording.events if isinstance(e.message, m.Confirmation) and e.message.step == "stop")
    app = ReplayApp(recording, playing=False, clock=Clock(), frame_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "paused" in bar(app))
        app.show_events(app.player.seek(asked.t))
        await until(pilot, lambda: "waiting for an answer" in bar(app))
        assert f"asked: {asked.message.action} on {asked.message.host}" in bar(app)
        assert asked.message.impact[:20] in bar(app) and "DESTRUCTIVE" in bar(app)
        assert "DESTRUCTIVE · estimate" not in bar(app)  # the forecast is in the impact: said once
        while not isinstance(app.question, m.DecisionMade):
            await pilot.press("full_stop")
        await until(pilot, lambda: "· approved (scripted)" in bar(app))
        assert app.player.now - asked.t == 7.0  # answered as long after as the operator took


def test_the_pause_routes_downtime_is_said_as_a_pause() -> None:
    """The engine publishes the pause route's pause as its downtime (issue 30's notifications): the
    banner says the server is paused, not down (the stop route's still says down)."""
    from screens.state import ConsoleState
    from screens.widgets.downtime_banner import downtime_text

    state = ConsoleState()
    state.apply(m.Downtime("r1", 100.0, paused=True), 100.0)
    assert downtime_text(state, 130.0, can_restart=True).plain.startswith("SERVER PAUSED 30 s")
    state.apply(m.Downtime("r1", 100.0), 100.0)
    assert downtime_text(state, 130.0, can_restart=True).plain.startswith("SERVICE DOWN 30 s")


async def test_the_jobs_progress_bars_of_a_store_in_the_current_journal_format(window) -> None:
    """A store the engine writes now (its journal's job-start, job-progress and job-exit entries, over
    the engine's fakes): the replay draws the jobs' bars as the run saw them, the extraction's
    counters going up to where its worker got, then the job finished."""
    finished = await window.console()
    assert finished.exit_code == 0, finished.message
    recording = read_recording(window.store.root / window.run_id)
    progress = [e for e in recording.events if isinstance(e.message, m.JobProgress)
                and e.message.worker == "extract" and e.message.key == "prompts"]
    assert progress, "the journal holds the extraction's progress"
    app = ReplayApp(recording, playing=False, clock=Clock(), frame_s=3600)
    async with app.run_test(size=SIZE) as pilot:
        await until(pilot, lambda: "paused" in bar(app))
        app.show_events(app.player.seek(progress[-1].t))
        jobs = app.screen.query_one(JobPanel)
        last = progress[-1].message
        shown = f"prompts {last.done:g}/{last.total:g}"
        await until(pilot, lambda: shown in " ".join(text_of(w) for w in jobs.query(Static)))
        assert "extract on ct129" in str(jobs.border_title)
        while not app.player.at_end:  # to the run's end: later jobs reported no bars (a check, the evaluation)
            await pilot.press("right_square_bracket")
            await pilot.pause()
        await until(pilot, lambda: "extract on ct129 (finished)" in str(jobs.border_title))
        assert shown in " ".join(text_of(w) for w in jobs.query(Static))  # its bars stay as far as they got


async def test_at_80x24_the_footer_shows_the_replay_keys_and_help_lists_the_rest():
    """The tmux walk at 80 columns found the replay's own keys cut off its footer (]  [  +  - gone) and
    the service panel saying "not checked yet" for a look the recording never holds."""
    from textual.widgets._footer import FooterKey

    from screens.modals.help import HelpModal
    from screens.widgets.service_panel import ServicePanel

    app, _ = replay()
    async with app.run_test(size=(80, 24)) as pilot:
        await until(pilot, lambda: "paused" in bar(app))
        keys = list(app.screen.query(FooterKey))
        palette = [k for k in keys if k.description == "palette"]
        edge = palette[0].region.x if palette else 80
        shown = {k.description for k in keys if k not in palette and k.region.right <= edge}
        assert {"Play/pause", "Back", "Step", "Event", "Help", "Quit"} <= shown, shown
        assert "not recorded" in text_of(app.screen.query_one(ServicePanel))
        await pilot.press("question_mark")
        await until(pilot, lambda: isinstance(app.screen, HelpModal))
        said = " ".join(text_of(s) for s in app.screen.query("Static"))
        assert "faster / slower" in said and "the run's results" in said and "filter the events" in said
