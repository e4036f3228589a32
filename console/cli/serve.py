"""`dflash-ops serve`: the console, read-only, in a browser (textual-serve).

Each browser that opens the page gets its own read-only console (a process of
`python -m console.cli serve --app`): the dashboard following the run that drives the hosts, with
the read-only console's keys only (none stops, starts, ends or writes anything). Every one of them is
a view of one watcher of the hosts that `serve` holds (console/sharing.py: one connection, agent and
service watch, however many watch), at most `--max-viewers` at once. It binds 127.0.0.1
unless told otherwise (reach it with an ssh port forward). Whatever the bind, the page, its files and
its websocket are refused without the token printed at start (one per user, kept in a file only
they can read: console/cli/serve_access.py; a cookie carries it once the page opened with
`?token=`), under a name the console does not answer to (DNS rebinding), and from another site's
page (its Origin).

textual-serve's `Server` is aiohttp: the guard is a middleware added to its application
(screens/serve.py), and the page's websocket address is taken from the request (so a forwarded port
of any number works).
"""

from __future__ import annotations

import argparse
import ipaddress
import shlex
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from console.cli.serve_access import WILDCARDS, serve_token, served_names, token_file
from console.cli.usage import UsageError
from console.config import DEFAULT_CONFIG_NAME
from console.request import Request, choose
from console.sharing import Hub, SharedSession

DEFAULT_PORT = 8765


def is_loopback(bind: str) -> bool:
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def app_command(config: Path, runs: str | None, hub: Path | None = None) -> str:
    """The command each browser's console runs (a shell line: textual-serve starts it so): a view of
    `hub`, the one watcher of the hosts (console/sharing.py)."""
    argv = [sys.executable, "-m", "console.cli", "serve", "--app", "--config", str(config.resolve())]
    if hub is not None:
        argv += ["--hub", str(hub)]
    if runs:
        argv += ["--runs", str(Path(runs).expanduser().resolve())]
    return shlex.join(argv)


def run(args: argparse.Namespace) -> int:
    # a bad config is said here, once, not in every browser; each browser's console is a read-only one
    config = choose(Request("console", config=args.config, runs=args.runs, read_only=True)).config
    if args.app:
        return serve_app(config, args.runs, Path(args.hub) if args.hub else None)
    path = token_file()
    token = serve_token(path, renew=args.new_token)
    names = served_names(args.bind, args.name)
    from screens.serve import make_server  # the browser side is the Textual app's

    if args.max_viewers < 1:
        raise UsageError(f"--max-viewers must be at least 1, not {args.max_viewers}")
    # One watcher of the hosts for every viewer: its socket in a directory of this user's only.
    hub = Hub(config, args.runs, Path(tempfile.mkdtemp(prefix="dflash-ops-serve-")) / "hub.sock")
    server = make_server(app_command(Path(config.source or args.config), args.runs, hub.path), args.bind, args.port,
                         token, f"dflash-ops (read-only): {', '.join(config.hosts)}", names,
                         max_viewers=args.max_viewers, hub=hub)
    host = socket.getfqdn() if args.bind in WILDCARDS else f"[{args.bind}]" if ":" in args.bind else args.bind
    print(f"dflash-ops serve: the console, read-only, at http://{host}:{args.port}/?token={token}", flush=True)
    print(f"dflash-ops serve: without its token (kept in {path}, yours only; --new-token replaces it) the page, "
          "its files and its websocket are refused: give the address only to the people who may watch",
          flush=True)
    if is_loopback(args.bind):
        print(f"dflash-ops serve: from another machine: ssh -N -L {args.port}:127.0.0.1:{args.port} "
              f"{_this_host()}, then open http://127.0.0.1:{args.port}/?token={token}", flush=True)
    try:
        server.serve()
    except OSError as exc:  # the port is taken, the address is not this machine's
        raise UsageError(f"cannot serve on {args.bind}:{args.port}: {exc.strerror or exc}") from None
    return 0


def serve_app(config: Any, runs: str | None, hub: Path | None) -> int:
    """One browser's console: read-only, following the live run (textual-serve's web driver), a view
    of `hub` (no connection of its own to any host); without one, a console of its own."""
    from console.operator import Operator
    from screens.app import run_app

    session = SharedSession(config, hub) if hub is not None else None
    return run_app(Operator(config, runs_dir=runs, read_only=True, session=session))


def _this_host() -> str:
    import getpass

    return f"{getpass.getuser()}@{socket.gethostname()}"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register `serve` on the top-level subparsers."""
    parser = sub.add_parser(
        "serve", help="the console, read-only, in a browser (for the people who share the window)",
        description="Serve the console read-only in a browser (textual-serve), following the run that drives "
                    "the hosts: hosts, GPUs, the service and its DOWN timer, the steps, the jobs, the journal. "
                    "No key acts on a host or writes a file. Binds 127.0.0.1 by default (reach it with "
                    "ssh -L); whatever the bind, the page needs the token printed at start.")
    parser.add_argument("--config", default=DEFAULT_CONFIG_NAME, metavar="FILE",
                        help=f"config file (default ./{DEFAULT_CONFIG_NAME})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, metavar="N",
                        help=f"the port to serve on (default {DEFAULT_PORT})")
    parser.add_argument("--bind", default="127.0.0.1", metavar="ADDR",
                        help="the address to listen on (default 127.0.0.1)")
    parser.add_argument("--name", action="append", default=[], metavar="NAME",
                        help="another name the page is opened by (a DNS alias, a proxy's name; repeatable): "
                             "any name not the console's own is refused")
    parser.add_argument("--new-token", action="store_true",
                        help="replace the token (addresses printed before stop working)")
    parser.add_argument("--runs", metavar="DIR", default=None,
                        help="the run store (default: the user data dir's runs/, or $DFLASH_OPS_RUNS)")
    parser.add_argument("--max-viewers", type=int, default=8, metavar="N",
                        help="browsers watching at once (default 8; each is a read-only console of its own): "
                             "past it the page says the cap is reached")
    parser.add_argument("--app", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--hub", default=None, help=argparse.SUPPRESS)  # the watcher's socket (--app)  # one browser's console
    parser.set_defaults(run=run)

