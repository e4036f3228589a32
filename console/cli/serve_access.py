"""Who may open the console `dflash-ops serve` shares: the holder of its token, by a name it answers to.

The token is one per user, made at the first start and kept in a file only that user can read
(`serve-token` under the user state dir, or `$DFLASH_OPS_SERVE_TOKEN_FILE`), so an address printed
once (a bookmark, a page left open) goes on working across restarts; `--new-token` replaces it.

The names guard against DNS rebinding: a page of another site whose name is made to resolve to this
machine reaches the console with that name as `Host` (and as `Origin`, which then agrees with it).
An address (`127.0.0.1`, `[::1]`, `10.1.2.3`) takes no DNS to reach, so no other site's page can
send it as its own; a name must be one the console was told about or bound to. The port is not
compared: an ssh forward may bring the console to another one.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from console.cli.usage import UsageError

TOKEN_FILE_ENV = "DFLASH_OPS_SERVE_TOKEN_FILE"
LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})
WILDCARDS = ("0.0.0.0", "::", "")
MIN_TOKEN_CHARS = 32


def token_file() -> Path:
    """$DFLASH_OPS_SERVE_TOKEN_FILE, else `serve-token` under the user state dir."""
    override = os.environ.get(TOKEN_FILE_ENV)
    if override:
        return Path(override).expanduser()
    import platformdirs

    return Path(platformdirs.user_state_dir("dflash-ops")) / "serve-token"


def serve_token(path: Path, renew: bool = False) -> str:
    """The token kept in `path`: made there (mode 0600, its folder 0700 when made) the first time, or
    anew with `renew`. A file another user owns, or that others may read or write, is refused (as
    ssh refuses such a key): its token may be known."""
    if renew or not os.path.lexists(path):
        return _write_token(path, replace=renew)
    info = os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path}: the serve token's file is not a plain file; remove it (a new token is made)")
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise UsageError(f"{path}: the serve token's file has mode {stat.S_IMODE(info.st_mode):04o} (owner uid "
                         f"{info.st_uid}): others may have read it. chmod 600 it if only you ever could, or "
                         "`dflash-ops serve --new-token` for a new one")
    token = path.read_text(encoding="utf-8").strip()
    if len(token) < MIN_TOKEN_CHARS or not token.isascii() or not token.isprintable():
        raise UsageError(f"{path}: holds no serve token; `dflash-ops serve --new-token` writes one")
    return token


def _write_token(path: Path, replace: bool) -> str:
    """A new token, written whole before it is the file's: a temporary file of mode 0600 linked in
    place (two first starts at once agree on one token) or, to replace one, renamed over it."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            os.fchmod(out.fileno(), 0o600)  # (the umask only narrows the mode; said for the reader)
            out.write(token + "\n")
            out.flush()
            os.fsync(out.fileno())
        if replace:
            os.replace(partial, path)
        else:
            try:
                os.link(partial, path)
            except FileExistsError:  # another start made it first: its token is the one
                return serve_token(path)
    finally:
        if os.path.lexists(partial):
            os.unlink(partial)
    return token


@dataclass(frozen=True)
class ServedNames:
    """The names (lower case, no trailing dot) and addresses a console answers to."""

    names: frozenset[str]
    addresses: frozenset[ipaddress.IPv4Address | ipaddress.IPv6Address]
    any_address: bool  # bound to every address of the machine: it cannot list them all

    def answers(self, host: str) -> bool:
        """Whether a request whose `Host` header is `host` ("name", "name:8765", "[::1]:8765") is for
        this console."""
        name = host_name(host)
        if not name:
            return False
        try:
            address = ipaddress.ip_address(name)
        except ValueError:
            return name in self.names
        return address.is_loopback or self.any_address or address in self.addresses


def host_name(host: str) -> str:
    """The name or address of a `Host` header, without its port, brackets or trailing dot; lower case."""
    host = host.strip().lower()
    if host.startswith("["):  # [v6]:port
        host = host[1:].split("]", 1)[0]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def served_names(bind: str, names: Iterable[str] = ()) -> ServedNames:
    """What a console bound to `bind` answers to: the loopback's names and addresses always (an ssh
    forward reaches it there), the bound address or name, with a wildcard bind this machine's names
    and any address, and `names` (--name: a DNS alias, a proxy's name)."""
    known = set(LOOPBACK_NAMES) | {host_name(n) for n in names if host_name(n)}
    addresses: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    wildcard = bind in WILDCARDS
    if wildcard:
        known |= {host_name(socket.gethostname()), host_name(socket.getfqdn())}
    else:
        try:
            addresses.add(ipaddress.ip_address(bind))
        except ValueError:
            known.add(host_name(bind))
    return ServedNames(frozenset(known), frozenset(addresses), wildcard)
