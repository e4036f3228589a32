"""Console telemetry: sample parsing, bounded history, staleness, attribution to the service."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console.telemetry import (
    HostTelemetry,
    SampleError,
    ServiceIdentity,
    agent_argv,
    is_service_process,
    parse_sample,
    service_pids,
)


class FakeClock:
    """Console monotonic time under the test's control."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sample_line(seq: int = 0, t: float = 0.0, used: list[int | None] | None = None, processes: list[dict] | None = None,
                interval: float = 1.0, **extra) -> str:
    used = [47179, 46237] if used is None else used
    gpus = [{"index": i, "name": "NVIDIA H200", "uuid": f"GPU-{i}", "mem_used_mib": u, "mem_total_mib": 143771,
             "util_pct": 3, "temp_c": 38, "power_w": 114.5} for i, u in enumerate(used)]
    return json.dumps({"v": 1, "seq": seq, "t": t, "host": "ct129", "interval": interval, "source": "nvml",
                       "simulated": False, "reason": None, "gpus": gpus, "processes": processes or [],
                       "ram": {"total_mib": 1000, "available_mib": 500}, **extra})


def test_parse_sample_reads_every_field():
    proc = {"pid": 4242, "gpu": 1, "mib": 46000, "user": "root", "command": "python -m sglang.launch_server",
            "ppid": 4200, "ancestors": [4200, 4100], "start_time": 123, "cgroup": "/system.slice/sglang-qwen.service"}
    sample = parse_sample(sample_line(seq=5, t=12.5, processes=[proc]))
    assert sample.seq == 5 and sample.t == 12.5 and sample.source == "nvml"
    assert [g.mem_used_mib for g in sample.gpus] == [47179, 46237]
    (p,) = sample.processes
    assert p.pid == 4242 and p.ancestors == (4200, 4100) and p.cgroup.endswith("sglang-qwen.service")
    assert sample.ram_available_mib == 500


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"seq": 0, "t": 1, "gpus": []}', "missing 'processes'"),
    (sample_line().replace('"mem_used_mib": 47179', '"mem_used_mib": "lots"'), "gpus[0].mem_used_mib"),
    ('{"seq": 0, "t": 1, "gpus": [{"name": "x"}], "processes": []}', "gpus[0]: expected an object with an index"),
])
def test_bad_lines_are_named(line: str, message: str):
    with pytest.raises(SampleError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_sample(line)


def test_a_bad_line_is_counted_not_raised():
    telemetry = HostTelemetry("ct129")
    assert telemetry.add_line("garbage") is None
    assert telemetry.bad_lines == 1 and "not JSON" in telemetry.last_bad and telemetry.latest is None


def test_history_keeps_at_least_ten_minutes_at_one_second():
    telemetry = HostTelemetry("ct129", interval=1.0)
    for i in range(2000):
        telemetry.add_line(sample_line(seq=i, t=float(i), used=[i, 0]))
    assert telemetry.history_len(0) >= 600
    series = telemetry.history(0)
    assert series[-1] == 1999 and series == sorted(series)  # oldest first, newest kept
    assert telemetry.history(0, seconds=60) == list(range(1940, 2000))
    assert telemetry.history(0, "util_pct", seconds=2) == [3.0, 3.0]


@settings(max_examples=40, deadline=None)
@given(interval=st.sampled_from([0.2, 0.5, 1.0, 2.0, 10.0]), n=st.integers(1, 5000))
def test_history_is_bounded_for_any_interval_and_length(interval: float, n: int):
    telemetry = HostTelemetry("h", interval=interval, history_s=600)
    for i in range(n):
        telemetry.add_line(sample_line(seq=i, t=i * interval, used=[i], interval=interval))
    kept = telemetry.history_len(0)
    assert kept <= 600 / interval + 1
    assert kept == min(n, int(600 / interval) + 1)
    assert telemetry.history(0)[-1] == n - 1


def test_staleness_follows_the_console_clock_not_the_host_clock():
    clock = FakeClock()
    telemetry = HostTelemetry("ct129", interval=1.0, clock=clock)
    assert telemetry.is_stale() and telemetry.age() is None
    telemetry.add_line(sample_line(t=5.0))  # the host clock is far behind: irrelevant
    clock.now += 2.5
    assert telemetry.age() == pytest.approx(2.5) and not telemetry.is_stale()
    clock.now += 1.0
    update = telemetry.update(streaming=False, error="connection lost")
    assert update.stale and update.age_s == pytest.approx(3.5) and update.error == "connection lost"


def test_attribution_by_main_pid_tree_and_by_cgroup():
    line = sample_line(processes=[
        {"pid": 500, "gpu": 0, "mib": 40000, "ancestors": [400, 300], "cgroup": "/user.slice/session-3.scope"},
        {"pid": 600, "gpu": 1, "mib": 40000, "ancestors": [1], "cgroup": "/system.slice/sglang-qwen.service"},
        {"pid": 700, "gpu": 0, "mib": 900, "ancestors": [650], "cgroup": "/system.slice/sglang-qwen.service.d"},
        {"pid": 800, "gpu": 0, "mib": 900, "ancestors": [], "cgroup": None},
    ])
    sample = parse_sample(line)
    by_tree = ServiceIdentity(main_pid=300)
    by_cgroup = ServiceIdentity(cgroup="/system.slice/sglang-qwen.service")
    assert service_pids(sample, by_tree) == {500}
    assert service_pids(sample, by_cgroup) == {600}  # a sibling unit with a longer name is not ours
    assert service_pids(sample, ServiceIdentity(main_pid=800)) == {800}
    # No identity (service stopped, MainPID=0; or the root cgroup of a container): nobody is attributed.
    assert service_pids(sample, ServiceIdentity(main_pid=None, cgroup="/")) == frozenset()
    assert not is_service_process(sample.processes[3], ServiceIdentity())


def test_service_pids_seen_while_running_are_remembered_after_the_stop():
    telemetry = HostTelemetry("ct129")
    telemetry.service = ServiceIdentity(main_pid=300)
    telemetry.add_line(sample_line(processes=[{"pid": 500, "gpu": 0, "mib": 1, "ancestors": [300], "start_time": 77}]))
    telemetry.service = ServiceIdentity()  # stopped: no MainPID any more
    telemetry.add_line(sample_line(processes=[{"pid": 500, "gpu": 0, "mib": 1, "ancestors": [1], "start_time": 77}]))
    assert telemetry.seen_service_pids == {500: 77}
    assert telemetry.update(streaming=True).service_pids == frozenset()


def test_agent_command_runs_from_the_code_directory_without_a_shell():
    assert agent_argv("/venv/bin/python", "/home/u/.dflash/code/ab12", 0.5, "/tmp/gpu.json") == [
        "env", "PYTHONPATH=/home/u/.dflash/code/ab12", "/venv/bin/python", "-m", "remote.agent",
        "--interval", "0.5", "--simulate", "/tmp/gpu.json"]


async def test_a_cancel_that_lands_as_the_awaited_sample_arrives_is_not_lost():
    """A step waits for a sample (the VRAM waiter); Ctrl-C lands in the same moment the sample
    does. On Python 3.11 `asyncio.wait_for` would return the sample and drop the cancel."""
    from console.telemetry import TelemetryStream

    class Supervisor:
        name = "ct129"

    stream = TelemetryStream(Supervisor(), code_dir=None)  # type: ignore[arg-type]
    waiter = asyncio.create_task(stream.wait_for(lambda s: True, timeout=30))
    await asyncio.sleep(0)  # the waiter is subscribed and waiting
    stream.telemetry.add_line(sample_line(seq=1, t=1.0))
    stream._publish()  # the sample arrives: the wait's future is done ...
    waiter.cancel()  # ... and the cancel lands in the same moment
    with pytest.raises(asyncio.CancelledError):
        await waiter
