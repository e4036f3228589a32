"""The host lock's file operations, run on the inference host (`python -I -c <this file> OP DIR ...`:
its source is sent whole in the command, so nothing has to be shipped before the lock is taken).

The lock lives in a directory every operator's account reaches (by default /var/tmp, sticky and
1777), so any local account can put things there before us. Hence every operation here is made of
calls that never follow a symlink and never take over what another account made:
- the directory is a real directory (not a symlink), owned by root or by this account (its owner
  can remove anyone's file in it, sticky bit or not), and sticky when others may write in it; one
  that does not exist is made sticky and 1777, like /tmp;
- the lock is written whole under a fresh private name (O_CREAT | O_EXCL | O_NOFOLLOW: never a file
  or a link someone put there), then hard-linked to its name (`link` fails when anything is there,
  a symlink or a directory too): one console wins, and nobody reads it half-written;
- a lock found is read only when it is a regular file nobody else may write (opened O_NOFOLLOW,
  checked on the descriptor), and said with the account that owns it: who holds the host;
- a lock moved aside (`rename`) to be removed: in a sticky directory only its owner (or root) can,
  so another account's lock is answered `forbidden`, naming that account.

Each operation prints one JSON object; an unsafe path exits 2 with the reason on stderr.
Standard library only (remote/ rule), Python >= 3.10.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import secrets
import stat
import sys

LOCK_FILE = "dflash-ops.lock"
MAX_LOCK_BYTES = 1 << 16  # a lock is a few hundred bytes: more is not a lock


class Unsafe(Exception):
    """What was found at a path the lock uses is not safe to use: said, never worked around."""


def _account(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def check_dir(directory: str) -> None:
    """The lock directory, made (sticky, 1777) when missing; Unsafe when what is there could let
    another account remove or replace the lock."""
    try:
        os.mkdir(directory, 0o700)
        os.chmod(directory, 0o1777)  # after mkdir: the umask would take the bits away
    except FileExistsError:
        pass
    except OSError as exc:
        raise Unsafe(f"cannot make the lock directory {directory}: {exc.strerror}") from None
    found = os.lstat(directory)
    if stat.S_ISLNK(found.st_mode):
        raise Unsafe(f"the lock directory {directory} is a symlink (to {os.readlink(directory)}): never followed")
    if not stat.S_ISDIR(found.st_mode):
        raise Unsafe(f"the lock directory {directory} is not a directory")
    if found.st_uid not in (0, os.geteuid()):
        raise Unsafe(f"the lock directory {directory} belongs to {_account(found.st_uid)}, who could remove any "
                     f"lock in it: use a directory of root's (sudo install -d -m 1777 {directory}) or /var/tmp")
    if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not found.st_mode & stat.S_ISVTX:
        raise Unsafe(f"the lock directory {directory} is writable by others without the sticky bit, so anyone "
                     f"could remove the lock: chmod +t {directory}")


def read(directory: str, name: str = LOCK_FILE) -> dict:
    """{"text", "account"} of the lock there, or {"absent": true}."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO never hangs us
    except FileNotFoundError:
        return {"absent": True}
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unsafe(f"{path} is a symlink (to {os.readlink(path)}), not a lock: never followed; "
                         f"remove it") from None
        raise Unsafe(f"cannot read {path}: {exc.strerror}") from None
    found = os.fstat(fd)  # what was opened, not what the name says now
    why = ("is not a regular file, not a lock" if not stat.S_ISREG(found.st_mode) else
           f"is writable by others than {_account(found.st_uid)}, so nobody can trust what it says"
           if found.st_mode & (stat.S_IWGRP | stat.S_IWOTH) else None)
    if why:
        os.close(fd)
        raise Unsafe(f"{path} {why}: remove it")
    with os.fdopen(fd, "rb") as f:
        text = f.read(MAX_LOCK_BYTES + 1)
    return {"text": text.decode("utf-8", "replace"), "account": _account(found.st_uid)}


def _write_private(directory: str, text: str, name: str = LOCK_FILE) -> str:
    """`text` in a fresh file of ours, readable by all: its path."""
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.new")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue  # someone's file under that name: another name
        break
    with os.fdopen(fd, "wb") as f:
        f.write(text.encode())
        os.fchmod(fd, 0o644)  # the second operator reads who holds the host
    return tmp


def take(directory: str, text: str, name: str = LOCK_FILE) -> dict:
    """{"taken": true}, or the lock already there ({"text", "account"}, or {"absent": true} when it
    went meanwhile). `name`: another lock of this kind in `directory` (a run's claim, console/procedure/claim.py)."""
    check_dir(directory)
    tmp = _write_private(directory, text, name)
    try:
        os.link(tmp, os.path.join(directory, name))
        return {"taken": True}
    except FileExistsError:
        return read(directory, name)
    finally:
        os.unlink(tmp)


def rewrite(directory: str, text: str) -> dict:
    """This console's own lock said again (a new run of it): replaced whole, never written into."""
    check_dir(directory)
    tmp = _write_private(directory, text)
    try:
        os.rename(tmp, os.path.join(directory, LOCK_FILE))
    except OSError:
        os.unlink(tmp)
        raise
    return {"taken": True}


def remove(directory: str, seen: str, name: str = LOCK_FILE) -> dict:
    """Move the lock aside (one console can) and remove it if it is the one `seen`; a lock put there
    meanwhile is linked back. {"removed": bool}, with "why" when not, and "account" when forbidden."""
    check_dir(directory)
    path = os.path.join(directory, name)
    aside = os.path.join(directory, f".{name}.{secrets.token_hex(8)}.gone")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return {"removed": False, "why": "gone"}  # another console moved it first
    except PermissionError:  # the sticky bit: another account's lock
        try:
            return {"removed": False, "why": "forbidden", "account": _account(os.lstat(path).st_uid)}
        except FileNotFoundError:
            return {"removed": False, "why": "gone"}
    try:
        if _read_moved(aside) == seen:
            return {"removed": True}
        try:  # someone else's lock: back where it was (unless yet another lock is there now)
            os.link(aside, path)
        except FileExistsError:
            return {"removed": False, "why": "changed twice"}
        return {"removed": False, "why": "changed"}
    finally:
        os.unlink(aside)


def _read_moved(aside: str) -> str:
    """The lock as this console moved it aside (under a fresh random name; never followed)."""
    fd = os.open(aside, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        return f.read(MAX_LOCK_BYTES + 1).decode("utf-8", "replace")


OPERATIONS = {"take": take, "read": read, "rewrite": rewrite, "remove": remove}


def answer(op: str, directory: str, *args: str) -> dict:
    """The operation's answer; Unsafe when the path is not safe to use."""
    return OPERATIONS[op](directory, *args)


def main(argv: list[str]) -> int:
    try:
        print(json.dumps(answer(*argv)))
    except Unsafe as exc:
        print(exc, file=sys.stderr)
        return 2
    except OSError as exc:  # a directory this account cannot write in, say
        print(f"{exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
