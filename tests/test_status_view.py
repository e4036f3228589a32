"""The status view's pure parts: the service lines of a systemd unit, and holder commands."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rich.console import Console

from console.messages import ServiceHealth, ServiceStatus, ServiceView
from console.views.status import service_lines, short_command

NOW = 1_800_000_000.0


def _text(lines) -> str:
    console = Console(record=True, width=200)
    for line in lines:
        console.print(line)
    return console.export_text()


def test_systemd_unit_up_but_not_ready_says_so_with_uptime():
    status = ServiceStatus("systemd", "sglang-qwen", True, "active", "running", 4242, since=NOW - 3 * 3600 - 300)
    health = ServiceHealth(200, False, model="Qwen3.6-27B", version="0.5.4", running_requests=2, queued_requests=1,
                           error="/health is 200 but a one-token /generate failed: HTTP 503")
    text = _text(service_lines("sglang-qwen", "ct129", ServiceView(status, health, NOW), NOW))
    assert "sglang-qwen on ct129: active (running), pid 4242, up 3 h 05 min" in text
    assert "/health 200, NOT READY; model Qwen3.6-27B; version 0.5.4; running 2, queued 1" in text
    assert "one-token /generate failed" in text


def test_failed_unit_and_unreachable_manager():
    failed = ServiceStatus("systemd", "sglang-qwen", False, "failed", "failed", detail="result: exit-code")
    assert "NOT RUNNING (failed): result: exit-code" in _text(
        service_lines("sglang-qwen", "ct129", ServiceView(failed, None, NOW), NOW))
    lost = ServiceView(None, None, NOW, error="ct129 is not connected (down)")
    assert "sglang-qwen on ct129: unknown: ct129 is not connected (down)" in _text(
        service_lines("sglang-qwen", "ct129", lost, NOW))


@given(st.lists(st.text(alphabet="abc/ -_.", min_size=1, max_size=30), min_size=1, max_size=6))
def test_short_command_keeps_the_program_name_within_the_limit(words):
    command = " ".join(words)
    short = short_command(command, limit=40)
    assert len(short) <= 40
    program = command.partition(" ")[0].rsplit("/", 1)[-1]
    assert short.startswith(program[:39])


def test_status_at_120_columns_is_one_row_per_gpu_and_ends_on_the_verdict():
    """Issue 28: `status` took 39 lines at 120 x 40 (3 or 4 rows per GPU) and its key line ("SERVICE
    DOWN since ...") scrolled off the top; the stopped service read 'NOT RUNNING (stopped): stopped'."""
    from rich.text import Text

    from console.cli.status import screen
    from console.views.status import status_view

    states, telemetry = _crowded_hosts()
    stopped = ServiceView(ServiceStatus("command", "server", False, "stopped", None, detail="stopped"), None, NOW)
    verdict = Text("SERVICE DOWN since 02:52:04 (run 20261202-025000-0660); `run --resume` restarts it")
    console = Console(record=True, width=120)
    console.print(screen(status_view(states, telemetry, "server", "ct129", stopped, NOW),
                         verdict, []))
    text = console.export_text()
    lines = text.rstrip("\n").splitlines()
    gpu_rows = [line for line in lines if "GiB" in line or " MiB (" in line]
    assert len(gpu_rows) == 10  # ct129's 2 and ct200's 8 GPUs, one line each
    # one block per host (issue 43.9): a line for each host, and ct129's holders wrap rather than being cut
    assert len(lines) <= 18, "\n".join(lines)
    assert lines[-1].startswith("SERVICE DOWN since 02:52:04")  # the last line: left above the prompt
    assert "NOT RUNNING (stopped)" in text and "(stopped): stopped" not in text
    assert "+3 more" in next(line for line in lines if line.lstrip().startswith("0 L40S"))


def _crowded_hosts():
    """Both hosts connected, ct129's two GPUs crowded with three holders each: (states, telemetry)."""
    from console.messages import GpuProcess, HostState
    from tests.tui.standin import serving_telemetry

    ct129, ct200 = serving_telemetry()
    crowded = tuple(GpuProcess(5000 + i, g, 900 + i, "root", f"/opt/venv/bin/python worker_{i}.py --tp-rank {g}")
                    for g in (0, 1) for i in range(3))
    ct129 = ct129.__class__(ct129.host, ct129.sample.__class__(**{**ct129.sample.__dict__,
                                                                  "processes": ct129.sample.processes + crowded}),
                            ct129.age_s, ct129.stale, ct129.streaming, service_pids=ct129.service_pids)
    states = {h: HostState(h, "connected", NOW - 60, latency_s=0.001) for h in ("ct129", "ct200")}
    return states, {"ct129": ct129, "ct200": ct200}


def _crowded_view():
    from console.views.status import status_view

    states, telemetry = _crowded_hosts()
    return status_view(states, telemetry, "server", "ct129", None, NOW)


@pytest.mark.parametrize("width", [None, 80, 120, 60, 40])
def test_status_never_cuts_a_host_name_util_or_holder(width: int | None):
    """Issue 43.9: piped or at 80 columns `status` cut host names to `c…` and dropped util and
    holders; holders were cut even at 120. Values stay whole: wrapped, or one block per host."""
    import io

    from console.views.status import short_command
    from tests.tui.standin import SGLANG

    out = io.StringIO()  # None: piped, the width rich gives a file that is not a terminal
    console = Console(file=out, width=width, force_terminal=False)
    console.print(_crowded_view())
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= console.width
    words = " ".join(text.split())  # a wrapped value reads whole once its line breaks are spaces
    lines = text.splitlines()
    assert any(line.startswith("ct129 ") for line in lines) and any(line.startswith("ct200 ") for line in lines)
    for util in ("62%", "58%", "97%", "90%"):
        assert util in words
    assert f"4242 43.1 GiB [service] +3 more {short_command(SGLANG)}" in words
    for i in range(8):
        assert f"{9100 + i} 68.4 GiB python train_drafter.py --config v4.yaml" in words
    assert text.count("…") == 2  # only where `short_command` shortens the server's command, once per GPU
