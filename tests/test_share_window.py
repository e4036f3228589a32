"""Sharing the window, on one real drill window: the browser view (`dflash-ops serve`, opened in
Debian's chromium through playwright) and the notifications (apprise's `json://` target posting to
a loopback server that records what arrives, beside a dead target on a closed port).

The run is driven in-process, a step at a time as the console's `n` does, until it pauses after the
stop with the service down (the left-down notification): the browser and the overrun are seen
during that downtime whatever the machine's load; then the run is resumed to its end."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from console import messages as m
from console.config import load_config
from console.operator import Operator
from console.procedure.store import RunStore
from console.views.units import duration
from tests.http_recorder import Recorder, closed_port
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env, drill  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(600)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("CI runs the browser test: install Debian's chromium (.ci/run does)")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install chromium)")

# xterm.js draws on a canvas: the page's terminal object, caught as textual.js makes it, says what
# it shows, line by line (the same buffer the canvas is drawn from).
CATCH_TERMINAL = """Object.defineProperty(Object.prototype, 'terminal', {configurable: true, set(value) {
    Object.defineProperty(this, 'terminal', {value, writable: true, configurable: true, enumerable: true});
    window.__terminal = value; }});"""
SCREEN_TEXT = """() => { const t = window.__terminal; if (!t) return '';
    const lines = []; for (let y = 0; y < t.rows; y++) { const line = t.buffer.active.getLine(y);
    lines.push(line ? line.translateToString(true) : ''); } return lines.join('\\n'); }"""


class Approving:
    """Approves every question (as --yes), keeping them."""

    name = "test"

    def __init__(self) -> None:
        self.asked: list[m.Confirmation] = []

    async def decide(self, confirmation: m.Confirmation) -> bool:
        self.asked.append(confirmation)
        return True


def free_port() -> int:
    return closed_port()  # bound and closed: free, for the server about to take it


def start_serve(config: Path, runs: Path, port: int, *extra: str) -> tuple[subprocess.Popen, str]:
    """`dflash-ops serve` and the address it prints first."""
    proc = subprocess.Popen([ENTRY_POINT, "serve", "--config", str(config), "--runs", str(runs), "--port", str(port),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    found = re.search(r"at http://\S+:(\d+)/(\?token=\S+)?", line)
    assert found and int(found.group(1)) == port, line + proc.stdout.read()
    deadline = time.monotonic() + 60
    while True:  # it prints before it listens
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}/{found.group(2) or ''}"


async def screen_until(page, *words: str, pattern: str = "", timeout: float = 120) -> str:
    """The page's terminal text once every word (and `pattern`, a regex) is on it."""
    text = ""
    async with asyncio.timeout(timeout):
        while not (all(word in text for word in words) and re.search(pattern, text)):
            await asyncio.sleep(0.2)
            text = await page.evaluate(SCREEN_TEXT)
    return text


async def opened(browser, url: str):
    page = await browser.new_page(viewport={"width": 1400, "height": 900})
    await page.add_init_script(CATCH_TERMINAL)
    answer = await page.goto(url, wait_until="domcontentloaded")
    return page, answer


async def step_to_the_stop(operator: Operator, decider: Approving, runs: Path) -> m.RunFinished:
    """The run a step at a time (stage and cache, then the stop), as the console's `n` does: paused
    after the stop with the service down."""
    paused = await operator.run(decider, one_step=True)
    while not RunStore(runs).open(paused.run_id).state.service.down:
        assert paused.status == "paused" and paused.service_up, paused
        paused = await operator.run(decider, resume=paused.run_id, one_step=True)
    assert paused.status == "paused" and not paused.service_up and paused.exit_code == 3, paused
    return paused


