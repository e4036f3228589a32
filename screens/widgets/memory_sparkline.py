"""Textual's Sparkline on a fixed scale: 0 to the GPU's memory, not the data's own min..max, so a
GPU that sat at 39 GB for ten minutes reads high, an idle one low, and a drop to zero shows."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from rich.console import Console, ConsoleOptions, RenderResult
from rich.segment import Segment
from rich.style import Style
from textual.app import RenderResult as TextualRenderResult
from textual.reactive import reactive
from textual.renderables._blend_colors import blend_colors
from textual.renderables.sparkline import Sparkline as SparklineRenderable
from textual.widgets import Sparkline

BARS = "▁▂▃▄▅▆▇█"


class FixedRangeSparkline(SparklineRenderable):
    """One line of bars, each the mean of its share of the data, scaled to [low, high]."""

    def __init__(self, data: Sequence[float], low: float, high: float, **kwargs) -> None:
        super().__init__(data, **kwargs)
        self.low, self.high = low, high

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        width = self.width or options.max_width
        data = list(self.data)
        if not data:
            yield Segment(" " * width)
            return
        extent = (self.high - self.low) or 1.0
        buckets = list(self._buckets(data, num_buckets=min(width, len(data))))
        shown = [buckets[int(i * len(buckets) / width)] for i in range(width)] if len(buckets) < width else buckets
        min_color, max_color = self.min_color.color, self.max_color.color
        for bucket in shown:
            ratio = min(max((statistics.fmean(bucket) - self.low) / extent, 0.0), 1.0)
            yield Segment(BARS[min(int(ratio * len(BARS)), len(BARS) - 1)],
                          Style.from_color(blend_colors(min_color, max_color, ratio)))


class MemorySparkline(Sparkline):
    """A GPU's used memory over the last minutes, from 0 to its total."""

    high = reactive(1.0)

    def render(self) -> TextualRenderResult:
        _, base = self.background_colors
        min_color = base + self.get_component_styles("sparkline--min-color").color
        max_color = base + self.get_component_styles("sparkline--max-color").color
        return FixedRangeSparkline(self.data or [], 0.0, self.high, width=self.size.width, height=1,
                                   min_color=min_color.rich_color, max_color=max_color.rich_color)
