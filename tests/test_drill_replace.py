"""`drill up --replicas 2` never silently replaces a running drill (issue 41, section 2: walking the
fleet drill, it did). On the command line (`drill up`, `drill`) a drill up with other settings is
refused, named, and left running; `--fresh` replaces it and says so; `up()` called by a bench or a
test (replace=True) ends it saying what it ends. The hosts are not started: `running_state` says
what runs, `_down_locked` and `_start_hosts` record what would be done."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from console.cli.main import main
from console.drill import hosts
from console.drill.layout import DrillLayout, describe

RUNNING = {"state": "ready", "pid": 4242, "replicas": 1, "gpu": False, "memory_saver": True, "crowded": False}


@pytest.fixture
def world(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    done: dict[str, Any] = {"ended": [], "started": [], "said": []}
    monkeypatch.setattr(hosts, "running_state", lambda layout: dict(RUNNING))
    monkeypatch.setattr(hosts, "_down_locked", lambda layout, say: done["ended"].append(layout.dir) or [])
    monkeypatch.setattr(hosts.procs, "marked_pids", lambda where: [])
    monkeypatch.setattr(hosts.fleet, "router_installed", lambda gateway=None: True)
    monkeypatch.setattr(hosts, "ensure_assets", lambda *a, **k: None)

    def start(layout: DrillLayout, *args: Any) -> Path:
        done["started"].append((layout.replicas, layout.router))
        return layout.config
    monkeypatch.setattr(hosts, "_start_hosts", start)
    done["dir"] = tmp_path / "drill"
    return done


def test_drill_up_with_other_replicas_is_refused_and_the_running_drill_left(world, capsys):
    code = main(["drill", "up", "--dir", str(world["dir"]), "--replicas", "2", "--simulated"])
    err = capsys.readouterr().err
    assert code == 1
    assert "a drill is up at" in err and "(one server, SIMULATED GPUs), not the one asked for (2 replicas behind smg, " \
        "SIMULATED GPUs)" in err and "`drill up --fresh` replaces it" in err
    assert world["ended"] == [] and world["started"] == []  # nothing ended, nothing started


def test_the_drill_command_refuses_too(world, capsys):
    code = main(["drill", "--dir", str(world["dir"]), "--replicas", "2", "--simulated", "--headless", "--yes"])
    assert code == 1 and "a drill is up at" in capsys.readouterr().err
    assert world["ended"] == [] and world["started"] == []


def test_fresh_replaces_it_and_says_so(world, capsys):
    code = main(["drill", "up", "--dir", str(world["dir"]), "--replicas", "2", "--simulated", "--fresh"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "ending the drill up at" in captured.err and "(one server, SIMULATED GPUs) to start a fresh one" in captured.err
    assert len(world["ended"]) == 1 and world["started"] == [(2, "smg")]


def test_a_bench_replaces_it_saying_what_it_ends(world):
    said: list[str] = []
    hosts.up(world["dir"], replicas=3, router="sglang-router", say=said.append)
    assert any("(one server, SIMULATED GPUs) to start the one asked for (3 replicas behind sglang-router, "
               "SIMULATED GPUs)" in line for line in said)
    assert world["started"] == [(3, "sglang-router")]


def test_the_same_drill_is_found_up_not_replaced(world):
    assert hosts.up(world["dir"], say=lambda _: None) == DrillLayout.at(world["dir"]).config
    assert world["ended"] == [] and world["started"] == []


def test_describe_names_each_setting():
    assert describe({"replicas": 2, "router": "smg", "gpu": True, "crowded": True, "memory_saver": False}) == \
        "2 replicas behind smg, REAL GPU, crowded, no memory saver"
    assert describe({"replicas": 2}) == "2 replicas behind sglang-router, SIMULATED GPUs"  # an old drill's state
