"""Shared fixtures: tiny models always; the SSH servers only where asyncssh is installed (the GPU
host has no asyncssh and runs `tests/gpu` alone, which needs no SSH)."""

import os

# One torch thread per process: the suite runs two test processes on two cores, each starting
# workers and rehearsal servers that use torch at the same time. With torch's default (a thread per
# core each) the threads spin waiting on each other: a speculative-decoding test took 120 s instead
# of 22 s, with four times the CPU. The workers and servers the tests start inherit this.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

pytest_plugins = ["tests.fixtures_models", "tests.engine_sweep", "tests.router_helpers"]  # engine_sweep: the engine sweeps' fixtures; router_helpers: the real router's fleet

try:
    import asyncssh  # noqa: F401 - only checking that it is there
except ImportError:
    pass
else:
    pytest_plugins += ["tests.ssh_fixtures", "tests.window_fixtures"]


# Seconds each file's tests took in a whole run on a quiet 2-core machine (`--durations`, summed per
# file, 2026-12-02), for the files past half a minute. Only the order uses them: the longest files start
# first, so none is left running alone at the end.
MEASURED_S = {
    "tests/test_window.py": 459, "tests/test_zero_downtime.py": 163, "tests/test_signals.py": 157,
    "tests/tui/test_tui_drill.py": 132, "tests/test_live_run.py": 230, "tests/test_budget_window.py": 150,
    "tests/test_share_window.py": 120, "tests/test_drill_hosts.py": 280, "tests/test_frozen_host.py": 55,
    "tests/test_service_ssh.py": 43, "tests/test_forecast.py": 37, "tests/test_cmd_run.py": 30,
}
DRILL_S = 30  # a file not measured yet: about this long for each test that starts a fresh drill


def pytest_collection_modifyitems(items):
    """The longest files first (each file's own order kept): measured, else by the fresh drills they start.

    CI runs the tests in two processes (pytest-xdist, one file at a time per process): started last,
    a long file (a few minutes of windows) would run alone after everything else had ended."""
    weight: dict[str, float] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # the rehearsal hosts' `drill` fixture, a fresh drill per test
        defs = info.name2fixturedefs.get("drill", ()) if info is not None else ()
        fresh = bool(defs) and defs[-1].func.__module__ == "tests.window_fixtures"  # the last one is used
        path = item.location[0]
        weight[path] = weight.get(path, 0) + fresh * DRILL_S
    for path in weight:
        weight[path] = MEASURED_S.get(path, weight[path])
    order = {path: rank for rank, path in enumerate(sorted(weight, key=lambda p: -weight[p]))}
    items.sort(key=lambda item: order[item.location[0]])
