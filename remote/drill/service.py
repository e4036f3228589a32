"""The rehearsal server as a command-managed service: start, stop and status commands for the drill's config.

    python -m remote.drill.service start  --state DIR -- STANDIN_ARGS...
    python -m remote.drill.service stop   --state DIR [--wait 10]
    python -m remote.drill.service status --state DIR

`start` launches `python -m remote.drill.standin STANDIN_ARGS` detached (a session of its own, stdin
from /dev/null, output to DIR/standin.log), records its pid in DIR/standin.pid and returns at once, as
`systemctl start` of a simple unit would. The first start of a drill (no DIR/stuck-vram.used yet) adds
`--hold-until-killed`, so the next stop leaves the simulated GPU memory held by a leftover process
(the story's 47 GB after `systemctl stop`); later starts add `--release-after 1.5`. Removing the
marker (a fresh drill) arms the episode again.

`stop` sends SIGTERM to the recorded server and waits until it is gone; its log is moved to
DIR/standin.prev.log, so a follower of the log (`tail -n +1 -F DIR/standin.log`) sees only the next
start. `status` prints the pid first and exits 0 while the server runs, else prints `stopped` and
exits 3 (what `systemctl is-active` does).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from remote.procstat import pid_alive

PID_FILE = "standin.pid"
LOG_FILE = "standin.log"
PREV_LOG_FILE = "standin.prev.log"
STUCK_MARKER = "stuck-vram.used"
RELEASE_AFTER_S = 1.5
EXIT_STOPPED = 3


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return [part.decode(errors="replace") for part in fh.read().split(b"\0") if part]
    except OSError:
        return []


def running_pid(state: Path) -> int | None:
    """The recorded server's pid while it is alive and still the standin (a reused pid is not it)."""
    try:
        pid = int((state / PID_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    if pid_alive(pid) and "remote.drill.standin" in _cmdline(pid):
        return pid
    return None


def start(state: Path, standin_args: list[str]) -> int:
    if (pid := running_pid(state)) is not None:
        print(f"{pid} already running")
        return 0
    state.mkdir(parents=True, exist_ok=True)
    marker = state / STUCK_MARKER
    if marker.exists():
        episode = ["--release-after", str(RELEASE_AFTER_S)]
    else:
        episode = ["--hold-until-killed"]
        marker.write_text(f"armed by the start at {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    log = state / LOG_FILE
    if log.exists():  # a server that ended without a stop left its log: keep it apart from this start's
        os.replace(log, state / PREV_LOG_FILE)
    argv = [sys.executable, "-m", "remote.drill.standin", *standin_args, *episode]
    with open(log, "ab") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)
    (state / PID_FILE).write_text(f"{proc.pid}\n")
    print(f"{proc.pid} started: {' '.join(argv)}")
    return 0


def stop(state: Path, wait_s: float) -> int:
    pid = running_pid(state)
    if pid is None:
        print("stopped (was not running)")
        return 0
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    if pid_alive(pid):
        print(f"{pid} still running {wait_s:g} s after SIGTERM", file=sys.stderr)
        return 1
    if (state / LOG_FILE).exists():
        os.replace(state / LOG_FILE, state / PREV_LOG_FILE)
    print(f"{pid} stopped")
    return 0


def status(state: Path) -> int:
    pid = running_pid(state)
    if pid is None:
        print("stopped")
        return EXIT_STOPPED
    print(f"{pid} running")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.drill.service", description=__doc__.splitlines()[0],
                                     usage="%(prog)s {start,stop,status} --state DIR [--wait S] [-- STANDIN_ARGS...]")
    parser.add_argument("action", choices=("start", "stop", "status"))
    parser.add_argument("--state", required=True, help="the service's directory (pid file, log, marker)")
    parser.add_argument("--wait", type=float, default=10.0, help="stop: seconds to wait for the server to end")
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    state = Path(args.state)
    if args.action == "start":
        if not extra:
            parser.error("start needs the standin's arguments after --")
        return start(state, extra)
    if extra:
        parser.error(f"{args.action} takes no standin arguments")
    return stop(state, args.wait) if args.action == "stop" else status(state)


if __name__ == "__main__":
    sys.exit(main())
