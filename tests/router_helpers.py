"""SGLang's real routers in front of real rehearsal servers, for tests: smg 1.13.0 (the default) and
the older sglang-router 0.3.2, each started as the drill starts it (`console.drill.fleet.launch_router`:
its launcher, smg's replicas registered with their settle), ended by pid (smg's SIGTERM is its real
graceful stop, kept short by the drill's `--shutdown-grace-period-secs`).

`router_fleet`: two replicas behind smg, once per test process; `legacy_router_fleet`: sglang-router in
front of the same two replicas (a second router, started only when a test asks for it);
`any_router_fleet`: a test run once on each gateway, where both must be seen to work."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.drill.fleet import GATEWAYS, MODULES, PINS, SGLANG_ROUTER, SMG, FleetError, launch_router
from tests.standin_helpers import ROOT, free_port, start_standin, stop, wait_status

ROUTER_START_S = 90.0
# A gateway that sees a stopped replica at its first failed check (1 s apart, 1 s timeout) and a live
# one again at its first answer: a flap is seen within seconds, as a team's tuned gateway sees it
# (both gateways take these flags on their command line).
QUICK_HEALTH = ("--health-failure-threshold", "1", "--health-success-threshold", "1",
                "--health-check-timeout-secs", "1")


def listing(router_url: str, key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(router_url + "/workers", headers=headers), timeout=5) as answer:
        return json.loads(answer.read())["workers"]


@contextlib.contextmanager
def running_router(worker_urls: list[str], log: Path, *extra: str, key: str | None = None,
                   gateway: str = SMG) -> Iterator[str]:
    """The real router (`gateway`) on a free loopback port with these workers, every one listed
    healthy (read with the admin `key` when it has control-plane keys); its URL."""
    try:
        proc, url = launch_router(gateway, sys.executable, free_port(), worker_urls, log, ROUTER_START_S, *extra,
                                  key=key, cwd=ROOT)
    except FleetError as exc:
        raise AssertionError(str(exc)) from None
    try:
        yield url
    finally:
        stop(proc)


def need_router(gateway: str | None = None) -> None:
    """The real routers are here (`gateway`, or both), or the test is skipped; under CI=true that is a
    failure: CI installs them (the dev extra) and runs the router tests."""
    missing = [PINS[g] for g in ([gateway] if gateway else GATEWAYS) if importlib.util.find_spec(MODULES[g]) is None]
    if missing:
        why = f"the fleet extra ({', '.join(missing)}) is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(why + ": CI installs it (the dev extra) and runs the router tests")
        pytest.skip(why, allow_module_level=True)


@pytest.fixture(scope="session")
def _replicas(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, list[str]]]:
    """Two rehearsal servers, shared by the routers below: (their logs' directory, their URLs)."""
    need_router()
    tmp = tmp_path_factory.mktemp("fleet")
    with running_replicas(tiny_target, tmp) as urls:
        yield tmp, urls


@pytest.fixture(scope="session")
def router_fleet(_replicas: tuple[Path, list[str]]) -> Iterator[tuple[str, list[str]]]:
    """Two rehearsal servers behind the real smg, started once for every test file that needs them
    (tests/test_router.py, tests/test_fleet_steps.py): (router URL, replica URLs). A test that takes a
    replica out puts it back."""
    tmp, urls = _replicas
    with running_router(urls, tmp / "smg.log", gateway=SMG) as router:
        yield router, urls


@pytest.fixture(scope="session")
def legacy_router_fleet(_replicas: tuple[Path, list[str]]) -> Iterator[tuple[str, list[str]]]:
    """sglang-router 0.3.2 in front of the same two rehearsal servers (each replica then behind two
    routers: a test drains through one of them only)."""
    tmp, urls = _replicas
    with running_router(urls, tmp / "sglang-router.log", gateway=SGLANG_ROUTER) as router:
        yield router, urls


@pytest.fixture(params=GATEWAYS)
def any_router_fleet(request: pytest.FixtureRequest) -> tuple[str, list[str]]:
    """The test once behind smg, once behind sglang-router: (router URL, replica URLs)."""
    return request.getfixturevalue("router_fleet" if request.param == SMG else "legacy_router_fleet")


@contextlib.contextmanager
def running_replicas(model: Path, tmp: Path, replicas: int = 2, *standin_args: str) -> Iterator[list[str]]:
    """`replicas` rehearsal servers, started side by side, each ready: their URLs."""
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    try:
        for i in range(replicas):
            port = free_port()
            procs.append(start_standin(model, port, tmp / f"standin{i}.log", "--metrics", "--warmup-delay", "0.1",
                                       *standin_args))
            urls.append(f"http://127.0.0.1:{port}")
        for i, (proc, url) in enumerate(zip(procs, urls, strict=True)):
            try:
                wait_status(url + "/health", 200, timeout=120, proc=proc)
            except (TimeoutError, RuntimeError) as exc:
                raise AssertionError(f"{exc}\n{(tmp / f'standin{i}.log').read_text()[-2000:]}") from None
        yield urls
    finally:
        for proc in procs:
            stop(proc)


@contextlib.contextmanager
def running_fleet(model: Path, tmp: Path, replicas: int = 2, *standin_args: str,
                  gateway: str = SMG) -> Iterator[tuple[str, list[str]]]:
    """`replicas` rehearsal servers behind the real router: (router URL, replica URLs)."""
    with running_replicas(model, tmp, replicas, *standin_args) as urls, \
            running_router(urls, tmp / f"{gateway}.log", gateway=gateway) as router:
        yield router, urls
