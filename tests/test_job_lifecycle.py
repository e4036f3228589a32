"""Jobs the engine can find again, and jobs that misbehave, over real SSH (embedded server and
OpenSSH's sshd): handle.json before the worker runs, attach after a console crash, list, no double
start; heartbeats and stalls; event lines over 1 MiB; a link that drops mid-read leaving no stray
task; cancel of a process that outlives KILL; typed messages and `collect`."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from console.messages import JobArtifact, JobError, JobExit, JobLog, JobProgress, JobResult, JobStalled
from console.ssh.hosts import Host, HostDisconnected
from console.ssh.jobs import (
    HANDLE_FORMAT,
    JobExists,
    JobHandle,
    JobMessages,
    JobNotFound,
    JobRunner,
    JobStalledError,
    collect,
    job_message,
)
from remote.procstat import parse_start_ticks
from tests.ssh_fixtures import SSHTarget

FAST = {"poll_interval": 0.05, "liveness_interval": 0.1}


async def events_of(runner: JobRunner, handle: JobHandle, **kwargs: Any) -> list[dict]:
    return [event async for _, event in runner.follow(handle, **kwargs)]


# --- found again by id ---------------------------------------------------------------------------


async def test_attach_after_a_console_crash_finds_the_same_job(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = JobRunner(host, **FAST)
    started = await runner.start("drill.selftest", ["--steps", "20", "--interval", "0.05", "--echo", "a b"],
                                 job_id="run7-extract")
    assert started.job_id == "run7-extract" and started.run_dir.endswith("/runs/run7-extract")
    on_disk = json.loads(Path(started.handle_path).read_text())
    assert on_disk["format"] == HANDLE_FORMAT and on_disk["pid"] == started.pid
    await host.close()  # the console dies: only the id it chose survives (in its state file)

    fresh = JobRunner(await ssh_target.connect(), **FAST)
    found = await fresh.attach("run7-extract")
    assert found == started
    assert (found.pid, found.start_ticks, found.worker) == (started.pid, started.start_ticks, "drill.selftest")
    assert found.argv[1:] == ("-m", "remote.drill.selftest", "--steps", "20", "--interval", "0.05", "--echo", "a b")
    assert await fresh.is_alive(found)
    events = await events_of(fresh, found)
    assert events[-1]["type"] == "exit" and events[-2]["data"]["pid"] == started.pid


async def test_the_worker_never_runs_before_its_handle_is_on_disk(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    for _ in range(5):  # the handle is written while the worker starts: no race either way
        handle = await runner.start("drill.selftest", ["--steps", "1", "--interval", "0"])
        events = await events_of(runner, handle)
        assert events[-2]["data"]["handle_at_start"] is True
        assert events[-2]["data"]["pid"] == handle.pid


async def test_starting_an_id_that_exists_is_refused_and_runs_nothing(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    first = await runner.start("drill.selftest", ["--steps", "40", "--interval", "0.05"], job_id="run7-stage")
    with pytest.raises(JobExists, match="job run7-stage already exists .*attach to it instead"):
        await runner.start("drill.selftest", ["--steps", "1"], job_id="run7-stage")
    (found,) = [h for h in await runner.list() if h.job_id == "run7-stage"]
    assert found == first and await runner.is_alive(first)
    await runner.cancel(first, grace=5)


async def test_a_start_cut_off_blocks_its_id_only_briefly(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    runs = Path(await runner.workdir()) / "runs"
    runs.mkdir(mode=0o700, exist_ok=True)
    staging = runs / ".starting-run3-cache"
    staging.mkdir()  # a console killed mid-start, a moment ago: its worker may still be waiting
    with pytest.raises(JobExists, match="run3-cache is being started"):
        await runner.start("drill.selftest", ["--steps", "1", "--interval", "0"], job_id="run3-cache")
    os.utime(staging, (time.time() - 120, time.time() - 120))  # long enough ago: that worker gave up
    handle = await runner.start("drill.selftest", ["--steps", "1", "--interval", "0"], job_id="run3-cache")
    assert (await events_of(runner, handle))[-1]["code"] == 0 and not staging.exists()


async def test_list_shows_the_jobs_with_a_handle_oldest_first(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    assert await runner.list() == []
    a = await runner.start("drill.selftest", ["--steps", "1", "--interval", "0"], job_id="run1-a")
    b = await runner.start("drill.selftest", ["--steps", "1", "--interval", "0"], job_id="run1-b")
    runs = Path(a.run_dir).parent
    (runs / "legacy-without-handle").mkdir()
    (runs / ".starting-run1-c").mkdir()
    assert [h.job_id for h in await runner.list()] == ["run1-a", "run1-b"]
    assert await runner.list() == [a, b]
    with pytest.raises(JobNotFound, match="without handle.json"):
        await runner.attach("legacy-without-handle")
    with pytest.raises(JobNotFound, match="is being started"):
        await runner.attach("run1-c")
    with pytest.raises(LookupError, match="job run9-x does not exist"):  # what the engine catches
        await runner.attach("run9-x")
    with pytest.raises(ValueError, match="not a job id"):
        await runner.attach("../run1-a")
    with pytest.raises(ValueError, match="job id"):
        await runner.start("drill.selftest", [], job_id=".hidden")


# --- heartbeats and stalls -----------------------------------------------------------------------


async def test_a_hung_worker_is_reported_stalled_with_its_last_event(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    handle = await runner.start("drill.selftest", ["--steps", "200", "--interval", "0.05",
                                                   "--stderr", "loading the target"])
    seen: list[dict] = []
    try:
        with pytest.raises(JobStalledError) as info:
            async for _, event in runner.follow(handle, stall_timeout=1.0):
                seen.append(event)
                if event["type"] == "progress":
                    os.kill(handle.pid, signal.SIGSTOP)  # hung: alive, heartbeat thread included
        assert info.value.last_event == seen[-1]
        assert info.value.silent_s >= 1.0 and "loading the target" in info.value.stderr_tail
        assert "has stalled: alive but no event for" in str(info.value)
        assert (await runner.status(handle)).state == "running"
    finally:
        os.kill(handle.pid, signal.SIGCONT)
        await runner.cancel(handle, grace=5)


async def test_heartbeats_keep_a_quiet_worker_from_stalling(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    handle = await runner.start("drill.selftest", ["--steps", "2", "--interval", "0", "--sleep-silent", "2.5"],
                                env={"DFLASH_HEARTBEAT_S": "0.2"})
    events = await events_of(runner, handle, stall_timeout=1.0)
    assert events[-1]["type"] == "exit" and events[-1]["code"] == 0
    assert sum(e["type"] == "heartbeat" for e in events) >= 5
    assert [e["seq"] for e in events] == list(range(len(events)))
    assert events.index(next(e for e in events if e["type"] == "exit")) == len(events) - 1  # none after exit


async def test_collect_says_stalled_without_heartbeats(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    handle = await runner.start("drill.selftest", ["--steps", "2", "--interval", "0", "--sleep-silent", "30"],
                                env={"DFLASH_HEARTBEAT_S": "0"})
    messages: list[Any] = []
    began = time.monotonic()
    outcome = await collect(runner, handle, on_message=messages.append, stall_timeout=1.0)
    assert time.monotonic() - began < 10
    assert outcome.state == "stalled" and not outcome.ok and "has stalled" in outcome.error
    stalled = messages[-1]
    assert isinstance(stalled, JobStalled) and stalled.job_id == handle.job_id
    assert stalled.last_event["type"] == "log" and stalled.silent_s >= 1.0
    await runner.cancel(handle, grace=5)


# --- long lines, drops, cancel -------------------------------------------------------------------


async def test_an_event_line_over_1_mib_is_read_whole(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    handle = await runner.start("drill.selftest", ["--steps", "2", "--interval", "0", "--big-line", "3000000"])
    events = await events_of(runner, handle)
    big = next(e for e in events if e["type"] == "log")
    assert big["msg"] == "x" * 3_000_000
    assert events[-1]["type"] == "exit" and events[-1]["code"] == 0
    assert [e["seq"] for e in events] == list(range(len(events)))


class FinProxy:
    """A TCP relay in front of the SSH server. Once `cut` is set, the next bytes the client sends
    are not passed on and both sides are closed gracefully: the far end goes away with requests in
    flight, as when sshd dies (asyncssh then fails them with ConnectionLost)."""

    def __init__(self, port: int):
        self.port = port
        self.cut = False
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        self._writers += [writer, up_writer]

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter, from_client: bool) -> None:
            try:
                while data := await source.read(65536):
                    if from_client and self.cut:
                        for w in self._writers:
                            w.close()
                        return
                    sink.write(data)
                    await sink.drain()
            except OSError:
                pass
            sink.close()

        await asyncio.gather(pipe(reader, up_writer, True), pipe(up_reader, writer, False))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for w in self._writers:
            w.close()


def _fake_job(tmp_path: Path, lines: int) -> JobHandle:
    """A run directory with a big events file, 'run' by this test's own (live) process."""
    run = tmp_path / "fake-run"
    run.mkdir()
    line = json.dumps({"type": "log", "msg": "x" * 200}) + "\n"
    (run / "events.jsonl").write_text(line * lines)
    ticks = parse_start_ticks(Path(f"/proc/{os.getpid()}/stat").read_text())[1]
    return JobHandle("h", "fake", "drill.selftest", str(run), os.getpid(), ticks, time.time())


