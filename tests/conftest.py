"""Shared fixtures: tiny models always; the SSH servers only where asyncssh is installed (the GPU
host has no asyncssh and runs `tests/gpu` alone, which needs no SSH)."""

import os
import sys

import pytest

# One torch thread per process: the suite runs three test processes on two cores, each starting
# workers and rehearsal servers that use torch at the same time. With torch's default (a thread per
# core each) the threads spin waiting on each other: a speculative-decoding test took 120 s instead
# of 22 s, with four times the CPU. The workers and servers the tests start inherit this.
for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_threads, "1")

# Bytecode is cached (beside the sources, in the ignored __pycache__ folders). A container image may
# say PYTHONDONTWRITEBYTECODE (this machine's does; CI runs on one like it): then each of the suite's
# hundreds of Python processes (the console, workers, rehearsal servers, service commands) compiled
# the console's and workers' sources again, and each test process rewrote and compiled every test
# module: 0.02-0.4 CPU-s a process. Installed packages are unaffected: pip compiled them.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

pytest_plugins = ["tests.fixtures_models", "tests.engine_sweep", "tests.pause_fixtures", "tests.router_helpers"]  # engine_sweep, pause_fixtures: the engine sweeps' fixtures; router_helpers: the real router's fleet

try:
    import asyncssh  # noqa: F401 - only checking that it is there
except ImportError:
    pass
else:
    pytest_plugins += ["tests.ssh_fixtures", "tests.window_fixtures", "tests.drill_helpers"]


# Seconds each file's tests took in a whole run on a 2-core machine (`pytest -q -n 3 --dist loadfile
# --durations=0`, summed per file, 2026-12-06, at 392f3b0), the 40 longest. Only the order uses them: the
# longest files start first, so none is left running alone at the end. (The 2026-12-03 figures had
# test_engine_sweep.py at 187 s, now 44: stale figures start short files before long ones.)
MEASURED_S = {
    "tests/test_window.py": 256, "tests/test_drill_fleet.py": 163, "tests/test_zero_downtime.py": 100,
    "tests/test_signals.py": 87, "tests/test_live_run.py": 83, "tests/test_drill_hosts.py": 83,
    "tests/tui/test_tui_drill.py": 79, "tests/test_transformers_matrix.py": 63,
    "tests/tui/test_tui_snapshots.py": 56, "tests/test_share_window.py": 56, "tests/test_budget_window.py": 53,
    "tests/test_service_ssh.py": 50, "tests/test_job_lifecycle.py": 48, "tests/tui/test_tui_console.py": 48,
    "tests/test_fleet_guard.py": 44, "tests/test_engine_sweep.py": 44, "tests/test_frozen_host.py": 43,
    "tests/test_broken_stdout.py": 43, "tests/test_drafter_check.py": 40, "tests/test_extract.py": 39,
    "tests/tui/test_tui_operator.py": 38, "tests/tui/test_tui_screens.py": 33,
    "tests/test_standin_memory_saver.py": 27, "tests/test_pause_sweep.py": 25, "tests/test_crosscheck.py": 25,
    "tests/test_standin.py": 24, "tests/tui/test_tui_walk.py": 24, "tests/tui/test_tui_replay.py": 24,
    "tests/test_fleet_steps.py": 23, "tests/test_completions.py": 22, "tests/test_pause_edges_drill.py": 22,
    "tests/test_jobs.py": 21, "tests/test_cmd_status.py": 19, "tests/test_cmd_probe.py": 18,
    "tests/test_pause_edges_sweep.py": 17, "tests/test_router.py": 17, "tests/test_standin_http.py": 16,
    "tests/test_evaluate.py": 15, "tests/test_sharing.py": 15, "tests/test_cli.py": 15,
}
DRILL_S = 30  # a file not measured yet: about this long for each test that starts a fresh drill


def pytest_configure(config):
    """Keep this file's order across the test processes. xdist's `--dist loadfile` hands out files
    by their number of tests unless told not to (`--loadscope-reorder`, on by default in xdist 3.8), which
    started the few-test, minutes-long window files late."""
    if hasattr(config.option, "loadscopereorder"):  # xdist is installed (the GPU host runs without it)
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items):
    """The longest files first (each file's own order kept): measured, else by the fresh drills they start.

    CI runs the tests in three processes (pytest-xdist, one file at a time per process): started last,
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


@pytest.fixture(autouse=True)
def no_question_guard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The console's questions answer at once: a test that presses y as a question appears means it.
    (The guard against keys meant for another screen, issue 43, has its own tests, which set
    `app.question_guard_s`.) Only where the test's module imported the console: no Textual otherwise."""
    app = sys.modules.get("screens.app")
    if app is not None:
        monkeypatch.setattr(app.ConsoleApp, "question_guard_s", 0.0)