@needs_chromium
async def test_the_window_in_a_browser_and_its_notifications(drill: Drill, tmp_path: Path) -> None:  # noqa: F811
    from playwright.async_api import async_playwright

    recorder = Recorder()
    dead = closed_port()
    config_path = tmp_path / "shared.toml"
    config_path.write_text(drill.config_path.read_text() + f'\n[notify]\nurls = ["{recorder.url}", '
                           f'"json://127.0.0.1:{dead}/hook"]\noverrun_margin_s = 0\n')
    served, url = start_serve(config_path, drill.runs, free_port())
    guarded, guarded_url = start_serve(config_path, drill.runs, free_port(), "--bind", "0.0.0.0")
    operator = Operator(load_config(config_path), runs_dir=drill.runs)
    decider = Approving()
    operator.start()
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM)
            page, answer = await opened(browser, url)
            assert answer.status == 200 and "?token=" not in url  # loopback: no token
            # Any other bind: the page, its files and its websocket are refused without the token.
            token_page, refused = await opened(browser, re.sub(r"\?token=.*", "", guarded_url))
            assert refused.status == 403 and "needs its token" in await token_page.content()
            assert "?token=" in guarded_url
            stepping = asyncio.create_task(step_to_the_stop(operator, decider, drill.runs))
            assert (await token_page.goto(guarded_url)).status == 200
            await screen_until(token_page, "ct129", "read-only")  # its websocket opened with the token's cookie
            await token_page.close()  # (its console ends: one less process beside the window)
            paused = await stepping
            run_id = paused.run_id
            # The dashboard in the browser during the downtime: hosts, the DOWN banner, the steps.
            await screen_until(page, "SERVICE DOWN", "ct129", "ct200", "SIMULATED", "preflight", "free-vram",
                               "extract", "restart", "read-only", pattern=r"stop\s+done")
            await page.screenshot(path=str(tmp_path / "browser-view.png"))
            # No key in the browser acts on a host: r says why not, s and the console's acting keys do nothing.
            await page.click("#terminal")
            for key in ("r", "s", "g", "n", "c"):
                await page.keyboard.press(key)
            await screen_until(page, "read-only: this console restarts nothing", timeout=30)
            await browser.close()
        state = RunStore(drill.runs).open(run_id).state
        assert state.service.down and state.status == "paused"  # nothing restarted it or resumed the run
        assert len(RunStore(drill.runs).run_ids()) == 1  # and no run was started from the page
        # The downtime ran past its forecast (+ 0 s margin): said while it lasts.
        await asyncio.to_thread(recorder.wait_for, lambda posts: any("longer than" in p["json"]["title"] for p in posts))
        finished = await operator.run(decider, resume=run_id)
        assert finished.status == "done" and finished.exit_code == 0, finished.message
    finally:
        await operator.stop()  # sends what still waits
        for proc in (served, guarded):
            proc.terminate()
            proc.wait(30)
        recorder.close()
    posts = [p["json"] for p in recorder.posts]
    service = "the server on ct129"
    assert [p["title"] for p in posts] == [
        f"dflash-ops: stopping {service}", f"dflash-ops: {service} LEFT DOWN by run {run_id}",
        f"dflash-ops: {service} down longer than forecast", f"dflash-ops: {service} is back",
        f"dflash-ops: run {run_id} done"], posts
    assert all(set(p) >= {"version", "title", "message", "type"} for p in posts)
    state = RunStore(drill.runs).open(run_id).state
    stop, left, overrun, back, ended = posts
    assert f"Run {run_id} (window route)" in stop["message"] and "on ct129 was approved" in stop["message"]
    assert re.search(r"forecast downtime \d+ s \(stop \d+ s, free-vram \d+ s, extract \d+ s, start \d+ s\)",
                     stop["message"]) and "remote.drill.service stop" in stop["message"], stop
    assert left["message"].startswith(f"Run {run_id} paused and left {service} down.\nSERVICE DOWN since ")
    assert f"stopped by run {run_id}" in left["message"] and left["type"] == "failure"  # the store's words
    assert f"`dflash-ops run --resume {run_id}` continues it and restarts the service" in left["message"]
    assert "past its forecast of" in overrun["message"] and "0 s margin" in overrun["message"]
    measured = state.service.ready_at - state.service.stopped_at
    assert f"down {duration(measured)} (forecast {duration(state.forecast['downtime_s'])})" in back["message"], back
    online = state.facts["headline_online"]
    assert online and ended["type"] == "success"
    for name, tau in state.headline.items():
        said = f"{name}: tau {tau:.2f}" + (f" (online {online[name]:.2f})" if name in online else "")
        assert said in ended["message"], ended
    # The dead target: every notification journalled as not sent, and the window still ended done.
    journal = RunStore(drill.runs).open(run_id).read_journal()
    failed = [e for e in journal if e["message"].startswith(f"notification not sent to json://127.0.0.1:{dead}/hook")]
    assert len(failed) == 5 and all(e["level"] == "warning" for e in failed), [e["message"] for e in journal]
    assert (tmp_path / "browser-view.png").stat().st_size > 10_000
