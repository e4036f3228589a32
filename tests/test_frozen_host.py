"""A service host that freezes after the stop (its SSH server SIGSTOPped, as a hung host or a
network partition would): the run fails, cannot restart it, and says so: exit 3, the host named,
the store naming the run that left the service down."""

from __future__ import annotations

import os
import signal

from console.procedure.engine import EXIT_DOWN
from console.procedure.store import RunStore
from tests.window_fixtures import Drill, drill  # noqa: F401 - the fixture


def test_a_frozen_service_host_after_the_stop_exits_3_naming_it(drill: Drill) -> None:  # noqa: F811
    # Keepalive and connection attempts of 1 s (the drill's are 5 s): the freeze is seen and each wait
    # for the host given up sooner; what the run does about it is the same.
    config = drill.config_path.read_text()
    for key in ("connect_timeout", "keepalive_interval"):
        assert f"{key} = 5\n" in config
        config = config.replace(f"{key} = 5\n", f"{key} = 1\n")
    drill.config_path.write_text(config)
    console = drill.start_cli("run", "--headless", "--yes")
    drill.wait_journal(lambda e: e["message"].startswith("stop: done"), proc=console)
    hosts = int((drill.dir / "drill.pid").read_text().split()[0])  # both rehearsal hosts' SSH servers
    os.kill(hosts, signal.SIGSTOP)
    try:
        out, _ = console.communicate(timeout=600)
    finally:
        os.kill(hosts, signal.SIGCONT)
    assert console.returncode == EXIT_DOWN, out
    assert "THE SERVICE IS STILL DOWN" in out and "ct129" in out
    assert "Traceback" not in out
    left = RunStore(drill.runs).left_down()
    assert left is not None and left.state.status == "failed" and left.state.service.down
