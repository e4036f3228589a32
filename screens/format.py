"""Small text helpers the panels share: durations, clock times, sizes."""

from __future__ import annotations

import time


def duration(seconds: float | None) -> str:
    """'4 s', '1 min 05 s', '2 h 03 min'; '-' for None."""
    if seconds is None:
        return "-"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60):02d} s"
    if seconds < 86400:
        return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} min"
    return f"{int(seconds // 86400)} d {int(seconds % 86400 // 3600)} h"


def clock(t: float | None) -> str:
    """Local wall-clock time 'HH:MM:SS' of a unix time."""
    return "--:--:--" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def gib(mib: float | None) -> str:
    return "?" if mib is None else f"{mib / 1024:.1f}"


def size(nbytes: float | None) -> str:
    """'812 MB', '12.4 GB' (decimal units, as disks and networks count)."""
    if nbytes is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def short_duration(seconds: float | None) -> str:
    """'45s', '1m45s', '1h05m': for narrow columns."""
    if seconds is None:
        return ""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def update_static(widget, renderable, key: object, lines: int | None = None) -> bool:
    """`widget.update(renderable)` only when `key` (what it shows) changed since the last call, and
    with a layout pass only when its height may have changed (`lines` differs, or is unknown):
    a repaint at 1 Hz stays a repaint, not a reflow of the whole screen."""
    if getattr(widget, "_shown_key", None) == key:
        return False
    layout = lines is None or getattr(widget, "_shown_lines", None) != lines
    widget._shown_key, widget._shown_lines = key, lines
    widget.update(renderable, layout=layout)
    return True
