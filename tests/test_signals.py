"""SIGTERM, SIGHUP and SIGINT during a run on the drill: real console processes signalled for real.

Each is handled as Ctrl-C is: journalled, the run cancelled, the engine's compensation ends our jobs
and restarts the service (`--yes`; `--no-restart` leaves it down, exit 3), the run finishes. A
second signal during the compensation is journalled and never abandons the restart half-way.
"""

from __future__ import annotations

import signal

import pytest

from console.procedure.engine import EXIT_DOWN, EXIT_FAILED
from tests.window_fixtures import Drill

pytestmark = pytest.mark.timeout(600)


def signal_entries(drill: Drill, name: str) -> list[dict]:
    return [e for e in drill.journal() if e["message"].startswith(f"{name} received")]


def test_sigterm_after_the_stop_restarts_the_service_and_a_second_signal_does_not_abandon_it(drill: Drill) -> None:
    console = drill.start_cli("run", "--headless", "--yes")
    drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)  # the service is down
    console.send_signal(signal.SIGTERM)  # `kill`, a logout
    drill.wait_journal(lambda e: e.get("step") == "restart" and e["message"].startswith("approved"), proc=console)
    console.send_signal(signal.SIGINT)  # a second signal (Ctrl-C) while the restart waits for the server
    out, _ = console.communicate(timeout=300)

    assert console.returncode == EXIT_FAILED, out  # cancelled, and the service is back up
    assert "Traceback" not in out and "SIGTERM received" in out
    _, state = drill.only_run()
    assert state["status"] == "cancelled" and not state["service"]["down"]
    assert drill.service_pid() is not None
    journal = drill.journal()
    starts = [e for e in journal if e.get("step") == "restart" and e["message"].startswith("approved")]
    assert len(starts) == 1  # one start, carried through to ready
    assert any(e["message"].startswith("restart: ready") or e["message"].startswith("ready after")
               for e in journal)
    (term,) = signal_entries(drill, "SIGTERM")
    (again,) = signal_entries(drill, "SIGINT")
    assert term["level"] == "warning" and "cancel" in term["message"]
    assert "the restart is not abandoned" in again["message"]
    assert journal.index(term) < journal.index(starts[0]) < journal.index(again)
    assert journal[-1]["message"].startswith("run cancelled (exit 1)")


def test_sighup_with_no_restart_finishes_the_run_and_exits_3_with_the_service_down(drill: Drill) -> None:
    console = drill.start_cli("run", "--headless", "--yes", "--no-restart")
    drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
    console.send_signal(signal.SIGHUP)  # the terminal closed
    out, _ = console.communicate(timeout=300)

    assert console.returncode == EXIT_DOWN, out
    assert "Traceback" not in out and "THE SERVICE IS STILL DOWN" in out
    _, state = drill.only_run()
    assert state["status"] == "cancelled" and state["service"]["down"]  # finished, and says who left it down
    assert drill.service_pid() is None
    (hup,) = signal_entries(drill, "SIGHUP")
    assert hup["level"] == "warning"
    status = drill.run_cli("status")
    assert status.returncode == 1 and "SERVICE DOWN since" in status.stdout


class Terminal:
    """The console on a real pseudo-terminal (120x40), its screen drained so that it never blocks."""

    def __init__(self, argv: list[str]):
        import fcntl
        import os
        import pty
        import struct
        import subprocess
        import termios
        import threading

        from tests.window_fixtures import cli_env

        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        env = {**cli_env(), "TERM": "xterm-256color"}
        env.pop("COLUMNS", None)
        self.proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
        os.close(slave)
        self.screen = bytearray()

        def drain() -> None:
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    return
                if not chunk:
                    return
                self.screen += chunk

        self._reader = threading.Thread(target=drain, daemon=True)
        self._reader.start()
        self.master = master

    def close(self) -> None:
        import os

        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self.master)


def wait_entry(drill: Drill, terminal: Terminal, predicate) -> dict:
    import time

    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for entry in drill.journal():
            if predicate(entry):
                return entry
        assert terminal.proc.poll() is None, f"the console exited ({terminal.proc.returncode}) first"
        time.sleep(0.05)
    raise TimeoutError("no such journal entry")


