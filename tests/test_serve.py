"""`dflash-ops serve`'s guard on textual-serve's aiohttp application, over real HTTP on loopback (the
page in a real browser during a drill window: tests/test_share_window.py): the token (always, kept in
a file of the user's only), its cookie, the names the console answers to, the websocket's origin, and
the page's websocket address taken from the request."""

from __future__ import annotations

import asyncio
import re
import shlex
import stat
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from console.cli.serve import app_command, is_loopback
from console.cli.serve_access import served_names
from screens.serve import cookie_name, make_server

COOKIE = cookie_name(0)  # (the test servers' port)


async def client_for(token: str) -> TestClient:
    server = make_server("true", "127.0.0.1", 0, token, "dflash-ops (read-only): ct129")
    client = TestClient(TestServer(await server._make_app()))
    await client.start_server()
    return client


async def test_without_its_token_the_page_its_files_and_its_websocket_are_refused() -> None:
    client = await client_for("s3cret")
    try:
        for path in ("/", "/static/js/textual.js", "/ws", "/?token=wrong"):
            answer = await client.get(path)
            assert answer.status == 403 and "needs its token" in await answer.text(), path
        page = await client.get("/?token=s3cret")
        assert page.status == 200
        cookie = page.cookies[COOKIE]
        assert cookie.value == "s3cret" and cookie["httponly"] and cookie["samesite"] == "Strict"
        # The page's own websocket address is the one it was reached at (an ssh forward of any port).
        html = await page.text()
        assert f'data-session-websocket-url="ws://{client.host}:{client.port}/ws"' in html
        # every file the page loads comes from this console: no web font from another site (issue 43)
        loaded = re.findall(r"""(?:href|src)="([^"]+)"|url\(["']?([^"')]+)""", html)
        loaded = [a or b for a, b in loaded]
        assert loaded and all(url.startswith(f"http://{client.host}:{client.port}/") for url in loaded), loaded
        assert 'data-pingurl=""' in html  # textual-serve's page pings no address of its own choosing
        for path in ("/static/css/xterm.css", "/static/js/textual.js"):  # nor do its files fetch another site
            text = await (await client.get(path)).text()
            assert not re.search(r"@import|url\(\s*[\"']?https?:", text), path
        script = await client.get("/static/js/textual.js")  # the cookie carries the token from here on
        assert script.status == 200
    finally:
        await client.close()


async def test_a_page_of_another_site_cannot_open_the_websocket() -> None:
    client = await client_for("s3cret")
    try:
        assert (await client.get("/?token=s3cret")).status == 200  # the cookie from here on
        foreign = await client.get("/ws", headers={"Origin": "http://evil.example"})
        assert foreign.status == 403 and "may not open this console" in await foreign.text()
    finally:
        await client.close()


@pytest.mark.parametrize(("bind", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("127.0.0.2", True), ("0.0.0.0", False), ("::", False),
                                                ("10.1.2.3", False), ("console-host", False)])
def test_a_loopback_bind_is_told_how_to_forward_it(bind: str, loopback: bool) -> None:
    assert is_loopback(bind) is loopback


def test_each_browser_runs_the_read_only_console_of_this_config(tmp_path: Path) -> None:
    config = tmp_path / "my config.toml"
    argv = shlex.split(app_command(config, str(tmp_path / "runs")))
    assert argv[1:] == ["-m", "console.cli", "serve", "--app", "--config", str(config.resolve()),
                        "--runs", str((tmp_path / "runs").resolve())]


# --- the token, always; the names the console answers to (issue 42) -----------------------------

TOKEN_ENV = "DFLASH_OPS_SERVE_TOKEN_FILE"


class NotServing:
    """`make_server`'s stand-in: what `dflash-ops serve` asked for, and nothing served."""

    def __init__(self, calls: list[dict], command: str, bind: str, port: int, token: str | None, title: str,
                 names: object = None, max_viewers: int = 8, hub: object = None) -> None:
        calls.append({"bind": bind, "port": port, "token": token, "names": names, "max_viewers": max_viewers})

    def serve(self) -> None:
        pass


def serve_cli(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture,
              *args: str) -> tuple[int, str, str, list[dict]]:
    """`dflash-ops serve ARGS` up to the point where it would serve: its exit, what it printed, and
    what it asked the server for. The token's file lies under tmp_path."""
    from console.cli.main import main
    from console.config.file import example_config_text

    config = tmp_path / "dflash-ops.toml"
    config.write_text(example_config_text())
    monkeypatch.setenv(TOKEN_ENV, str(tmp_path / "state" / "serve-token"))
    calls: list[dict] = []
    monkeypatch.setattr("screens.serve.make_server", lambda *a, **k: NotServing(calls, *a, **k))
    code = main(["serve", "--config", str(config), "--port", "8765", *args])
    out, err = capsys.readouterr()
    return code, out, err, calls


def test_a_loopback_bind_needs_its_token_too_kept_in_a_file_of_the_users_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code, out, _, calls = serve_cli(monkeypatch, tmp_path, capsys)
    path = tmp_path / "state" / "serve-token"
    assert code == 0 and path.is_file(), out
    token = path.read_text().strip()
    assert len(token) >= 32 and calls == [{"bind": "127.0.0.1", "port": 8765, "token": token,
                                           "names": served_names("127.0.0.1"), "max_viewers": 8}]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    first = out.splitlines()[0]  # the address to open, the token in it
    assert first.endswith(f"at http://127.0.0.1:8765/?token={token}"), out
    assert str(path) in out and f"then open http://127.0.0.1:8765/?token={token}" in out
    # The next start keeps it (an open page or a bookmark goes on working); --new-token replaces it.
    assert serve_cli(monkeypatch, tmp_path, capsys)[3][0]["token"] == token
    _, out, _, calls = serve_cli(monkeypatch, tmp_path, capsys, "--new-token")
    assert calls[0]["token"] != token and calls[0]["token"] == path.read_text().strip()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_a_token_file_others_can_read_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "state" / "serve-token"
    path.parent.mkdir()
    path.write_text("x" * 43)
    path.chmod(0o644)
    code, out, err, calls = serve_cli(monkeypatch, tmp_path, capsys)
    assert code == 2 and not calls and not out
    assert str(path) in err and "0644" in err and "chmod 600" in err, err


