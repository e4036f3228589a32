"""The systemd manager's commands and parsing, on recorded systemctl output (systemd cannot run here)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pytest

from console.service.control import (
    ReadyTimeout,
    ServiceError,
    ServiceFailed,
    SystemdManager,
    parse_startup_line,
    parse_systemctl_show,
    parse_systemd_timestamp,
    service_identity,
    start_and_wait,
    status_from_show,
)
from console.service.sglang_api import SglangClient
from console.telemetry import ServiceIdentity

DATA = Path(__file__).parent / "data" / "systemd"


@dataclass
class Result:
    exit_status: int
    stdout: str = ""
    stderr: str = ""


@dataclass
class RecordedSystemctl:
    """A stand-in for `Host.run` on a systemd host: answers systemctl from recorded files and
    records every argv it was given. `state` names the show_<state>.txt file to answer with."""

    state: str = "active"
    calls: list[list[str]] = field(default_factory=list)
    fail: dict[str, Result] = field(default_factory=dict)
    after_start: str = "active"  # the state `start` leaves the unit in ("failed": it crashed at once)
    journal: str = "journal_startup.txt"  # what `journalctl -u UNIT -n N` prints

    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None) -> Result:
        self.calls.append(argv)
        if "journalctl" in argv:
            words = argv[argv.index("journalctl"):]
            lines = int(words[words.index("-n") + 1])
            text = (DATA / self.journal).read_text().splitlines()
            return Result(0, "\n".join(text[-lines:] if lines else []) + "\n")
        words = argv[argv.index("systemctl") + 1:]
        verb = words[0]
        if verb in self.fail:
            return self.fail[verb]
        if verb == "is-active":
            props = parse_systemctl_show((DATA / f"show_{self.state}.txt").read_text())
            word = props["ActiveState"]
            return Result(0 if word == "active" else 3, word + "\n")
        if verb == "show":
            return Result(0, (DATA / f"show_{self.state}.txt").read_text())
        if verb in ("stop", "start"):
            self.state = "inactive" if verb == "stop" else self.after_start
            return Result(0)
        return Result(1, stderr=f"Unknown command verb {verb}.")


async def test_status_of_a_running_unit():
    runner = RecordedSystemctl("active")
    status = await SystemdManager(runner, "sglang-qwen").status()
    assert status.active and status.state == "active" and status.sub_state == "running"
    assert status.main_pid == 2741803 and status.cgroup == "/system.slice/sglang-qwen.service"
    assert status.since == datetime(2026, 11, 28, 21, 14, 7, tzinfo=UTC).timestamp()
    assert runner.calls[0] == ["systemctl", "is-active", "sglang-qwen"]
    assert runner.calls[1][:3] == ["systemctl", "show", "sglang-qwen"]
    assert "MainPID" in runner.calls[1][-1] and "ActiveEnterTimestamp" in runner.calls[1][-1]


@pytest.mark.parametrize("state, active, word, main_pid", [
    ("inactive", False, "inactive", None),
    ("deactivating", False, "deactivating", 2741803),
    ("failed", False, "failed", None),
])
async def test_status_of_other_states(state: str, active: bool, word: str, main_pid: int | None):
    status = await SystemdManager(RecordedSystemctl(state), "sglang-qwen").status()
    assert (status.active, status.state, status.main_pid) == (active, word, main_pid)


async def test_failed_unit_says_why_and_unknown_unit_says_not_found():
    failed = await SystemdManager(RecordedSystemctl("failed"), "sglang-qwen").status()
    assert failed.detail == "result: exit-code" and failed.since is None
    missing = await SystemdManager(RecordedSystemctl("not_found"), "sglang-qwn").status()
    assert missing.state == "not-found" and "sglang-qwn not found" in missing.detail


async def test_stop_and_start_run_exactly_systemctl_with_optional_sudo():
    runner = RecordedSystemctl("active")
    manager = SystemdManager(runner, "sglang-qwen", sudo=True)
    await manager.stop()
    assert (await manager.status()).state == "inactive"
    await manager.start()
    assert runner.calls[0] == ["sudo", "-n", "systemctl", "stop", "sglang-qwen"]
    assert runner.calls[-1] == ["sudo", "-n", "systemctl", "start", "sglang-qwen"]
    assert manager.log_argv() == ["sudo", "-n", "journalctl", "-u", "sglang-qwen", "-f", "-n", "0", "-o", "cat", "--no-pager"]


async def test_a_failed_stop_names_the_command_and_the_sudo_fix():
    runner = RecordedSystemctl("active", fail={"stop": Result(1, stderr="sudo: a password is required")})
    with pytest.raises(ServiceError, match=r"`sudo -n systemctl stop sglang-qwen` failed \(exit 1\).*NOPASSWD"):
        await SystemdManager(runner, "sglang-qwen", sudo=True).stop()


def test_show_parsing_keeps_values_with_equals_signs():
    props = parse_systemctl_show("ExecStart={ path=/usr/bin/python ; argv[]=python -m x --a=b }\nMainPID=12\n\n")
    assert props["ExecStart"].endswith("--a=b }") and props["MainPID"] == "12"
    assert status_from_show("u", {"ActiveState": "active", "MainPID": "junk"}).main_pid is None


@pytest.mark.parametrize("text, expected", [
    ("Sat 2026-11-28 21:14:07 UTC", datetime(2026, 11, 28, 21, 14, 7, tzinfo=UTC).timestamp()),
    ("n/a", None), ("", None), ("yesterday", None),
])
def test_timestamps(text: str, expected: float | None):
    assert parse_systemd_timestamp(text) == expected


def test_recorded_startup_journal_becomes_progress():
    events = [p for line in (DATA / "journal_startup.txt").read_text().splitlines() if (p := parse_startup_line(line))]
    stages = [e.stage for e in events]
    assert stages[0] == "loading" and stages[-2:] == ["weights_loaded", "ready"]
    shards = [(e.done, e.total) for e in events if e.total]
    assert shards == [(0, 11), (1, 11), (6, 11), (11, 11)]
    assert stages.count("weights_loaded") == 1  # TP1's lines and uvicorn's say nothing more


async def test_telemetry_recognises_the_unit_by_main_pid_and_cgroup_only_while_active():
    running = await SystemdManager(RecordedSystemctl("active"), "sglang-qwen").status()
    assert service_identity(running) == ServiceIdentity(2741803, "/system.slice/sglang-qwen.service")
    stopping = await SystemdManager(RecordedSystemctl("deactivating"), "sglang-qwen").status()
    assert service_identity(stopping) == ServiceIdentity()


async def test_a_unit_that_fails_at_restart_is_an_error_at_once_with_its_journal():
    runner = RecordedSystemctl("inactive", after_start="failed", journal="journal_failed.txt")
    manager = SystemdManager(runner, "sglang-qwen", sudo=True)
    began = time.monotonic()
    with pytest.raises(ServiceFailed) as info:
        # nothing listens on port 9: without asking the manager this would wait the full 60 s
        await start_and_wait(manager, SglangClient("http://127.0.0.1:9", timeout=1), timeout=60)
    assert time.monotonic() - began < 10
    message = str(info.value)
    assert message.startswith("sglang-qwen is failed (failed) after its start: it will not become ready; "
                              "result: exit-code")
    assert "torch.OutOfMemoryError: CUDA out of memory" in message
    assert info.value.log_lines[-1].endswith("Failed with result 'exit-code'.")
    assert ["sudo", "-n", "journalctl", "-u", "sglang-qwen", "-n", "20", "--no-pager"] in runner.calls


async def test_an_activating_unit_is_waited_for():
    runner = RecordedSystemctl("inactive", after_start="deactivating")  # neither up nor down: keep waiting
    manager = SystemdManager(runner, "sglang-qwen")
    with pytest.raises(ReadyTimeout):
        await start_and_wait(manager, SglangClient("http://127.0.0.1:9", timeout=1), timeout=1)
    assert not any("journalctl" in call for call in runner.calls)
