"""The current remote job: one progress bar per counter it reports (weights in tensors and bytes,
prompts, anchors) with n/N, and the rate when the core measured one."""

from __future__ import annotations

from typing import Any

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import ProgressBar, Static

from screens.format import size
from screens.state import JobView


def counter_text(progress: Any) -> str:
    """'weights 120/480 tensors, 12.3 GB', 'prompts 3/10: linked_list_reverse', '12.4 GB'."""
    key = str(getattr(progress, "key", None) or getattr(progress, "unit", ""))
    unit = str(getattr(progress, "unit", "") or "")
    done, total = getattr(progress, "done", None), getattr(progress, "total", None)
    if unit == "bytes":
        text = f"{key} {size(done)}" + (f" / {size(total)}" if total else "")
    else:
        shown_total = f"/{total:g}" if isinstance(total, int | float) else ""
        shown_done = f"{done:g}" if isinstance(done, int | float) else "?"
        text = f"{key} {shown_done}{shown_total}" + (f" {unit}" if unit and unit != key else "")
    label = getattr(progress, "message", None)
    if label:
        text += f", {label}"
    rate = getattr(progress, "rate", None)
    if isinstance(rate, int | float) and rate > 0:
        text += f", {size(rate)}/s" if unit == "bytes" else f", {rate:.1f} {unit or key}/s"
    return text


class Counter(Horizontal):
    DEFAULT_CSS = """
    Counter { height: 1; }
    Counter > ProgressBar { width: 22; }
    Counter > ProgressBar > Bar { width: 14; }
    Counter > Static { width: 1fr; }
    """

    def __init__(self, key: str) -> None:
        super().__init__(classes="counter")
        self.key = key
        self._ready = False  # is_mounted turns True only after on_mount
        self._pending: Any = None

    def compose(self) -> ComposeResult:
        # No ETA (it jumps; snapshots would differ) and no bar for a counter without a total
        # (an indeterminate bar animates forever).
        yield ProgressBar(show_eta=False, classes="bar")
        yield Static(classes="text")

    def on_mount(self) -> None:
        self._ready = True
        if self._pending is not None:
            self.show(self._pending)

    def show(self, progress: Any) -> None:
        if not self._ready:
            self._pending = progress
            return
        total, done = getattr(progress, "total", None), getattr(progress, "done", None)
        bar = self.query_one(ProgressBar)
        bar.display = bool(total)
        if total:
            bar.update(total=float(total), progress=float(done or 0))
        self.query_one(".text", Static).update(counter_text(progress))


class JobPanel(Vertical):
    DEFAULT_CSS = """
    JobPanel { height: auto; border: round $primary-darken-1; padding: 0 1; }
    JobPanel > .job-note { color: $text-muted; height: auto; }
    JobPanel > .counters { height: auto; }
    JobPanel.stalled > .job-note { color: $warning; }
    """

    def __init__(self) -> None:
        super().__init__(id="job")
        self.border_title = "Job"
        self._job: str | None = None
        self._counters: dict[str, Counter] = {}

    def compose(self) -> ComposeResult:
        yield Vertical(classes="counters")
        yield Static("no job running", classes="job-note")

    def show(self, job: JobView | None) -> None:
        note = self.query_one(".job-note", Static)
        box = self.query_one(".counters", Vertical)
        if job is None:
            self.border_title = "Job"
            note.update("no job running")
            return
        if job.job_id != self._job:
            box.remove_children()
            self._counters = {}
            self._job = job.job_id
        self.border_title = f"Job {job.label}" + (" (finished)" if job.finished else "")
        for key, progress in job.bars.items():
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters[key] = Counter(key)
                box.mount(counter)
            counter.show(progress)
        self.set_class(job.stalled is not None, "stalled")
        text = job.stalled or job.last_log or (f"phase {job.phase}" if job.phase else "")
        note.update(text)
        note.display = bool(text)
