"""The browser side of `dflash-ops serve` (console/cli/serve.py): textual-serve's aiohttp server with
its guard. It lives with the Textual app, so the core (console/) never imports Textual.

Every request (the page, its files, its websocket) passes three checks, in this order: the `Host`
is a name the console answers to (console/cli/serve_access.py: no DNS rebinding), a page that says
where it comes from (`Origin`) is this console's own, and the token, from the address (`?token=`) or
from the cookie the page got with it, compared in constant time. Then the viewers are counted: past
`max_viewers` consoles open at once (each browser's is a console of its own), the page says the cap is
reached and its websocket is refused; a viewer that closes its page frees its place (its console ends
with its websocket)."""

from __future__ import annotations

import hmac
import logging
import re
from typing import Any
from urllib.parse import urlsplit

from console.cli.serve_access import ServedNames, served_names

COOKIE_PREFIX = "dflash-ops-token"
MAX_VIEWERS = 8  # consoles open at once through one `serve` (--max-viewers)
TOKEN_IN_ADDRESS = re.compile(r"([?&]token=)[^&\s\"]*")
# textual-serve's page links a web font from Google's servers: each viewer's browser would tell another
# site when and from where the window is watched (and wait on it where the network is closed). The
# terminal's own monospace font serves instead: every file of the page comes from this console.
OTHER_SITES = re.compile(r"<link[^>]*href=\"https?://[^\"]*\"[^>]*/?>\s*", re.IGNORECASE | re.DOTALL)


class MaskToken(logging.Filter):
    """The access log's lines (aiohttp's, one a request) without the token of their address."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = TOKEN_IN_ADDRESS.sub(r"\1…", record.msg)
        return True


def cookie_name(port: int) -> str:
    """The token's cookie. A cookie is sent to every port of a host: one name per port, so two
    consoles served from one machine (two users, two tokens) never overwrite each other's."""
    return f"{COOKIE_PREFIX}-{port}"


def make_server(command: str, bind: str, port: int, token: str, title: str,
                names: ServedNames | None = None, max_viewers: int = MAX_VIEWERS, hub: Any = None) -> Any:
    """textual-serve's server for `command`, refusing requests without `token`, under a name it does
    not answer to (`names`, by default the bind's own), or from another site's page; at most
    `max_viewers` browsers at once. `hub` (console/sharing.py's), the one watcher every browser's
    console views, runs as long as the server does."""
    import aiohttp_jinja2
    from aiohttp import web
    from textual_serve.server import Server, to_int

    if not token:
        raise ValueError("dflash-ops serve needs a token")
    if max_viewers < 1:
        raise ValueError(f"--max-viewers must be at least 1, not {max_viewers}")
    served = names if names is not None else served_names(bind)
    cookie = cookie_name(port)

    def full() -> str:
        return (f"dflash-ops serve: {max_viewers} viewer{'s' if max_viewers != 1 else ''} already watch this "
                f"console, its cap (`dflash-ops serve --max-viewers`): try again when one closes its page\n")

    class ConsoleServer(Server):
        viewers = 0  # websockets open now: each is a console of its own

        async def handle_websocket(self, request: web.Request) -> web.WebSocketResponse:
            if self.viewers >= max_viewers:
                raise web.HTTPServiceUnavailable(text=full())
            self.viewers += 1
            try:
                return await super().handle_websocket(request)
            finally:  # textual-serve has stopped its console by now: nothing of the viewer is left
                self.viewers -= 1

        async def _make_app(self) -> web.Application:
            app = await super()._make_app()
            app.middlewares.append(guard)
            return app

        async def handle_index(self, request: web.Request) -> web.Response:
            if self.viewers >= max_viewers:
                return web.Response(status=503, text=full())
            here = f"{request.scheme}://{request.host}"
            socket = ("wss" if request.scheme == "https" else "ws") + f"://{request.host}/ws"
            page = aiohttp_jinja2.render_string("app_index.html", request, {
                "font_size": to_int(request.query.get("fontsize", "16"), 16), "app_websocket_url": socket,
                "config": {"static": {"url": f"{here}/static/"}}, "application": {"name": self.title}})
            return web.Response(text=OTHER_SITES.sub("", page), content_type="text/html")

        async def on_startup(self, app: web.Application) -> None:
            # (no banner: the command says where it serves, with the token; textual-serve's would not)
            if hub is not None:
                await hub.start()

        async def on_shutdown(self, app: web.Application) -> None:
            await super().on_shutdown(app)
            if hub is not None:
                await hub.stop()

        def initialize_logging(self) -> None:
            super().initialize_logging()
            logging.getLogger("aiohttp.access").addFilter(MaskToken())  # said once at start, never logged
            # The hub's connections (console/sharing.py) live in this process: asyncssh's line for each
            # connect and reconnect would fill the output (and a reader that stops reading, its pipe).
            logging.getLogger("asyncssh").setLevel(logging.WARNING)

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if not served.answers(request.host):
            raise web.HTTPForbidden(text=f"dflash-ops serve: this console does not answer to the name "
                                         f"{request.host!r}: open the address `dflash-ops serve` printed at "
                                         "start (--name adds a name it answers to)\n")
        origin = request.headers.get("Origin")
        if origin is not None and urlsplit(origin).netloc.lower() != request.host.lower():
            raise web.HTTPForbidden(text=f"dflash-ops serve: a page of {origin} may not open this console\n")
        given = request.query.get("token") or request.cookies.get(cookie) or ""
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise web.HTTPForbidden(text="dflash-ops serve: this console needs its token: open the address "
                                         "`dflash-ops serve` printed at start (…/?token=…)\n")
        response = await handler(request)
        if not response.prepared:  # (a websocket's answer has gone out already)
            response.headers["Referrer-Policy"] = "no-referrer"  # the address holds the token
            response.headers["X-Frame-Options"] = "DENY"  # no other site shows it in a frame of its own
            response.headers["Content-Security-Policy"] = "frame-ancestors 'none'"
            if request.query.get("token"):
                response.set_cookie(cookie, token, httponly=True, samesite="Strict")
        return response

    return ConsoleServer(command, host=bind, port=port, title=title)
