"""The browser side of `dflash-ops serve` (console/cli/serve.py): textual-serve's aiohttp server with
the token's guard. It lives with the Textual app, so the core (console/) never imports Textual."""

from __future__ import annotations

import hmac
from typing import Any
from urllib.parse import urlsplit

COOKIE = "dflash-ops-token"


def make_server(command: str, bind: str, port: int, token: str | None, title: str) -> Any:
    """textual-serve's server for `command`, refusing requests without `token` (None: no token)."""
    import aiohttp_jinja2
    from aiohttp import web
    from textual_serve.server import Server, to_int

    class ConsoleServer(Server):
        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            app.middlewares.append(guard)
            return app

        @aiohttp_jinja2.template("app_index.html")
        async def handle_index(self, request: web.Request) -> dict[str, Any]:
            here = f"{request.scheme}://{request.host}"
            socket = ("wss" if request.scheme == "https" else "ws") + f"://{request.host}/ws"
            return {"font_size": to_int(request.query.get("fontsize", "16"), 16), "app_websocket_url": socket,
                    "config": {"static": {"url": f"{here}/static/"}}, "application": {"name": self.title}}

        async def on_startup(self, app: web.Application) -> None:
            pass  # the command says where it serves, with the token (textual-serve's banner would not)

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        origin = request.headers.get("Origin")
        if request.path == "/ws" and origin and urlsplit(origin).netloc != request.host:
            raise web.HTTPForbidden(text=f"dflash-ops serve: a page of {origin} may not open this console\n")
        if token is None:
            return await handler(request)
        given = request.query.get("token") or request.cookies.get(COOKIE) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise web.HTTPForbidden(text="dflash-ops serve: this console needs its token: open the address "
                                         "`dflash-ops serve` printed at start (…/?token=…)\n")
        response = await handler(request)
        if request.query.get("token") and isinstance(response, web.Response):
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    return ConsoleServer(command, host=bind, port=port, title=title)
