"""A poke while a service check is under way is a check more at once (issue 41, section 2: during the
fleet window's rejoin the service panel said "NOT RUNNING / starting" for a replica that was ready).

The restart pokes the service watch when the server is ready; the check then under way had read it
starting. The poll loop cleared its wake-up after that check, so the poke was lost and the stale view
stayed until the next interval (5 s): through the whole rejoin. It is cleared before the check now."""

from __future__ import annotations

import asyncio
import time

from console import messages as m
from console.config import example_config_text, parse_config
from console.session.bus import MessageBus
from console.session.session import Session


def test_a_poke_during_a_check_is_not_lost():
    async def scenario() -> list[str]:
        session = Session(parse_config(example_config_text()), MessageBus(), service_interval=30.0)
        seen: list[str] = []
        under_way, release = asyncio.Event(), asyncio.Event()

        async def check() -> m.ServiceView:
            seen.append("starting" if not seen else "ready")
            if len(seen) == 1:  # the check under way when the restart says ready
                under_way.set()
                await release.wait()
            return m.ServiceView(object(), None, time.time())  # a status: the next check waits the interval

        async def connected() -> None:
            return None

        session.check_service, session.wait_first_states = check, connected  # type: ignore[method-assign]
        poller = asyncio.create_task(session._poll_service())
        try:
            await asyncio.wait_for(under_way.wait(), 5)
            session.poke_service()  # the restart: ready, while the first check still runs
            release.set()
            deadline = time.monotonic() + 3  # far under the 30 s interval
            while len(seen) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        finally:
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        return seen

    assert asyncio.run(scenario()) == ["starting", "ready"]


def test_a_look_older_than_the_restarts_ready_is_never_shown_as_not_running():
    """The panel between the restart's ready and the next look: the server's readiness the run
    checked itself (its /health and a generation), never the stale NOT RUNNING / starting."""
    from screens.state import ConsoleState
    from screens.widgets.service_panel import service_renderable
    from tests.tui.standin import T0, service_view

    state = ConsoleState()
    state.apply(service_view(active=False, t=T0))  # the last look: before the start
    state.apply(m.StartupProgress("weights_loaded", "Load weight end."))
    state.apply(m.Downtime("run-1", None, T0 + 5))  # the restart: ready at T0 + 5
    assert state.startup is None
    shown = [t.plain for t in service_renderable(state.service, state.downtime, state.startup, T0 + 6).renderables]
    assert len(shown) == 1 and shown[0].startswith("ready at ") and "the service is read again" in shown[0]
    state.apply(service_view(active=True, t=T0 + 6))  # the next look: as it is
    shown = [t.plain for t in service_renderable(state.service, state.downtime, state.startup, T0 + 6).renderables]
    assert not any("ready at" in line or "NOT RUNNING" in line for line in shown) and "health 200, ready" in shown
    # A look after the ready that finds it down again is shown as it is.
    state.apply(service_view(active=False, t=T0 + 7))
    shown = [t.plain for t in service_renderable(state.service, state.downtime, state.startup, T0 + 7).renderables]
    assert "NOT RUNNING (inactive)" in shown
