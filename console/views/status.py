"""What `dflash-ops status` draws: hosts (connection, latency, GPUs, holders) and the service, as rich
renderables built from the messages the core publishes. Pure: no I/O, the time is passed in.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from console.messages import GpuReading, HostState, ServiceView, TelemetryUpdate
from console.views.units import duration, memory_pair, mib

COMMAND_CHARS = 60



def connection_text(state: HostState, now: float) -> Text:
    """The host's link: 'connected, 1.2 ms', 'reconnecting for 12 s', 'down' (why: `problem_lines`)."""
    if state.status == "connected":
        latency = f", {state.latency_s * 1000:.1f} ms" if state.latency_s is not None else ""
        return Text(f"connected{latency}", style="green")
    if state.status == "connecting":
        return Text("connecting...", style="yellow")
    if state.status == "reconnecting":
        return Text(f"reconnecting for {duration(now - state.since, tenths=True)}", style="yellow")
    return Text("down", style="bold red")


def problem_lines(states: Mapping[str, HostState], telemetry: Mapping[str, TelemetryUpdate | None]) -> list[Text]:
    """Why a host is down or reconnecting, and why its telemetry stopped: one full line each, under
    the table (too long for a cell, and worth copying whole)."""
    lines = []
    for name, state in states.items():
        if state.status in ("down", "reconnecting") and state.last_error:
            lines.append(Text(f"{state.status}: {state.last_error}", style="bold red" if state.status == "down" else "yellow"))
        update = telemetry.get(name)
        no_sample = update is not None and update.sample is None and update.error
        if no_sample or (state.status == "connected" and update is not None and not update.streaming and update.error):
            lines.append(Text(f"{name}: telemetry: {update.error}", style="yellow"))
    return lines


def _memory(gpu: GpuReading) -> str:
    """'43.9/48.0 GiB 91%': the dashboard's unit, whole."""
    if gpu.mem_used_mib is None:
        return "? MiB"
    share = f" {100 * gpu.mem_used_mib / gpu.mem_total_mib:.0f}%" if gpu.mem_total_mib else ""
    return memory_pair(gpu.mem_used_mib, gpu.mem_total_mib) + share


def short_command(command: str | None, limit: int = COMMAND_CHARS) -> str:
    """'/opt/venv/bin/python -m sglang.launch_server ...' -> 'python -m sglang.launch_server ...',
    cut at `limit` characters: the program's name and first arguments say what it is."""
    if not command:
        return "?"
    program, _, rest = command.partition(" ")
    text = f"{program.rsplit('/', 1)[-1]} {rest}".rstrip()
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _holders(update: TelemetryUpdate, gpu: int) -> Text:
    """The GPU's biggest holder (pid, MiB, [service], then its command, shortened by `short_command`),
    and how many more: one row per GPU."""
    procs = sorted((p for p in update.sample.processes if p.gpu == gpu), key=lambda p: -(p.mib or 0))
    if not procs:
        return Text("-", style="dim")
    top = procs[0]
    text = Text(f"{top.pid} {mib(top.mib)}")
    if top.pid in update.service_pids:
        text.append(" [service]", style="cyan")
    if len(procs) > 1:
        text.append(f" +{len(procs) - 1} more", style="dim")
    text.append(f" {short_command(top.command)}")
    return text


def telemetry_text(update: TelemetryUpdate | None) -> Text:
    """The sample's source and age: 'nvml, 0.4 s ago', 'SIMULATED, 0.2 s ago', 'STALE: 14 s ago'."""
    if update is None or update.sample is None:
        why = "why: below" if update is not None and update.error else "waiting for the agent"  # whole, under the table
        return Text(f"no sample yet ({why})", style="yellow")
    sample = update.sample
    text = Text()
    if sample.simulated:
        text.append("SIMULATED", style="bold magenta")
    else:
        text.append(sample.source)
    age = duration(update.age_s, tenths=True) if update.age_s is not None else "?"
    if update.stale:
        text.append(f", STALE: last sample {age} ago", style="bold yellow")
    else:
        text.append(f", {age} ago", style="dim")
    return text