async def test_a_name_not_the_consoles_is_refused_with_its_token() -> None:
    # DNS rebinding: a page of rebind.example whose name now resolves to 127.0.0.1 sends its own
    # name as Host (and as Origin, which then agrees with it).
    client = await client_for("s3cret")
    try:
        for host in ("rebind.example", f"rebind.example:{client.port}", "127.0.0.1.nip.io"):
            answer = await client.get("/?token=s3cret", headers={"Host": host, "Origin": f"http://{host}"})
            assert answer.status == 403 and "does not answer to the name" in await answer.text(), host
            assert COOKIE not in answer.cookies
            socket_answer = await client.get("/ws?token=s3cret", headers={"Host": host})
            assert socket_answer.status == 403, host
        for host in (f"127.0.0.1:{client.port}", "localhost:8765", "LOCALHOST", "[::1]:8765", "127.0.0.2"):
            assert (await client.get("/?token=s3cret", headers={"Host": host})).status == 200, host
    finally:
        await client.close()


@pytest.mark.parametrize(("bind", "names", "host", "answers"), [
    ("127.0.0.1", (), "localhost:8765", True),
    ("127.0.0.1", (), "console-host", False),
    ("127.0.0.1", (), "10.1.2.3", False),  # not where it listens
    ("10.1.2.3", (), "10.1.2.3:8765", True),
    ("10.1.2.3", (), "127.0.0.1:8765", True),  # an ssh forward to it
    ("10.1.2.3", (), "10.1.2.4", False),
    ("10.1.2.3", (), "console-host", False),
    ("10.1.2.3", ("console-host",), "Console-Host.:8765", True),
    ("console-host", (), "console-host:8765", True),
    ("0.0.0.0", (), "192.168.7.9:8765", True),  # any address of the machine: a browser sent no name
    ("::", (), "[fe80::1]:8765", True),
    ("0.0.0.0", (), "evil.example", False),
    ("0.0.0.0", ("ops.example.org",), "ops.example.org", True),
    ("0.0.0.0", (), "", False),
])
def test_the_names_a_console_answers_to(bind: str, names: tuple[str, ...], host: str, answers: bool) -> None:
    assert served_names(bind, names).answers(host) is answers


def test_a_wildcard_bind_answers_to_this_machines_names() -> None:
    import socket

    served = served_names("0.0.0.0", ())
    assert served.answers(socket.gethostname()) and served.answers(socket.getfqdn() + ":8765")


def test_the_access_log_keeps_no_token() -> None:
    import logging

    from screens.serve import MaskToken

    line = ('127.0.0.1 [05/Dec/2026:12:26:39 +0000] "GET /?fontsize=3&token=s3cret-x_y HTTP/1.1" 200 4696 '
            '"http://127.0.0.1:8765/?token=s3cret-x_y" "curl/7.88.1"')
    record = logging.LogRecord("aiohttp.access", logging.INFO, __file__, 1, line, (), None)
    assert MaskToken().filter(record) and "s3cret" not in record.getMessage()
    assert '"GET /?fontsize=3&token=… HTTP/1.1"' in record.getMessage()


async def test_past_the_viewers_cap_the_page_says_so_and_a_closed_page_frees_its_place() -> None:
    """Issue 42: each browser's websocket is a console of its own; past `max_viewers` at once the page
    says the cap is reached (503) and a websocket is refused; a viewer that closes its page leaves
    nothing behind and frees its place."""
    server = make_server("sleep 60", "127.0.0.1", 0, "s3cret", "dflash-ops (read-only): ct129", max_viewers=1)
    client = TestClient(TestServer(await server._make_app()))
    await client.start_server()
    try:
        assert (await client.get("/?token=s3cret")).status == 200  # the cookie from here on
        first = await client.ws_connect("/ws?width=80&height=24")
        try:
            page = await client.get("/")
            said = await page.text()
            assert page.status == 503 and "1 viewer already watch" in said and "--max-viewers" in said, said
            second = await client.get("/ws", headers={"Connection": "Upgrade", "Upgrade": "websocket",
                                                       "Sec-WebSocket-Version": "13",
                                                       "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
            assert second.status == 503 and "its cap" in await second.text()
        finally:
            await first.close()
        for _ in range(200):  # the closed viewer's place comes back once its console has ended
            if (await client.get("/")).status == 200:
                break
            await asyncio.sleep(0.05)
        assert (await client.get("/")).status == 200 and server.viewers == 0
    finally:
        await client.close()


def test_a_cap_below_one_viewer_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                           capsys: pytest.CaptureFixture) -> None:
    code, _, err, calls = serve_cli(monkeypatch, tmp_path, capsys, "--max-viewers", "0")
    assert code == 2 and "--max-viewers must be at least 1, not 0" in err and calls == []
    code, _, _, calls = serve_cli(monkeypatch, tmp_path, capsys, "--max-viewers", "3")
    assert code == 0 and calls[0]["max_viewers"] == 3
