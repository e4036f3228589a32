"""Notifications (console/notify/): the `[notify]` table's validation, and the notifier fed the bus's
messages of a run in a real run store, sending through apprise's `json://` target to a loopback HTTP
server that records what arrives. A dead target is journalled and holds nothing back. (Every event
on a real drill window: tests/test_share_window.py.)"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from console import messages as m
from console.config import NOTIFY_EVENTS, ConfigError, dump_config, parse_config
from console.notify import Notifier
from console.procedure import forecast as fc
from console.procedure.state import Owner
from console.procedure.store import RunStore
from console.session.bus import MessageBus
from tests.http_recorder import Recorder, closed_port

BASE = """
[hosts.ct129]
address = "10.0.0.129"
[service]
host = "ct129"
unit = "sglang.service"
[target]
model_path = "/models/target"
layers = [1, 2]
"""


def config_with(notify: str):
    return parse_config(BASE + "\n[notify]\n" + notify, "f.toml")


def test_notify_table_defaults_and_round_trip() -> None:
    config = config_with('urls = ["json://127.0.0.1:8080/hook", "ntfy://ntfy.sh/dflash"]')
    assert config.notify.events == NOTIFY_EVENTS and config.notify.overrun_margin_s == 60
    assert parse_config(dump_config(config), "f.toml") == config
    assert parse_config(BASE, "f.toml").notify.urls == ()  # no table: no one is told


@pytest.mark.parametrize(("table", "field", "said"), [
    ('urls = ["json://127.0.0.1/hook", "nosuch://x"]', "notify.urls[1]", '"nosuch://x"'),
    ('urls = "json://127.0.0.1/hook"', "notify.urls", "(a string)"),
    ('urls = []\nevents = ["run-ended", "stop"]', "notify.events[1]", '"stop"'),
    ("events = []", "notify.events", "[]"),
    ("overrun_margin_s = -5", "notify.overrun_margin_s", "-5"),
])
def test_a_bad_notify_field_is_named(table: str, field: str, said: str) -> None:
    with pytest.raises(ConfigError) as error:
        config_with(table)
    assert error.value.path == field and f"`{field}`" in str(error.value) and said in str(error.value)


def test_an_unknown_notify_key_is_named() -> None:
    with pytest.raises(ConfigError, match=r"unknown key `notify.url` in f.toml; did you mean `urls`\?"):
        config_with('url = ["json://127.0.0.1/hook"]')


def _run(tmp_path: Path, forecast_s: float) -> tuple[RunStore, str]:
    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    run.state.owner = Owner.this_process()  # this process drives it: its notifier speaks for it
    run.state.route = "window"
    phases = (m.ForecastPhase("stop", forecast_s / 2, "estimate"), m.ForecastPhase("start", forecast_s / 2, "estimate"))
    run.state.forecast = fc.to_state(m.Forecast(run.run_id, forecast_s, phases))  # as the engine writes it
    run.state.headline = {"reference": 3.4567, "candidate": 1.2}
    run.state.facts["headline_online"] = {"reference": 3.41}
    run.save()
    return store, run.run_id


def _stop_question() -> m.Confirmation:
    return m.Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang.service"),
                          "SGLang on ct129 goes down", True, estimate_s=0.2, estimate_basis="forecast")


async def test_every_event_reaches_a_live_target_and_a_dead_one_is_journalled(tmp_path: Path) -> None:
    recorder = Recorder()
    dead = f"json://127.0.0.1:{closed_port()}/hook"
    config = config_with(f'urls = ["{recorder.url}", "{dead}"]\noverrun_margin_s = 0')
    store, run_id = _run(tmp_path, forecast_s=0.2)
    bus = MessageBus()
    notifier = Notifier(config, store, bus)
    notifier.start()
    try:
        bus.publish(m.StepUpdate(run_id, "stop", "running", started_at=time.time()))
        bus.publish(m.DecisionMade(_stop_question(), True, "--yes"))
        down_since = time.time()
        bus.publish(m.Downtime(run_id, down_since))
        await asyncio.to_thread(recorder.wait_for, lambda posts: any("longer than" in p["json"]["title"] for p in posts))
        bus.publish(m.Downtime(run_id, None, down_since + 42.0))
        run = store.open(run_id)
        run.state.service.down = True  # the store says the run left it down: both notes come
        run.state.service.stopped_at = down_since
        run.state.status = "failed"
        run.save()
        bus.publish(m.RunFinished(run_id, "failed", 3, False, "extract: failed", str(store.root / run_id)))
        posts = await asyncio.to_thread(recorder.wait_for, lambda posts: len(posts) >= 5)
    finally:
        await notifier.close()
        recorder.close()
    by_title = {p["json"]["title"]: p["json"] for p in posts}
    assert len(posts) == 5 and all(p["path"] == "/hook" for p in posts)
    assert all(set(p["json"]) >= {"version", "title", "message", "type"} for p in posts)
    stop = by_title["dflash-ops: stopping sglang.service on ct129"]
    assert "window route" in stop["message"] and "ct129" in stop["message"] and "forecast downtime 0 s (stop 0 s, start 0 s)" in stop["message"]
    assert "systemctl stop sglang.service" in stop["message"] and stop["type"] == "warning"
    overrun = by_title["dflash-ops: sglang.service on ct129 down longer than forecast"]
    assert "past its forecast of 0 s by more than the 0 s margin" in overrun["message"]
    back = by_title["dflash-ops: sglang.service on ct129 is back"]
    assert "down 42 s (forecast 0 s)" in back["message"] and back["type"] == "success"
    ended = by_title[f"dflash-ops: run {run_id} failed"]
    assert "reference: tau 3.46 (online 3.41)" in ended["message"] and "candidate: tau 1.20" in ended["message"]
    left = by_title[f"dflash-ops: sglang.service on ct129 LEFT DOWN by run {run_id}"]
    assert left["message"].startswith(f"Run {run_id} failed and left sglang.service on ct129 down.\nSERVICE DOWN since")
    assert f"`dflash-ops run --resume {run_id}` restarts the service" in left["message"] and left["type"] == "failure"
    journal = store.open(run_id).read_journal()
    failed = [e["message"] for e in journal if e["message"].startswith("notification not sent")]
    assert len(failed) == 5 and all(f"127.0.0.1:{dead.split(':')[2]}" in line for line in failed)
    assert all(e["level"] == "warning" for e in journal if e["message"].startswith("notification not sent"))
    assert sum(e["message"].startswith(f"notified json://127.0.0.1:{recorder.port}/hook") for e in journal) == 5


async def test_a_target_that_never_answers_holds_nothing_back(tmp_path: Path) -> None:
    """Publishing returns while the target still holds the first request: the sends are off the
    loop. (Were they not, this test would wait on itself: the target answers only after.)"""
    recorder = Recorder()
    recorder.hold.clear()
    config = config_with(f'urls = ["{recorder.url}"]\nevents = ["run-ended"]')
    store, run_id = _run(tmp_path, forecast_s=10)
    bus = MessageBus()
    notifier = Notifier(config, store, bus)
    notifier.start()
    try:
        for _ in range(40):  # more than the target's queue holds: the rest are dropped, and said
            bus.publish(m.RunFinished(run_id, "done", 0, True, "the procedure finished", str(store.root / run_id)))
        await asyncio.to_thread(recorder.wait_for, lambda posts: len(posts) == 1)
        assert not notifier.wait_sent(0)  # still held by the target: the bus went on all the same
    finally:
        recorder.hold.set()
        await notifier.close(wait_s=30)
        recorder.close()
    journal = store.open(run_id).read_journal()
    dropped = [e for e in journal if "notifications were already waiting for this target" in e["message"]]
    assert dropped and len(dropped) + sum(e["message"].startswith("notified ") for e in journal) == 40


async def test_runs_this_process_does_not_drive_are_not_notified(tmp_path: Path) -> None:
    recorder = Recorder()
    config = config_with(f'urls = ["{recorder.url}"]')
    store, run_id = _run(tmp_path, forecast_s=10)
    run = store.open(run_id)
    run.state.owner = Owner("someone", "elsewhere", 1, time.time())  # another console's run, followed here
    run.save()
    bus = MessageBus()
    notifier = Notifier(config, store, bus)
    notifier.start()
    try:
        bus.publish(m.Downtime(run_id, time.time() - 5))
        bus.publish(m.Downtime(run_id, None, time.time()))
        bus.publish(m.RunFinished(run_id, "done", 0, True, "the procedure finished", str(store.root / run_id)))
        assert notifier.wait_sent(5)
    finally:
        await notifier.close()
        recorder.close()
    assert recorder.posts == []


@pytest.mark.parametrize("read_only", [False, True])
async def test_every_console_starts_its_notifier_and_ends_it(tmp_path: Path, read_only: bool) -> None:
    """The headless run, the console and the drill start the notifier with their operator; a
    read-only console (and each browser's console of `serve`) too, which drives no run: it tells only
    that another run's console is gone (`console-gone`, told once among them all)."""
    from console.operator import Operator

    config = parse_config(BASE.replace('"10.0.0.129"', f'"127.0.0.1"\nport = {closed_port()}')
                          + '\n[notify]\nurls = ["json://127.0.0.1:9/hook"]\n', "f.toml")
    operator = Operator(config, runs_dir=tmp_path / "runs", read_only=read_only)
    operator.start()
    try:
        notifier = operator.notifier
        assert notifier is not None
    finally:
        await operator.stop()
    assert operator.notifier is None
    if notifier is not None:  # its target's thread ends with it
        notifier.targets[0].thread.join(30)
        assert not notifier.targets[0].thread.is_alive()


async def test_the_pause_route_is_said_in_its_own_words(tmp_path: Path) -> None:
    """Its pause is the stop that was approved; a run that left the server paused (memory released)
    is named as the store names it."""
    recorder = Recorder()
    config = config_with(f'urls = ["{recorder.url}"]\nevents = ["stop-approved", "left-down"]')
    store, run_id = _run(tmp_path, forecast_s=3)
    run = store.open(run_id)
    run.state.route = "pause"
    run.state.service.paused, run.state.service.paused_at = True, time.time() - 30
    run.state.service.released = ["kv_cache"]
    run.state.status = "failed"
    run.save()
    bus = MessageBus()
    notifier = Notifier(config, store, bus)
    notifier.start()
    try:
        bus.publish(m.StepUpdate(run_id, "pause", "running", started_at=time.time()))
        bus.publish(m.DecisionMade(m.Confirmation("pause", "pause the server's generation", "ct129",
                                                  ("POST", "/pause_generation"), "requests wait", True), True, "tui"))
        bus.publish(m.RunFinished(run_id, "failed", 1, True, "extract: failed", str(store.root / run_id)))
        posts = await asyncio.to_thread(recorder.wait_for, lambda posts: len(posts) == 2)
    finally:
        await notifier.close()
        recorder.close()
    paused, left = (p["json"] for p in posts)
    assert paused["title"] == "dflash-ops: pausing sglang.service on ct129"
    assert f"Run {run_id} (pause route): the pause of sglang.service on ct129 was approved (tui)" in paused["message"]
    assert left["title"] == f"dflash-ops: sglang.service on ct129 LEFT PAUSED by run {run_id}"
    assert f"PAUSED: memory released by run {run_id} (kv_cache)" in left["message"]


async def test_the_pause_route_says_its_overrun_and_its_return(tmp_path: Path) -> None:
    """On the pause route the engine publishes the pause as the downtime (paused, from the pause to
    the continue): past its forecast, and taking requests again, are said in the pause's words. A
    question names its own run, whatever run the last step update was about."""
    recorder = Recorder()
    config = config_with(f'urls = ["{recorder.url}"]\noverrun_margin_s = 0')
    store, run_id = _run(tmp_path, forecast_s=0.2)
    other = store.create(None, None)
    other.state.owner = Owner.this_process()
    other.save()
    run = store.open(run_id)
    run.state.route = "pause"
    run.save()
    bus = MessageBus()
    notifier = Notifier(config, store, bus)
    notifier.start()
    try:
        bus.publish(m.StepUpdate(other.run_id, "preflight", "running", started_at=time.time()))  # another run's
        bus.publish(m.DecisionMade(m.Confirmation("pause", "pause the server's generation", "ct129",
                                                  ("POST", "/pause_generation"), "requests wait", False), True,
                                   "tui", run_id))
        paused_at = time.time()
        bus.publish(m.Downtime(run_id, paused_at, paused=True))
        await asyncio.to_thread(recorder.wait_for, lambda posts: any("longer than" in p["json"]["title"] for p in posts))
        bus.publish(m.Downtime(run_id, None, paused_at + 42.0))
        posts = await asyncio.to_thread(recorder.wait_for, lambda posts: len(posts) >= 3)
    finally:
        await notifier.close()
        recorder.close()
    approved, overrun, back = (p["json"] for p in posts)
    assert approved["title"] == "dflash-ops: pausing sglang.service on ct129"
    assert approved["message"].startswith(f"Run {run_id} (pause route): the pause")  # not the other run's
    assert overrun["title"] == "dflash-ops: sglang.service on ct129 paused longer than forecast"
    assert "has been paused" in overrun["message"] and f"(run {run_id})" in overrun["message"]
    assert back["title"] == "dflash-ops: sglang.service on ct129 is back"
    assert "takes requests again at" in back["message"] and "paused 42 s (forecast 0 s)" in back["message"]


def test_the_stop_notification_says_an_unknown_phase_never_a_dash(tmp_path: Path) -> None:
    """A forecast with a phase nothing told (issue 27): 'unknown (at least N s)' and 'start unknown'."""
    from console.notify.events import Watcher

    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    run.state.route = "window"
    phases = (m.ForecastPhase("stop", 12.0, "systemd"), m.ForecastPhase("start", None, "unknown: nothing tells it"))
    run.state.forecast = fc.to_state(m.Forecast(run.run_id, 12.0, phases))
    run.save()
    watcher = Watcher(config_with(f'urls = ["json://127.0.0.1:{closed_port()}/hook"]'), store.open, "sglang.service on ct129")
    question = m.Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang.service"),
                              "goes down", True, None, "forecast")
    said = watcher.on(m.DecisionMade(question, True, "--yes", run_id=run.run_id))
    assert "forecast downtime unknown (at least 12 s) (stop 12 s, start unknown)" in said[0].body


