"""The rehearsal server as a command-managed service: start, stop and status commands for the drill's config.

    python -m remote.drill.service start  --state DIR [--cuda-mib N | --cuda-leave-mib N] -- STANDIN_ARGS...
    python -m remote.drill.service stop   --state DIR [--wait 10]
    python -m remote.drill.service status --state DIR

`start` launches `python -m remote.drill.standin STANDIN_ARGS` detached (a session of its own, stdin
from /dev/null, output to DIR/standin.log), records its pid in DIR/standin.pid and returns at once, as
`systemctl start` of a simple unit would. The stuck-VRAM episode: the first stop of a drill (no
DIR/stuck-vram.used yet) leaves the simulated GPU memory held by a leftover process (the story's 47 GB
after `systemctl stop`), later stops release it 1.5 s after the server has gone. The simulated
holder decides when the server ends (`--stuck-marker`, creating the marker), so removing the marker
(a fresh drill, or `console.drill.hosts.rearm` on a running one) arms the episode again.

On the GPU drill (`start --cuda-mib N`) the server serves from the GPU and a real CUDA process
(`hold-vram`, SGLang's scheduler in the story) holds N MiB beside it from the start; `start` returns
once that memory is held. It outlives the server the same way, decided at the start: the first
start's stop leaves it holding until someone kills it, later ones release it RELEASE_AFTER_S after
the server has gone. Its
log is DIR/cuda-worker.log.

`start --cuda-leave-mib N` crowds the card instead: once the server is up (its ready line in its
log), the CUDA worker takes all but N MiB of what is then free. The drill's crowded GPU
(`drill up --gpu --crowded`): the extraction no longer fits beside the server's weights, so the pause
route must release them too (issue 40's case), on any card, sized from what the card has left rather
than from a guess of what the server and the contexts hold.

`stop` sends SIGTERM to the recorded server and waits until it is gone; its log is moved to
DIR/standin.prev.log, so a follower of the log (`tail -n +1 -F DIR/standin.log`) sees only the next
start. A rehearsal knob, for tests: while DIR/stop.hold exists (`STOP_HOLD`), `stop` does not return
once the server is gone (a stop as slow as systemd's on a slow unit), so a test holds the console's
window in its stop until an event of its own, then removes the file (tests/test_drill_fleet.py: a
fleet fault seen before the window reaches its extraction). `status` prints the pid first and exits
0 while the server runs, else prints `stopped` and exits 3 (what `systemctl is-active` does).
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
STOP_HOLD = "stop.hold"  # a test's hold on `stop` (see the module's docstring); never made by the drill itself
RELEASE_AFTER_S = 1.5
EXIT_STOPPED = 3
CUDA_LOG_FILE = "cuda-worker.log"
CUDA_WORKER_TIMEOUT_S = 120.0  # torch's import and the CUDA context on a loaded machine
READY_LINE = "The server is fired up and ready to roll!"  # SGLang's ready line: the standin logs it (server.py)
SERVER_READY_TIMEOUT_S = 600.0  # a crowding worker waits this long for the server's ready line


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


def start(state: Path, standin_args: list[str], cuda_mib: int = 0, cuda_leave_mib: int = 0) -> int:
    if (pid := running_pid(state)) is not None:
        print(f"{pid} already running")
        return 0
    state.mkdir(parents=True, exist_ok=True)
    marker = state / STUCK_MARKER
    on_gpu = bool(cuda_mib or cuda_leave_mib)
    if not on_gpu:  # the simulated holder decides when the server ends (a marker removed re-arms it)
        episode = ["--stuck-marker", str(marker), "--release-after", str(RELEASE_AFTER_S)]
    elif marker.exists():
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
    _execed(proc)
    (state / PID_FILE).write_text(f"{proc.pid}\n")
    print(f"{proc.pid} started: {' '.join(argv)}")
    if cuda_leave_mib:  # it fills the card once the server is up: `start` returns now, as systemctl's would
        spawn_cuda_worker(state, proc.pid, ["--leave-mib", str(cuda_leave_mib)], episode)
        print(f"a CUDA worker will take all but {cuda_leave_mib} MiB once the server is up ({state / CUDA_LOG_FILE})")
    elif cuda_mib:
        return start_cuda_worker(state, proc.pid, cuda_mib, episode)
    return 0


def _execed(proc: subprocess.Popen) -> None:
    """Returns once the server's process runs its own program (or has ended). Popen returns as the
    exec begins, and until the kernel has set the new program up its /proc/PID/cmdline reads empty
    (most reads right after Popen, and for longer on a loaded machine): `running_pid` would take the
    server for another process, and `status` say it stopped, or the drill's start that it exited."""
    while not _cmdline(proc.pid) and proc.poll() is None:
        time.sleep(0.005)


