"""One window per inference host, whoever logs in: the lock `dflash-ops.lock` names the run and the
console driving it (`Owner`), in a directory every operator's account reaches (`[hosts.<name>]
lock_dir`, /var/tmp by default), so that two operators with accounts of their own meet at one lock.

Taken exclusively on the host, so that two consoles starting together cannot both take it: the
lock's text is written whole to a fresh private name, then hard-linked to the lock's name (which
fails when anything is there: one console wins, and a reader never sees it half-written). The
directory is shared with every local account, so the file operations (remote/lockfile.py) never
follow a symlink nor take over a file or directory another account put there, and a lock is read
with the account that owns its file: who holds the host is said from that.
A lock whose console is gone is taken over by moving it aside (a rename: only one console moves a
given file, and the directory's sticky bit lets only its account do it) and checking that the file
moved is the one judged gone; another console's fresh lock moved by mistake is linked back. A live
(or unknowable) console's lock refuses the run before anything is done on the host, naming it; a
lock that is not a JSON object naming a run is damaged, and said so with its path.

Held until the run ends (not released at the ready moment: a second run must not stop the service
during this run's evaluation, nor offer to end its evaluator), and released only by the console
that holds it, or for a run whose console is gone (a finished run restarted from another console),
the same way: moved aside, checked, removed.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from console.procedure.outcomes import StepFailed
from console.procedure.state import Owner
from console.ssh.hosts import CommandFailed
from remote.lockfile import LOCK_FILE as LOCK_NAME

if TYPE_CHECKING:
    from console.procedure.window import Window

LOCK_FILE = LOCK_NAME  # in the service host's lock directory (`[hosts.<name>] lock_dir`): the run driving it
OWNER_FIELDS = ("user", "host", "pid", "since", "start_ticks")


class LockHeld(StepFailed):
    """Another live console's run holds the host: this engine touches nothing of it (no job ended,
    no restart, the lock kept)."""


def lock_dir(window: Window) -> str:
    return window.config.hosts[window.config.service.host].lock_dir


def lock_path(window: Window) -> str:
    return f"{lock_dir(window)}/{LOCK_FILE}"


def owner_of(held: dict[str, Any]) -> Owner | None:
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


async def _lock_file(window: Window, host: str, op: str, *args: str) -> dict[str, Any]:
    """One of the lock file's operations on the host (remote/lockfile.py); a path that is not safe
    to use (a symlink, another account's file or directory) fails the preflight, saying why."""
    try:
        return await window.hosts.lock_file(host, op, [lock_dir(window), *args])
    except CommandFailed as exc:
        why = exc.stderr_tail or f"exit status {exc.exit_status}"  # not the command: it holds the whole script
        raise StepFailed("preflight", f"the host lock on {host}: {why}") from None


async def _read(window: Window, host: str) -> tuple[str, str] | None:
    """The lock's text and the account on the host that owns its file, or None when there is none."""
    found = await _lock_file(window, host, "read")
    return None if found.get("absent") else (found["text"], found["account"])


async def _remove_if_unchanged(window: Window, host: str, path: str, seen: str) -> bool:
    """Move the lock aside (one console can), and remove it if it is the one `seen`; a lock put
    there meanwhile by another console is linked back. True when `seen` was removed."""
    answer = await _lock_file(window, host, "remove", seen)
    if answer.get("why") == "changed twice":
        window.journal("preflight", f"the host lock {host}:{path} changed hands twice while it was looked at",
                       host=host, level="warning")
    elif answer.get("why") == "forbidden":  # the sticky bit: only its account (or root) removes it
        raise StepFailed("preflight", f"the host lock {host}:{path} belongs to the account {answer['account']} and "
                                      f"names a run whose console is gone; only {answer['account']} (or root) can "
                                      f"remove it: ask them to (`rm {path}`), then run again")
    return bool(answer.get("removed"))


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
    path = lock_path(window)
    me = window.state.owner
    mine = json.dumps({"run_id": window.run.run_id, **(me.__dict__ if me else {})})
    for _ in range(4):
        found = await _lock_file(window, host, "take", mine)
        if found.get("taken"):
            window.holds_lock = True
            return
        if found.get("absent"):
            continue  # removed meanwhile: try again
        text, account = found["text"], found["account"]
        held = _parse(host, path, text)
        if _is_this_console(held, me):  # this console's (an attempt whose answer was lost, an earlier run)
            await _lock_file(window, host, "rewrite", mine)
            window.holds_lock = True
            return
        owner = owner_of(held)
        alive = False if _finished_here(window, held["run_id"]) else owner.alive() if owner is not None else False
        who = ("this run's earlier console" if held["run_id"] == window.run.run_id else
               f"run {held['run_id']}") + (f" ({owner.describe()})" if owner else "")
        if alive is not False:
            window.lock_refused = True
            where = "" if alive else " (on another machine: cannot tell from here whether it still runs)"
            raise LockHeld("preflight", f"{host} is driven by {who}{where}, logged in to {host} as {account} "
                                        f"({path}): one run per inference host at a time, and nothing of it was "
                                        f"touched. Wait for it (`dflash-ops status` shows the host and its service "
                                        f"meanwhile; its console's `dflash-ops console --read-only` follows the run)")
        if await _remove_if_unchanged(window, host, path, text):
            window.journal("preflight", f"taking over the lock of {who} on {host} (logged in as {account}): its "
                                        f"console is gone", host=host, level="warning")
    raise StepFailed("preflight", f"the host lock {host}:{path} kept changing hands: another console is starting "
                                  f"a run on {host}; try again")


async def release(window: Window) -> None:
    """Remove the lock when it names this run and its console is this one or gone; never another
    live console's."""
    host = window.config.service.host
    path = lock_path(window)
    try:
        found = await _read(window, host)
    except StepFailed:
        return  # not a lock of ours (a symlink, another account's file): not ours to remove
    if found is None:
        return
    text = found[0]
    try:
        held = _parse(host, path, text)
    except StepFailed:
        return  # damaged: not ours to remove
    if held["run_id"] != window.run.run_id:
        return
    owner = owner_of(held)
    nobody_drives = window.state.finished or owner is None or owner.alive() is False
    if not _is_this_console(held, window.state.owner) and not nobody_drives:
        return
    try:
        removed = await _remove_if_unchanged(window, host, path, text)
    except StepFailed as exc:  # another account's lock (the sticky bit): said, left for that account
        window.journal(None, exc.msg, host=host, level="warning")
        return
    if removed:
        window.holds_lock = False
        window.journal(None, f"released the host lock {host}:{path}", host=host)
