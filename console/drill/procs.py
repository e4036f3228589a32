"""Which local processes a drill started, and ending them: every one carries the drill's mark.

The rehearsal hosts' process puts `DFLASH_OPS_DRILL=<drill dir>` in its own environment and in that
of every command its SSH servers run, so everything the drill starts inherits it: the rehearsal
server and its GPU worker (even once re-parented), the simulated training run, the telemetry agents
and the workers the console starts there (detached with setsid, they keep their environment). Ending
a drill ends exactly the processes whose environment holds that mark, by pid and start time
(`remote.endpids`): never a process of someone else's, never one that merely looks alike.
"""

from __future__ import annotations

import os
from pathlib import Path

from remote.endpids import end_processes
from remote.procstat import PPID, pid_alive, read_stat, start_time

MARK_ENV = "DFLASH_OPS_DRILL"


def mark_value(drill_dir: Path) -> str:
    return str(Path(drill_dir).resolve())


def ancestors() -> set[int]:
    """This process and its parents: a drill command run from inside the drill never ends itself."""
    seen, pid = set(), os.getpid()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        fields = read_stat(pid)
        pid = int(fields[PPID]) if fields else 0
    return seen


def marked_pids(drill_dir: Path) -> list[int]:
    """Live processes of this user whose environment carries the drill's mark, lowest pid first."""
    needle = f"{MARK_ENV}={mark_value(drill_dir)}".encode()
    skip = ancestors()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as fh:
                environ = fh.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        pid = int(entry.name)
        if needle in environ and pid_alive(pid):
            found.append(pid)
    return sorted(found)


def end_marked(drill_dir: Path, grace_s: float = 2.0, rounds: int = 3) -> list[dict]:
    """End every marked process (TERM, then KILL after `grace_s`); repeated while new ones appear
    (a dying parent may have started a child meanwhile). Returns `remote.endpids` outcomes."""
    outcomes: list[dict] = []
    for _ in range(rounds):
        pids = marked_pids(drill_dir)
        if not pids:
            break
        outcomes += end_processes([(pid, start_time(pid)) for pid in pids], grace_s)
    return outcomes
