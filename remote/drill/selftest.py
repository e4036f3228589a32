"""A small worker that exercises the job machinery: sleeps, reports progress, crashes on request.

    python -m remote.drill.selftest --steps N --interval S [--crash-at K] [--echo ARG ...]

Emits a `phase`, one `progress` and one `log` per step, then a `result` holding the echoed
arguments exactly as received (so tests can check that quoting kept each one literal). With
`--crash-at K` it raises an uncaught exception at step K: a message on stderr, an `error` event
and exit code 1, as a real worker bug would. `--sleep-silent S` sleeps S seconds after step 1
(only heartbeats, if on, are written meanwhile); `--big-line N` first logs one N-byte message.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from remote.events import EventWriter, run_worker


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m remote.drill.selftest", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3, help="number of steps")
    parser.add_argument("--interval", type=float, default=0.1, help="seconds to sleep per step")
    parser.add_argument("--crash-at", type=int, default=None, help="raise an exception at this step")
    parser.add_argument("--echo", nargs="*", default=[], help="arguments to return in the result")
    parser.add_argument("--echo-env", nargs="*", default=[], help="environment variables to return in the result")
    parser.add_argument("--stderr", default=None, help="a line to write to stderr before starting")
    parser.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (to test KILL)")
    parser.add_argument("--sleep-silent", type=float, default=0.0,
                        help="after the first step, sleep this long writing no event of its own")
    parser.add_argument("--big-line", type=int, default=0, help="first write a log event this many bytes long")
    return parser.parse_args(argv)


def main(events: EventWriter, argv: list[str] | None = None) -> dict[str, Any]:
    """Run the steps; return the echoed arguments and facts about the process."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    run_dir = os.environ.get("DFLASH_RUN_DIR")
    handle_at_start = bool(run_dir) and os.path.exists(os.path.join(run_dir, "handle.json"))
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.stderr:
        print(args.stderr, file=sys.stderr, flush=True)
    events.phase("steps")
    if args.big_line:
        events.log("x" * args.big_line)
    for step in range(1, args.steps + 1):
        if args.crash_at is not None and step == args.crash_at:
            raise RuntimeError(f"selftest crashed at step {step} as asked")
        time.sleep(args.interval)
        events.progress("steps", step, args.steps, "step", label=f"step {step}")
        events.log(f"step {step}/{args.steps} done")
        if step == 1 and args.sleep_silent:
            time.sleep(args.sleep_silent)
    return {"echo": args.echo, "pid": os.getpid(), "cwd": os.getcwd(), "sid": os.getsid(0),
            "handle_at_start": handle_at_start, "env": {name: os.environ.get(name) for name in args.echo_env}}


if __name__ == "__main__":
    run_worker(main)