@dataclass(frozen=True)
class HostRows:
    """One host as `status` shows it: its name, link and telemetry source, and a row per GPU (GPU,
    memory, util, holders; a single row for a host without readings)."""

    name: str
    link: Text
    source: Text
    gpus: tuple[tuple[Text, Text, Text, Text], ...]


HEADERS = ("host", "connection", "telemetry", "GPU", "memory", "util", "holders: pid, memory, command")
_GPU_HEADERS = HEADERS[3:]
HOLDERS_MIN = 30  # narrower, the holders column would fold inside words: a line per value instead


def host_rows(states: Mapping[str, HostState], telemetry: Mapping[str, TelemetryUpdate | None],
              now: float) -> list[HostRows]:
    """Each host's cells, for either layout of `HostsView`."""
    hosts = []
    for name, state in states.items():
        update = telemetry.get(name)
        link = connection_text(state, now)
        source = telemetry_text(update) if state.status == "connected" or update is not None else Text("-")
        stale = "dim" if update is not None and update.stale else ""
        sample = update.sample if update is not None else None
        if sample is None:
            rows = ((Text("-"), Text(""), Text(""), Text("")),)
        elif not sample.gpus:  # the agent says why (no NVML, no nvidia-smi): in the widest column
            rows = ((Text("no GPU readings", style="yellow"), Text(""), Text(""),
                     Text(sample.reason or "", style="yellow")),)
        else:
            rows = tuple((Text(f"{gpu.index} {(gpu.name or '').replace('NVIDIA ', '')}".rstrip(), style=stale),
                          Text(_memory(gpu), style=stale),
                          Text(f"{gpu.util_pct:.0f}%" if gpu.util_pct is not None else "?", style=stale),
                          _holders(update, gpu.index)) for gpu in sample.gpus)
        hosts.append(HostRows(name, link, source, rows))
    return hosts


class HostsView:
    """The hosts, never a value cut (host names, links, GPUs, memory, util, holders): one table, a
    row per GPU with the host's link on its first row, where every cell fits whole on its line;
    else one block per host (its name, link and telemetry on a line, then its GPUs' rows, under one
    header) whose holders wrap between words, as piped or at 80 columns."""

    def __init__(self, hosts: list[HostRows]):
        self.hosts = hosts

    def _widths(self) -> list[int]:
        widths = [cell_len(h) for h in HEADERS]
        for host in self.hosts:
            for i, cell in enumerate((host.name, host.link.plain, host.source.plain)):
                widths[i] = max(widths[i], cell_len(cell))
            for row in host.gpus:
                for i, cell in enumerate(row, start=3):
                    widths[i] = max(widths[i], cell.cell_len)
        return widths

    def table(self) -> Table:
        """A row per GPU, every cell whole on one line (drawn only where that fits)."""
        table = Table(title="Hosts", title_justify="left", header_style="bold", box=None, padding=(0, 1), expand=True)
        for header in HEADERS:
            table.add_column(header, no_wrap=True, justify="right" if header == "util" else "left",
                             ratio=1 if header.startswith("holders") else None)
        for host in self.hosts:
            for i, row in enumerate(host.gpus):
                first = (host.name, host.link, host.source) if i == 0 else ("", "", "")
                table.add_row(*first, *row)
        return table

    def stacked(self, widths: list[int]) -> list[RenderableType]:
        """One block per host; the GPU columns aligned across hosts, the holders wrapping."""
        parts: list[RenderableType] = [Text("Hosts", style="bold italic")]
        for n, host in enumerate(self.hosts):
            parts.append(Text.assemble((host.name, "bold"), "  ", host.link, "  ", host.source))
            table = Table(box=None, padding=(0, 1), show_header=n == 0, header_style="bold", expand=True)
            for header, width in zip(_GPU_HEADERS, widths[3:], strict=True):
                holders = header.startswith("holders")
                table.add_column(header, justify="right" if header == "util" else "left", overflow="fold",
                                 min_width=None if holders else width, ratio=1 if holders else None)
            for row in host.gpus:
                table.add_row(*row)
            parts.append(table)
        return parts

    def lines(self) -> list[RenderableType]:
        """One block per host, a line per value, for a width where even the GPU columns do not fit:
        each wraps between words."""
        parts: list[RenderableType] = [Text("Hosts", style="bold italic")]
        for host in self.hosts:
            parts.append(Text.assemble((host.name, "bold"), "  ", host.link, "  ", host.source))
            for gpu, memory, util, holders in host.gpus:
                parts.append(Padding(gpu, (0, 0, 0, 2)))
                for header, value in (("memory", memory), ("util", util), ("holders", holders)):
                    if value.plain:
                        parts.append(Padding(Text.assemble(f"{header}: ", value), (0, 0, 0, 4)))
        return parts

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = self._widths()
        if sum(widths) + 2 * len(widths) <= options.max_width:  # one space either side of each cell
            yield self.table()
        elif sum(widths[3:6]) + 2 * 4 + HOLDERS_MIN <= options.max_width:
            yield from self.stacked(widths)
        else:
            yield from self.lines()


