"""The status view's pure parts: the service lines of a systemd unit, and holder commands."""

from __future__ import annotations

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
