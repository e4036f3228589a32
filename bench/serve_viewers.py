"""What watching costs production: `dflash-ops serve` with 1 and with 10 viewers, each a page of
Debian's chromium (playwright, `executable_path`: nothing downloads a browser), during a drill window.

`python -m bench.serve_viewers [--viewers 10] [--json FILE]`

The drill comes up; `serve` starts on it. For 1 viewer, then for N (the baseline run first, side by
side): the pages open and show the console, then one window runs (`run --headless --yes`, the stop
route) while the hosts are sampled every half second. Counted on the hosts: the telemetry agents
running (each host's `remote.agent` processes), the SSH connections to each host (every process's
established TCP connections to its SSH port: serve's watcher, its viewers, the window's own console),
and the requests the rehearsal server processed during the window (its `sglang:num_requests_total`,
the watchers' one-token `/generate`s among them: no user load runs). Printed: each figure with 1 and
with N viewers and their ratio; the last line the headline (target: the same with N as with 1, since
every viewer is a view of serve's one watcher, console/sharing.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from console.config import Config, load_config
from console.drill.hosts import down, up

ROOT = Path(__file__).resolve().parent.parent
ENTRY = [sys.executable, "-m", "console.cli"]


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def agents(config: Config) -> dict[str, int]:
    counts = {name: 0 for name in config.hosts}
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if "remote.agent" in cmdline:
            for name in config.hosts:
                if f"/{name}/home/" in cmdline:
                    counts[name] += 1
    return counts


def ssh_connections(config: Config) -> dict[str, int]:
    ports = {host.port: name for name, host in config.hosts.items()}
    counts = {name: 0 for name in config.hosts}
    for conn in psutil.net_connections(kind="tcp"):
        if conn.raddr and conn.status == psutil.CONN_ESTABLISHED and conn.raddr.port in ports:
            counts[ports[conn.raddr.port]] += 1
    return counts


def requests_done(config: Config) -> float | None:
    """The server's count of requests processed (None while it is down or starting)."""
    try:
        text = urllib.request.urlopen(config.service.url.rstrip("/") + "/metrics", timeout=2).read().decode()
    except OSError:
        return None
    found = re.search(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


class RequestCount:
    """Requests the server processed over a window that restarts it: its counter starts again from 0
    with each start, so each reading adds what it grew by since the last (all of it after a restart)."""

    def __init__(self, config: Config):
        self.config, self.total, self.last = config, 0.0, requests_done(config)

    def sample(self) -> None:
        now = requests_done(self.config)
        if now is None:
            return
        self.total += now - self.last if self.last is not None and now >= self.last else now
        self.last = now


def start_serve(config_path: Path, runs: Path, port: int, state: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([*ENTRY, "serve", "--config", str(config_path), "--runs", str(runs), "--port", str(port),
                             "--max-viewers", "16"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, env={**os.environ, "DFLASH_OPS_SERVE_TOKEN_FILE": str(state / "token")})
    return proc, re.search(r"(http://\S+/\?token=\S+)", proc.stdout.readline()).group(1)


async def open_pages(browser: Any, url: str, n: int) -> list[Any]:
    pages = []
    for _ in range(n):
        page = await browser.new_page(viewport={"width": 1000, "height": 700})
        await page.goto(url, wait_until="domcontentloaded")
        pages.append(page)
    return pages


def viewers_up(serve: subprocess.Popen) -> int:
    """Viewer consoles running under serve (one ending is a zombie a moment: not counted)."""
    count = 0
    for child in psutil.Process(serve.pid).children(recursive=True):
        try:
            count += "--app" in " ".join(child.cmdline()) and child.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            continue
    return count


async def one_window(config_path: Path, runs: Path, config: Config) -> dict[str, Any]:
    """One stop-route window, the hosts sampled every half second meanwhile."""
    count = RequestCount(config)
    began = time.monotonic()
    window = subprocess.Popen([*ENTRY, "run", "--headless", "--yes", "--config", str(config_path), "--runs", str(runs)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    peak_agents = {name: 0 for name in config.hosts}
    peak_ssh = {name: 0 for name in config.hosts}
    while window.poll() is None:
        for name, n in agents(config).items():
            peak_agents[name] = max(peak_agents[name], n)
        for name, n in ssh_connections(config).items():
            peak_ssh[name] = max(peak_ssh[name], n)
        await asyncio.to_thread(count.sample)
        await asyncio.sleep(0.5)
    if window.returncode != 0:
        raise SystemExit(f"the window exited {window.returncode}")
    await asyncio.to_thread(count.sample)
    return {"agents": peak_agents, "ssh": peak_ssh, "requests": count.total, "window_s": time.monotonic() - began}


async def measure(viewers: int, config_path: Path, config: Config, runs: Path, browser: Any, url: str,
                  serve: subprocess.Popen) -> dict[str, Any]:
    pages = await open_pages(browser, url, viewers)
    deadline = time.monotonic() + 120
    while viewers_up(serve) < viewers:
        if time.monotonic() > deadline:
            raise SystemExit(f"only {viewers_up(serve)} of {viewers} viewers' consoles started")
        await asyncio.sleep(0.2)
    await asyncio.sleep(5)  # each console's first look (what a viewer costs at its start counts too)
    say(f"{viewers} viewer(s) up; a window runs")
    figures = await one_window(config_path, runs, config)
    for page in pages:
        await page.close()
    deadline = time.monotonic() + 60
    while viewers_up(serve) and time.monotonic() < deadline:  # a closed page ends its console
        await asyncio.sleep(0.2)
    figures["left_after_close"] = viewers_up(serve)
    return figures


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("no chromium here (apt-get install chromium)")
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    drill_dir, runs = work / "drill", work / "runs"
    config_path = up(drill_dir, fresh=True, say=say)
    config = load_config(config_path)
    serve, url = start_serve(config_path, runs, args.port, work)
    out = (work / "serve.log").open("w")
    pump = asyncio.get_running_loop().run_in_executor(None, lambda: shutil.copyfileobj(serve.stdout, out))
    try:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=chromium)
            try:
                say("a warm-up window (the drill's first stop leaves VRAM held: not counted)")
                await one_window(config_path, runs, config)
                results = {n: await measure(n, config_path, config, runs, browser, url, serve)
                           for n in (1, args.viewers)}
            finally:
                await browser.close()
    finally:
        serve.terminate()
        serve.wait(30)
        await pump
        down(drill_dir, say=lambda line: None)
    return results


def table(results: dict[int, dict[str, Any]], n: int) -> list[str]:
    one, many = results[1], results[n]
    rows = [f"{'on the hosts, during a window':<36}{'1 viewer':>10}{f'{n} viewers':>12}{f'{n}/1':>8}"]
    for kind, label in (("agents", "telemetry agents on"), ("ssh", "SSH connections to")):
        for host in one[kind]:
            a, b = one[kind][host], many[kind][host]
            rows.append(f"{label + ' ' + host:<36}{a:>10}{b:>12}{(b / a if a else float('nan')):>7.2f}x")
    a, b = one["requests"], many["requests"]
    rows.append(f"{'requests the server processed':<36}{a:>10.0f}{b:>12.0f}{(b / a if a else float('nan')):>7.2f}x")
    a, b = one["window_s"], many["window_s"]
    rows.append(f"{'the window lasted (s)':<36}{a:>10.1f}{b:>12.1f}{b / a:>7.2f}x")
    a, b = (r["requests"] / r["window_s"] * 60 for r in (one, many))
    rows.append(f"{'requests a minute':<36}{a:>10.1f}{b:>12.1f}{(b / a if a else float('nan')):>7.2f}x")
    rows.append(f"{'viewer consoles left after close':<36}{one['left_after_close']:>10}{many['left_after_close']:>12}")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--viewers", type=int, default=10)
    parser.add_argument("--port", type=int, default=18765)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    for row in table(results, args.viewers):
        print(row)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    one, many = results[1], results[args.viewers]
    same = one["agents"] == many["agents"]
    print(f"{args.viewers} viewers vs 1 during a drill window: agents {sum(many['agents'].values())} vs "
          f"{sum(one['agents'].values())}, SSH connections {sum(many['ssh'].values())} vs {sum(one['ssh'].values())}, "
          f"server requests {many['requests'] / many['window_s'] * 60:.1f} vs "
          f"{one['requests'] / one['window_s'] * 60:.1f} a minute "
          f"({'the same' if same else 'NOT the same'} agents; target: the same with {args.viewers} as with 1)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
