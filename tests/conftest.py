"""Shared fixtures: tiny models always; the SSH servers only where asyncssh is installed (the GPU
host has no asyncssh and runs `tests/gpu` alone, which needs no SSH)."""

pytest_plugins = ["tests.fixtures_models"]

try:
    import asyncssh  # noqa: F401 - only checking that it is there
except ImportError:
    pass
else:
    pytest_plugins += ["tests.ssh_fixtures", "tests.window_fixtures"]
