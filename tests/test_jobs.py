"""Remote jobs over real SSH (embedded server and OpenSSH's sshd): code shipping, detached start,
following by offset across drops and console restarts, dead-job detection, cancel."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import stat
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from console.ssh.hosts import Host, HostDisconnected
from console.ssh.jobs import (
    LOCAL_CODE,
    JobDead,
    JobHandle,
    JobRunner,
    follow_with_reconnect,
    parse_start_ticks,
    split_events,
)
from console.ssh.supervisor import HostSupervisor
from tests.ssh_fixtures import SSHTarget


async def collect(runner: JobRunner, handle: JobHandle, offset: int = 0) -> list[dict]:
    return [event async for _, event in runner.follow(handle, offset)]


def seqs(events: list[dict]) -> list[int]:
    return [e["seq"] for e in events]


@given(comm=st.text(alphabet=st.characters(blacklist_characters="\0\n"), max_size=15),
       ticks=st.integers(0, 2**62))
def test_start_ticks_are_read_whatever_the_command_name(comm: str, ticks: int) -> None:
    rest = ["S"] + [str(i) for i in range(4, 22)] + [str(ticks)] + ["0"] * 30
    line = f"4242 ({comm}) " + " ".join(rest)
    assert parse_start_ticks(line) == ("S", ticks)


@given(st.lists(st.dictionaries(st.sampled_from(["type", "msg", "done"]), st.text() | st.integers()),
                min_size=1, max_size=12),
       st.lists(st.integers(0, 10_000), max_size=6))
def test_events_split_at_any_read_boundary_come_out_once(events: list[dict], cuts: list[int]) -> None:
    """However the file's bytes arrive (a reader may see half a line), following by offset yields
    every event exactly once, in order."""
    stream = b"".join(json.dumps(e).encode() + b"\n" for e in events)
    bounds = sorted({min(c, len(stream)) for c in cuts} | {len(stream)})
    seen, offset = [], 0
    for bound in bounds:  # each read sees the file as it was when `bound` bytes were written
        got, used = split_events(stream[offset:bound])
        seen += [e for _, e in got]
        offset += used
        assert sum(n for n, _ in got) == used
    assert seen == events and offset == len(stream)


def test_a_garbled_line_is_reported_not_fatal() -> None:
    got, used = split_events(b'{"type":"log"}\nnot json\n{"type":"exit","code":0}\n{"type"')
    assert [e["type"] for _, e in got] == ["log", "invalid", "exit"]
    assert got[1][1]["raw"] == "not json" and used == 49


def test_job_handle_survives_json() -> None:
    handle = JobHandle("h", "j1", "selftest", "/w/runs/j1", 123, 456, 1.5)
    assert JobHandle.from_json(handle.to_json()) == handle
    with pytest.raises(ValueError, match="not a saved job handle"):
        JobHandle.from_json('{"host": "h"}')


async def test_code_is_shipped_once_per_tree(ssh_target: SSHTarget, tmp_path: Path) -> None:
    local = tmp_path / "remote"
    shutil.copytree(LOCAL_CODE, local, ignore=shutil.ignore_patterns("__pycache__"))
    host = await ssh_target.connect()
    runner = JobRunner(host, local_code=local)
    first = await runner.ensure_code()
    assert runner.uploaded_files > 0
    assert (Path(first) / "remote" / "drill" / "selftest.py").read_bytes() == (local / "drill" / "selftest.py").read_bytes()
    sentinel = Path(first) / "sentinel"
    sentinel.write_text("still here")

    again = await JobRunner(host, local_code=local).ensure_code()
    assert again == first and sentinel.exists()  # not re-sent, not replaced
    runner2 = JobRunner(host, local_code=local)
    await runner2.ensure_code()
    assert runner2.uploaded_files == 0

    (local / "drill" / "selftest.py").write_text((local / "drill" / "selftest.py").read_text() + "\n# changed\n")
    changed = await runner2.ensure_code()
    assert changed != first and runner2.uploaded_files > 0
    assert not list(Path(first).parent.glob(".incoming-*"))  # no half-shipped tree left behind


async def test_selftest_runs_detached_and_reports_everything(ssh_target: SSHTarget, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    echo = [f"'; rm -rf {canary}'", "$(id)", "two words", ""]
    host = await ssh_target.connect()
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", ["--steps", "3", "--interval", "0.05", "--echo", *echo])
    events = await collect(runner, handle)

    assert seqs(events) == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types == ["phase"] + ["progress", "log"] * 3 + ["result", "exit"]
    assert [(e["done"], e["total"], e["unit"]) for e in events if e["type"] == "progress"] == [
        (1, 3, "step"), (2, 3, "step"), (3, 3, "step")]
    result = events[-2]["data"]
    assert result["echo"] == echo  # each argument arrived as one literal word
    assert canary.is_dir()
    assert result["pid"] == handle.pid == result["sid"]  # its own session: setsid, no fork
    assert result["cwd"] == await runner.ensure_code()
    assert events[-1] == {**events[-1], "type": "exit", "code": 0}
    run_dir = Path(handle.run_dir)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert (await runner.status(handle)).state == "exited"


async def test_the_environment_given_reaches_the_worker_but_no_command_line(ssh_target: SSHTarget) -> None:
    """An API key passed as the worker's environment is never in an argv (the host's process list
    shows every user's argv); it reaches the worker intact, quotes and spaces included."""
    secret = "sk-live 'quoted' $(id) `x` \\ end"
    host = await ssh_target.connect()
    sent: list[str] = []
    real_run = host.run

    async def recorded_run(argv, *args, **kwargs):
        sent.append(" ".join(argv))
        return await real_run(argv, *args, **kwargs)

    host.run = recorded_run
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", ["--steps", "1", "--interval", "0", "--echo-env", "DFLASH_SGLANG_API_KEY",
                                                   "EMPTY_ONE"], env={"DFLASH_SGLANG_API_KEY": secret, "EMPTY_ONE": ""})
    events = await collect(runner, handle)
    assert events[-2]["data"]["env"] == {"DFLASH_SGLANG_API_KEY": secret, "EMPTY_ONE": ""}
    assert sent and not any("sk-live" in command for command in sent)
    assert "sk-live" not in Path(handle.run_dir, "handle.json").read_text()
    with pytest.raises(ValueError, match="newline"):
        await runner.start("drill.selftest", [], env={"KEY": "two\nlines"})