def test_the_console_opened_by_run_takes_its_route_and_a_sigterm_ends_its_run_then_the_console(drill: Drill) -> None:
    """`run` on a terminal opens the console with the command line's --route (issue 22 #15); SIGTERM
    there cancels the run as in the headless run, journalled, and the console exits with the run's code."""
    from tests.window_fixtures import ENTRY_POINT

    terminal = Terminal([ENTRY_POINT, "run", "--route", "zero-downtime", "--config", str(drill.config_path),
                         "--runs", str(drill.runs)])
    try:
        started = wait_entry(drill, terminal, lambda e: e["message"].startswith("started run"))
        assert "(zero-downtime route" in started["message"]
        terminal.proc.send_signal(signal.SIGTERM)
        assert terminal.proc.wait(240) == EXIT_FAILED  # cancelled; the server was never touched
    finally:
        terminal.close()
    _, state = drill.only_run()
    assert state["status"] == "cancelled" and state["route"] == "zero-downtime"
    assert signal_entries(drill, "SIGTERM") and drill.service_pid() is not None


async def test_the_console_run_takes_no_restart_and_step(drill: Drill) -> None:
    """What `run --no-restart --step` on a terminal hands the console: each of its runs leaves the
    service down after a failure (no restart offered) and runs one step, then pauses."""
    import asyncio

    from console.operator import Asked, Operator
    from console.procedure.decider import ApproveAll

    operator = Operator(drill.config, runs_dir=str(drill.runs), asked=Asked(no_restart=True, one_step=True))
    operator.start()
    try:
        finished = await operator.run(ApproveAll())  # as the console's autostart and `g` call it
    finally:
        await asyncio.wait_for(operator.stop(), 30)
    assert finished.status == "paused" and finished.service_up, finished.message
    assert operator.engine.restart_on_failure is False
    _, state = drill.only_run()
    assert state["steps"]["preflight"]["status"] == "done" and state["steps"].get("stop", {}).get("status") != "done"


def test_sighup_in_the_console_after_the_stop_leaves_nobody_to_approve_the_restart_exit_3(drill: Drill) -> None:
    """The terminal closes while the console's run has the service down: the hang-up is journalled,
    the run is cancelled and finished, no question waits forever for an answer nobody can give, and
    the console ends with exit 3, the store saying which run left the service down."""
    import os
    import time

    from tests.window_fixtures import ENTRY_POINT

    terminal = Terminal([ENTRY_POINT, "run", "--config", str(drill.config_path), "--runs", str(drill.runs)])
    try:
        deadline = time.monotonic() + 240
        while not any(e["message"].startswith("stop: done") for e in drill.journal()):
            assert time.monotonic() < deadline and terminal.proc.poll() is None, bytes(terminal.screen[-4000:])
            os.write(terminal.master, b"y")  # approve the stop (and the stuck-VRAM holders) in its modal
            time.sleep(0.5)
        terminal.proc.send_signal(signal.SIGHUP)
        os.close(terminal.master)  # and the terminal is gone
        terminal.master = os.open(os.devnull, os.O_RDONLY)
        assert terminal.proc.wait(240) == EXIT_DOWN
    finally:
        terminal.close()
    _, state = drill.only_run()
    assert state["status"] == "cancelled" and state["service"]["down"]
    assert signal_entries(drill, "SIGHUP") and drill.service_pid() is None
    assert any(e["message"].startswith("refused: start the service") for e in drill.journal())


def test_a_terminal_already_gone_when_sighup_comes_still_lets_the_console_end(drill: Drill) -> None:
    """A closed terminal (tmux kill-server, a dropped ssh): the terminal is hung up first and the
    SIGHUP comes after, when it no longer answers as a terminal. The console must still stop
    drawing on it, cancel its run and exit (it hung on, drawing, once its run had ended)."""
    import os
    import time

    from tests.window_fixtures import ENTRY_POINT

    terminal = Terminal([ENTRY_POINT, "run", "--config", str(drill.config_path), "--runs", str(drill.runs)])
    try:
        wait_entry(drill, terminal, lambda e: e["message"].startswith("started run"))
        deadline = time.monotonic() + 240
        while not all(any(e["message"].startswith(f"{step}: done") for e in drill.journal())
                      for step in ("stage", "cache")):  # the stop's question comes next
            assert time.monotonic() < deadline and terminal.proc.poll() is None, bytes(terminal.screen[-4000:])
            time.sleep(0.1)
        os.close(terminal.master)  # the terminal is gone: its slave side now answers EIO
        terminal.master = os.open(os.devnull, os.O_RDONLY)
        terminal.proc.send_signal(signal.SIGHUP)  # then what the kernel sends a hung-up terminal's
        terminal.proc.send_signal(signal.SIGCONT)  # processes (Textual redraws its screen on it)
        assert terminal.proc.wait(120) == EXIT_FAILED  # cancelled before the stop; the server untouched
    finally:
        terminal.close()
    _, state = drill.only_run()
    assert state["status"] in ("cancelled", "refused") and not state["service"]["down"]
    assert signal_entries(drill, "SIGHUP") and drill.service_pid() is not None
