"""The current remote job: one progress bar per counter it reports (weights in tensors and bytes,
prompts, anchors) with n/N, the rate when the core measured one, and the extraction's time left.
Only the job going now says its phase; a finished one says it finished. A value and its unit are
joined by a no-break space, so a narrow panel never splits `25.9 GiB` over two lines."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, RenderResult
from rich.measure import Measurement
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import ProgressBar, Static

from console.views.units import duration, size
from screens.state import JobView

NBSP = "\u00a0"


class Glued:
    """Text that wraps at its plain spaces only: a value and its unit joined by a no-break space
    stay on one line (rich itself breaks at a no-break space: `7000.5` / `anchor/s`)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        words = self.text.split(" ")
        return Measurement(max((cell_len(w) for w in words), default=1), cell_len(self.text))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        line = ""
        for word in self.text.split(" "):
            joined = f"{line} {word}" if line else word
            if line and cell_len(joined) > options.max_width:
                yield Text(line.replace(NBSP, " "), overflow="fold")
                line = word
            else:
                line = joined
        yield Text(line.replace(NBSP, " "), overflow="fold")


def whole(text: str) -> str:
    """A value and its unit that never wrap apart."""
    return text.replace(" ", NBSP)


def note_of(job: JobView) -> str:
    """The line under a job's counters: why it stalled, its last log line, or its phase while it runs."""
    if job.stalled:
        return job.stalled
    if job.finished:
        return ""  # the title says it finished; its last phase is no longer news
    return job.last_log or (f"phase: {job.phase}" if job.phase else "")


def counter_text(progress: Any, in_bytes: Any = None, eta_s: float | None = None) -> tuple[str, str]:
    """(head, detail): ('weights 480/480 tensors', '25.9 GiB / 25.9 GiB, 2.0 GiB/s'),
    ('prompts 4/10', 'async_rate_limiter: 1536 tokens, 0.4 prompts/s, 15 s left')."""
    key = str(getattr(progress, "key", None) or getattr(progress, "unit", "")).replace("_", " ")
    unit = str(getattr(progress, "unit", "") or "")
    done, total = getattr(progress, "done", None), getattr(progress, "total", None)
    details: list[str] = []
    if unit == "bytes":
        head = f"{key} {whole(size(done))}" + (f" / {whole(size(total))}" if total else "")
    else:
        shown_total = f"/{total:g}" if isinstance(total, int | float) else ""
        shown_done = f"{done:g}" if isinstance(done, int | float) else "?"
        named = unit and not key.startswith(unit.rstrip("s"))  # 'prompts 1/4', not 'prompts 1/4 prompt'
        head = f"{key} {shown_done}{shown_total}" + (f"{NBSP}{unit}" if named else "")
        label = getattr(progress, "message", None)
        if label and in_bytes is None:
            details.append(str(label))
    rate = getattr(progress, "rate", None)
    if in_bytes is not None:
        details.append(whole(size(in_bytes.done)) + (f" / {whole(size(in_bytes.total))}" if in_bytes.total else ""))
        rate, unit = in_bytes.rate, "bytes"
    if isinstance(rate, int | float) and rate > 0:
        details.append(whole(f"{size(rate)}/s" if unit == "bytes" else f"{rate:.1f} {unit or key}/s"))
    if eta_s is not None:
        details.append(whole(f"{duration(eta_s)} left"))
    return head, ", ".join(details)