def spawn_cuda_worker(state: Path, server_pid: int, size: list[str], episode: list[str]) -> subprocess.Popen:
    """The GPU drill's CUDA worker (`hold-vram`), detached; `size`: its --mib or --leave-mib."""
    argv = [sys.executable, "-m", "remote.drill.service", "hold-vram", "--state", str(state), *size,
            "--server-pid", str(server_pid), *episode]
    with open(state / CUDA_LOG_FILE, "ab") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True)


def start_cuda_worker(state: Path, server_pid: int, mib: int, episode: list[str]) -> int:
    """The GPU drill's CUDA worker beside the server: returns once it holds its memory (0), or 1
    with its log's tail when it could not."""
    log = state / CUDA_LOG_FILE
    worker = spawn_cuda_worker(state, server_pid, ["--mib", str(mib)], episode)
    deadline = time.monotonic() + CUDA_WORKER_TIMEOUT_S
    held = f"{worker.pid} holds {mib} MiB"
    while time.monotonic() < deadline:
        if held in log.read_text(errors="replace"):
            print(f"{worker.pid} CUDA worker holds {mib} MiB on the GPU")
            return 0
        if worker.poll() is not None:
            break
        time.sleep(0.05)
    print(f"the CUDA worker did not take its {mib} MiB; {log} ends with:\n"
          f"{log.read_text(errors='replace')[-1500:]}", file=sys.stderr)
    return 1


def wait_until_served(state: Path, server_pid: int) -> bool:
    """True once the server's log has its ready line; False when the server ended or never got there."""
    deadline = time.monotonic() + SERVER_READY_TIMEOUT_S
    while time.monotonic() < deadline and pid_alive(server_pid):
        with contextlib.suppress(OSError):
            if READY_LINE in (state / LOG_FILE).read_text(errors="replace"):
                return True
        time.sleep(0.2)
    return False


def wait_crowded(state: Path, timeout_s: float = CUDA_WORKER_TIMEOUT_S) -> str:
    """The crowding worker's line once it holds its memory beside the running server (`start
    --cuda-leave-mib`); raises RuntimeError with its log's tail when it does not within `timeout_s`."""
    pid = running_pid(state)
    deadline = time.monotonic() + timeout_s
    log = state / CUDA_LOG_FILE
    while pid is not None and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            for line in log.read_text(errors="replace").splitlines():
                if line.endswith(f"beside server {pid}"):
                    return line
                if f"server {pid} never came up" in line or f"once server {pid} is up" in line:
                    deadline = 0.0
        time.sleep(0.2)
    tail = log.read_text(errors="replace")[-1500:] if log.exists() else "(no log)"
    raise RuntimeError(f"the crowding CUDA worker holds nothing beside server {pid}; {log} ends with:\n{tail}")


