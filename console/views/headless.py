"""The headless view of a run: what `dflash-ops run --headless` and the terminal drill print.

It subscribes to the session's bus and prints each step's transitions, the journal's warnings and
errors, the downtime, and rich progress bars for the jobs (weights n/N and bytes, prompts i/N,
anchors); a chosen plan is `console.views.plan.plan_view`.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.progress import (
    BarColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.text import Text

from console import messages as m
from console.procedure.decider import register_live_display
from console.session import MessageBus
from console.views.plan import plan_view
from console.views.units import duration, mib, rate, size

STATUS_STYLE = {"done": "green", "skipped": "cyan", "left-out": "dim", "running": "bold", "failed": "bold red",
                "refused": "yellow", "cancelled": "yellow", "pending": "dim"}


@contextlib.contextmanager
def build_progress(title: str, console: Console | None = None,
                   clock: Callable[[], float] | None = None) -> Iterator[Callable[[str], None]]:
    """A progress line on the terminal for a long build (the drill's assets): the title, a bar and
    the time left once the build counts its work (a `[done/total] what` line), the time so far and
    the build's last line; each other line it writes is kept above. Yields the callback that takes
    those lines."""
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(bar_width=24),
                        TimeElapsedColumn(), TextColumn("{task.fields[left]}"),
                        TextColumn("{task.fields[stage]}", style="dim"),
                        console=console or Console(stderr=True), transient=True, get_time=clock)
    task = progress.add_task(title, total=None, stage="", left="")

    def tell(line: str) -> None:
        counted = COUNTED.match(line)
        if counted is None:
            progress.console.print(Text(f"  {line}", style="dim"))
            progress.update(task, stage=line[:60])
            return
        done, total = int(counted["done"]), int(counted["total"])
        progress.update(task, total=total, completed=done, stage=f"{counted['what']} ({done}/{total})")
        left = progress.tasks[0].time_remaining
        progress.update(task, left=f"about {duration(left)} left" if left is not None else "")
        progress.refresh()

    with progress:
        yield tell


COUNTED = re.compile(r"^\[(?P<done>\d+)/(?P<total>\d+)\] (?P<what>.*)$")  # a build's counted line


BAR_MIN, BAR_MAX = 10, 40


class _JobLines:
    """The jobs' bars, one task a line: its name, the bar, then its values (n/N or sizes, the
    prompt, the rate) and the time. Where a line does not fit the width (80 columns piped, a narrow
    terminal) the bar shrinks, then the values go to the next line, each whole (never `559.2 KiB /
    …` nor `3500.3…`, as rich's table of columns cut them)."""

    def __init__(self, progress: Progress):
        self.progress = progress

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = options.max_width
        with self.progress._lock:
            tasks = [t for t in self.progress.tasks if t.visible]
        pad = max((cell_len(t.description) for t in tasks), default=0)
        rows = []
        for task in tasks:
            values = [v for v in (task.fields.get("count", ""), *task.fields.get("extra", "").split("  ")) if v]
            elapsed = int(task.finished_time if task.finished else (task.elapsed or 0))
            values.append(f"{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}")
            rows.append((task, values))
        # one bar width for all (the values start in one column), as wide as the longest line allows;
        # at least BAR_MIN where the name leaves room (the values that do not fit go to the next line)
        room = min((width - pad - 2 - cell_len(" ".join(values)) for _, values in rows), default=BAR_MAX)
        bar_width = max(0, min(BAR_MAX, max(room, BAR_MIN), width - pad - 1))
        for task, values in rows:
            line = Text(task.description.ljust(pad) + " ", style="progress.description")
            if bar_width:
                line.append_text(_bar(task.percentage / 100 if task.total else 0.0, bar_width))
            for value in values:  # each value whole: on this line, else on the next one, indented
                if cell_len(line.plain) + 1 + cell_len(value) > width and line.plain.strip():
                    yield line
                    line = Text("  ")
                line.append((" " if line.plain.strip() else "") + value)
            yield line


def _bar(fraction: float, width: int) -> Text:
    done = round(max(0.0, min(1.0, fraction)) * width)
    return Text("━" * done, style="bar.complete") + Text("━" * (width - done), style="bar.back")


class _JobBars(Progress):
    def get_renderables(self):
        yield _JobLines(self)


class HeadlessView:
    """Prints a run as it happens."""

    def __init__(self, bus: MessageBus, console: Console | None = None, show_progress: bool = True,
                 warnings_only: bool = False):
        self.console = console or Console(stderr=True)
        self.warnings_only = warnings_only  # `--plan`: the journal's warnings and errors, nothing else
        self.progress = _JobBars(console=self.console, transient=False) if show_progress else None
        self._tasks: dict[tuple[str, str], TaskID] = {}
        self._ended: dict[str, str] = {}  # steps ended before this run's plan (a resume shows them first)
        self._unsubscribe = bus.subscribe(self.on_message)
        self._unregister = lambda: None
        if self.progress is not None:
            self.progress.start()
            self._unregister = register_live_display(self.progress)  # a question pauses the bars

    def close(self) -> None:
        self._unsubscribe()
        self._unregister()
        if self.progress is not None:
            self.progress.stop()

    def _print(self, renderable: Any) -> None:
        self.console.print(renderable, soft_wrap=True)

    def on_message(self, message: Any) -> None:
        if self.warnings_only and not isinstance(message, m.JournalEntry):
            return
        if isinstance(message, m.StepUpdate):
            self._ended[message.step] = message.status
            style = STATUS_STYLE.get(message.status, "")
            took = f" ({duration(message.duration_s, tenths=True)})" if message.duration_s is not None and message.status != "running" else ""
            line = Text(f"[{message.step}] ", style="bold")
            line.append(message.status + took, style=style)
            if message.detail:
                line.append(f": {message.detail}")
            self._print(line)
        elif isinstance(message, m.PlanReady):
            # commands whole, however wide; a resume's plan: only what it will do
            self.console.print(plan_view(message, ended=self._ended), crop=False)
        elif isinstance(message, m.JournalEntry) and message.level in ("warning", "error"):
            self._print(Text(f"  {message.level}: {message.message}", style="yellow" if message.level == "warning" else "red"))
        elif isinstance(message, m.HoldersFound):
            for holder in message.holders:
                self._print(Text(f"  holder: pid {holder.pid} {mib(holder.mib)} {holder.user or '?'} "
                                 f"{holder.command or '?'}" + (" (was the service's)" if holder.was_service else ""),
                                 style="yellow"))
        elif isinstance(message, m.Downtime):
            if message.down_since is not None:
                self._print(Text(f"SERVICE DOWN since {time.strftime('%H:%M:%S', time.localtime(message.down_since))}",
                                 style="bold white on red"))
            elif message.restarted_at is not None:
                self._print(Text("service back up", style="bold green"))
        elif isinstance(message, m.StartupProgress):
            self._print(Text(f"  server: {message.stage}"
                             + (f" {message.done}/{message.total}" if message.total else ""), style="dim"))
        elif type(message).__name__ == "JobProgress":
            self._job_progress(message)
        elif isinstance(message, m.RunFinished):
            style = {"done": "bold green", "degraded": "bold yellow"}.get(message.status, "bold red")
            self._print(Text(f"run {message.run_id} {message.status} (exit {message.exit_code}): {message.message}",
                             style=style))

    def _job_progress(self, message: m.JobProgress) -> None:
        if self.progress is None:
            return
        key = (message.job_id, message.key or message.unit)
        total = message.total
        in_bytes = message.unit == "bytes"
        # n/N, in the console's units for bytes (25.9 GiB / 25.9 GiB), as the dashboard writes it
        count = (f"{size(message.done)} / {size(total)}" if in_bytes else f"{message.done:g}/{total:g}") \
            if total is not None else (size(message.done) if in_bytes else f"{message.done:g}")
        extra = message.message or ""
        if message.rate:  # two spaces: the label and the rate are two values, each kept whole
            extra = f"{extra}  {rate(message.rate) if in_bytes else f'{message.rate:.1f} {message.unit}/s'}".strip()
        if key not in self._tasks:
            description = f"{message.host} {message.worker} {message.key or message.unit}"
            self._tasks[key] = self.progress.add_task(description, total=total, extra=extra, count=count)
        self.progress.update(self._tasks[key], completed=message.done, total=total, extra=extra, count=count)
