"""Small text helpers the panels share: clock times, and repainting only what changed. Durations
and sizes come from `console.views.units` (one formatter for every view)."""

from __future__ import annotations

import time


def clock(t: float | None) -> str:
    """Local wall-clock time 'HH:MM:SS' of a unix time."""
    return "--:--:--" if t is None else time.strftime("%H:%M:%S", time.localtime(t))


def update_static(widget, renderable, key: object, lines: int | None = None) -> bool:
    """`widget.update(renderable)` only when `key` (what it shows) changed since the last call, and
    with a layout pass only when its height may have changed (`lines` differs, or is unknown):
    a repaint at 1 Hz stays a repaint, not a reflow of the whole screen."""
    if getattr(widget, "shown_key", None) == key:
        return False
    layout = lines is None or getattr(widget, "shown_lines", None) != lines
    widget.shown_key, widget.shown_lines = key, lines
    widget.update(renderable, layout=layout)
    return True
