"""`dflash-ops serve`'s guard on textual-serve's aiohttp application, over real HTTP on loopback (the
page in a real browser during a drill window: tests/test_share_window.py): the token, its cookie,
the websocket's origin, and the page's websocket address taken from the request."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from console.cli.serve import app_command, is_loopback
from screens.serve import COOKIE, make_server


async def client_for(token: str | None) -> TestClient:
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
        assert f'data-session-websocket-url="ws://{client.host}:{client.port}/ws"' in await page.text()
        script = await client.get("/static/js/textual.js")  # the cookie carries the token from here on
        assert script.status == 200
    finally:
        await client.close()


async def test_a_page_of_another_site_cannot_open_the_websocket() -> None:
    client = await client_for(None)  # loopback: no token
    try:
        assert (await client.get("/")).status == 200
        foreign = await client.get("/ws", headers={"Origin": "http://evil.example"})
        assert foreign.status == 403 and "may not open this console" in await foreign.text()
    finally:
        await client.close()


@pytest.mark.parametrize(("bind", "loopback"), [("127.0.0.1", True), ("localhost", True), ("::1", True),
                                                ("127.0.0.2", True), ("0.0.0.0", False), ("::", False),
                                                ("10.1.2.3", False), ("console-host", False)])
def test_only_a_loopback_bind_goes_without_a_token(bind: str, loopback: bool) -> None:
    assert is_loopback(bind) is loopback


def test_each_browser_runs_the_read_only_console_of_this_config(tmp_path: Path) -> None:
    config = tmp_path / "my config.toml"
    argv = shlex.split(app_command(config, str(tmp_path / "runs")))
    assert argv[1:] == ["-m", "console.cli", "serve", "--app", "--config", str(config.resolve()),
                        "--runs", str((tmp_path / "runs").resolve())]