def hold_vram(mib: int, server_pid: int, hold_until_killed: bool, release_after: float,
              leave_mib: int = 0, state: Path | None = None) -> int:
    """Hold `mib` MiB of real GPU memory while `server_pid` lives, and after it as the episode says.
    `leave_mib` (with `state`): once the server is up, hold all but that much of what is free."""
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # outlive the session that started the server
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    if leave_mib:
        torch.empty(1, device="cuda")  # this process's own context first: it is not what is left free
        if state is None or not wait_until_served(state, server_pid):
            print(f"server {server_pid} never came up: nothing held", flush=True)
            return 1
        free_bytes, _ = torch.cuda.mem_get_info()
        mib = (free_bytes >> 20) - leave_mib
        if mib <= 0:
            print(f"only {free_bytes >> 20} MiB free once server {server_pid} is up: nothing to crowd "
                  f"(--leave-mib {leave_mib})", flush=True)
            return 1
    block = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    block.fill_(1)  # touched, so the driver has really handed the pages over
    torch.cuda.synchronize()
    print(f"{os.getpid()} holds {mib} MiB on {torch.cuda.get_device_name()} beside server {server_pid}", flush=True)
    while pid_alive(server_pid):
        time.sleep(0.05)
    if hold_until_killed:
        print(f"server {server_pid} has gone; still holding {mib} MiB until killed", flush=True)
        while True:
            time.sleep(3600)
    time.sleep(release_after)
    print(f"server {server_pid} has gone; released {mib} MiB", flush=True)
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
    print(f"{pid} stopped", flush=True)
    _held(state)
    return 0


def _held(state: Path) -> None:
    """Returns once no STOP_HOLD file is in `state`: the server is gone, and the stop command is held
    until the test that made the file removes it (never a timeout of its own: the caller's command
    timeout bounds it, as it bounds any stop)."""
    hold = state / STOP_HOLD
    if not hold.exists():
        return
    print(f"held until {hold} is removed (a rehearsal's hold)", flush=True)
    while hold.exists():
        time.sleep(0.05)


def status(state: Path) -> int:
    pid = running_pid(state)
    if pid is None:
        print("stopped")
        return EXIT_STOPPED
    print(f"{pid} running")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remote.drill.service", description=__doc__.splitlines()[0],
                                     usage="%(prog)s {start,stop,status} --state DIR [--wait S] [--cuda-mib N | --cuda-leave-mib N] "
                                           "[-- STANDIN_ARGS...]")
    parser.add_argument("action", choices=("start", "stop", "status", "hold-vram"))
    parser.add_argument("--state", required=True, help="the service's directory (pid file, log, marker)")
    parser.add_argument("--wait", type=float, default=10.0, help="stop: seconds to wait for the server to end")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--cuda-mib", type=int, default=0,
                       help="start: a real CUDA worker holds this many MiB beside the server (the GPU drill)")
    sizes.add_argument("--cuda-leave-mib", type=int, default=0,
                       help="start: once the server is up, a real CUDA worker takes all but this many MiB free")
    # hold-vram: the CUDA worker itself (started by `start --cuda-mib`)
    parser.add_argument("--mib", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--leave-mib", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--server-pid", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--hold-until-killed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--release-after", type=float, default=RELEASE_AFTER_S, help=argparse.SUPPRESS)
    argv = sys.argv[1:] if argv is None else argv
    ours, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    state = Path(args.state)
    if args.action == "hold-vram":
        if (args.mib <= 0 and args.leave_mib <= 0) or args.server_pid <= 0:
            parser.error("hold-vram needs --mib or --leave-mib, and --server-pid")
        return hold_vram(args.mib, args.server_pid, args.hold_until_killed, args.release_after, args.leave_mib, state)
    if args.action == "start":
        if not extra:
            parser.error("start needs the standin's arguments after --")
        return start(state, extra, args.cuda_mib, args.cuda_leave_mib)
    if extra:
        parser.error(f"{args.action} takes no standin arguments")
    return stop(state, args.wait) if args.action == "stop" else status(state)


if __name__ == "__main__":
    sys.exit(main())