async def _reported_after(action) -> list[dict]:
    """What asyncio's exception handler saw while `action` ran and its leftovers were collected."""
    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        await action()
        for _ in range(5):
            gc.collect()
            await asyncio.sleep(0.02)
    finally:
        loop.set_exception_handler(previous)
    return reported


async def test_a_link_that_dies_mid_read_leaves_no_unretrieved_task(ssh_target: SSHTarget, tmp_path: Path) -> None:
    handle = _fake_job(tmp_path, 40_000)  # 9 MiB of events: reads as big as the server allows
    proxy, host = await _through_proxy(ssh_target, tmp_path)
    runner = JobRunner(host, **FAST)
    errors: list[str] = []

    async def follow_until_cut() -> None:
        try:
            async for _ in runner.follow(handle):
                proxy.cut = True  # the next read's requests are in flight when the far end goes
        except HostDisconnected as exc:
            errors.append(str(exc))  # kept as text: the exception would keep the tasks alive

    try:
        reported = await _reported_after(follow_until_cut)
    finally:
        await proxy.close()
    assert errors and "connection lost" in errors[0]
    assert not reported, [c.get("message") for c in reported]


async def _through_proxy(ssh_target: SSHTarget, tmp_path: Path) -> tuple[FinProxy, Host]:
    proxy = FinProxy(ssh_target.server.port)
    port = await proxy.start()
    key = (ssh_target.server.host_key.export_public_key().decode() if ssh_target.kind == "openssh"
           else ssh_target.server.known_hosts_line().split(" ", 1)[1])
    known = tmp_path / "known_hosts_proxy"
    known.write_text(f"[127.0.0.1]:{port} {key.strip()}\n")
    return proxy, await ssh_target.connect(port=port, known_hosts=str(known))


