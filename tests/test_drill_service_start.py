"""The drill's service start (remote/drill/service.py): once `start` has written the server's pid, the
process behind it reads as the server, whatever the machine's load."""

from __future__ import annotations

import os
import signal
import subprocess

from remote.drill import service


def test_a_started_process_reads_as_its_program_once_its_exec_is_waited_for():
    """Right after Popen the child's /proc/PID/cmdline can still read empty: here 55 of 200 `sleep`s
    read so at once (measured). A start that wrote its pid file then had `running_pid` take the live
    server for another process, and the drill said it "exited before it was ready" (seen under load).
    `start` waits for the exec (`_execed`) before it writes the pid; 200 starts, each read at once."""
    for n in range(200):
        proc = subprocess.Popen(["sleep", "30"], stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True)
        try:
            service._execed(proc)
            assert service._cmdline(proc.pid)[:1] == ["sleep"], f"start {n}: its cmdline read empty"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
