"""SGLang's real router (sglang-router 0.3.2) in front of real rehearsal servers, for tests: started as
the drill starts it (`console.drill.fleet.router_command`), ended by pid."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.drill.fleet import router_command
from tests.standin_helpers import ROOT, free_port, start_standin, stop, wait_status


def listing(router_url: str, key: str | None = None) -> list[dict]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with urllib.request.urlopen(urllib.request.Request(router_url + "/workers", headers=headers), timeout=5) as answer:
        return json.loads(answer.read())["workers"]


def wait_workers(router_url: str, urls: list[str], proc: subprocess.Popen, log: Path, timeout: float = 90.0,
                 key: str | None = None) -> None:
    """Until the router lists every one of `urls` healthy (it registers them in the background)."""
    deadline = time.monotonic() + timeout
    seen: list[dict] = []
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"the router exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, ValueError, KeyError):
            seen = listing(router_url, key)
            healthy = {w["url"] for w in seen if w["is_healthy"]}
            if set(urls) <= healthy:
                return
        time.sleep(0.2)
    raise AssertionError(f"the router never listed {urls} healthy; last listing {seen}\n{log.read_text()[-3000:]}")


@contextlib.contextmanager
def running_router(worker_urls: list[str], log: Path, *extra: str, key: str | None = None) -> Iterator[str]:
    """The real router on a free loopback port with these workers, every one listed healthy (read with
    the admin `key` when it has control-plane keys); its URL."""
    port = free_port()
    argv = router_command(sys.executable, port, free_port(), worker_urls, *extra)
    with log.open("w") as fh:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_workers(url, worker_urls, proc, log, key=key)
        yield url
    finally:
        stop(proc)



def need_router() -> None:
    """The real router is here, or the test is skipped; under CI=true that is a failure: CI installs
    it (the dev extra) and runs the router tests."""
    if importlib.util.find_spec("sglang_router") is None:
        why = "the fleet extra (sglang-router) is not installed"
        if os.environ.get("CI") == "true":
            pytest.fail(why + ": CI installs it (the dev extra) and runs the router tests")
        pytest.skip(why, allow_module_level=True)

@pytest.fixture(scope="session")
def router_fleet(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """Two rehearsal servers behind the real router, started once for every test file that needs them
    (tests/test_router.py, tests/test_fleet_steps.py): (router URL, replica URLs). A test that takes a
    replica out puts it back."""
    need_router()
    with running_fleet(tiny_target, tmp_path_factory.mktemp("fleet")) as found:
        yield found


@contextlib.contextmanager
def running_fleet(model: Path, tmp: Path, replicas: int = 2, *standin_args: str) -> Iterator[tuple[str, list[str]]]:
    """`replicas` rehearsal servers (started side by side, each ready) behind the real router:
    (router URL, replica URLs)."""
    procs, urls = [], []
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
        with running_router(urls, tmp / "router.log") as router:
            yield router, urls
    finally:
        for proc in procs:
            stop(proc)
