"""The CPU a command costs, by the kind of process that spent it (the suite's CPU map).

    python bench/cpu_by_process.py [--interval S] -- COMMAND...

Runs COMMAND and reads /proc every `--interval` seconds (0.2): each live process's user + system
time, kept at its last reading, summed by kind (the console, the drill's hosts, the rehearsal server,
each worker, pytest). CI is CPU-bound (2 cores, the suite keeps both about 90 % busy), so a test's
cost is its CPU, not its wall: this says where a drill window's goes. Processes that live less than
one interval may be missed; those that started before the command are left out. Last line: the total.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

KINDS = ("remote.probe", "remote.provenance", "remote.drafter", "remote.extract_check", "remote.extract", "remote.completions",
         "remote.evaluate", "remote.drill.standin", "remote.drill.trainer", "remote.agent", "remote.endpids",
         "console.drill.hosts", "dflash-ops", "pytest", "sglang_router", "chromium", "sshd")


def kind_of(cmdline: str) -> str:
    """The module a `python -m` runs, else the first kind named anywhere (a test's temporary paths
    hold "pytest": only the program's own words are read for it)."""
    words = cmdline.split(" ")
    if "-m" in words[:3] and words.index("-m") + 1 < len(words):
        module = words[words.index("-m") + 1]
        return next((k for k in KINDS if module.startswith(k)), module)
    return next((k for k in KINDS if k in " ".join(words[:2])), words[0][-40:] or "?")


def snapshot(before: set[str]) -> dict[str, tuple[str, float]]:
    tick = os.sysconf("SC_CLK_TCK")
    seen = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in before:
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        seen[pid] = (cmdline, (int(fields[11]) + int(fields[12])) / tick)
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    before = {pid for pid in os.listdir("/proc") if pid.isdigit()}
    last: dict[str, tuple[str, float]] = {}
    started = time.monotonic()
    child = subprocess.Popen(command)
    def read() -> None:  # a process's name is kept from while it lived (an exited one reads empty)
        for pid, (cmdline, cpu) in snapshot(before).items():
            last[pid] = (cmdline or last.get(pid, ("", 0.0))[0], cpu)

    while child.poll() is None:
        read()
        time.sleep(args.interval)
    read()
    by_kind: collections.Counter[str] = collections.Counter()
    count: collections.Counter[str] = collections.Counter()
    for cmdline, cpu in last.values():
        kind = kind_of(cmdline)
        by_kind[kind] += cpu
        count[kind] += 1
    for kind, cpu in by_kind.most_common():
        if cpu >= 0.05:  # how many processes too: a kind started per window costs its start each time
            print(f"{cpu:8.1f} s  {kind} ({count[kind]} processes, {cpu / count[kind]:.2f} s each)")
    print(f"CPU {sum(by_kind.values()):.1f} s over {time.monotonic() - started:.1f} s of wall (exit {child.returncode})")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
