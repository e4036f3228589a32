"""The user guide's screenshots (SVG, `App.save_screenshot`), taken by driving the console by keys,
at 120 x 40 and at 80 x 24 (`-80x24` in the name):

    .venv/bin/python -m tests.tui.screenshots docs/

- tui-dashboard.svg: the dashboard mid-window over two real-sized hosts (2 and 8 GPUs; the
  stand-in operator's fixed telemetry, as in the snapshot tests);
- tui-holders.svg, tui-results.svg, tui-per-prompt.svg, tui-window.svg: the drill (real SSH, the
  real engine and workers): the holders modal after the stop, the results of that run, its per-prompt
  table and its window timeline;
- tui-replay.svg: `dflash-ops replay` of the recorded drill run (tests/data/replay), paused just after
  the stop's question was answered: the DOWN banner, the steps, the question and its command.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from console.config import load_config
from console.drill.hosts import down, up
from console.operator import Operator
from screens.app import ConsoleApp, ProcedureEnded
from screens.modals.confirm import ConfirmModal
from screens.modals.holders import HoldersModal
from screens.results import ResultsScreen
from tests.tui.standin import StandinOperator, fixed_clock, mid_window

SIZES = ((120, 40), (80, 24))
SHOTS = ("tui-dashboard.svg", "tui-holders.svg", "tui-results.svg", "tui-per-prompt.svg", "tui-window.svg",
         "tui-replay.svg")
RECORDED = Path(__file__).parents[1] / "data" / "replay" / "20261202-041120-520a"


def named(name: str, size: tuple[int, int]) -> str:
    """'tui-holders.svg' at 120 x 40, 'tui-holders-80x24.svg' at 80 x 24."""
    return name if size == SIZES[0] else name.replace(".svg", f"-{size[0]}x{size[1]}.svg")


async def dashboard(out: Path, size: tuple[int, int]) -> None:
    operator = StandinOperator()
    operator.seed(history=600)
    app = ConsoleApp(operator, clock=fixed_clock)
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        mid_window(operator)
        await pilot.pause(1.5)  # the tick that shows the extraction's rate in the banner
        app.save_screenshot(named("tui-dashboard.svg", size), str(out))


async def drill(out: Path, size: tuple[int, int]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(up(Path(tmp) / "drill", fresh=True))
        try:
            app = ConsoleApp(Operator(load_config(config), runs_dir=Path(tmp) / "runs"))
            ended: list = []
            async with app.run_test(size=size, message_hook=lambda m: ended.append(m)
                                    if isinstance(m, ProcedureEnded) else None) as pilot:
                await pilot.pause(3)
                await pilot.press("g")
                while not ended:
                    await pilot.pause(0.1)
                    screen = app.screen
                    if isinstance(screen, HoldersModal):
                        await pilot.pause(0.5)
                        app.save_screenshot(named("tui-holders.svg", size), str(out))
                    if isinstance(screen, ConfirmModal | HoldersModal):
                        await screen.answerable.wait()  # (a key sooner is ignored: the question's guard)
                        await pilot.press("y")
                        while app.screen is screen:
                            await pilot.pause(0.05)
                await pilot.pause(1)
                await pilot.press("o")
                while not isinstance(app.screen, ResultsScreen):
                    await pilot.pause(0.05)
                await pilot.pause(0.5)
                app.save_screenshot(named("tui-results.svg", size), str(out))
                await pilot.press("2")
                await pilot.pause(0.5)
                app.save_screenshot(named("tui-per-prompt.svg", size), str(out))
                await pilot.press("6")
                await pilot.pause(0.5)
                app.save_screenshot(named("tui-window.svg", size), str(out))
                await pilot.press("escape", "q")
        finally:
            down(Path(tmp) / "drill")


async def replay(out: Path, size: tuple[int, int]) -> None:
    from console.procedure.replay import read_recording
    from screens.replay import ReplayApp

    app = ReplayApp(read_recording(RECORDED), playing=False, clock=lambda: 0.0, frame_s=3600)
    async with app.run_test(size=size) as pilot:
        await pilot.press(*"]]]]")  # to the stop
        while app.question is None or app.state.down_since is None:
            await pilot.press("full_stop")
        await pilot.pause()
        app.save_screenshot(named("tui-replay.svg", size), str(out))


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else "docs")
    for size in SIZES:
        asyncio.run(dashboard(out, size))
        asyncio.run(drill(out, size))
        asyncio.run(replay(out, size))
    print(f"wrote {', '.join(str(out / named(n, size)) for size in SIZES for n in SHOTS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
