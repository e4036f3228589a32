"""Issue 27, item 11 (the plan part): a resume's plan shows only what it will do.

The real engine over the engine fakes (`tests/engine_fakes.py`): a console dies once the service is
ready again (extraction done, evaluation not); the next console resumes with the headless view on
the same bus. Its plan must not say the stop (or the restart) acts, nor list their commands among
those that will run: the resume only evaluates."""

from __future__ import annotations

import io

from rich.console import Console

from console.procedure.engine import Engine
from console.views.headless import HeadlessView
from console.views.plan import service_commands
from tests.engine_fakes import ScriptedDecider
from tests.engine_sweep import (  # its fixtures (producers, window) come through tests/conftest.py
    Crasher,
    Window,
)
from tests.fake_hosts import FakeHosts


def plan_lines(text: str) -> list[str]:
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "plan (" in line)
    return lines[start:]


async def test_a_resume_that_only_evaluates_plans_no_stop(window: Window) -> None:
    assert await window.console(Crasher("ready")) is None
    world = window.world
    world.clock.advance(1.0)
    hosts = FakeHosts(world)  # the resuming console, its headless view on its bus
    screen = io.StringIO()
    HeadlessView(hosts.bus, Console(file=screen, width=300, no_color=True), show_progress=False)
    engine = Engine(hosts, world.config, window.store.open(window.run_id), ScriptedDecider(world.clock), window.store)
    finished = await engine.execute()
    assert finished.exit_code == 0, finished
    assert [what for _, what in world.service.commands].count("stop") == 1  # never stopped again
    lines = plan_lines(screen.getvalue())
    rows = {line.split("│")[1].strip(): line for line in lines if line.count("│") >= 4}
    for step in ("stop", "free-vram", "extract"):  # (the restart was under way: the resume checks it)
        cells = [c.strip() for c in rows[step].split("│")]
        assert cells[2] == "no" and "done earlier in this run" in rows[step], rows[step]
    assert [c.strip() for c in rows["evaluate"].split("│")][2] == "yes"
    commands = service_commands(window.world.config)
    listed = "\n".join(lines[next(i for i, line in enumerate(lines) if "commands, exactly" in line):]) \
        if any("commands, exactly" in line for line in lines) else ""
    assert commands["stop"] not in listed
