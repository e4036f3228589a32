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
