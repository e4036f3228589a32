"""Shared fixtures: tiny models always; the SSH servers only where asyncssh is installed (the GPU
host has no asyncssh and runs `tests/gpu` alone, which needs no SSH)."""

pytest_plugins = ["tests.fixtures_models", "tests.engine_sweep", "tests.router_helpers"]  # engine_sweep: the engine sweeps' fixtures; router_helpers: the real router's fleet

try:
    import asyncssh  # noqa: F401 - only checking that it is there
except ImportError:
    pass
else:
    pytest_plugins += ["tests.ssh_fixtures", "tests.window_fixtures"]


def pytest_collection_modifyitems(items):
    """The files that rehearse whole windows first, most windows first (each file's own order kept).

    CI runs the tests in two processes (pytest-xdist, one file at a time per process): started last,
    the longest file (a few minutes of windows) would run alone after everything else had ended."""
    windows: dict[str, int] = {}
    for item in items:
        info = getattr(item, "_fixtureinfo", None)  # the rehearsal hosts' `drill` fixture, a fresh drill per test
        defs = info.name2fixturedefs.get("drill", ()) if info is not None else ()
        fresh = bool(defs) and defs[-1].func.__module__ == "tests.window_fixtures"  # the last one is used
        windows[item.location[0]] = windows.get(item.location[0], 0) + fresh
    order = {path: rank for rank, path in enumerate(sorted(windows, key=lambda p: -windows[p]))}
    items.sort(key=lambda item: order[item.location[0]])
