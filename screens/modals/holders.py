"""After the stop, processes still hold VRAM on the service's GPUs: which ones, which of them the
console proposes to end (exactly these PIDs, TERM then KILL), and the literal command it will run."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from console.messages import Confirmation, HoldersFound, VramHolder
from console.views.units import duration
from screens.modals.confirm import REFUSALS, QuestionModal, command_text
from screens.widgets.event_log import short_paths


def targeted_pids(argv: tuple[str, ...]) -> set[int]:
    """The pids the endpids command names (its PID:START_TIME arguments)."""
    pids = set()
    for arg in argv:
        head, sep, tail = arg.partition(":")
        if sep and head.isdigit() and tail.isdigit():
            pids.add(int(head))
    return pids


def holders_table(holders: tuple[VramHolder, ...], targets: set[int]) -> Table:
    """One row per holder: whether the command ends it, pid, MiB, GPUs, user, and its command tagged
    [service] when it was the service's (its process tree or cgroup before the stop)."""
    table = Table(box=None, header_style="bold", padding=(0, 1), pad_edge=False, expand=True)
    for name, justify in (("end", "left"), ("pid", "right"), ("MiB", "right"), ("GPUs", "left"),
                          ("user", "left"), ("command", "left")):
        table.add_column(name, justify=justify, no_wrap=name != "command", ratio=1 if name == "command" else None)
    for h in sorted(holders, key=lambda h: -h.mib):
        chosen = h.pid in targets if targets else True
        command = Text(short_paths(h.command or "?"), overflow="fold")  # the literal command is above, whole
        command.append(" [service]" if h.was_service else " [not the service's]",
                       style="cyan" if h.was_service else "yellow")
        if not h.visible:
            command.append(f" [not visible here: {h.visible_reason or 'another pid namespace'}]", style="dim")
        table.add_row(Text("yes", style="bold red") if chosen else Text("no", style="dim"), str(h.pid), str(h.mib),
                      ",".join(map(str, h.gpus)), h.user or "?", command)
    return table


class HoldersModal(QuestionModal):
    """Answer True to end the listed processes, False to leave them (the run stops there)."""

    def __init__(self, confirmation: Confirmation, found: HoldersFound | None) -> None:
        n = len(found.holders) if found is not None else None
        what = f"{n} process{'es' if n != 1 else ''}" if n is not None else "the processes"
        super().__init__(f"VRAM is still held on {confirmation.host} after the stop: end {what}?",
                         yes="End them", no="Leave them", destructive=True, id="holders",
                         refusal=REFUSALS["free-vram"])
        self.confirmation = confirmation
        self.found = found

    def body(self) -> ComposeResult:
        c, found = self.confirmation, self.found
        yield Static(Text(f"on {c.host}, runs (exactly these PIDs: TERM, then KILL after the grace period):"),
                     classes="label")
        yield Static(command_text(c.argv), classes="command")
        yield Static(Text(f"impact: {c.impact}"), classes="impact")
        if c.estimate_s is not None:
            yield Static(Text(f"estimate: {duration(c.estimate_s)}"))
        if found is not None:
            yield Static(Text(f"still used: {found.used} (free means under {found.threshold_mib} MiB per GPU)"))
            yield Static(holders_table(found.holders, targeted_pids(c.argv)), classes="holders-table")