async def test_a_crash_is_an_error_event_and_a_nonzero_exit(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", ["--steps", "5", "--interval", "0.01", "--crash-at", "2"])
    events = await collect(runner, handle)
    assert events[-2]["type"] == "error" and "crashed at step 2" in events[-2]["msg"]
    assert events[-1]["code"] == 1
    status = await runner.status(handle)
    assert (status.state, status.exit_code) == ("exited", 1)
    assert "RuntimeError: selftest crashed at step 2" in await runner.stderr_tail(handle)


async def test_a_killed_worker_is_dead_with_its_stderr_tail(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", ["--steps", "200", "--interval", "0.05",
                                             "--stderr", "loading shards from /models/x"])
    seen = []
    with pytest.raises(JobDead) as info:
        async for _, event in runner.follow(handle):
            seen.append(event)
            if event["type"] == "progress":
                os.kill(handle.pid, signal.SIGKILL)  # the hosts are this machine
    assert seen and all(e["type"] != "exit" for e in seen)
    assert "loading shards from /models/x" in info.value.stderr_tail
    assert "is dead" in str(info.value) and handle.job_id in str(info.value)
    status = await runner.status(handle)
    assert status.state == "dead" and "loading shards" in status.stderr_tail


async def test_a_reused_pid_is_not_taken_for_the_job(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host)
    handle = await runner.start("drill.selftest", ["--steps", "100", "--interval", "0.05"])
    assert handle.start_ticks is not None
    assert await runner.is_alive(handle)
    impostor = replace(handle, start_ticks=handle.start_ticks + 1)  # same pid, another process
    assert not await runner.is_alive(impostor)
    await runner.cancel(handle, grace=5)


async def test_a_job_that_ends_while_its_stat_is_read_is_gone_not_an_error(ssh_target: SSHTarget) -> None:
    """The job ends between the open of /proc/PID/stat and its read: the server answers the read with
    a failure (ESRCH, "No such process"). The job is gone, as when the file is not there; it once
    failed a drill window's cache step with "reading /proc/29996/stat: No such process"."""
    host = await ssh_target.connect()
    runner = JobRunner(host)
    handle = await runner.start("drill.selftest", ["--steps", "2000", "--interval", "0.05"])
    assert await runner.is_alive(handle)
    opened = runner._open

    async def open_then_end(path: str):
        f = await opened(path)
        if path == f"/proc/{handle.pid}/stat":  # the hosts are this machine: it ends for real, and is reaped
            os.kill(handle.pid, signal.SIGKILL)
            deadline = asyncio.get_running_loop().time() + 30
            while Path(f"/proc/{handle.pid}").exists():
                assert asyncio.get_running_loop().time() < deadline, f"pid {handle.pid} was never reaped"
                await asyncio.sleep(0.05)
        return f

    runner._open = open_then_end  # type: ignore[method-assign]
    assert not await runner.is_alive(handle)


