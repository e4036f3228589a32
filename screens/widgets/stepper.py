"""The procedure's steps: status, how long each took (or has been running), the estimate from
earlier runs, and why a step was skipped, left out, refused or failed. An ended step's time is its
own work; the time its questions waited for the operator is beside it, dim ("0s +19s"; help says
what "+" means), so that a slow answer never reads as a slow stop. Hints name only keys that work."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.widgets import Static

from console.views.units import duration
from screens.format import update_static
from screens.state import StepView

MARKS = {"pending": ("·", "dim"), "running": ("▶", "bold yellow"), "done": ("✓", "green"),
         "skipped": ("↷", "cyan"), "failed": ("✗", "bold red"), "refused": ("⊘", "yellow"),
         "left-out": ("–", "dim"), "cancelled": ("⊘", "yellow")}


def stepper_renderable(steps: Mapping[str, StepView], planned: bool, now: float, running: bool = False,
                       read_only: bool = False, ended: Text | None = None) -> Group:
    table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False, expand=True)
    table.add_column("", width=1, no_wrap=True)
    table.add_column("step", no_wrap=True, min_width=9, ratio=1)
    table.add_column("status", no_wrap=True)
    table.add_column("took", justify="right", no_wrap=True)
    table.add_column("est.", justify="right", no_wrap=True, style="dim")
    notes: list[Text] = []
    for step in steps.values():
        mark, style = MARKS.get(step.status, ("?", ""))
        if step.status == "running" and step.started_at is not None:
            took = duration(now - step.started_at, compact=True)
        elif step.started_at is not None and step.ended_at is not None:
            work = step.work_s if step.work_s is not None else step.ended_at - step.started_at
            took = Text(duration(work, compact=True))
            if step.decision_s is not None and step.decision_s >= 1:
                took.append(f" +{duration(step.decision_s, compact=True)}", style="dim")
        else:
            took = ""
        estimate = f"~{duration(step.estimate_s, compact=True)}" if step.estimate_s is not None else ""
        table.add_row(Text(mark, style=style), Text(step.name, style="bold" if step.status == "running" else ""),
                      Text(step.status, style=style), took, estimate)
        why = step.detail or (step.why if step.status in ("skipped", "left-out") else None)
        if why and step.status in ("skipped", "left-out", "refused", "failed", "cancelled"):
            notes.append(Text(f"{step.name}: {why}", style="red" if step.status == "failed" else "dim"))
    # the run's end first, where the steps are (a toast covered the last rows; under a long route's
    # steps it fell below the panel's bottom on a 40-row screen)
    parts: list = [table] if ended is None else [ended, table]
    followed = any(s.status != "pending" for s in steps.values())  # a run another console drives, seen here
    if not planned and not (read_only and followed):
        idle = "no run going: this console watches" if read_only else "no plan yet: p plans, g runs"
        parts.append(Text("planning: preflight is running" if running else idle, style="dim"))
    parts.extend(notes[-3:])
    return Group(*parts)


def ended_line(finished: Any, read_only: bool = False, steps: Mapping[str, StepView] | None = None) -> Text | None:
    """'run 20251201-093500-ab12 done: o opens the results', under the steps of the run this console drove;
    a run paused after a step names the step that waits for n ('n runs the next step, extract')."""
    if finished is None:
        return None
    if finished.status == "done":
        return Text(f"run {finished.run_id} done" + ("" if read_only else ": o opens the results"), style="green")
    line = f"run {finished.run_id} {finished.status} (exit {finished.exit_code})"
    if finished.status == "paused" and not read_only:
        waiting = next((s.name for s in (steps or {}).values() if s.status == "pending" and s.acts), None)
        line += ": n runs the next step" + (f", {waiting}" if waiting else "")
    return Text(line, style="yellow" if finished.service_up else "bold red")


def stepper_chips(steps: Mapping[str, StepView], now: float) -> Text:
    """The steps on a line or two, for narrow terminals: '✓ preflight  ✓ stage  ▶ extract 1m45s  · restart'."""
    text = Text()
    for step in steps.values():
        mark, style = MARKS.get(step.status, ("?", ""))
        if text:
            text.append("  ")
        text.append(f"{mark}{step.name}", style=style if step.status != "pending" else "dim")
        if step.status == "running" and step.started_at is not None:
            text.append(f"\u00a0{duration(now - step.started_at, compact=True)}", style="bold")
    return text


class Stepper(Static):
    DEFAULT_CSS = """
    Stepper { height: auto; border: round $primary-darken-1; padding: 0 1; }
    """

    def __init__(self) -> None:
        super().__init__(id="stepper")
        self.border_title = "Steps"

    def show(self, steps: Mapping[str, StepView], planned: bool, run_id: str | None, route: str | None,
             now: float, compact: bool = False, running: bool = False, read_only: bool = False,
             finished: Any = None) -> None:
        self.border_title = f"Steps  {run_id}" + (f" ({route})" if route and route != "window" else "") \
            if run_id else "Steps"
        ended = None if running else ended_line(finished, read_only, steps)
        key = (compact, planned, running, read_only, ended and ended.plain, tuple((s.name, s.status, s.estimate_s, s.started_at, s.ended_at, s.detail,
                                        s.work_s, s.decision_s,
                                        int(now - s.started_at) if s.status == "running" and s.started_at else None)
                                       for s in steps.values()))
        if compact:  # the chips, and the run's end on a line of its own
            shown = stepper_chips(steps, now) if ended is None else Text("\n").join([stepper_chips(steps, now), ended])
        else:
            shown = stepper_renderable(steps, planned, now, running, read_only, ended)
        update_static(self, shown, key)