async def test_a_download_cut_mid_transfer_leaves_no_unretrieved_task(ssh_target: SSHTarget, tmp_path: Path) -> None:
    big = tmp_path / "states.safetensors"
    big.write_bytes(os.urandom(48 << 20))
    proxy, host = await _through_proxy(ssh_target, tmp_path)
    errors: list[str] = []

    async def download() -> None:
        try:
            await host.get(str(big), tmp_path / "fetched", progress=lambda done, total: setattr(proxy, "cut", True))
        except HostDisconnected as exc:
            errors.append(str(exc))

    try:
        reported = await _reported_after(download)
    finally:
        await proxy.close()
    assert errors and "connection lost during download" in errors[0]
    assert not reported, [c.get("message") for c in reported]
    assert not (tmp_path / "fetched").exists()


async def test_dropped_embedded_connections_leave_no_unretrieved_task(embedded_server, tmp_path: Path) -> None:
    handle = _fake_job(tmp_path, 40_000)
    host = Host(embedded_server.spec("h", workdir=str(tmp_path / "work")))
    await host.connect()
    runner = JobRunner(host, **FAST)
    errors: list[str] = []

    async def follow_until_dropped() -> None:
        try:
            async for _ in runner.follow(handle):
                asyncio.ensure_future(embedded_server.drop_connections())
        except HostDisconnected as exc:
            errors.append(str(exc))

    try:
        reported = await _reported_after(follow_until_dropped)
    finally:
        await host.close()
    assert errors and not reported, [c.get("message") for c in reported]


class KillProofRunner(JobRunner):
    """A runner whose SIGKILL never lands, like KILL on a process in uninterruptible sleep (a hung
    driver call), which a test cannot create on purpose."""

    async def _signal(self, handle: JobHandle, sig: str) -> None:
        if sig != "KILL":
            await super()._signal(handle, sig)


