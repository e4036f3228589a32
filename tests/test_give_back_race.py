"""Issue 40, item 7, "Two give-backs never race", through the real commands on the drill: a pause run
is cancelled after its release with `--no-restart` (the server left PAUSED with its memory released,
its console gone: the "left paused" alert), then two operators answer it at the same moment with
`dflash-ops run --resume RUN`. Two console processes, held at a gate until both are up and let go
together (no sleep decides the order): exactly one `/resume_memory_occupation` and one
`/continue_generation` reach the rehearsal server (its log names every control request as it comes;
a second resume of a tag no longer released would end it, as SGLang's scheduler ends), the server
ends serving, and the console that lost the run's claim (console/procedure/claim.py) sends nothing
and says who gave the memory back and when, exit 0."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from console.procedure.engine import EXIT_DOWN
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env

pytestmark = pytest.mark.timeout(600)

# Says it is up, waits for the go on stdin, then becomes the console (the same pid: `exec`).
GATE = ("import os, sys; print('ready', flush=True); sys.stdin.readline(); "
        "null = os.open(os.devnull, os.O_RDONLY); os.dup2(null, 0); os.execv(sys.argv[1], sys.argv[1:])")


def service_log(drill: Drill) -> Path:
    return Path(list(drill.config.service.log)[-1])  # `tail -n +1 -F DIR/standin.log`


def control_requests(log: Path, offset: int) -> list[str]:
    text = log.read_bytes()[offset:].decode(errors="replace")
    return re.findall(r"POST (/(?:pause_generation|continue_generation|release_memory_occupation|"
                      r"resume_memory_occupation))", text)


def left_paused(drill: Drill) -> str:
    """A pause run cancelled (SIGINT) once its release answered, `--no-restart`: it ends cancelled,
    exit 3, the server paused with its memory released."""
    console = drill.start_cli("run", "--headless", "--yes", "--route", "pause", "--no-restart")
    drill.wait_journal(lambda e: e.get("step") == "release" and "released in" in e.get("message", ""), proc=console)
    console.send_signal(signal.SIGINT)
    out = console.communicate(timeout=180)[0]
    assert console.returncode == EXIT_DOWN, out
    run_id, state = drill.only_run()
    assert state["status"] == "cancelled" and state["service"]["released"] and state["service"]["paused"], state
    return run_id


def test_two_resumes_of_a_run_left_paused_give_the_memory_back_once(drill: Drill, tmp_path: Path) -> None:
    run_id = left_paused(drill)
    pid = drill.service_pid()
    log = service_log(drill)
    offset = log.stat().st_size
    argv = [ENTRY_POINT, "run", "--resume", run_id, "--headless", "--yes", "--config", str(drill.config_path),
            "--runs", str(drill.runs)]
    consoles = [subprocess.Popen([sys.executable, "-c", GATE, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=cli_env()) for _ in range(2)]
    for console in consoles:
        assert console.stdout.readline() == "ready\n"
    for console in consoles:  # the go, to both at once
        console.stdin.write("go\n")
        console.stdin.flush()
    outs = [" ".join(console.communicate(timeout=240)[0].split()) for console in consoles]
    # the loser's own words (the winner's end may name the give-back too: "its server's memory was given back by")
    said = [i for i, out in enumerate(outs) if f"run {run_id}'s memory was given back by" in out]
    assert len(said) == 1, outs
    loser, winner = consoles[said[0]], consoles[1 - said[0]]
    assert loser.returncode == 0, outs
    assert winner.returncode in (0, 1), outs  # the run ended cancelled earlier: its recovery exits as it ended
    assert re.search(rf"run {run_id}'s memory was given back by \S+@\S+ pid {winner.pid} at \d\d:\d\d:\d\d: "
                     rf"nothing to do", outs[said[0]]), outs
    assert control_requests(log, offset) == ["/resume_memory_occupation", "/continue_generation"], log.read_text()
    assert drill.service_pid() == pid, "the server paused is the one serving: never ended, never restarted"
    ready = urllib.request.urlopen(drill.config.service.url.rstrip("/") + "/ready", timeout=30)
    assert ready.status == 200
    _, state = drill.only_run()
    assert not state["service"]["paused"] and not state["service"]["released"], state["service"]
    assert state["service"]["resumes"] == 1 and state["service"]["continues"] == 1, state["service"]
    assert state["service"]["given_back_by"].endswith(f"pid {winner.pid}")
    assert not (drill.runs / run_id / "claim.json").exists(), "the winner let go of the run"
