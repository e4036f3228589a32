"""Sharing the window, on one real drill window: the browser view (`dflash-ops serve`, opened in
Debian's chromium through playwright) and the notifications (apprise's `json://` target posting to
a loopback server that records what arrives, beside a dead target on a closed port).

The run is driven in-process, a step at a time as the console's `n` does, until it pauses after the
stop with the service down (the left-down notification): the browser and the overrun are seen
during that downtime whatever the machine's load; then the run is resumed to its end.

In the browser: who may open the console (its token, on loopback too; a name of another site that
resolves here, as DNS rebinding makes one; a page of another origin), and that nothing a page sends
acts or writes: every key of every screen the read-only console shows and every command of its
palette, during the downtime and on the finished run's results, leave the hosts, the service and
the run store as they were."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from textual.screen import Screen

from console import messages as m
from console.config import load_config
from console.operator import Operator
from console.procedure.store import JOURNAL, RunStore, read_jsonl
from console.views.units import duration
from screens.app import ConsoleApp
from screens.modals.quit import QuitWhileDownModal
from screens.results import ResultsScreen
from screens.runs import RunsScreen
from tests.http_recorder import Recorder, closed_port
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env, drill  # noqa: F401 - the fixture

pytestmark = pytest.mark.timeout(600)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("CI"):
    raise RuntimeError("CI runs the browser test: install Debian's chromium (.ci/run does)")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="no chromium here (apt-get install chromium)")

# xterm.js draws on a canvas: the page's terminal object, caught as textual.js makes it, says what
# it shows, line by line (the same buffer the canvas is drawn from). A wait for words on it is woken
# by the terminal's own event (each write it parsed), never by a timer.
CATCH_TERMINAL = """window.__screenText = () => { const t = window.__terminal; if (!t) return '';
    const lines = []; for (let y = 0; y < t.rows; y++) { const line = t.buffer.active.getLine(y);
    lines.push(line ? line.translateToString(true) : ''); } return lines.join('\\n'); };
Object.defineProperty(Object.prototype, 'terminal', {configurable: true, set(value) {
    Object.defineProperty(this, 'terminal', {value, writable: true, configurable: true, enumerable: true});
    window.__terminal = value; window.dispatchEvent(new Event('dflash-terminal')); }});"""
SCREEN_TEXT = "() => window.__screenText ? window.__screenText() : ''"
SCREEN_UNTIL = """([words, pattern, gone]) => new Promise(resolve => {
    const regex = new RegExp(pattern, 'm');
    const shown = () => { const text = window.__screenText();
        return words.every(w => text.includes(w)) && regex.test(text) && !(gone && text.includes(gone)) ? text : null; };
    const follow = () => { const now = shown(); if (now !== null) { resolve(now); return; }
        const listener = window.__terminal.onWriteParsed(() => { const text = shown();
            if (text !== null) { listener.dispose(); resolve(text); } }); };
    if (window.__terminal) follow(); else window.addEventListener('dflash-terminal', follow, {once: true}); })"""


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


def start_serve(config: Path, runs: Path, port: int, token_file: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """`dflash-ops serve` (its token kept in `token_file`) and the address it prints first."""
    proc = subprocess.Popen([ENTRY_POINT, "serve", "--config", str(config), "--runs", str(runs), "--port", str(port),
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**cli_env(), "DFLASH_OPS_SERVE_TOKEN_FILE": str(token_file)}, stdin=subprocess.DEVNULL)
    line = proc.stdout.readline()
    found = re.search(r"at http://\S+:(\d+)/(\?token=\S+)", line)
    assert found and int(found.group(1)) == port, line + proc.stdout.read()
    deadline = time.monotonic() + 60
    while True:  # it prints before it listens
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                break
        assert time.monotonic() < deadline and proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{port}/{found.group(2)}"


async def screen_until(page, *words: str, pattern: str = "", gone: str = "", timeout: float = 120) -> str:
    """The page's terminal text once every word (and `pattern`, a JavaScript regex, multi-line) is on
    it, and `gone` not."""
    try:
        return await asyncio.wait_for(page.evaluate(SCREEN_UNTIL, [list(words), pattern, gone]), timeout)
    except TimeoutError:
        text = await page.evaluate(SCREEN_TEXT)
        raise AssertionError(f"not on the page in {timeout} s: {words} {pattern!r} (gone: {gone!r})\n{text}") from None


# --- nothing a page sends acts or writes ---------------------------------------------------------

# A name of another site, resolved to this machine (DNS rebinding does so; chromium's own rule here).
REBIND = "--host-resolver-rules=MAP rebind.test 127.0.0.1"
# A websocket opened by a page's script: whether it opened.
SOCKET_FROM_PAGE = """(url) => new Promise(resolve => { const socket = new WebSocket(url);
    socket.onopen = () => { socket.close(); resolve('open'); }; socket.onerror = () => resolve('refused'); })"""
PLAYWRIGHT_KEYS = {"slash": "/", "question_mark": "?", "space": "Space", "escape": "Escape", "enter": "Enter",
                   "tab": "Tab", "shift+tab": "Shift+Tab", "ctrl+q": "Control+q", "ctrl+c": "Control+c"}
RUNS_HINT = "space marks a run (two at most)"
QUIT_ASKS = "Quitting leaves it down"
RESULTS_TABS = "1 Summary"
HELP_SAYS = "Read-only: this console"
# What the read-only console's palette offers (Maximize: when the focused panel can be), and what each
# shows while the service is down, until escape (Open results: a notice, no run has results yet;
# Maximize: the panel, whole). Quit, the last, asks and l leaves it down: the page's console ends.
READ_ONLY_PALETTE = {"Compare runs": RUNS_HINT, "Help": HELP_SAYS, "Maximize": "", "Open results": "",
                     "Theme": "Search for themes", "Quit": QUIT_ASKS}


def keys_of(*bindings: Any) -> list[str]:
    """The keys of Textual bindings, each of a binding's keys apart ("escape,n,q")."""
    return [key for binding in bindings for key in binding.key.split(",")]


