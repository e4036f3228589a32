"""A replica that flaps while the fleet window lasts: `bench/window.py --replicas N --load --flap`.

`Flapper` pauses one replica's process (SIGSTOP) and continues it (SIGCONT) by turns, from the moment
the drained replica leaves the gateway until the moment it is listed healthy again (the window as the
users' gateway sees it). Each turn is held until the gateway's own listing shows it, as
tests/test_fleet_guard.py does: stopped until the gateway lists the replica unhealthy (its own health
check saw it), then 2.5 s more (`UNHEALTHY_HOLD_S`); continued until it is listed healthy again, then
1 s more (`HEALTHY_HOLD_S`). A request the gateway sent to the replica before its check saw the pause
waits for the continue: that is the longest wait. It is continued whatever happens (`stop`), and every
change the gateway listed is recorded with its time (`Flapper.seen`).

`quicken`: the flapped replica's health check as a team tunes its gateway (smg only, per worker,
through `PATCH /workers/{id}`: a 1 s timeout, unhealthy at the first failure, healthy at the first
success: the guard tests' QUICK_HEALTH). The drill's gateway keeps smg's defaults otherwise (3 failed
checks with a 5 s timeout each: a paused replica is listed unhealthy ~16 s after its pause, measured).
sglang-router takes no per-worker health settings: said, nothing changed.

`KeepWindow`: the bench's operator, who says yes to every question but the fleet's offer to end the
window early (issue 41, section 2: another replica unhealthy mid-window is said at once and offered):
the window goes on to its end, so one drain and one rejoin are measured. The offers are counted.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from console.messages import Confirmation
from console.procedure.steps.fleet_guard import WATCH_S

POLL_S = 0.2  # how often the gateway's listing is read
# Each state is held this long once the gateway lists it: unhealthy longer than the console's watch
# period (fleet_guard.WATCH_S, 2 s: a shorter fall may go unseen between two of its reads), healthy 1 s.
UNHEALTHY_HOLD_S = WATCH_S + 0.5
HEALTHY_HOLD_S = 1.0


def listing(router_url: str, timeout_s: float = 2.0) -> dict[str, bool]:
    """url -> healthy, as the gateway lists its workers now (smg: a draining one is not healthy)."""
    with urllib.request.urlopen(router_url.rstrip("/") + "/workers", timeout=timeout_s) as answer:
        workers = json.loads(answer.read())["workers"]
    return {str(w["url"]).rstrip("/"): bool(w.get("is_healthy")) and w.get("status") != "draining" for w in workers}


QUICK_HEALTH = {"timeout_secs": 1, "failure_threshold": 1, "success_threshold": 1, "check_interval_secs": 1}


def quicken(router_url: str, worker_url: str) -> tuple[bool, str]:
    """Tune the health check of the worker at `worker_url` (smg): whether it was, and what was done."""
    with urllib.request.urlopen(router_url.rstrip("/") + "/workers", timeout=5) as answer:
        workers = json.loads(answer.read())["workers"]
    mine = next((w for w in workers if str(w["url"]).rstrip("/") == worker_url.rstrip("/")), None)
    if mine is None or "status" not in mine:  # sglang-router lists no status and takes no per-worker health
        return False, "the gateway takes no per-worker health settings: its defaults kept"
    body = json.dumps({"health": QUICK_HEALTH}).encode()
    request = urllib.request.Request(f"{router_url.rstrip('/')}/workers/{mine['id']}", body,
                                     {"Content-Type": "application/json"}, method="PATCH")
    with urllib.request.urlopen(request, timeout=5) as answer:
        status = answer.status
    return status == 202, (f"PATCH /workers/{{id}} health {json.dumps(QUICK_HEALTH)}: HTTP {status} (a 1 s timeout, "
                           f"unhealthy at the first failed check, healthy at the first answer)")


class Flapper:
    """Flap the replica at `url` (process `pid`, named `name`) while the replica at `drained` is out of
    the gateway at `router_url`."""

    def __init__(self, router_url: str, name: str, url: str, pid: int, drained: str,
                 holds: tuple[float, float] = (UNHEALTHY_HOLD_S, HEALTHY_HOLD_S)):
        self.router_url, self.name, self.url, self.pid = router_url, name, url.rstrip("/"), pid
        self.drained, self.holds = drained.rstrip("/"), holds
        self.stopping = threading.Event()
        self.window: list[float] = []  # [out, back]: the drained replica leaving the gateway, listed healthy again
        self.seen: list[tuple[float, str]] = []  # (time, "unhealthy" | "healthy") as the gateway listed the flapped one
        self.pauses: list[tuple[float, float]] = []  # (SIGSTOP, SIGCONT) per turn
        self.seen_after: list[float] = []  # each pause's SIGSTOP -> the gateway listing it unhealthy
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="flapper", daemon=True)
        self._paused_at: float | None = None

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        """Stop flapping; the replica is continued (never left paused)."""
        self.stopping.set()
        self.thread.join(timeout=30)
        self._continue()

    def _listed(self) -> dict[str, bool] | None:
        try:
            return listing(self.router_url)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.errors.append(f"{time.time():.2f}: {type(exc).__name__}: {exc}")
            return None

    def _window_over(self, now: dict[str, bool] | None) -> bool:
        if now is not None and len(self.window) == 1 and now.get(self.drained):
            self.window.append(time.time())
        return self.stopping.is_set() or len(self.window) == 2

    def _until(self, check: Any) -> bool:
        """Poll the listing until `check(listing)` (True) or the window is over (False)."""
        while True:
            now = self._listed()
            if self._window_over(now):
                return False
            if now is not None and check(now):
                return True
            time.sleep(POLL_S)

    def _hold(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._window_over(self._listed()):
                return False
            time.sleep(POLL_S)
        return True

    def _continue(self) -> None:
        if self._paused_at is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
            self.pauses.append((self._paused_at, time.time()))
            self._paused_at = None

    def _run(self) -> None:
        try:
            # The window opens when the drained replica is no longer listed healthy (draining or gone).
            while not self.stopping.is_set():
                now = self._listed()
                if now is not None and not now.get(self.drained, False):
                    self.window.append(time.time())
                    break
                time.sleep(POLL_S)
            while not self.stopping.is_set() and len(self.window) == 1:
                os.kill(self.pid, signal.SIGSTOP)
                self._paused_at = paused = time.time()
                if not self._until(lambda now: not now.get(self.url, False)):
                    break
                self.seen.append((time.time(), "unhealthy"))
                self.seen_after.append(time.time() - paused)
                if not self._hold(self.holds[0]):
                    break
                self._continue()
                if not self._until(lambda now: now.get(self.url, False)):
                    break
                self.seen.append((time.time(), "healthy"))
                self._hold(self.holds[1])
        finally:
            self._continue()

    def figures(self) -> dict[str, Any]:
        """What the flap did, as numbers: the turns, the gateway's view of each, how long each took."""
        pauses = [b - a for a, b in self.pauses]
        return {"replica": self.name, "window": self.window, "pauses": len(self.pauses),
                "listed_unhealthy": sum(1 for _, s in self.seen if s == "unhealthy"),
                "listed_healthy_again": sum(1 for _, s in self.seen if s == "healthy"),
                "longest_pause_s": max(pauses, default=0.0),
                "seen_unhealthy_after_s": self.seen_after, "seen": self.seen, "errors": self.errors[-5:]}


class KeepWindow:
    """Yes to every question but the fleet's offer to end the window early (counted, refused)."""

    name = "--yes (the bench: no to ending the window early)"

    def __init__(self) -> None:
        self.offers: list[str] = []

    async def decide(self, confirmation: Confirmation) -> bool:
        if confirmation.step == "fleet":
            self.offers.append(confirmation.impact)
            return False
        return True


def fleet_said(run_dir: Path) -> dict[str, int]:
    """How often the run's journal said the fleet at risk, and healthy again (the console's own view)."""
    said = {"at_risk": 0, "healthy_again": 0}
    with contextlib.suppress(OSError):
        for line in (run_dir / "journal.jsonl").read_text().splitlines():
            with contextlib.suppress(ValueError):
                message = str(json.loads(line).get("message", ""))
                said["at_risk"] += message.startswith("THE FLEET IS AT RISK")
                said["healthy_again"] += message.startswith("the fleet is healthy again")
    return said
