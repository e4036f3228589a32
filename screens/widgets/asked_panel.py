"""What another console waits on: a watching (read-only) console shows the question the driving
console has open, its action, host and literal command whole (wrapped, folded inside a path longer
than the line). The DOWN banner, three rows at most, says only what is asked and where; this block,
under it and the screen's width (the side column is full at 120 x 40 and capped at 80 x 24), says
the rest. Hidden while nothing is asked."""

from __future__ import annotations

from rich.console import Group
from rich.text import Text
from textual.widgets import Static

from console.messages import AskedQuestion
from screens.format import update_static


def asked_renderable(asked: AskedQuestion, run_id: str) -> Group:
    lines = [Text(f"run {run_id}'s console asks: {asked.what}", style="bold")]
    if asked.command:  # the budget offer runs no command of its own
        lines.append(Text(f"$ {asked.command}", overflow="fold"))
    return Group(*lines)


class AskedPanel(Static):
    """Hidden (class "idle") until `show` gets a question."""

    DEFAULT_CSS = """
    AskedPanel { height: auto; border-left: thick $warning; padding: 0 1; color: $warning; }
    AskedPanel.idle { display: none; }
    """

    def __init__(self) -> None:
        super().__init__(id="asked", classes="idle")

    def show(self, asked: AskedQuestion | None, run_id: str | None) -> None:
        self.set_class(asked is None, "idle")
        if asked is None:
            return
        shown = asked_renderable(asked, run_id or "?")
        width = max(1, self.content_region.width or 40)
        rows = sum(max(1, -(-t.cell_len // width)) for t in shown.renderables)
        update_static(self, shown, tuple(t.markup for t in shown.renderables), rows)