async def press(page, key: str, *shows: str, gone: str = "") -> str:
    """`key` (Textual's name) sent through the page, then what it shows (or closes) waited for."""
    await page.keyboard.press(PLAYWRIGHT_KEYS.get(key, key))
    return await screen_until(page, *shows, gone=gone, timeout=30) if shows or gone else ""


def store_files(runs: Path) -> dict[str, Any]:
    """The run store as no view may change it: each file as (inode, size, modification time), so a
    file rewritten whole counts as changed; the journals by their lines, less the notifier's (the
    console that drives the run journals each notification as it goes out, the overrun's too)."""
    files: dict[str, Any] = {}
    for path in sorted(runs.rglob("*")):
        if path.name == JOURNAL:
            files[str(path.relative_to(runs))] = [e for e in read_jsonl(path) if not
                                                  e["message"].startswith(("notified ", "notification not sent"))]
        elif path.is_file():
            info = path.stat()
            files[str(path.relative_to(runs))] = (info.st_ino, info.st_size, info.st_mtime_ns)
    return files


def hosts_now(rehearsal: Drill) -> dict[str, Any]:
    """The service's process, and on each host what its workdir holds (the jobs' run directories,
    the host lock) by name."""
    now: dict[str, Any] = {"service pid": rehearsal.service_pid()}
    for name, host in rehearsal.config.hosts.items():
        workdir = Path(host.workdir)
        now[name] = sorted(str(p.relative_to(workdir)) for p in workdir.rglob("*") if "__pycache__" not in p.parts)
    return now


async def session_ended(page, timeout: float = 30) -> None:
    """Until the page says its console ended (textual-serve's "Session ended.")."""
    try:
        await page.locator(".closed-dialog").wait_for(state="visible", timeout=timeout * 1000)
    except Exception as exc:  # noqa: BLE001 - said with what the page shows instead
        raise AssertionError(f"the page's console did not end: {exc}\n{await page.evaluate(SCREEN_TEXT)}") from None


async def every_key_while_down(page) -> None:
    """The dashboard's keys, the quit question's and every palette command while a run holds the
    service down (r, g, n, c would restart it or resume the run): the last, Quit's l, leaves it down
    and ends this page's console."""
    assert set(keys_of(*QuitWhileDownModal.BINDINGS)) == {"r", "w", "l", "escape", "n", "q"}
    for key in ("g", "n", "p", "c", "tab", "shift+tab", "r"):  # what they did not do is checked after
        await press(page, key)
    await press(page, "o", "read-only: this console restarts nothing", "no run with results yet")
    await press(page, "q", QUIT_ASKS)
    await press(page, "n", gone=QUIT_ASKS)
    await press(page, "ctrl+q", QUIT_ASKS)
    await press(page, "ctrl+c")  # (the same question, already asked)
    # gone from the page, and the dashboard's own footer back (a modal's names no Help): the question's
    # screen is off the stack, so ctrl+p reaches the dashboard (on a loaded CI machine it once arrived
    # while the question's text was gone but its screen not yet, and the palette never opened)
    await press(page, "escape", "? Help", gone=QUIT_ASKS)
    await every_palette_command(page)  # its last, Quit, asks again: l leaves it down, the console ends


