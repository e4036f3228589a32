"""Host operations over real SSH, each test run against the embedded server and OpenSSH's sshd."""

from __future__ import annotations

import asyncio
import gc
import os
import shlex
from pathlib import Path

import asyncssh
import pytest
from hypothesis import given
from hypothesis import strategies as st

from console.ssh.hosts import (
    AuthFailed,
    CommandFailed,
    Host,
    HostDisconnected,
    HostUnreachable,
    UnknownHostKey,
    command_line,
    tail_text,
)
from tests.ssh_fixtures import SSHTarget, free_port

NASTY_ARGS = ["plain", "two words", "", "it's", '"dq"', "$HOME", "`id`", "$(id)", "a;b", "a|b", "*",
              "~", "line1\nline2", "back\\slash", "-n", "--", "é ünïcode"]


@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"))))
def test_command_line_round_trips_through_a_posix_shell_parser(argv: list[str]) -> None:
    assert shlex.split(command_line(argv)) == argv


def test_command_line_refuses_a_string() -> None:
    with pytest.raises(TypeError):
        command_line("rm -rf /tmp/x")  # type: ignore[arg-type]


@given(st.text(max_size=5000))
def test_tail_text_keeps_the_end(text: str) -> None:
    tail = tail_text(text, limit=100)
    assert len(tail) <= 100
    assert text.rstrip().endswith(tail)


