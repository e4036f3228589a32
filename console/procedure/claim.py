"""Who acts on a run now: one console at a time, claimed atomically in the run's directory.

    <runs>/<run_id>/claim.json   {"user", "host", "pid", "since", "start_ticks", "doing"}

Two consoles can open the same run at the same moment: two operators answering the same "left
paused" alert with `dflash-ops run --resume RUN`, or a resume and another console's `r`. Both read
the run while it still held the server, and both would send `/resume_memory_occupation` and
`/continue_generation`; the second resume of a tag no longer released ends SGLang's scheduler
(weight_updater.py, `offload_tags.remove`: KeyError), so the server dies. `RunState.owner`, written
after `owned_elsewhere` was checked, cannot tell them apart: both checked before either wrote, and a
finished run left paused never records an owner at all.

So before anything is sent, the engine claims the run here (`take`), with the host lock's own file
operations (remote/lockfile.py, under the name `claim.json`): written whole to a fresh private name,
then hard-linked to its name, which fails when anything is there: one console wins. A claim whose
console is gone (`Owner.alive()` False) is taken over by moving it aside and checking that the file
moved is the one judged gone; another console's fresh claim moved by mistake is linked back. The winner reads the run again under its claim (the
other may have just given the server back) and keeps the claim until it is done with the run
(`release`); the loser waits for a give-back to end (`ClaimHeld.doing`), then reads the run and says
who gave the server back and when, sending nothing (`engine.py`, `Engine.claim_run`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from console.procedure.outcomes import ResumeRefused
from console.procedure.state import Owner
from remote import lockfile

CLAIM = "claim.json"
OWNER_FIELDS = ("user", "host", "pid", "since", "start_ticks")
DRIVING = "driving the run"  # a claim another console never waits for (it may hold the run for an hour)
WAIT_S = 120.0  # a console that finds the run claimed for its give-back waits this long for it
POLL_S = 0.1
log = logging.getLogger(__name__)
GIVING_BACK = "giving the server back"  # waited for: the loser then says who gave it back and when


class GivenBack(LookupError):
    """`r` found the run given back by another console meanwhile (the message says who and when):
    nothing was sent."""


# What a claim's file operations raise besides OSError (a claim.json that is a symlink or writable by
# others: never followed nor trusted); the engine goes on unclaimed, as on a full disk.
Unsafe = lockfile.Unsafe


class ClaimHeld(Exception):
    """Another live console (or one that cannot be told: another machine) has claimed the run."""

    def __init__(self, holder: Owner, doing: str):
        super().__init__(f"claimed by {holder.describe()} ({doing})")
        self.holder, self.doing = holder, doing


def _same_process(a: Owner, b: Owner) -> bool:
    return a.pid == b.pid and a.host == b.host and a.start_ticks in (None, b.start_ticks)


def _parse(text: str) -> tuple[Owner | None, str]:
    """The claim's owner and what it does; (None, ...) for a damaged claim (taken over as a gone one)."""
    try:
        data: Any = json.loads(text)
        return Owner(**{k: data[k] for k in OWNER_FIELDS if k in data}), str(data.get("doing") or "the run")
    except (ValueError, TypeError, AttributeError):
        return None, "?"


def _text(run_dir: Path) -> str | None:
    """The claim's text, None when there is none (read as the host lock is: never followed)."""
    return lockfile.read(str(run_dir), CLAIM).get("text")


def holder(run_dir: Path) -> tuple[Owner, str] | None:
    """Who claims the run now and what for, None when nobody (or a damaged claim)."""
    text = _text(run_dir)
    owner, doing = _parse(text) if text is not None else (None, "")
    return (owner, doing) if owner is not None else None


def take(run_dir: Path, me: Owner, doing: str) -> bool:
    """Claim the run for `me` (`doing`: what for, said to a console that finds it claimed). True when
    claimed now, False when `me` had claimed it already (this console's engine, `r` while it runs);
    ClaimHeld while another live (or unknowable) console holds it; a gone one's is taken over."""
    mine = json.dumps({**me.__dict__, "doing": doing}, sort_keys=True)
    for _ in range(8):
        found = lockfile.take(str(run_dir), mine, CLAIM)
        if found.get("taken"):
            return True
        text = found.get("text")
        if text is None:
            continue  # released meanwhile: try again
        owner, held_doing = _parse(text)
        if owner is not None and _same_process(owner, me):
            return False
        if owner is not None and owner.alive() is not False:
            raise ClaimHeld(owner, held_doing)
        lockfile.remove(str(run_dir), text, CLAIM)  # its console is gone (or the claim is damaged): taken over
    raise ClaimHeld(Owner("?", "?", 0, 0.0), "a claim that kept changing hands")


def release(run_dir: Path, me: Owner) -> None:
    """Remove the claim if it is `me`'s (never another console's)."""
    text = _text(run_dir)
    if text is None:
        return
    owner, _ = _parse(text)
    if owner is not None and _same_process(owner, me):
        lockfile.remove(str(run_dir), text, CLAIM)


def given_back_line(run_id: str, service: Any) -> str:
    """What a console that lost the claim says once the run no longer holds the server: "run X's
    memory was given back by alice@ct129 pid 4242 at 09:31:02: nothing to do"."""
    def at(t: float | None) -> str:
        return time.strftime("%H:%M:%S", time.localtime(t)) if t is not None else "?"

    if service.restarted_outside:
        return f"run {run_id}: the server it paused was restarted outside it ({service.restarted_outside}): nothing to do"
    if service.pauses:
        who = service.given_back_by or "a console outside this run (it answers /ready 200)"
        return f"run {run_id}'s memory was given back by {who} at {at(service.continued_at)}: nothing to do"
    if service.stops:
        return f"run {run_id}'s service was started again (ready at {at(service.ready_at)}): nothing to do"
    return f"run {run_id} no longer holds the service: nothing to do"



async def take_waiting(run_dir: Path, run_id: str, me: Owner, doing: str, say: Callable[[str], None]) -> bool | None:
    """`take`, waiting (up to WAIT_S) while another console holds the claim for its give-back, `say`ing
    so once. True: claimed now; False: this console's already; None: it cannot be claimed (a full
    disk, an unsafe claim file), and the give-back goes on unclaimed rather than wait on it.
    ResumeRefused: held by a console that drives the run, held past WAIT_S, or cancelled meanwhile."""
    said, deadline = False, time.monotonic() + WAIT_S
    while True:
        try:
            return take(run_dir, me, doing)
        except ClaimHeld as exc:
            who = f"{exc.holder.describe()}, {exc.doing}"
            if exc.doing == DRIVING or time.monotonic() > deadline:
                raise ResumeRefused(f"run {run_id} is claimed by {who} (its {CLAIM}): nothing was written or sent; "
                                    f"`dflash-ops console --read-only` follows it") from None
            if not said:  # said here only: the run is the other console's until it lets go
                said = True
                say(f"run {run_id} is claimed by {who}: waiting for it (nothing is sent meanwhile)")
            try:
                await asyncio.sleep(POLL_S)
            except asyncio.CancelledError:  # Ctrl-C (or a signal) while waiting: nothing was sent
                task = asyncio.current_task()
                while task is not None and task.cancelling():
                    task.uncancel()
                raise ResumeRefused(f"cancelled while run {run_id} is claimed by {who}: nothing was written or "
                                    f"sent here") from None
        except (OSError, Unsafe) as exc:
            log.warning("run %s: cannot claim it (%s): going on unclaimed", run_id, exc)
            return None