async def every_key_when_done(page) -> None:
    """Every key of the read-only dashboard, the finished run's results (e exports nothing), the runs
    list, the events and help, while the service serves (g and n would start a window, p would plan):
    the last, q, ends this page's console."""
    assert set(keys_of(*ConsoleApp.BINDINGS, *Screen.BINDINGS)) == {  # every key of the dashboard is here
        "g", "n", "p", "c", "r", "o", "h", "slash", "question_mark", "q", "ctrl+q", "ctrl+c", "tab", "shift+tab",
        "super+c"}
    assert set(keys_of(*RunsScreen.BINDINGS)) == {"escape", "space", "enter", "o", "c"}
    assert set(keys_of(*ResultsScreen.BINDINGS)) == {"escape", "e", "d", *"1234567"}
    for key in ("g", "n", "p", "c", "r", "tab", "shift+tab"):
        await press(page, key)
    await press(page, "slash", "filter: a word")
    await press(page, "enter", gone="filter: a word")
    await press(page, "question_mark", HELP_SAYS)
    await press(page, "q", gone=HELP_SAYS)
    text = await press(page, "o", RESULTS_TABS)
    assert "Export" not in text  # the footer offers no export
    for key in ("2", "3", "4", "5", "6", "7", "1", "d"):
        await press(page, key)
    await press(page, "e", "read-only: this console writes nothing")
    await press(page, "escape", gone=RESULTS_TABS)
    await press(page, "h", RUNS_HINT)
    await press(page, "space")
    await press(page, "c", "mark two runs with space first")
    await press(page, "enter", RESULTS_TABS)
    await press(page, "escape", gone=RESULTS_TABS)
    await press(page, "escape", gone=RUNS_HINT)
    await press(page, "q")  # the service serves, no run goes: the page's console ends at once
    await session_ended(page)


async def press_until_taken(page, key: str, *shows: str, gone: str = "", taken: Callable[[str], bool]) -> str:
    """`key` through the page until `shows` is on it and `gone` not. Textual drops a key sent to a
    palette being pushed or popped (its text on the page before or after its screen takes keys), as a
    loaded CI machine met: a key whose sign (`taken`, of the page's text) is not seen in 10 s is sent
    again; one that was taken is never repeated."""
    for _ in range(3):
        await page.keyboard.press(key)
        try:
            return await screen_until(page, *shows, gone=gone, timeout=10)
        except AssertionError:
            if taken(await page.evaluate(SCREEN_TEXT)):
                return await screen_until(page, *shows, gone=gone, timeout=30)
    return await screen_until(page, *shows, gone=gone, timeout=1)


async def open_palette(page, *shows: str) -> str:
    """ctrl+p until the palette shows. Textual opens no palette while one is still on the screen stack
    (`action_command_palette`: `CommandPalette.is_open`), and a closing palette's text leaves the page
    before its screen leaves the stack: a ctrl+p in between is dropped (after Open results, Maximize)."""
    return await press_until_taken(page, "Control+p", "Search for commands", *shows,
                                   taken=lambda text: "Search for commands" in text)


async def close_with_escape(page, *shows: str, gone: str) -> str:
    """escape until `gone` leaves the page and `shows` is on it (an escape sent to a palette still being
    pushed is lost, as CI met once after Theme)."""
    return await press_until_taken(page, "Escape", *shows, gone=gone, taken=lambda text: gone not in text)


async def palette(page) -> list[str]:
    """The palette opened through the page: the commands it lists (each a title over its help line)."""
    text = await open_palette(page, "Change the current theme")
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "Search for commands" in line)
    listed = []
    for line in lines[start + 1:]:
        if line.lstrip().startswith("▁"):
            break
        if line.strip():
            listed.append(line.strip())
    return listed[::2]


async def every_palette_command(page) -> None:
    """Each command the palette lists, run through the page (its title typed, its hit chosen); escape
    from what it showed. Quit comes last: l leaves the service down and ends the page's console."""
    titles = await palette(page)
    assert set(titles) <= set(READ_ONLY_PALETTE) and len(titles) >= len(READ_ONLY_PALETTE) - 1, titles
    for n, title in enumerate(sorted(titles, key=list(READ_ONLY_PALETTE).index)):
        if n:
            await open_palette(page)
        await page.keyboard.type(title)
        await screen_until(page, pattern=rf"^\s*{title}\s*$", timeout=30)  # its hit, the first
        shows = READ_ONLY_PALETTE[title]
        if title == "Quit":
            await press(page, "enter", shows)
            for key in ("r", "w", "l"):  # r and w are not offered here: nothing
                await press(page, key)
            await session_ended(page)
            return
        await press(page, "enter", *([shows] if shows else []), gone=f"🔎 {title}")
        # back from what it showed (a modal or a screen: the dashboard's footer back, so the next ctrl+p
        # reaches it); a command that showed nothing (Maximize hides the footer) only leaves the palette
        await close_with_escape(page, *(["? Help"] if shows else []), gone=shows or "🔎")