async def test_run_returns_output_and_status(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    result = await host.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (result.exit_status, result.stdout, result.stderr) == (3, "out\n", "err\n")


async def test_run_feeds_input_to_the_command(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    text = "".join(f"line {i}\n" for i in range(5000))
    assert (await host.run(["wc", "-l"], input=text)).stdout.strip() == "5000"


async def test_arguments_arrive_literally(ssh_target: SSHTarget, tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    canary.mkdir()
    args = [*NASTY_ARGS, f"'; rm -rf {canary}'", f"$(rm -rf {canary})"]
    host = await ssh_target.connect()
    result = await host.run(["printf", "%s\\0", *args])
    assert result.stdout.split("\0")[:-1] == args
    assert canary.is_dir()


async def test_failed_command_names_argv_status_and_stderr(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    with pytest.raises(CommandFailed) as info:
        await host.run(["sh", "-c", "echo 'disk full' >&2; exit 7", "x y"])
    err = info.value
    assert err.exit_status == 7 and err.stderr_tail == "disk full"
    assert err.argv[-1] == "x y"
    assert "exited with status 7" in str(err) and "disk full" in str(err) and "testhost" in str(err)


async def test_run_timeout_is_a_command_failure(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    with pytest.raises(CommandFailed, match="timed out after 0.3 s"):
        await host.run(["sleep", "5"], timeout=0.3)


async def test_stream_yields_lines_as_they_come(ssh_target: SSHTarget, tmp_path: Path) -> None:
    # The command prints its second line only after the test has seen the first: a stream that
    # waited for the end would never get there (the test would time out).
    flag = tmp_path / "flag"
    script = 'echo first; echo; while [ ! -e "$1" ]; do sleep 0.02; done; echo "last line"'
    host = await ssh_target.connect()
    lines = []
    async for line in host.stream(["sh", "-c", script, "sh", str(flag)]):
        lines.append(line)
        if line == "first":
            flag.touch()
    assert lines == ["first", "", "last line"]


async def test_stream_raises_with_stderr_tail_on_failure(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    seen = []
    with pytest.raises(CommandFailed) as info:
        async for line in host.stream(["sh", "-c", "echo partial; echo 'it broke' >&2; exit 4"]):
            seen.append(line)
    assert seen == ["partial"]
    assert info.value.exit_status == 4 and "it broke" in info.value.stderr_tail


async def test_put_and_get_round_trip_with_progress(ssh_target: SSHTarget, tmp_path: Path) -> None:
    payload = os.urandom(300_000)
    (tmp_path / "src.bin").write_bytes(payload)
    remote_dir = ssh_target.workdir / "files"
    remote_dir.mkdir(parents=True)
    host = await ssh_target.connect()
    seen: list[tuple[int, int]] = []
    await host.put(tmp_path / "src.bin", f"{remote_dir}/dst.bin", progress=lambda d, t: seen.append((d, t)))
    assert (remote_dir / "dst.bin").read_bytes() == payload
    assert seen[-1] == (len(payload), len(payload)) and len(seen) > 1
    assert [p.name for p in remote_dir.iterdir()] == ["dst.bin"]  # no temp file left behind
    back: list[tuple[int, int]] = []
    await host.get(f"{remote_dir}/dst.bin", tmp_path / "back.bin", progress=lambda d, t: back.append((d, t)))
    assert (tmp_path / "back.bin").read_bytes() == payload
    assert back[-1] == (len(payload), len(payload))


async def test_get_of_a_missing_file_names_it_and_leaves_nothing(ssh_target: SSHTarget, tmp_path: Path) -> None:
    host = await ssh_target.connect()
    with pytest.raises(Exception, match="nope.bin") as info:
        await host.get(f"{ssh_target.workdir}/nope.bin", tmp_path / "out.bin")
    assert "testhost" in str(info.value)
    assert list(tmp_path.glob("*out.bin*")) == []


async def test_local_port_forward_reaches_a_server_on_the_host(ssh_target: SSHTarget) -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"echo:" + await reader.readline())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    remote_port = server.sockets[0].getsockname()[1]
    host = await ssh_target.connect()
    local_port = await host.forward_local_port("127.0.0.1", remote_port)
    assert local_port != remote_port
    reader, writer = await asyncio.open_connection("127.0.0.1", local_port)
    writer.write(b"hello\n")
    assert await reader.readline() == b"echo:hello\n"
    writer.close()
    server.close()


async def test_ping_measures_a_round_trip(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    latency = await host.ping()
    assert 0 < latency < 5


async def test_unknown_host_key_is_refused_with_how_to_trust_it(ssh_target: SSHTarget, tmp_path: Path) -> None:
    empty = tmp_path / "known_hosts_empty"
    empty.write_text("")
    with pytest.raises(UnknownHostKey) as info:
        await ssh_target.connect(known_hosts=str(empty))
    err = info.value
    assert not err.changed and err.fingerprint and err.fingerprint.startswith("SHA256:")
    port = ssh_target.server.port
    assert f"ssh-keyscan -p {port} 127.0.0.1 >> {empty}" in str(err)
    assert err.fingerprint in str(err)


async def test_changed_host_key_is_refused_as_changed(ssh_target: SSHTarget, tmp_path: Path) -> None:
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().strip()
    known = tmp_path / "known_hosts_stale"
    known.write_text(f"[127.0.0.1]:{ssh_target.server.port} {other}\n")
    with pytest.raises(UnknownHostKey) as info:
        await ssh_target.connect(known_hosts=str(known))
    assert info.value.changed
    assert "CHANGED" in str(info.value) and f"ssh-keygen -R '[127.0.0.1]:{ssh_target.server.port}'" in str(info.value)


async def test_wrong_client_key_is_auth_failed(ssh_target: SSHTarget, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger_key"
    stranger.write_bytes(asyncssh.generate_private_key("ssh-ed25519").export_private_key())
    stranger.chmod(0o600)
    with pytest.raises(AuthFailed, match="refused key"):
        await ssh_target.connect(identity_file=str(stranger))


async def test_closed_port_is_unreachable(tmp_path: Path) -> None:
    from console.ssh.hosts import HostSpec

    host = Host(HostSpec("nowhere", "127.0.0.1", port=free_port(), known_hosts=str(tmp_path / "kh"),
                         ssh_config=str(tmp_path / "cfg"), connect_timeout=2))
    (tmp_path / "cfg").touch()
    with pytest.raises(HostUnreachable, match=r"nowhere: cannot reach \w+@127.0.0.1:\d+: Connection refused"):
        await host.connect()


async def test_operations_after_a_drop_raise_host_disconnected(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    await ssh_target.drop(host)
    await asyncio.wait_for(host.wait_closed(), 10)
    with pytest.raises(HostDisconnected):
        await host.run(["true"])


async def test_a_server_that_never_answers_times_out(tmp_path: Path) -> None:
    from console.ssh.hosts import HostSpec

    accepted: list[asyncio.StreamWriter] = []
    silent = await asyncio.start_server(lambda r, w: accepted.append(w), "127.0.0.1", 0)  # TCP up, no SSH banner
    port = silent.sockets[0].getsockname()[1]
    (tmp_path / "cfg").touch()
    host = Host(HostSpec("mute", "127.0.0.1", port=port, known_hosts=str(tmp_path / "kh"),
                         ssh_config=str(tmp_path / "cfg"), connect_timeout=0.3))
    with pytest.raises(HostUnreachable, match="no SSH answer from .*127.0.0.1:.* within 0.3 s"):
        await host.connect()
    silent.close()
    for writer in accepted:  # closing the server leaves accepted connections open
        writer.close()
    await silent.wait_closed()


async def test_a_stream_left_early_leaves_the_connection_usable(ssh_target: SSHTarget) -> None:
    host = await ssh_target.connect()
    async for line in host.stream(["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; sleep 0.01; done"]):
        if line == "3":
            break
    assert (await host.run(["echo", "still fine"])).stdout == "still fine\n"


async def test_a_stream_cut_by_a_drop_is_host_disconnected_with_no_stray_task_error(
        ssh_target: SSHTarget) -> None:
    """A drop is HostDisconnected, not the command "exiting with status -1" (sshd's channel just
    ends); and the stderr reader's own ConnectionLost is collected, never left for asyncio to
    report as "Task exception was never retrieved"."""
    host = await ssh_target.connect()

    async def follow_until_the_drop() -> str:
        try:
            async for line in host.stream(["sh", "-c", "i=0; while true; do i=$((i+1)); echo $i; sleep 0.01; done"]):
                if line == "3":
                    await ssh_target.drop(host)
        except HostDisconnected as exc:
            return str(exc)  # only the text: the traceback would keep the stream's tasks alive
        return "the stream ended without an error"

    loop = asyncio.get_running_loop()
    reported: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: reported.append(context))
    try:
        message = await follow_until_the_drop()
        await asyncio.sleep(0.2)  # let the channel's readers see the loss
        await host.close()  # the closed connection keeps the error (and its frames) until now
        gc.collect()  # a task whose exception nobody fetched is reported when it is collected
    finally:
        loop.set_exception_handler(None)
    assert message.startswith("testhost: connection lost during `sh -c"), message
    assert [c["message"] for c in reported] == []
