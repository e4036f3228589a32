"""The console's one way of writing a duration and a size, shared by the dashboard, the modals, the
results, the headless view and the CLI: an operator reads `1 min 05 s` and `25.9 GiB` the same
everywhere. Memory and files are counted in binary units (GiB, MiB), as nvidia-smi and free do."""

from __future__ import annotations

BINARY_UNITS = (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10))


def duration(seconds: float | None, compact: bool = False, tenths: bool = False) -> str:
    """'4 s', '1 min 05 s', '2 h 03 min', '1 d 4 h'; with `compact`, for narrow columns: '4s',
    '1m05s', '2h03m'; with `tenths`, under 10 s to a tenth ('0.4 s', for a step's or a reading's
    age). '-' (compact: '') for None; a negative duration counts as 0."""
    if seconds is None:
        return "" if compact else "-"
    if tenths and round(seconds, 1) < 10:
        return f"{max(0.0, seconds):.1f}" + ("s" if compact else " s")
    whole = max(0, int(round(seconds)))
    if whole < 60:
        return f"{whole}s" if compact else f"{whole} s"
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes}m{secs:02d}s" if compact else f"{minutes} min {secs:02d} s"
    if whole < 86400 or compact:
        hours, minutes = divmod(whole // 60, 60)
        return f"{hours}h{minutes:02d}m" if compact else f"{hours} h {minutes:02d} min"
    days, hours = divmod(whole // 3600, 24)
    return f"{days} d {hours} h"


def size(nbytes: float | None) -> str:
    """'25.9 GiB', '812.0 MiB', '512 B'; '?' for None."""
    if nbytes is None:
        return "?"
    for unit, scale in BINARY_UNITS:
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def mib(value_mib: float | None) -> str:
    """A size given in MiB (what NVML reports), written as `size` writes it: '43.9 GiB'."""
    return "?" if value_mib is None else size(value_mib * (1 << 20))


def rate(bytes_per_s: float | None) -> str:
    """'2.0 GiB/s'; '' when unknown."""
    return "" if bytes_per_s is None else f"{size(bytes_per_s)}/s"


def memory_pair(used_mib: float | None, total_mib: float | None) -> str:
    """Used of total memory in the total's unit: '43.9/48.0 GiB' ('?' where a reading is missing)."""
    if total_mib is None:
        return f"{mib(used_mib)}/?"
    total = mib(total_mib)
    number, unit = total.split(" ")
    scale = dict(BINARY_UNITS).get(unit, 1) / (1 << 20)
    used = "?" if used_mib is None else f"{used_mib / scale:.1f}"
    return f"{used}/{number} {unit}"
