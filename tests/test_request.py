"""Issue 39 item 2: what the operator asks for is answered by one call (`console/request.py`), for
the command line, the console and `serve` alike: the run, its config and the refusals, said before
anything connects. Over a real run store and real config files; the commands' own tests
(test_unfinished_runs.py, test_resume_rules.py, test_cmd_run.py) go through the entry point."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from console.config import ConfigError
from console.procedure.outcomes import ResumeRefused
from console.procedure.state import Owner, current_user
from console.procedure.store import RunStore, RunStoreError, UnfinishedRun
from console.request import Refused, Request, choose
from tests.cli_hosts import write_config

HOST = {"address": "127.0.0.1", "port": 22, "user": "ops", "workdir": "/tmp/dflash-ops"}


def config(path: Path, **service: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_config(path, {"ct129": HOST}, {"host": "ct129", "manager": "command", "start": "true",
                                                "stop": "true", "status": "false", **service})


def started(store: RunStore, config_path: Path):
    """A run a console began and left (its owner gone): unfinished, the service up."""
    run = store.create(str(config_path.resolve()), None)
    run.state.started, run.state.status, run.state.route = True, "paused", "window"
    run.state.owner = Owner("ops", "elsewhere", 1, 0.0, 0)  # another machine's console: not alive here
    run.save()
    return run


def test_a_new_run_while_one_is_unfinished_is_answered_with_it_not_a_new_run(tmp_path: Path) -> None:
    conf = config(tmp_path / "dflash-ops.toml")
    store = RunStore(tmp_path / "runs")
    left = started(store, conf)
    with pytest.raises(UnfinishedRun, match=f"unfinished run {left.run_id}: resume / discard"):
        choose(Request("run", config=str(conf), runs=str(store.root)))  # a script is refused it
    chosen = choose(Request("run", config=str(conf), runs=str(store.root)), offered=True)
    assert chosen.run is None  # the console opens on the answer and offers it first
    assert [r.run_id for r in store.readable()] == [left.run_id]  # nothing created


def test_resume_names_the_run_and_its_recorded_config_from_any_directory(tmp_path: Path, monkeypatch) -> None:
    conf = config(tmp_path / "conf" / "dflash-ops.toml")
    store = RunStore(tmp_path / "runs")
    left = started(store, conf)
    monkeypatch.chdir(tmp_path)  # no ./dflash-ops.toml here: the run's own config is used, and said
    said: list[str] = []
    chosen = choose(Request("resume", runs=str(store.root)), said.append)
    assert chosen.run is not None and chosen.run.run_id == left.run_id
    assert chosen.config.source == conf.resolve()
    assert said == chosen.said == [f"using the config of run {left.run_id}: {conf.resolve()} (recorded by the run; "
                                   f"./dflash-ops.toml is not here)"]


def test_a_resume_under_another_service_is_refused_naming_both(tmp_path: Path) -> None:
    conf = config(tmp_path / "a" / "dflash-ops.toml")
    other = config(tmp_path / "b" / "dflash-ops.toml", host="ct129", start="echo other")
    store = RunStore(tmp_path / "runs")
    left = started(store, conf)
    left.state.service_identity = {"host": "ct129", "manager": "command", "unit": "a-different-unit"}
    left.save()
    with pytest.raises(ResumeRefused) as refused:
        choose(Request("resume", left.run_id, config=str(other), runs=str(store.root)))
    assert left.run_id in str(refused.value)


def test_a_run_another_live_console_drives_is_refused_before_anything_is_sent(tmp_path: Path) -> None:
    conf = config(tmp_path / "dflash-ops.toml")
    store = RunStore(tmp_path / "runs")
    left = started(store, conf)
    console = subprocess.Popen(["sleep", "60"])  # another console, alive on this machine
    try:
        with open(f"/proc/{console.pid}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        left.state.owner = Owner(current_user(), os.uname().nodename, console.pid, time.time(), ticks)
        left.state.status = "running"
        left.save()
        with pytest.raises(ResumeRefused, match="nothing was written or sent"):
            choose(Request("resume", left.run_id, config=str(conf), runs=str(store.root)))
    finally:
        console.kill()
        console.wait()


def test_discard_takes_the_newest_unfinished_run_and_says_when_there_is_none(tmp_path: Path) -> None:
    conf = config(tmp_path / "dflash-ops.toml")
    store = RunStore(tmp_path / "runs")
    with pytest.raises(Refused, match=f"no unfinished run to discard in {store.root}"):
        choose(Request("discard", config=str(conf), runs=str(store.root)))
    left = started(store, conf)
    assert choose(Request("discard", config=str(conf), runs=str(store.root))).run.run_id == left.run_id
    with pytest.raises(RunStoreError):
        choose(Request("discard", "no-such-run", config=str(conf), runs=str(store.root)))


def test_a_broken_config_is_said_for_a_run_but_a_discard_goes_on_without_it(tmp_path: Path) -> None:
    conf = config(tmp_path / "dflash-ops.toml")
    store = RunStore(tmp_path / "runs")
    left = started(store, conf)
    conf.write_text("[service\n")
    with pytest.raises(ConfigError):
        choose(Request("resume", left.run_id, config=str(conf), runs=str(store.root)))
    chosen = choose(Request("discard", left.run_id, config=str(conf), runs=str(store.root)))
    assert chosen.run.run_id == left.run_id and chosen.config is None


def test_a_fleet_replica_named_on_a_one_server_config_is_refused(tmp_path: Path) -> None:
    conf = config(tmp_path / "dflash-ops.toml")
    with pytest.raises(Refused, match="--replica r2: this config has no \\[fleet\\]"):
        choose(Request("run", config=str(conf), runs=str(tmp_path / "runs"), replica="r2"))
    assert RunStore(tmp_path / "runs").readable() == []  # nothing begun