async def test_cancel_returns_when_the_process_survives_kill(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    runner = KillProofRunner(host, **FAST)
    handle = await runner.start("drill.selftest", ["--steps", "400", "--interval", "0.05", "--ignore-term"])
    await asyncio.sleep(0.5)  # its SIGTERM handler is installed
    try:
        began = time.monotonic()
        status = await asyncio.wait_for(runner.cancel(handle, grace=0.2, kill_wait=0.5), 10)
        assert time.monotonic() - began < 5
        assert status.survived_kill and status.state == "running"
        assert status.note.startswith(f"survived KILL: pid {handle.pid} still running 0.5 s after SIGKILL")
    finally:
        os.kill(handle.pid, signal.SIGKILL)
    assert (await JobRunner(host, **FAST).cancel(handle, grace=0.1)).state == "dead"


# --- typed messages and collect ------------------------------------------------------------------


async def test_collect_turns_a_real_job_into_typed_messages(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    handle = await runner.start("drill.selftest", ["--steps", "3", "--interval", "0.2", "--echo", "x"])
    messages: list[Any] = []
    outcome = await collect(runner, handle, on_message=messages.append)
    assert outcome.ok and outcome.exit_code == 0 and outcome.result["echo"] == ["x"]
    assert outcome.offset == Path(handle.events_path).stat().st_size
    assert [type(m).__name__ for m in messages] == [
        "JobLog", *["JobProgress", "JobLog"] * 3, "JobResult", "JobExit"]
    assert messages[0].kind == "phase" and messages[0].message == "steps"
    progress = [m for m in messages if isinstance(m, JobProgress)]
    assert [(p.done, p.total, p.unit, p.phase, p.message) for p in progress] == [
        (i, 3, "step", "steps", f"step {i}") for i in (1, 2, 3)]
    assert progress[0].rate is None
    assert all(2.0 < p.rate < 6.0 for p in progress[1:]), [p.rate for p in progress]  # one step per ~0.2 s
    assert all((m.job_id, m.worker, m.host) == (handle.job_id, handle.worker, handle.host) for m in messages)
    assert messages[-1] == JobExit(handle.job_id, handle.worker, handle.host, 0)


async def test_collect_reports_a_crash_and_a_dead_job(ssh_target: SSHTarget) -> None:
    runner = JobRunner(await ssh_target.connect(), **FAST)
    crash = await runner.start("drill.selftest", ["--steps", "5", "--interval", "0", "--crash-at", "2"])
    outcome = await collect(runner, crash)
    assert (outcome.state, outcome.exit_code) == ("exited", 1) and not outcome.ok
    assert "crashed at step 2" in outcome.error and "RuntimeError" in outcome.stderr_tail

    victim = await runner.start("drill.selftest", ["--steps", "200", "--interval", "0.05"])

    def kill_on_progress(message: Any) -> None:
        if isinstance(message, JobProgress):
            os.kill(victim.pid, signal.SIGKILL)

    outcome = await collect(runner, victim, on_message=kill_on_progress)
    assert outcome.state == "dead" and "is dead" in outcome.error and outcome.exit_code is None


def test_job_message_covers_every_event_type() -> None:
    handle = JobHandle("ct129", "run7-extract", "extract", "/w/runs/run7-extract", 4242, 1, 0.0)
    ids = ("run7-extract", "extract", "ct129")
    state = JobMessages(handle)
    assert state({"type": "phase", "name": "load", "t": 1.0}) == JobLog(*ids, "info", "load", "phase", "load", 1.0)
    first = state({"type": "progress", "key": "bytes", "done": 0, "total": 100, "unit": "B", "t": 1.0})
    second = state({"type": "progress", "key": "bytes", "done": 50, "total": 100, "unit": "B", "t": 3.0})
    other = state({"type": "progress", "key": "tensors", "done": 7, "total": 9, "unit": "tensors", "t": 3.5})
    assert (first.rate, second.rate, other.rate) == (None, 25.0, None)
    assert second.phase == "load" and second.fraction == 0.5
    art = state({"type": "artifact", "seq": 4, "t": 4.0, "path": "/w/states", "kind": "states", "prompts": 10})
    assert art == JobArtifact(*ids, "/w/states", "states", {"prompts": 10})
    assert state({"type": "result", "data": {"n": 1}}) == JobResult(*ids, {"n": 1})
    assert state({"type": "error", "msg": "no fla", "where": "--kernels"}) == JobError(*ids, "no fla", "--kernels")
    assert state({"type": "exit", "code": 2}) == JobExit(*ids, 2)
    assert state({"type": "heartbeat", "seq": 9, "t": 5.0}) is None
    released = state({"type": "gpu_released", "seq": 10, "t": 6.0, "gpus": [0, 1]})
    assert isinstance(released, JobLog) and released.kind == "gpu_released" and "gpus=[0, 1]" in released.message
    assert state({"type": "invalid", "raw": "garbage"}).level == "warning"
    # Without a state of its own, job_message keeps one per job: rates still come out.
    job_message(handle, {"type": "progress", "key": "p", "done": 1, "total": 4, "unit": "prompts", "t": 10.0})
    later = job_message(handle, {"type": "progress", "key": "p", "done": 3, "total": 4, "unit": "prompts", "t": 11.0})
    assert later.rate == 2.0


def test_a_saved_handle_keeps_its_argv_and_accepts_the_file_format() -> None:
    handle = JobHandle("h", "j1", "selftest", "/w/runs/j1", 123, 456, 1.5, ("python3", "-m", "remote.x"))
    assert JobHandle.from_json(handle.to_json()) == handle
    on_disk = {"format": HANDLE_FORMAT, **json.loads(handle.to_json())}
    assert JobHandle.from_json(json.dumps(on_disk)) == handle
    with pytest.raises(ValueError, match="not a saved job handle"):
        JobHandle.from_json("{nope")
