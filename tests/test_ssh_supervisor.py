"""HostSupervisor against a real (embedded) server: connect, notice a drop, reconnect, publish why."""

from __future__ import annotations

import asyncio
from pathlib import Path

from console.messages import HostState
from console.ssh.embedded_server import EmbeddedSSHServer
from console.ssh.supervisor import HostSupervisor


async def wait_for_status(states: list[HostState], status: str, timeout: float = 10) -> HostState:
    async def poll() -> HostState:
        while not states or states[-1].status != status:
            await asyncio.sleep(0.02)
        return states[-1]

    return await asyncio.wait_for(poll(), timeout)


async def test_supervisor_reconnects_after_the_server_restarts(embedded_server: EmbeddedSSHServer) -> None:
    supervisor = HostSupervisor(embedded_server.spec("inference"), backoff=(0.05, 0.2), ping_interval=0.2)
    states: list[HostState] = []
    supervisor.subscribe(states.append)
    supervisor.start()
    try:
        host = await supervisor.wait_connected(10)
        up = states[-1]
        assert up.status == "connected" and up.latency_s is not None and up.latency_s > 0
        assert (await host.run(["echo", "hi"])).stdout == "hi\n"

        await embedded_server.stop()
        await wait_for_status(states, "reconnecting")
        lost = next(s for s in states if s.status == "reconnecting")
        assert "connection lost" in (lost.last_error or "")
        await asyncio.sleep(0.5)  # several failed attempts while the server is away
        still = states[-1]
        assert still.status == "reconnecting" and still.since == lost.since and still.attempts >= 1
        assert "inference" in (still.last_error or "")

        await embedded_server.start()
        host2 = await supervisor.wait_connected(10)
        assert host2 is not host and (await host2.run(["echo", "back"])).stdout == "back\n"
        # connecting, connected (+ latency updates), reconnecting (one per failed try), connected
        statuses = [s.status for s in states]
        collapsed = [s for i, s in enumerate(statuses) if i == 0 or s != statuses[i - 1]]
        assert collapsed == ["connecting", "connected", "reconnecting", "connected"]
    finally:
        await supervisor.stop()
    assert supervisor.host is None


async def test_unknown_host_key_makes_the_host_down_not_a_crash(embedded_server: EmbeddedSSHServer,
                                                                tmp_path: Path) -> None:
    (tmp_path / "empty_known_hosts").write_text("")
    spec = embedded_server.spec("training", known_hosts=str(tmp_path / "empty_known_hosts"))
    supervisor = HostSupervisor(spec, backoff=(0.05, 0.2))
    states: list[HostState] = []
    supervisor.subscribe(states.append)
    supervisor.start()
    try:
        down = await wait_for_status(states, "down")
        assert "unknown host key" in (down.last_error or "") and "ssh-keyscan" in (down.last_error or "")
        # The operator trusts the key; the supervisor picks it up on its next try.
        (tmp_path / "empty_known_hosts").write_text(embedded_server.known_hosts_line())
        supervisor.retry_now()
        await supervisor.wait_connected(10)
        assert states[-1].status == "connected" and states[-1].attempts == 0
    finally:
        await supervisor.stop()


async def test_a_host_never_reached_is_down_with_the_reason(tmp_path: Path) -> None:
    from console.ssh.hosts import HostSpec
    from tests.ssh_fixtures import free_port

    (tmp_path / "cfg").touch()
    spec = HostSpec("ghost", "127.0.0.1", port=free_port(), ssh_config=str(tmp_path / "cfg"),
                    known_hosts=str(tmp_path / "kh"))
    supervisor = HostSupervisor(spec, backoff=(0.05, 0.1))
    seen: list[HostState] = []
    supervisor.subscribe(seen.append)
    supervisor.start()
    try:
        down = await wait_for_status(seen, "down")
        assert "Connection refused" in (down.last_error or "")
        await asyncio.sleep(0.3)
        assert seen[-1].attempts > down.attempts  # still retrying, never raising
        assert supervisor.host is None
    finally:
        await supervisor.stop()
