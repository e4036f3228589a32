"""Which process a pid names now, from /proc/<pid>/stat: state, parent, start time.

The command name (field 2) is in parentheses and may hold spaces and ')', so fields are counted
after the last ')': state is field 3, ppid field 4, starttime field 22 (clock ticks since boot).
A pid with its start time names exactly one process: a pid reused later has another start time.
Read one way here for the agent, the simulated GPU, `endpids` and the console's job checks.
"""

from __future__ import annotations

STATE, PPID, START_TIME = 0, 1, 19  # indices into `stat_fields`


def stat_fields(text: str) -> list[str] | None:
    """The fields after the command name (state, ppid, ..., starttime); None if `text` is not a stat line."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) <= START_TIME:
        return None
    return fields


def parse_start_ticks(text: str) -> tuple[str, int] | None:
    """(state letter, starttime) from the text of /proc/<pid>/stat, or None if unreadable."""
    fields = stat_fields(text)
    if fields is None:
        return None
    try:
        return fields[STATE], int(fields[START_TIME])
    except ValueError:
        return None


def read_stat(pid: int) -> list[str] | None:
    """`stat_fields` of a local process; None when it does not exist (or cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            text = fh.read().decode(errors="replace")  # the command name is bytes, not always UTF-8
    except OSError:
        return None
    return stat_fields(text)


def start_time(pid: int) -> int | None:
    """The start time (clock ticks since boot) of local process `pid`; None if it does not exist."""
    fields = read_stat(pid)
    try:
        return int(fields[START_TIME]) if fields else None
    except ValueError:
        return None


def pid_alive(pid: int) -> bool:
    """True when `pid` is a live process (a zombie counts as dead: its memory would be freed)."""
    fields = read_stat(pid)
    return fields is not None and fields[STATE] not in ("Z", "X")