async def test_cancel_sends_term_then_kill(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    polite = await runner.start("drill.selftest", ["--steps", "200", "--interval", "0.05"])
    stubborn = await runner.start("drill.selftest", ["--steps", "200", "--interval", "0.05", "--ignore-term"])
    await asyncio.sleep(0.5)  # both past start-up, signal handlers installed

    status = await runner.cancel(polite, grace=5)
    assert (status.state, status.exit_code) == ("exited", 143)  # TERM became a clean exit event
    events = await collect(runner, polite)
    assert events[-1] == {**events[-1], "type": "exit", "code": 143}

    status = await runner.cancel(stubborn, grace=0.3)
    assert status.state == "dead" and not await runner.is_alive(stubborn)


async def test_a_restarted_console_resumes_without_loss_or_repeat(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", ["--steps", "6", "--interval", "0.05"])
    saved_offset, before = 0, []
    async for offset, event in runner.follow(handle):
        saved_offset = offset
        before.append(event)
        if len(before) == 4:
            break
    saved = handle.to_json()
    await host.close()

    host2 = await ssh_target.connect()  # a new console process would start exactly so
    runner2 = JobRunner(host2, poll_interval=0.05, liveness_interval=0.1)
    after = await collect(runner2, JobHandle.from_json(saved), saved_offset)
    assert seqs(before + after) == list(range(len(before) + len(after)))
    assert after[-1]["type"] == "exit" and after[-1]["code"] == 0


async def test_a_dropped_connection_loses_and_repeats_nothing(ssh_target: SSHTarget) -> None:
    """The link drops mid-job (embedded: the server restarts; sshd: the transport is closed) and
    comes back: every event arrives once, in order, and the job itself ran on untouched."""
    supervisor = HostSupervisor(ssh_target.spec("inference"), backoff=(0.05, 0.2), ping_interval=0.2)
    supervisor.start()
    try:
        host = await supervisor.wait_connected(10)
        handle = await JobRunner(host).start("drill.selftest", ["--steps", "10", "--interval", "0.1"])
        events: list[dict] = []
        dropped = False
        async for _, event in follow_with_reconnect(supervisor, handle, poll_interval=0.05, liveness_interval=0.1,
                                                    connect_timeout=20):
            events.append(event)
            if event["type"] == "progress" and event["done"] == 3 and not dropped:
                dropped = True
                await ssh_target.drop(supervisor.host)
                with pytest.raises(HostDisconnected):  # the old connection really is gone
                    await host.run(["true"])
        assert dropped
        assert seqs(events) == list(range(len(events)))
        assert [e["done"] for e in events if e["type"] == "progress"] == list(range(1, 11))
        assert events[-1]["code"] == 0 and events[-2]["data"]["pid"] == handle.pid
        assert supervisor.host is not host
    finally:
        await supervisor.stop()


async def test_following_raises_host_disconnected_on_a_drop(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", ["--steps", "20", "--interval", "0.05"])
    last = 0
    with pytest.raises(HostDisconnected):
        async for offset, event in runner.follow(handle):
            last = offset
            if event["type"] == "progress":
                await ssh_target.drop(host)
    fresh = JobRunner(await ssh_target.connect(), poll_interval=0.05, liveness_interval=0.1)
    rest = await collect(fresh, handle, last)
    assert rest[-1]["type"] == "exit" and rest[-1]["code"] == 0


def test_a_host_without_the_connection_cannot_start_jobs() -> None:
    from console.ssh.hosts import HostSpec

    runner = JobRunner(Host(HostSpec("h", "127.0.0.1")))
    with pytest.raises(HostDisconnected, match="h: not connected"):
        asyncio.run(runner.start("drill.selftest", []))


async def test_a_worker_that_cannot_start_is_dead_with_the_reason(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect(python="/nonexistent/bin/python3")
    runner = JobRunner(host, poll_interval=0.05, liveness_interval=0.1)
    handle = await runner.start("drill.selftest", [])
    with pytest.raises(JobDead, match="/nonexistent/bin/python3"):
        await collect(runner, handle)
