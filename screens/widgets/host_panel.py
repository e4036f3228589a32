"""One host: its link, and per GPU a memory bar, the last ten minutes of memory, utilisation,
temperature and power; the processes holding the most memory; SIMULATED on drill hosts; stale
readings greyed with their age."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.bar import Bar
from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import Sparkline, Static

from console.messages import GpuReading, HostState, TelemetryUpdate
from console.views.status import ago, connection_text, short_command
from screens.format import gib

HOLDERS_SHOWN = 3
HISTORY_S = 600.0  # the sparkline's ten minutes

History = Callable[[str, int], Sequence[float | None]]


def memory_bar(gpu: GpuReading, width: int = 16) -> Bar | Text:
    if gpu.mem_used_mib is None or not gpu.mem_total_mib:
        return Text("?".center(width), style="dim")
    share = gpu.mem_used_mib / gpu.mem_total_mib
    colour = "red" if share > 0.9 else "yellow" if share > 0.6 else "green"
    return Bar(size=gpu.mem_total_mib, begin=0, end=gpu.mem_used_mib, width=width, color=colour,
               bgcolor="grey23")


def readings_text(gpu: GpuReading) -> str:
    if gpu.util_pct is None and gpu.temp_c is None and gpu.power_w is None:
        return ""  # a simulated GPU reports memory only
    util = f"{gpu.util_pct:3.0f}%" if gpu.util_pct is not None else "   ?"
    temp = f"{gpu.temp_c:3.0f}°C" if gpu.temp_c is not None else "  ?°C"
    power = f"{gpu.power_w:4.0f} W" if gpu.power_w is not None else "   ? W"
    return f"{util} {temp} {power}"


class GpuRow(Horizontal):
    """GPU index, memory bar, used/total GiB, sparkline, util / temperature / power."""

    DEFAULT_CSS = """
    GpuRow { height: 1; }
    GpuRow > .gpu-name { width: 5; }
    GpuRow > .gpu-bar { width: 17; }
    GpuRow > .gpu-mem { width: 13; }
    GpuRow > Sparkline { width: 1fr; min-width: 8; margin: 0 1 0 0; }
    GpuRow > .gpu-readings { width: 17; }
    """

    def __init__(self, index: int) -> None:
        super().__init__(classes="gpu-row")
        self.index = index
        self._ready = False  # is_mounted turns True only after on_mount
        self._pending: tuple[GpuReading, Sequence[float | None]] | None = None

    def compose(self) -> ComposeResult:
        yield Static(f"GPU{self.index}", classes="gpu-name")
        yield Static(classes="gpu-bar")
        yield Static(classes="gpu-mem")
        yield Sparkline([], classes="gpu-spark")
        yield Static(classes="gpu-readings")

    def on_mount(self) -> None:
        self._ready = True
        if self._pending is not None:
            self.show(*self._pending)

    def show(self, gpu: GpuReading, history: Sequence[float | None]) -> None:
        if not self._ready or not self.children:  # not composed yet, or removed before it was mounted
            self._pending = (gpu, history)
            return
        self.query_one(".gpu-bar", Static).update(memory_bar(gpu))
        self.query_one(".gpu-mem", Static).update(f" {gib(gpu.mem_used_mib):>5}/{gib(gpu.mem_total_mib)}G")
        values = [v or 0.0 for v in history]
        self.query_one(Sparkline).data = values or [0.0]
        self.query_one(".gpu-readings", Static).update(readings_text(gpu))


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
    table.add_column("GPUs", justify="right", no_wrap=True, max_width=8, overflow="ellipsis")
    table.add_column("MiB", justify="right", no_wrap=True)
    table.add_column("user", no_wrap=True, max_width=10)
    table.add_column("command", no_wrap=True, overflow="ellipsis", ratio=1)
    for group in procs[:HOLDERS_SHOWN]:
        proc = group[0]
        command = Text(short_command(proc.command, 200))
        if proc.pid in update.service_pids:
            command.append(" [service]", style="cyan")
        gpus = ",".join(str(p.gpu) for p in group if p.gpu is not None) or "-"
        mib = sum(p.mib or 0 for p in group)
        table.add_row(str(proc.pid), gpus, str(mib) if any(p.mib is not None for p in group) else "?",
                      proc.user or "?", command)
    if len(procs) > HOLDERS_SHOWN:
        return Group(table, Text(f"+{len(procs) - HOLDERS_SHOWN} more", style="dim"))
    return table


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

    def show(self, state: HostState | None, update: TelemetryUpdate | None, now: float) -> None:
        title = Text(self.host, style="bold")
        if state is not None:
            title.append("  ")
            title.append_text(connection_text(state, now))
        sample = update.sample if update is not None else None
        if sample is not None and sample.simulated:
            title.append("  ")
            title.append(" SIMULATED ", style="bold white on dark_magenta")
        self.border_title = title
        self.set_class(bool(update is not None and update.stale), "stale")
        subtitle = ""
        if sample is not None:
            age = ago(update.age_s) if update.age_s is not None else "?"
            subtitle = f"STALE: last sample {age} ago" if update.stale else f"{sample.source}, {age} ago"
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
        note.update("\n".join(problems))
        note.display = bool(problems)
        if sample is not None:
            self._show_gpus(sample.gpus)
        self.query_one(".holders", Static).update(holders_renderable(update))

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
