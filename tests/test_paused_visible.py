"""Issue 40 item 6: a server a run holds paused (the pause route) is visible everywhere. The follower
publishes it from the store as the driving console does (PAUSED since the pause, the memory tags
released, by which run) for a read-only or newly opened console; the service panel and the banner
say paused, not DOWN or a stuck SGLang; `status` and every console's service watch leave /health
unprobed while the run holds the server paused (SGLang answers 503 for the whole pause)."""

from __future__ import annotations

from rich.console import Console
from textual.app import App, ComposeResult

from console import messages as m
from console.config import example_config_text, parse_config
from console.procedure.follower import RunFollower
from console.procedure.state import Owner
from console.procedure.store import RunStore
from console.service.control import ServiceMonitor
from console.session import Session
from console.session.bus import MessageBus
from console.views.status import service_lines
from screens.format import clock
from screens.state import ConsoleState
from screens.widgets.downtime_banner import downtime_text
from screens.widgets.service_panel import ServicePanel, service_renderable

PAUSED_AT = 1_800_000_000.0
TAGS = ["kv_cache", "weights"]
ACTIVE = m.ServiceStatus("systemd", "sglang-qwen", True, "active", "running", 4242, since=PAUSED_AT - 3600)
STUCK = ("/health answered 503: SGLang's own health check got no answer from its scheduler within 20 s "
         "(stuck or busy), or the server is still starting")


def plain(renderable) -> str:
    console = Console(width=200, record=True, color_system=None)
    console.print(renderable)
    return console.export_text()


def paused_run(store: RunStore):
    """A run of the pause route between its release and its resume, driven by this process."""
    run = store.create(None, None)
    run.state.route, run.state.owner = "pause", Owner.this_process()
    svc = run.state.service
    svc.paused, svc.paused_at, svc.pauses, svc.pause_confirmed = True, PAUSED_AT, 1, True
    svc.released, svc.released_tags, svc.released_at, svc.releases = list(TAGS), list(TAGS), PAUSED_AT + 2, 1
    run.save()
    return run


def test_the_follower_says_paused_from_the_store_and_the_session_leaves_health_unprobed(tmp_path) -> None:
    store = RunStore(tmp_path)
    run = paused_run(store)
    bus = MessageBus()
    seen: list = []
    bus.subscribe(seen.append)
    session = Session(parse_config(example_config_text()), bus)  # never started: no host is reached
    follower = RunFollower(store, bus, session)

    follower.look()
    downtime = [x for x in seen if isinstance(x, m.Downtime)]
    assert downtime == [m.Downtime(run.run_id, PAUSED_AT, None, paused=True)]  # not "up" from stopped_at alone
    live = [x for x in seen if isinstance(x, m.LiveRun)][-1]
    assert live.paused_since == PAUSED_AT and live.released == tuple(TAGS) and "pid" in live.owner
    assert session.paused_by == f"run {run.run_id}"

    # The continue: the server takes requests again; the hold ends and the service is checked at once.
    svc = run.state.service
    svc.released, svc.paused, svc.resumed_at, svc.continued_at = [], False, PAUSED_AT + 60, PAUSED_AT + 61
    run.state.status = "done"
    run.save()
    session._service_wake.clear()
    follower.look()
    assert [x for x in seen if isinstance(x, m.Downtime)][-1] == m.Downtime(run.run_id, None, PAUSED_AT + 61)
    assert session.paused_by is None and session._service_wake.is_set()


class ActiveManager:
    name = "sglang-qwen"

    async def status(self) -> m.ServiceStatus:
        return ACTIVE


class PausedServer:
    """SGLang during a pause: every /health answers 503 (after its own check's wait)."""

    def __init__(self) -> None:
        self.asked = 0

    async def health(self) -> int:
        self.asked += 1
        return 503


async def test_the_service_watch_does_not_probe_health_while_a_run_holds_the_server_paused() -> None:
    server = PausedServer()
    monitor = ServiceMonitor(ActiveManager(), server)
    view = await monitor.check(paused_by="run r1")
    assert server.asked == 0 and view.health is None and view.error is None and view.not_probed == "run r1"
    assert view.status == ACTIVE  # the manager is still asked: a stopped server is still seen


def test_status_names_the_run_that_holds_the_server_paused_instead_of_probing(tmp_path) -> None:
    from console.cli.status import hold_from_store

    store = RunStore(tmp_path)
    run = paused_run(store)
    session = Session(parse_config(example_config_text()))
    hold_from_store(session, store)
    assert session.paused_by == f"run {run.run_id}"
    text = plain_lines(service_lines("sglang-qwen", "ct129", m.ServiceView(ACTIVE, None, PAUSED_AT,
                                                                         not_probed=session.paused_by), PAUSED_AT))
    assert f"health: paused by run {run.run_id}: /health not probed" in text


def plain_lines(lines) -> str:
    return "\n".join(plain(line) for line in lines)