class Counter(Horizontal):
    DEFAULT_CSS = """
    Counter { height: auto; layout: grid; grid-size: 2; grid-columns: 15 1fr; grid-rows: auto; }
    Counter > ProgressBar { width: 15; }
    Counter > ProgressBar > Bar { width: 9; }
    Counter > Static { width: 1fr; height: auto; }
    Counter > .detail { column-span: 2; color: $text-muted; padding-left: 2; }
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
        yield Static(classes="detail")

    def on_mount(self) -> None:
        self._ready = True
        if self._pending is not None:
            self.show(*self._pending)

    def show(self, progress: Any, in_bytes: Any = None, eta_s: float | None = None) -> None:
        if not self._ready:
            self._pending = (progress, in_bytes, eta_s)
            return
        bars = self.query(ProgressBar)
        if not bars:  # being removed (the job changed) or not composed yet
            self._pending = (progress, in_bytes, eta_s)
            return
        total, done = getattr(progress, "total", None), getattr(progress, "done", None)
        bar = bars.first()
        bar.display = bool(total)
        if total:
            bar.update(total=float(total), progress=float(done or 0))
        head, detail = counter_text(progress, in_bytes, eta_s)
        self.query_one(".text", Static).update(Glued(head))
        shown = self.query_one(".detail", Static)
        shown.update(Glued(detail))
        shown.display = bool(detail)


class JobSection(Vertical):
    """One job: its name, a counter per key it reports, and its last log line (or why it stalled)."""

    DEFAULT_CSS = """
    JobSection { height: auto; }
    JobSection > .job-title { text-style: bold; }
    JobSection > .counters { height: auto; }
    JobSection > .job-note { color: $text-muted; height: auto; }
    JobSection.stalled > .job-note { color: $warning; }
    """

    def __init__(self, job_id: str) -> None:
        super().__init__(classes="job-section")
        self.job_id = job_id
        self._counters: dict[str, Counter] = {}
        self._ready = False  # is_mounted turns True only after on_mount
        self._pending: tuple[JobView, bool, float] | None = None

    def on_mount(self) -> None:
        self._ready = True
        if self._pending is not None:
            self.show(*self._pending)

    def compose(self) -> ComposeResult:
        yield Static(classes="job-title")
        yield Vertical(classes="counters")
        yield Static(classes="job-note")

    def show(self, job: JobView, titled: bool, now: float) -> None:
        titles = self.query(".job-title")
        if not self._ready or not titles:  # not composed yet, or removed before it was mounted
            self._pending = (job, titled, now)
            return
        title = titles.first(Static)
        title.update(job.label + (" (finished)" if job.finished else ""))
        title.display = titled
        box = self.query_one(".counters", Vertical)
        if not box.is_attached:  # the section is being removed (its job went): nothing to draw
            return
        for key, progress in job.bars.items():
            if key.endswith("_bytes") and key[: -len("_bytes")] in job.bars:
                continue  # drawn on its counter's line: "weights 480/480 tensors" + "27.8 / 27.8 GB, 2.1 GB/s"
            counter = self._counters.get(key)
            if counter is None:
                counter = self._counters[key] = Counter(key)
                box.mount(counter)
            eta = job.eta_s(now) if key == job.eta_key() and not job.finished else None
            counter.show(progress, job.bars.get(f"{key}_bytes"), eta)
        self.set_class(job.stalled is not None, "stalled")
        text = note_of(job)
        note = self.query_one(".job-note", Static)
        note.update(text)
        note.display = bool(text)


class JobPanel(Vertical):
    """The jobs going now (stage and cache run side by side), else the last one that ran."""

    DEFAULT_CSS = """
    JobPanel { height: auto; max-height: 1fr; overflow-y: auto; scrollbar-size-vertical: 1;
               border: round $primary-darken-1; padding: 0 1; }
    JobPanel > .job-idle { color: $text-muted; height: auto; }
    """

    def __init__(self) -> None:
        super().__init__(id="job")
        self.border_title = "Job"
        self._sections: dict[str, JobSection] = {}

    def compose(self) -> ComposeResult:
        yield Static("no job running", classes="job-idle")

    def show(self, jobs: list[JobView], now: float) -> None:
        jobs = [j for j in jobs if j.bars or not j.finished]  # a finished job with nothing to show: no empty box
        self.query_one(".job-idle", Static).display = not jobs
        self.set_class(not jobs or all(j.finished for j in jobs), "idle")
        wanted = {j.job_id for j in jobs}
        for job_id in [k for k in self._sections if k not in wanted]:
            self._sections.pop(job_id).remove()
        if len(jobs) == 1:
            self.border_title = f"Job {jobs[0].label}" + (" (finished)" if jobs[0].finished else "")
        else:
            self.border_title = f"Jobs ({len(jobs)})" if jobs else "Job"
        for job in jobs:
            section = self._sections.get(job.job_id)
            if section is None:
                section = self._sections[job.job_id] = JobSection(job.job_id)
                self.mount(section)
            section.show(job, titled=len(jobs) > 1, now=now)
