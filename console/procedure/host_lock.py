"""One run per inference host: the lock `dflash-ops.lock` in the service host's workdir names the run
and the console driving it (`Owner`).

Taken exclusively on the host, so that two consoles starting together cannot both take it: the
lock's text is written whole to a private temporary name, then hard-linked to the lock's name
(`ln`, which fails when a lock is there: one console wins, and a reader never sees it half-written).
A lock whose console is gone is taken over by moving it aside (`mv`, a rename: only one console
moves a given file) and checking that the file moved is the one judged gone; another console's
fresh lock moved by mistake is linked back. A live (or unknowable) console's lock refuses the run;
a lock that is not a JSON object naming a run is damaged, and said so with its path.

Held until the run ends (not released at the ready moment: a second run must not stop the service
during this run's evaluation, nor offer to end its evaluator), and released only by the console
that holds it, or for a run whose console is gone (a finished run restarted from another console),
the same way: moved aside, checked, removed.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

from console.procedure.outcomes import StepFailed
from console.procedure.state import Owner
from console.ssh.hosts import CommandFailed

if TYPE_CHECKING:
    from console.procedure.window import Window

LOCK_FILE = "dflash-ops.lock"  # in the service host's workdir: the run driving that host
OWNER_FIELDS = ("user", "host", "pid", "since", "start_ticks")


class LockHeld(StepFailed):
    """Another live console's run holds the host: this engine touches nothing of it (no job ended,
    no restart, the lock kept)."""


async def lock_path(window: Window) -> str:
    return f"{await window.hosts.workdir(window.config.service.host)}/{LOCK_FILE}"


def _owner_of(held: dict[str, Any]) -> Owner | None:
    try:
        return Owner(**{k: held[k] for k in OWNER_FIELDS if k in held})
    except TypeError:
        return None


def _parse(host: str, path: str, text: str) -> dict[str, Any]:
    """The lock's JSON object; anything else is a damaged lock, said with its path."""
    try:
        held = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        why = f"not JSON ({exc})" if text.strip() else "empty"
        held = None
    else:
        why = f"a JSON {type(held).__name__}, not an object" if not isinstance(held, dict) else "no run_id in it"
    if not isinstance(held, dict) or not isinstance(held.get("run_id"), str):
        raise StepFailed("preflight", f"the host lock {host}:{path} is damaged ({why}): nobody can tell which run "
                                      f"drives {host}. If no console drives it, remove the file and run again")
    return held


def _is_this_console(held: dict[str, Any], me: Owner | None) -> bool:
    return me is not None and held.get("pid") == me.pid and held.get("host") == me.host \
        and held.get("start_ticks") in (None, me.start_ticks)


async def _read(window: Window, host: str, path: str) -> str | None:
    try:
        return await window.hosts.read_text(host, path)
    except FileNotFoundError:
        return None


async def _create(window: Window, host: str, path: str, text: str) -> bool:
    """The lock made whole under a private name, then linked to its name: True when this console
    made it, False when a lock was there already (another console won)."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.new"
    await window.hosts.write_text(host, tmp, text)
    try:
        await window.hosts.run(host, ["ln", "--", tmp, path])
        return True
    except CommandFailed:
        return False
    finally:
        await window.hosts.run(host, ["rm", "-f", "--", tmp])


async def _remove_if_unchanged(window: Window, host: str, path: str, seen: str) -> bool:
    """Move the lock aside (one console can), and remove it if it is the one `seen`; a lock put
    there meanwhile by another console is linked back. True when `seen` was removed."""
    aside = f"{path}.{uuid.uuid4().hex[:8]}.gone"
    try:
        await window.hosts.run(host, ["mv", "--", path, aside])
    except CommandFailed:
        return False  # not there any more: another console moved it first
    try:
        if await _read(window, host, aside) == seen:
            return True
        try:  # someone else's lock: back where it was (unless yet another lock is there now)
            await window.hosts.run(host, ["ln", "--", aside, path])
        except CommandFailed:
            window.journal("preflight", f"the host lock {host}:{path} changed hands twice while it was looked at",
                           host=host, level="warning")
        return False
    finally:
        await window.hosts.run(host, ["rm", "-f", "--", aside])


def _finished_here(window: Window, run_id: str) -> bool:
    """The lock's run is in this console's store and has finished: nobody drives it any more."""
    if window.store is None or run_id == window.run.run_id:
        return False
    try:
        return window.store.open(run_id).state.finished
    except Exception:  # noqa: BLE001 - not in this store, or unreadable: the lock's owner decides
        return False


async def take(window: Window) -> None:
    """Take the host's lock for this run and console, or refuse (`LockHeld`) while another live (or
    unknowable) console holds it; a gone console's lock is taken over, saying so."""
    host = window.config.service.host
    path = await lock_path(window)
    me = window.state.owner
    mine = json.dumps({"run_id": window.run.run_id, **(me.__dict__ if me else {})})
    for _ in range(4):
        if await _create(window, host, path, mine):
            window.holds_lock = True
            return
        text = await _read(window, host, path)
        if text is None:
            continue  # removed meanwhile: try again
        held = _parse(host, path, text)
        if _is_this_console(held, me):  # this console's (an attempt whose answer was lost, an earlier run)
            await window.hosts.write_text(host, path, mine)
            window.holds_lock = True
            return
        owner = _owner_of(held)
        alive = False if _finished_here(window, held["run_id"]) else owner.alive() if owner is not None else False
        who = ("this run's earlier console" if held["run_id"] == window.run.run_id else
               f"run {held['run_id']}") + (f" ({owner.describe()})" if owner else "")
        if alive is not False:
            window.lock_refused = True
            where = "" if alive else " (on another machine: cannot tell from here whether it still runs)"
            raise LockHeld("preflight", f"{host} is driven by {who}{where} ({path}): one run per inference host "
                                        f"at a time; wait for it, or watch it with dflash-ops console --read-only")
        if await _remove_if_unchanged(window, host, path, text):
            window.journal("preflight", f"taking over the lock of {who} on {host}: its console is gone", host=host,
                           level="warning")
    raise StepFailed("preflight", f"the host lock {host}:{path} kept changing hands: another console is starting "
                                  f"a run on {host}; try again")


async def release(window: Window) -> None:
    """Remove the lock when it names this run and its console is this one or gone; never another
    live console's."""
    host = window.config.service.host
    path = await lock_path(window)
    text = await _read(window, host, path)
    if text is None:
        return
    try:
        held = _parse(host, path, text)
    except StepFailed:
        return  # damaged: not ours to remove
    if held["run_id"] != window.run.run_id:
        return
    owner = _owner_of(held)
    nobody_drives = window.state.finished or owner is None or owner.alive() is False
    if not _is_this_console(held, window.state.owner) and not nobody_drives:
        return
    if await _remove_if_unchanged(window, host, path, text):
        window.holds_lock = False
        window.journal(None, f"released the host lock {host}:{path}", host=host)
