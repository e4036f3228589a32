"""`run --headless --yes 2>&1 | tee log` on the drill when the pipe's reader dies (issue 43 #6).

A closed or broken stdout never ends nor stalls the window: Ctrl-C after the stop reaches `tee` too
(one process group), and the console must still end its jobs, restart the service and finish the
run; a reader killed alone must not end the console on its next write, the window carries on to its
end. Real console processes on the drill, their output a real pipe, as a shell sets it up.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from console.procedure.engine import EXIT_FAILED
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env

pytestmark = pytest.mark.timeout(600)


def start_piped(drill: Drill, log: Path) -> tuple[subprocess.Popen, subprocess.Popen]:
    """`dflash-ops run --headless --yes 2>&1 | tee log`: the reader and the console in one process
    group of their own (the shell's job), the console's stdout and stderr the pipe's writing end."""
    reader = subprocess.Popen(["tee", str(log)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              process_group=0)
    env = cli_env()
    env.pop("PYTHONUNBUFFERED", None)  # as a shell runs it: stdout block-buffered into the pipe
    console = subprocess.Popen([ENTRY_POINT, "run", "--headless", "--yes", "--config", str(drill.config_path),
                                "--runs", str(drill.runs)], stdin=subprocess.DEVNULL, stdout=reader.stdin,
                               stderr=subprocess.STDOUT, env=env, process_group=reader.pid)
    reader.stdin.close()  # the console holds the only writing end: the pipe breaks when tee dies
    return reader, console


def tee_read(log: Path, line: str, console: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until `tee` has written `line` to `log` (the console still running), or fail saying so."""
    import time

    deadline = time.monotonic() + timeout
    while line not in (log.read_text() if log.exists() else ""):
        assert console.poll() is None and time.monotonic() < deadline, f"{line!r} never reached {log}"
        time.sleep(0.05)  # a file written by another process: polled, with a deadline, on its content


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def job_pids(drill: Drill) -> list[int]:
    """The pids of every job this run started on the drill's hosts (their handle.json)."""
    pids = []
    for host in drill.config.hosts.values():
        for handle in (Path(host.workdir) / "runs").glob("*/handle.json"):
            pids.append(json.loads(handle.read_text())["pid"])
    return pids


def finish(console: subprocess.Popen, reader: subprocess.Popen) -> int:
    try:
        return console.wait(120)
    finally:
        for proc in (console, reader):
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait(10)


def test_ctrl_c_after_the_stop_kills_tee_too_and_the_service_is_restarted_all_the_same(drill: Drill,
                                                                                         tmp_path: Path) -> None:
    reader, console = start_piped(drill, tmp_path / "log")
    try:
        drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)  # the service is down
        # ... and tee has the console's line of it: the journal is written first, the terminal's line
        # may still be on its way through the pipe (on a loaded machine, for a while)
        tee_read(tmp_path / "log", "[stop] done", console)
    finally:
        os.killpg(reader.pid, signal.SIGINT)  # Ctrl-C: the shell's whole job, tee included
    code = finish(console, reader)

    assert code == EXIT_FAILED  # cancelled, and the service is back up
    _, state = drill.only_run()
    assert state["status"] == "cancelled" and not state["service"]["down"]
    assert drill.service_pid() is not None  # served again
    journal = drill.journal()
    assert any(e["message"].startswith("SIGINT received") for e in journal)
    assert any(e.get("step") == "restart" and e["message"].startswith("approved") for e in journal)
    assert journal[-1]["message"].startswith("run cancelled (exit 1)")
    assert not [pid for pid in job_pids(drill) if alive(pid)]  # the jobs ended, the extractor too
    assert "[stop] done" in (tmp_path / "log").read_text()  # what tee read before it died


def test_the_reader_killed_alone_after_the_stop_never_ends_the_window(drill: Drill, tmp_path: Path) -> None:
    reader, console = start_piped(drill, tmp_path / "log")
    try:
        drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
    finally:
        reader.kill()  # only the reader: the console's next write meets a broken pipe
        reader.wait(10)
    code = finish(console, reader)

    _, state = drill.only_run()
    assert (code, state["status"]) == (0, "done")  # the window ran to its end, as without a terminal
    assert not state["service"]["down"] and drill.service_pid() is not None
    journal = drill.journal()
    assert journal[-1]["message"].startswith("run done (exit 0)")
    assert not [pid for pid in job_pids(drill) if alive(pid)]


def test_a_write_to_a_pipe_nobody_reads_or_whose_reader_is_gone_returns_at_once_and_never_raises() -> None:
    """The writes under the run: a reader that stops reading without dying (a full pipe) blocks
    only the writer thread, and the drain gives up; a reader gone is let go of, quietly."""
    import time

    from console.terminal_output import PENDING_MAX, TerminalOutput, _Writer

    read_end, write_end = os.pipe()
    writer = _Writer()
    try:
        stream = TerminalOutput(os.fdopen(write_end, "w", closefd=False), writer)
        began = time.monotonic()
        for _ in range(2 * PENDING_MAX // 1000):  # far more than the pipe holds, and than is queued
            stream.write("x" * 999 + "\n")
            stream.flush()
        assert time.monotonic() - began < 5 and not stream.gone
        assert writer.drain(0.2) is False  # the reader took nothing: the end does not wait on it

        os.close(read_end)  # and now it is gone: the blocked write fails with EPIPE
        read_end = -1
        assert writer.drain(5) and stream.gone
        assert stream.write("after\n") == 6  # goes nowhere, raises nothing
        os.write(write_end, b"anyone else's write\n")  # the descriptor is /dev/null now: no EPIPE
    finally:
        writer.close()
        os.close(write_end)
        if read_end >= 0:
            os.close(read_end)