def hosts_table(states: Mapping[str, HostState], telemetry: Mapping[str, TelemetryUpdate | None],
                now: float) -> HostsView:
    """The hosts' links, telemetry and GPUs, laid out for the width (`HostsView`)."""
    return HostsView(host_rows(states, telemetry, now))


def service_lines(service_name: str, host: str, view: ServiceView | None, now: float) -> list[Text]:
    """The service's state (manager) and, while it runs, its health through the forwarded port."""
    title = Text(f"Service {service_name} on {host}: ", style="bold")
    if view is None:
        return [title + Text("not checked yet", style="yellow")]
    if view.status is None:
        return [title + Text(f"unknown: {view.error}", style="bold red")]
    status = view.status
    if status.active:
        state = Text(f"{status.state}" + (f" ({status.sub_state})" if status.sub_state else ""), style="green")
        if status.main_pid:
            state.append(f", pid {status.main_pid}")
        if status.since:
            state.append(f", up {duration(now - status.since, tenths=True)}")
    else:
        state = Text(f"NOT RUNNING ({status.state})", style="bold red")
    detail = status.detail.splitlines()[0].strip() if status.detail else ""
    if detail and not status.active and detail not in (status.state, status.sub_state):  # said once
        state.append(f": {detail}", style="red")
    lines = [title + state]
    if view.error:
        lines.append(Text(f"  {view.error}", style="yellow"))
    if view.not_probed:  # SGLang answers 503 for the whole pause: not asked, and not taken for a fault
        lines.append(Text(f"  health: paused by {view.not_probed}: /health not probed", style="yellow"))
    health = view.health
    if health is None:
        return lines
    line = Text("  health: ", style="bold")
    if health.health_status is None:
        line.append(f"no answer ({health.error})", style="bold red")
        return [*lines, line]
    ok = health.health_status == 200
    line.append(f"/health {health.health_status}", style="green" if ok else "yellow")
    line.append(", ready" if health.ready else ", NOT READY", style="green" if health.ready else "bold yellow")
    if health.model:
        line.append(f"; model {health.model}")
    if health.version:
        line.append(f"; version {health.version}")
    if health.running_requests is not None:
        line.append(f"; running {health.running_requests:.0f}, queued {health.queued_requests or 0:.0f}")
    lines.append(line)
    if health.error:
        lines.append(Text(f"  {health.error}", style="yellow"))
    return lines


def status_view(states: Mapping[str, HostState], telemetry: Mapping[str, TelemetryUpdate | None],
                service_name: str, service_host: str, service: ServiceView | None,
                now: float | None = None) -> RenderableType:
    """The whole status screen."""
    now = time.time() if now is None else now
    return Group(hosts_table(states, telemetry, now), *problem_lines(states, telemetry),
                 *service_lines(service_name, service_host, service, now))


def unreadable_run_line(run_id: str, directory: object, why: str) -> Text:
    """A run whose state cannot be read, named with its path and why: `runs` and `status` list it
    beside the others instead of ending in a traceback or hiding them."""
    where = why if str(directory) in why else f"{directory}: {why}"
    return Text(f"unreadable run {run_id}: {where}", style="yellow")
