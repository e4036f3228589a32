"""The drill's rehearsal hosts for the window tests: real SSH servers in their own process, the
rehearsal server as a command-managed service, simulated GPUs with the stuck-VRAM episode.

Each test process keeps one drill up, and each test gets it as `up` leaves it: `rearm` ends what the
last test started, empties the hosts' run directories, restores the config and assets, re-arms the
stuck-VRAM episode (the first stop leaves VRAM held again) and starts the service again only when it
is not serving as `up` started it; a drill the last test brought down or broke is started fresh.
Each test has its own run store. The assets are built once per machine (the user cache dir).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from console.config import Config, load_config
from console.drill.hosts import down
from console.drill.rearm import rearm
from console.procedure.store import JOURNAL, RunStore, read_jsonl

ENTRY_POINT = str(Path(sys.executable).parent / "dflash-ops")


@dataclass
class Drill:
    dir: Path
    config_path: Path
    runs: Path
    _journal_read: tuple[Any, list[dict[str, Any]]] | None = field(default=None, repr=False, compare=False)

    @property
    def config(self) -> Config:
        return load_config(self.config_path)

    def service_pid(self) -> int | None:
        """The rehearsal server's pid as its status command reports it (None: not running)."""
        argv = self.config.service.status
        done = subprocess.run(["sh", "-c", argv] if isinstance(argv, str) else list(argv), capture_output=True, text=True)
        words = done.stdout.split()
        return int(words[0]) if done.returncode == 0 and words and words[0].isdigit() else None

    def service_command(self, argv: Any) -> None:
        """The server's own stop or start command, run from the test as an operator would on the host:
        with the drill's mark, so that `drill down` ends what it starts (the server's GPU worker
        outlived the test sessions without it)."""
        from console.drill.procs import MARK_ENV, mark_value

        subprocess.run(list(argv), check=True, capture_output=True, timeout=60,
                       env={**os.environ, MARK_ENV: mark_value(self.dir)})

    def run_cli(self, *args: str, timeout: float = 240, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run([ENTRY_POINT, *args, "--config", str(self.config_path), "--runs", str(self.runs)],
                              capture_output=True, text=True, timeout=timeout, env=cli_env(), **kwargs)

    def start_cli(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen([ENTRY_POINT, *args, "--config", str(self.config_path), "--runs", str(self.runs)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                                stdin=subprocess.DEVNULL)

    def only_run(self) -> tuple[str, dict[str, Any]]:
        store = RunStore(self.runs)
        (run_id,) = store.run_ids()
        return run_id, store.open(run_id).state.to_json()

    def journal(self) -> list[dict[str, Any]]:
        """The latest run's journal entries. The waits below poll it 20 times a second while a window
        runs: it is read again only when the file has grown, and no state.json is parsed for it (that
        cost 7 ms a poll, a seventh of a core spent waiting)."""
        ids = RunStore(self.runs).run_ids()
        path = self.runs / ids[-1] / JOURNAL if ids else None
        try:
            key = (path, path.stat().st_size) if path is not None else None
        except FileNotFoundError:
            key = None
        if key is None:
            return []
        if self._journal_read is None or self._journal_read[0] != key:
            self._journal_read = (key, read_jsonl(path))
        return list(self._journal_read[1])

    def job_dirs(self, host: str, worker: str) -> list[Path]:
        """The run directories of the jobs of step `worker` on `host` (how many times it was started)."""
        runs = Path(self.config.hosts[host].workdir) / "runs"
        return sorted(p for p in runs.glob(f"*-{worker}*") if p.is_dir()) if runs.is_dir() else []

    def wait_journal(self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 180,
                     proc: subprocess.Popen | None = None) -> dict[str, Any]:
        """Until a journal entry satisfies `predicate` (the console writes and fsyncs each one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for entry in self.journal():
                if predicate(entry):
                    return entry
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the console exited ({proc.returncode}) first:\n{proc.stdout.read()}")
            time.sleep(0.05)
        raise TimeoutError("no such journal entry")


def cli_env() -> dict[str, str]:
    return {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the console: no handler, no cleanup, as a crash or an OOM kill."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def shared_drill_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One drill per test process, brought down at its end."""
    root = tmp_path_factory.mktemp("shared-drill") / "drill"
    try:
        yield root
    finally:
        down(root, say=lambda _: None)


@pytest.fixture
def drill(shared_drill_dir: Path, tmp_path: Path) -> Drill:
    config = rearm(shared_drill_dir, say=lambda _: None)
    return Drill(shared_drill_dir, config, tmp_path / "runs")