def test_a_degraded_run_is_told_with_both_figures_and_the_remedy(tmp_path: Path) -> None:
    """Issue 40 item 4: the run-ended notification of a run whose window left the served drafter degraded."""
    from console.notify.events import Watcher
    from console.procedure.steps.drafter import degraded_end

    store = RunStore(tmp_path / "runs")
    run = store.create(None, None)
    run.state.facts["drafter"] = {"before": 4.0, "after": 1.02, "degraded": True}
    run.save()
    watcher = Watcher(config_with(f'urls = ["json://127.0.0.1:{closed_port()}/hook"]'), store.open, "sglang.service on ct129")
    message = f"the procedure finished; {degraded_end(run.state.facts)}"
    (said,) = watcher.on(m.RunFinished(run.run_id, "degraded", 5, True, message, str(run.dir)))
    assert said.level == "warning" and "ended degraded (exit 5)" in said.body
    assert "acceptance length 4.00 before the window, 1.02 after" in said.body and "restart" in said.body


async def test_a_run_whose_console_is_gone_while_it_holds_the_server_paused_is_told_once(tmp_path: Path) -> None:
    """Issue 40, item 6: two watching consoles follow a pause-route run whose console was killed with
    the server paused (memory released). Exactly one of them tells it (`console-gone`): who held it,
    the store's words, how to give it back. A console that resumes the run and dies too is told again."""
    import dataclasses

    from console.config import example_config_text
    from console.procedure.follower import RunFollower
    from console.session import Session

    recorder = Recorder()
    config = config_with(f'urls = ["{recorder.url}"]')
    store, run_id = _run(tmp_path, forecast_s=3)
    run = store.open(run_id)
    run.state.route, run.state.status = "pause", "running"
    run.state.owner = dataclasses.replace(Owner.this_process(), pid=4_000_001, start_ticks=1)  # killed
    svc = run.state.service
    svc.paused, svc.paused_at, svc.pause_confirmed = True, time.time() - 30, True
    svc.released, svc.released_tags = ["kv_cache", "cuda_graph"], ["kv_cache", "cuda_graph"]
    run.save()
    watching = []
    for _ in range(2):  # two consoles open on the same store, each with its notifier and its follower
        bus = MessageBus()
        notifier = Notifier(config, store, bus)
        notifier.start()
        watching.append((notifier, RunFollower(store, bus, Session(parse_config(example_config_text()), bus))))
    try:
        for _, follower in watching * 2:  # each looks twice: told once in all
            follower.look()
        posts = await asyncio.to_thread(recorder.wait_for, lambda posts: len(posts) == 1)
        run = store.open(run_id)  # a second console resumes it, and is killed too
        run.state.owner = dataclasses.replace(run.state.owner, pid=4_000_002)
        run.save()
        for _, follower in watching:
            follower.look()
        posts = await asyncio.to_thread(recorder.wait_for, lambda posts: len(posts) == 2)
        for notifier, _ in watching:
            assert notifier.wait_sent(5)
    finally:
        for notifier, _ in watching:
            await notifier.close()
        recorder.close()
    assert len(recorder.posts) == 2
    told = posts[0]["json"]
    assert told["title"] == f"dflash-ops: sglang.service on ct129 LEFT PAUSED: the console of run {run_id} is gone"
    assert "pid 4000001" in told["message"] and f"PAUSED: memory released by run {run_id} (kv_cache, cuda_graph)" \
        in told["message"]
    assert f"run --resume {run_id}" in told["message"], told["message"]
    assert "pid 4000002" in posts[1]["json"]["message"]