def test_the_service_panel_says_paused_by_which_run_and_what_is_released_never_down_or_stuck() -> None:
    downtime = m.Downtime("r1", PAUSED_AT, paused=True)
    live = m.LiveRun("r1", "running", "op@ws1 pid 7 since 09:00:00", False, False, False,
                     paused_since=PAUSED_AT, released=tuple(TAGS))
    not_probed = m.ServiceView(ACTIVE, None, PAUSED_AT + 5, not_probed="run r1")
    text = plain(service_renderable(not_probed, downtime, None, PAUSED_AT + 90, "run r1"))
    assert "DOWN" not in text and "stopped by" not in text
    text = plain(service_renderable(not_probed, downtime, None, PAUSED_AT + 90, "run r1", live))
    assert "PAUSED 1 min 30 s" in text and f"paused by run r1 since {clock(PAUSED_AT)}" in text
    assert "released: kv_cache, weights" in text and "/health not probed while paused (503 until the continue)" in text
    assert text.count("paused by run r1") == 1  # who paused it, said once
    assert "DOWN" not in text and "stopped by" not in text
    # A probe made before this console knew of the pause: said as the pause's, not a stuck SGLang.
    probed = m.ServiceView(ACTIVE, m.ServiceHealth(503, False, error=STUCK), PAUSED_AT + 5, error=STUCK)
    text = plain(service_renderable(probed, downtime, None, PAUSED_AT + 90, "run r1", live))
    assert "stuck or busy" not in text and "health: 503 while paused" in text


def test_the_banner_says_paused_since_when_by_whom_and_what_is_released() -> None:
    state = ConsoleState()
    state.apply(m.Downtime("r1", PAUSED_AT, paused=True))
    state.apply(m.LiveRun("r1", "running", "op@ws1 pid 7 since 09:00:00", False, False, False,
                          paused_since=PAUSED_AT, released=tuple(TAGS)))
    text = downtime_text(state, PAUSED_AT + 30, can_restart=False).plain
    assert text.startswith(f"SERVER PAUSED 30 s since {clock(PAUSED_AT)} · run r1 by op@ws1 pid 7")
    assert "released: kv_cache, weights" in text


class PanelApp(App):
    def compose(self) -> ComposeResult:
        yield ServicePanel("sglang-qwen", "ct129")


async def test_the_panel_of_a_paused_server_is_marked_paused_not_down() -> None:
    app = PanelApp()
    async with app.run_test(size=(80, 20)) as pilot:
        panel = app.query_one(ServicePanel)
        panel.show(m.ServiceView(ACTIVE, None, PAUSED_AT, not_probed="run r1"), m.Downtime("r1", PAUSED_AT, paused=True),
                   None, PAUSED_AT + 5, "run r1")
        await pilot.pause()
        assert panel.has_class("paused") and not panel.has_class("down")
        panel.show(m.ServiceView(ACTIVE, None, PAUSED_AT), m.Downtime("r1", PAUSED_AT), None, PAUSED_AT + 5, "run r1")
        await pilot.pause()
        assert panel.has_class("down") and not panel.has_class("paused")


def test_the_health_read_before_the_pause_is_withdrawn_at_once() -> None:
    """The tmux walk: for 20 s after the pause the panel still said "health 200, ready" (a probe under
    way waits out SGLang's own check). Once the session learns the run holds the server paused, a view
    with no health and "/health not probed" is published at once."""
    bus = MessageBus()
    seen: list = []
    bus.subscribe(seen.append)
    session = Session(parse_config(example_config_text()), bus)  # never started: no host is reached
    session.service.last = m.ServiceView(ACTIVE, m.ServiceHealth(200, True), PAUSED_AT - 1)
    session.held_paused("run r1")
    (view,) = [x for x in seen if isinstance(x, m.ServiceView)]
    assert view.health is None and view.not_probed == "run r1" and view.status == ACTIVE
    session.held_paused("run r1")  # the same: nothing more
    session.held_paused(None)  # given back: the next look probes again (nothing published before it)
    assert len([x for x in seen if isinstance(x, m.ServiceView)]) == 1


async def test_a_followed_job_is_relayed_to_its_exit_after_its_step_ended(tmp_path, monkeypatch) -> None:
    """The tmux walk (issue 43 item 8): a read-only console still showed the staged extractor
    "waiting for the go" after the run was done: the follower stopped relaying the job as soon as its
    step ended, before its last events (the extraction, its exit) were read. Relayed to its exit now."""
    import asyncio
    import dataclasses
    import json

    from console.procedure import follower as follower_module
    from console.procedure.state import JobRecord
    from console.ssh.jobs import JobHandle

    store = RunStore(tmp_path)
    run = store.create(None, None)
    run.state.status, run.state.owner = "running", Owner.this_process()
    run.state.step("extract").status = "running"
    handle = JobHandle("ct129", "j-extract", "extract", "/w/runs/j", 4242, None, PAUSED_AT)
    run.state.jobs["extract"] = JobRecord("j-extract", "ct129", "extract",
                                          handle=json.loads(json.dumps(dataclasses.asdict(handle))))
    run.save()
    release = asyncio.Event()

    async def events(supervisor, followed, offset, stall_timeout):  # the job's events file, read as it grows
        yield 10, {"type": "log", "seq": 1, "t": PAUSED_AT, "message": "staged: waiting for the go signal"}
        await release.wait()
        yield 20, {"type": "exit", "seq": 2, "t": PAUSED_AT + 5, "code": 0}

    monkeypatch.setattr(follower_module, "follow_with_reconnect", events)
    bus, seen = MessageBus(), []
    bus.subscribe(seen.append)
    session = Session(parse_config(example_config_text()), bus)
    session.supervisors = {"ct129": object()}
    follower = RunFollower(store, bus, session)
    follower.look()
    for _ in range(100):
        await asyncio.sleep(0)
    run.state.step("extract").status = "done"  # the step ended; the job's exit is not read yet
    run.save()
    follower.look()
    release.set()
    for _ in range(100):
        await asyncio.sleep(0)
    follower._stop_job()
    assert [x.code for x in seen if isinstance(x, m.JobExit)] == [0]