async def refused_sockets(page, *socket_urls: str) -> None:
    """`page` opens a websocket at each of `socket_urls`: the console refuses each (403, as the browser
    reports it, not the browser's own refusal)."""
    refusals: list[str] = []
    every = asyncio.Event()

    def refused(error: str) -> None:
        refusals.append(error)
        if len(refusals) == len(socket_urls):
            every.set()

    def follow(socket: Any) -> None:
        socket.on("socketerror", refused)

    page.on("websocket", follow)
    for tried in socket_urls:
        assert await page.evaluate(SOCKET_FROM_PAGE, tried) == "refused", tried
    await asyncio.wait_for(every.wait(), 30)
    page.remove_listener("websocket", follow)
    assert all("Unexpected response code: 403" in error for error in refusals), refusals


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
    token_file = tmp_path / "state" / "serve-token"
    served, url = start_serve(config_path, drill.runs, free_port(), token_file)
    guarded, guarded_url = start_serve(config_path, drill.runs, free_port(), token_file, "--bind", "0.0.0.0")
    # One token, printed by each, kept in a file of this user's only.
    token = token_file.read_text().strip()
    assert url.endswith(f"/?token={token}") and guarded_url.endswith(f"/?token={token}")
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    bare, guarded_bare = url.split("?")[0], guarded_url.split("?")[0]
    operator = Operator(load_config(config_path), runs_dir=drill.runs)
    decider = Approving()
    operator.start()
    try:
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=[REBIND])
            page, answer = await opened(browser, url)
            assert answer.status == 200
            # Without the token the page, its files and its websocket are refused, on loopback too.
            token_page, refused = await opened(browser, guarded_bare)
            assert refused.status == 403 and "needs its token" in await token_page.content()
            stepping = asyncio.create_task(step_to_the_stop(operator, decider, drill.runs))
            guarded_socket = guarded_url.replace("http://", "ws://").replace("/?token=", "/ws?token=")
            await refused_sockets(token_page, guarded_socket.split("?")[0])  # its own origin, no token
            for refused_url in (bare, f"{bare}static/js/textual.js", f"{bare}?token=wrong"):
                assert (await token_page.goto(refused_url)).status == 403, refused_url
            # A name of another site that resolves here (DNS rebinding): refused, its token given or not.
            rebound = await token_page.goto(url.replace("127.0.0.1", "rebind.test"))
            assert rebound.status == 403 and "does not answer to the name" in await token_page.content()
            assert (await token_page.goto(guarded_url)).status == 200
            await screen_until(token_page, "ct129", "read-only")  # its websocket opened with the token's cookie
            await token_page.close()  # (its console ends: one less process beside the window)
            # A page of another origin (the loopback console's, on its own port) cannot open this
            # console's websocket, its token given or not: the console answers 403.
            await refused_sockets(page, guarded_socket, guarded_socket.split("?")[0])
            paused = await stepping
            run_id = paused.run_id
            # The dashboard in the browser during the downtime: hosts, the DOWN banner, the steps.
            await screen_until(page, "SERVICE DOWN", "ct129", "ct200", "SIMULATED", "preflight", "free-vram",
                               "extract", "restart", "read-only", pattern=r"stop\s+done")
            await page.screenshot(path=str(tmp_path / "browser-view.png"))
            # Nothing a page sends acts, while the service is down (the keys that would restart it or
            # resume the run) and once the window is done (those that would start one, plan, export):
            # every key of every screen and every palette command, then the hosts, the service and
            # the run store as they were.
            store, hosts = store_files(drill.runs), hosts_now(drill)
            await page.click("#terminal")
            await every_key_while_down(page)
            assert store_files(drill.runs) == store and hosts_now(drill) == hosts
            state = RunStore(drill.runs).open(run_id).state
            assert state.service.down and state.status == "paused"  # nothing restarted it or resumed the run
            assert len(RunStore(drill.runs).run_ids()) == 1  # and no run was started from the page
            await page.reload()  # a console again (its start goes on beside the rest of the window)
            # The downtime ran past its forecast (+ 0 s margin): said while it lasts.
            await asyncio.to_thread(recorder.wait_for,
                                    lambda posts: any("longer than" in p["json"]["title"] for p in posts))
            finished = await operator.run(decider, resume=run_id)
            assert finished.status == "done" and finished.exit_code == 0, finished.message
            await screen_until(page, f"run {run_id} done", "read-only")
            store, hosts = store_files(drill.runs), hosts_now(drill)
            await page.click("#terminal")
            await every_key_when_done(page)
            assert store_files(drill.runs) == store and hosts_now(drill) == hosts
            assert len(RunStore(drill.runs).run_ids()) == 1
            await browser.close()
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
