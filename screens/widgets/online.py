"""The results screen's "Online" tab: the served drafter's online tau beside its offline tau (the
run's crosscheck.json, `console.procedure.crosscheck`), per prompt, with the triage list when they
disagree; one dim line when the run has no cross-check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.containers import VerticalScroll
from textual.widgets import Static

from console.procedure.crosscheck import (
    PROMPT_HEADERS,
    CrossCheckError,
    load,
    prompt_rows,
    summary_sentence,
    triage_lines,
)

NO_CHECK = "no crosscheck.json in this run: the online cross-check did not run (dflash-ops crosscheck RUN runs it)"


def read_online(run_dir: Path) -> dict[str, Any] | str:
    """The run's cross-check as report.json's `online`, or the line to show instead."""
    try:
        found = load(run_dir)
    except CrossCheckError as exc:
        return str(exc)
    return NO_CHECK if found is None else found.to_json()


def online_view(online: dict[str, Any] | str) -> tuple[Group, Table | None, Group]:
    """What the tab shows: the verdict first (red when they disagree), the per-prompt table, the
    definitions, then the triage; the sentences fold into the screen, the table keeps its width
    (every prompt name and tau whole: it scrolls sideways when wider than the screen)."""
    if isinstance(online, str):
        return Group(Text(online, style="dim")), None, Group()
    style = {True: "green", False: "bold red"}.get(online.get("agrees"), "")
    head = Group(Text(summary_sentence(online), style=style), Text(""))
    table = None
    if online.get("prompts"):
        table = Table(title="Per prompt", title_justify="left", box=None, header_style="bold", padding=(0, 2, 0, 0))
        for name in PROMPT_HEADERS:
            table.add_column(name, justify="left" if name == "prompt" else "right", no_wrap=True)
        for row in prompt_rows(online):
            table.add_row(*row, style="red" if row[-1] == "NO" else "")
    parts: list[Any] = []
    if online.get("tau") is not None:
        parts += [Text(""), *(Text(f"{label}: {online.get(key)}", style="dim") for label, key in (
            ("online", "definition"), ("offline", "offline_definition"), ("agreement", "agreement")))]
    if online.get("triage"):
        parts += [Text(""), Text("Triage (suspects first)", style="bold")]
        parts += [Text(line, style="red" if line.startswith("SUSPECT") else "") for line in triage_lines(online)]
    return head, table, Group(*parts)


class OnlinePanel(VerticalScroll):
    """The Online tab's content, scrollable; `online` is report.json's `online` or a line to show."""

    def __init__(self, online: dict[str, Any] | str) -> None:
        head, table, tail = online_view(online)
        shown = [Static(head, classes="table fit")]
        if table is not None:
            shown.append(Static(table, classes="table online-prompts"))  # its natural width: never cut
        shown.append(Static(tail, classes="table fit"))
        super().__init__(*shown, id="online-view", classes="result-scroll")
        self.online = online
