"""One host: its link, and per GPU a memory bar, the last ten minutes of memory, utilisation,
temperature and power; the processes holding the most memory; SIMULATED on drill hosts; stale
readings greyed with their age."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Static

from console.messages import GpuReading, HostState, TelemetryUpdate
from console.views.status import connection_text, short_command
from console.views.units import duration, memory_pair
from screens.format import update_static
from screens.widgets.memory_sparkline import MemorySparkline

HOLDERS_SHOWN = 3
STALE_INTERVALS = 3  # no sample for this many intervals: the readings are old (the core's rule too)
HISTORY_S = 600.0  # the sparkline's ten minutes

History = Callable[[str, int], Sequence[float | None]]


BAR_WIDTH = 13
_EIGHTHS = " ▏▎▍▌▋▊▉"


def memory_bar(gpu: GpuReading, width: int = BAR_WIDTH) -> Text:
    """Used memory as a bar of eighth blocks on a dark track: green, yellow over 60%, red over 90%."""
    if gpu.mem_used_mib is None or not gpu.mem_total_mib:
        return Text("?".center(width), style="dim")
    share = min(max(gpu.mem_used_mib / gpu.mem_total_mib, 0.0), 1.0)
    colour = "red" if share > 0.9 else "yellow" if share > 0.6 else "green"
    full, rest = divmod(int(round(share * width * 8)), 8)
    filled = "█" * full + (_EIGHTHS[rest] if rest else "")
    return Text.assemble((filled, f"{colour} on grey23"), (" " * (width - len(filled)), "on grey23"))


def readings_text(gpu: GpuReading) -> Text:
    """'62%  61°C  231 W'; a reading the host does not report is '?', and a GPU reporting none of
    them (a simulated one, a driver without the counters) says so rather than leaving a gap."""
    if gpu.util_pct is None and gpu.temp_c is None and gpu.power_w is None:
        return Text("util/temp/power n/a", style="dim")
    util = f"{gpu.util_pct:3.0f}%" if gpu.util_pct is not None else "   ?"
    temp = f"{gpu.temp_c:3.0f}°C" if gpu.temp_c is not None else "  ?°C"
    power = f"{gpu.power_w:4.0f} W" if gpu.power_w is not None else "   ? W"
    return Text(f"{util} {temp} {power}")


def gpu_line(gpu: GpuReading) -> Text:
    """'GPU0 ██████████▌   43.9/48.0 GiB  62%  61°C  231 W' (the sparkline follows, its own widget)."""
    line = Text(f"GPU{gpu.index:<2}")
    line.append_text(memory_bar(gpu))
    line.append(f" {memory_pair(gpu.mem_used_mib, gpu.mem_total_mib):>13} ")
    line.append_text(readings_text(gpu))
    return line


class GpuRow(Horizontal):
    """One GPU on one line: memory bar, used/total GiB, util / temperature / power, then the
    sparkline of its memory. Two widgets, not five: a sample repaints each of them once."""

    DEFAULT_CSS = """
    GpuRow { height: 1; }
    GpuRow > .gpu-line { width: 53; }
    GpuRow > MemorySparkline { width: 1fr; min-width: 8; }
    """

    def __init__(self, index: int) -> None:
        super().__init__(classes="gpu-row")
        self.index = index
        self._ready = False  # is_mounted turns True only after on_mount
        self._pending: tuple[GpuReading, Sequence[float | None]] | None = None

    def compose(self) -> ComposeResult:
        yield Static(f"GPU{self.index}", classes="gpu-line")
        yield MemorySparkline([], classes="gpu-spark")

    def on_mount(self) -> None:
        self._ready = True
        if self._pending is not None:
            self.show(*self._pending)

    def show(self, gpu: GpuReading, history: Sequence[float | None]) -> None:
        if not self._ready or not self.children:  # not composed yet, or removed before it was mounted
            self._pending = (gpu, history)
            return
        # A fixed size: a repaint, never a layout pass.
        key = (gpu.mem_used_mib, gpu.mem_total_mib, gpu.util_pct, gpu.temp_c, gpu.power_w)
        update_static(self.query_one(".gpu-line", Static), gpu_line(gpu), key, 1)
        values = [v or 0.0 for v in history] or [0.0]
        spark = self.query_one(MemorySparkline)
        if gpu.mem_total_mib and spark.high != gpu.mem_total_mib:
            spark.high = float(gpu.mem_total_mib)
        if spark.data != values:
            spark.data = values


def gpu_ranges(indices: list[int]) -> str:
    """[0, 1, 2, 3, 5] -> '0-3,5': a process on many GPUs stays whole in a narrow column."""
    runs: list[list[int]] = []
    for i in sorted(set(indices)):
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs) or "-"


def holders_renderable(update: TelemetryUpdate | None) -> Table | Text:
    """The processes holding the most memory on the host: pid, MiB, user, command."""
    sample = update.sample if update is not None else None
    if sample is None:
        return Text("")
    by_pid: dict[int, list] = {}
    for proc in sample.processes:  # one row per process: a server holds every GPU it serves on
        by_pid.setdefault(proc.pid, []).append(proc)
    procs = sorted(by_pid.values(), key=lambda group: -sum(p.mib or 0 for p in group))
    if not procs:
        return Text("no process holds GPU memory", style="dim")
    table = Table(box=None, show_header=True, header_style="dim", padding=(0, 1), expand=True, pad_edge=False)
    table.add_column("pid", justify="right", no_wrap=True)
    table.add_column("GPUs", justify="right", no_wrap=True)  # whole: "0-6", never "0,1,2,3…"
    table.add_column("MiB", justify="right", no_wrap=True)
    table.add_column("user", no_wrap=True, max_width=10)
    table.add_column("command", no_wrap=True, overflow="ellipsis", ratio=1)
    for group in procs[:HOLDERS_SHOWN]:
        proc = group[0]
        command = Text(short_command(proc.command, 200))
        if proc.pid in update.service_pids:
            command.append(" [service]", style="cyan")
        gpus = gpu_ranges([p.gpu for p in group if p.gpu is not None])
        mib = sum(p.mib or 0 for p in group)
        table.add_row(str(proc.pid), gpus, str(mib) if any(p.mib is not None for p in group) else "?",
                      proc.user or "?", command)
    if len(procs) > HOLDERS_SHOWN:
        return Group(table, Text(f"+{len(procs) - HOLDERS_SHOWN} more", style="dim"))
    return table


def holders_key(update: TelemetryUpdate | None) -> object:
    """What the holders table shows, to redraw it only when that changed."""
    sample = update.sample if update is not None else None
    if sample is None:
        return None
    return (tuple((p.pid, p.gpu, p.mib, p.user, p.command) for p in sample.processes), update.service_pids)


class HostPanel(Vertical):
    """A bordered panel per host; `show` redraws it from the newest state."""

    DEFAULT_CSS = """
    HostPanel { height: auto; border: round $primary-darken-1; padding: 0 1; }
    HostPanel.stale .gpu-row, HostPanel.stale .holders { text-opacity: 45%; }
    HostPanel .host-note { color: $warning; height: auto; }
    HostPanel .holders { height: auto; margin-top: 0; }
    HostPanel > .gpus { height: auto; }
    """

    def __init__(self, host: str, history: History) -> None:
        super().__init__(id=f"host-{host}", classes="host-panel")
        self.host = host
        self.history = history
        self.border_title = host
        self._gpus: tuple[int, ...] = ()
        self._rows: list[GpuRow] = []

    def compose(self) -> ComposeResult:
        yield Static(classes="host-note")
        yield Vertical(classes="gpus")
        yield Static(classes="holders")

    def show(self, state: HostState | None, update: TelemetryUpdate | None, now: float,
             received_at: float | None = None) -> None:
        """Redraw; `received_at` (console clock) lets the sample's age move on between messages. A panel
        not composed yet draws nothing: the dashboard's tick can reach it first, and the next tick or
        sample draws it."""
        if not self.is_mounted:
            return
        title = Text(self.host, style="bold")
        if state is not None:
            title.append("  ")
            title.append_text(connection_text(state, now))
        sample = update.sample if update is not None else None
        if sample is not None and sample.simulated:
            title.append("  ")
            title.append(" SIMULATED ", style="bold white on dark_magenta")
        self.border_title = title
        age_s = update.age_s if update is not None else None
        if age_s is not None and received_at is not None:
            age_s += max(0.0, now - received_at)
        stale = bool(update is not None and (update.stale or (
            sample is not None and age_s is not None and age_s > STALE_INTERVALS * max(sample.interval, 0.1))))
        self.set_class(stale, "stale")
        subtitle = ""
        if sample is not None:
            age = duration(age_s, tenths=True) if age_s is not None else "?"
            subtitle = f"STALE: last sample {age} ago" if stale else f"{sample.source}, {age} ago"
        if subtitle != self.border_subtitle:
            self.border_subtitle = subtitle
        note = self.query_one(".host-note", Static)
        problems = []
        if state is not None and state.status in ("down", "reconnecting") and state.last_error:
            problems.append(state.last_error)
        if update is not None and not update.streaming and update.error:
            problems.append(f"telemetry: {update.error}")
        if sample is None and not problems:
            problems.append("waiting for the first telemetry sample")
        elif sample is not None and not sample.gpus:
            problems.append(f"no GPU readings: {sample.reason or 'the agent found none'}")
        update_static(note, "\n".join(problems), tuple(problems))
        note.display = bool(problems)
        if sample is not None:
            self._show_gpus(sample.gpus)
        update_static(self.query_one(".holders", Static), holders_renderable(update), holders_key(update))

    def _show_gpus(self, gpus: Sequence[GpuReading]) -> None:
        box = self.query_one(".gpus", Vertical)
        indices = tuple(g.index for g in gpus)
        if indices != self._gpus:
            box.remove_children()
            self._rows = [GpuRow(i) for i in indices]
            box.mount_all(self._rows)
            self._gpus = indices
        for row, gpu in zip(self._rows, gpus, strict=True):
            row.show(gpu, self.history(self.host, gpu.index))
