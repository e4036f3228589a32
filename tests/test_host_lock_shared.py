"""One window per inference host, whoever logs in (issue 41, part 3): the host lock lives in a
directory every operator's account reaches, so two operators with SSH accounts (and homes) of their
own meet at one lock, and the second is refused naming the first, before anything is sent.

Over real SSH: two embedded SSH servers on loopback, one per operator, each with its own login and
home, both on this machine (one inference host), configured with the same `lock_dir`. The lock's
file operations run as the host runs them (`python -I -c remote/lockfile.py ...` over the link).
The embedded server runs every login as this machine's user, so what only two real accounts show
(the sticky bit: only a lock's account removes it; a directory another account made is not
trusted) is checked with the system's own accounts nobody and daemon (`setpriv`, as root only).
Then what a hostile local user can put at the lock's path, in-process: each refused, never followed.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from console.config import ConfigError, load_config
from console.procedure import host_lock, remote_files
from console.procedure.outcomes import StepFailed
from console.procedure.state import Owner, current_user
from console.ssh.embedded_server import EmbeddedSSHServer
from console.ssh.hosts import CommandFailed, Host
from remote import lockfile
from tests.cli_hosts import write_config

HOST = "ct129"


class OverSSH:
    """The one `WindowHosts` call the host lock makes, over a real SSH link to the host."""

    def __init__(self, host: Host):
        self.host = host

    async def lock_file(self, host: str, op: str, args: list[str]) -> dict:
        return await remote_files.lock_file(self.host, op, args)


class OperatorsRun:
    """What the host lock reads of a `Window`: one operator's run, its console, the config."""

    def __init__(self, config: Any, hosts: Any, owner: Owner, run_id: str):
        self.config, self.hosts, self.store = config, hosts, None
        self.run = SimpleNamespace(run_id=run_id)
        self.state = SimpleNamespace(owner=owner, finished=False)
        self.holds_lock = self.lock_refused = False
        self.journaled: list[str] = []

    def journal(self, step: str | None, message: str, **_: Any) -> None:
        self.journaled.append(message)


@pytest.fixture
def alices_console() -> Iterator[Owner]:
    """The first operator's console: a live process of its own (this test's process is the second's)."""
    proc = subprocess.Popen(["sleep", "300"])
    with open(f"/proc/{proc.pid}/stat", encoding="ascii") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    yield Owner("alice", os.uname().nodename, proc.pid, time.time() - 60, ticks)
    proc.kill()
    proc.wait()


@pytest.fixture
async def logins(tmp_path: Path) -> AsyncIterator[dict[str, Host]]:
    """alice and bob, each logged in to the inference host with their own account and home."""
    servers, links = [], {}
    for user in ("alice", "bob"):
        server = EmbeddedSSHServer(tmp_path / user / "home", tmp_path / user / "ssh", user=user, python=sys.executable)
        await server.start()
        servers.append(server)
        links[user] = Host(server.spec(HOST, workdir=str(tmp_path / user / "home" / "dflash-ops")))
        await links[user].connect()
    yield links
    for link in links.values():
        await link.close()
    for server in servers:
        await server.stop()


def config_with_lock_dir(tmp_path: Path, lock_dir: Path, user: str) -> Any:
    """The operator's own config: their login and home, the host's shared lock directory."""
    table = {"address": "127.0.0.1", "user": user, "workdir": str(tmp_path / user / "home" / "dflash-ops"),
             "lock_dir": str(lock_dir)}
    return load_config(write_config(tmp_path / f"{user}.toml", {HOST: table}))


async def test_two_operators_meet_at_one_lock_and_the_second_is_told_who_holds_it(
        tmp_path: Path, logins: dict[str, Host], alices_console: Owner) -> None:
    shared = tmp_path / "var-tmp" / "dflash-ops-locks"  # not there yet: the first take makes it, like /tmp
    shared.parent.mkdir()
    alice = OperatorsRun(config_with_lock_dir(tmp_path, shared, "alice"), OverSSH(logins["alice"]), alices_console,
                         "run-alice")
    bob = OperatorsRun(config_with_lock_dir(tmp_path, shared, "bob"), OverSSH(logins["bob"]), Owner.this_process(),
                       "run-bob")

    await host_lock.take(alice)
    assert alice.holds_lock
    made = shared.lstat()
    assert stat.S_ISDIR(made.st_mode) and stat.S_IMODE(made.st_mode) == 0o1777, oct(made.st_mode)
    lock = shared / host_lock.LOCK_FILE
    held = lock.read_bytes()
    assert stat.S_IMODE(lock.lstat().st_mode) == 0o644  # the second operator reads who holds it
    assert sorted(os.listdir(shared)) == [host_lock.LOCK_FILE]  # no private name left behind

    with pytest.raises(host_lock.LockHeld) as refused:
        await host_lock.take(bob)
    said = str(refused.value)
    assert f"{HOST} is driven by run run-alice ({alices_console.describe()}), logged in to {HOST} as " \
           f"{current_user()} ({lock})" in said, said
    assert "one run per inference host" in said and "nothing of it was touched" in said and "dflash-ops status" in said
    assert bob.lock_refused and not bob.holds_lock
    assert lock.read_bytes() == held  # alice's lock, untouched

    await host_lock.release(bob)  # not bob's run: kept
    assert lock.read_bytes() == held
    await host_lock.release(alice)
    assert not lock.exists()
    await host_lock.take(bob)  # alice's window over: bob's turn
    assert bob.holds_lock


async def test_a_symlink_put_at_the_lock_is_refused_never_followed(tmp_path: Path, logins: dict[str, Host]) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("not a lock")
    (shared / host_lock.LOCK_FILE).symlink_to(victim)  # a hostile local user's, before anyone took the lock
    bob = OperatorsRun(config_with_lock_dir(tmp_path, shared, "bob"), OverSSH(logins["bob"]), Owner.this_process(),
                       "run-bob")

    with pytest.raises(StepFailed) as refused:
        await host_lock.take(bob)
    said = str(refused.value)
    assert f"the host lock on {HOST}: {shared / host_lock.LOCK_FILE} is a symlink (to {victim}), not a lock: " \
           f"never followed" in said, said
    assert victim.read_text() == "not a lock" and not bob.holds_lock
    assert (shared / host_lock.LOCK_FILE).is_symlink()  # left for its owner to see, not removed by us
    assert sorted(os.listdir(shared)) == [host_lock.LOCK_FILE]


# --- what a hostile local user can put in the shared directory (remote/lockfile.py, in-process) ---------


def _hostile_directory(lock: Path) -> None:
    lock.mkdir()


def _hostile_fifo(lock: Path) -> None:
    os.mkfifo(lock)


def _hostile_writable(lock: Path) -> None:
    lock.write_text('{"run_id": "theirs"}')
    lock.chmod(0o666)


def _hostile_dangling(lock: Path) -> None:
    lock.symlink_to(lock.parent / "made-through-the-link")


@pytest.mark.parametrize(("put", "said"), [
    (_hostile_directory, "is not a regular file, not a lock"),
    (_hostile_fifo, "is not a regular file, not a lock"),
    (_hostile_writable, "is writable by others than"),
    (_hostile_dangling, "is a symlink"),
])
def test_what_another_account_put_at_the_lock_is_refused(tmp_path: Path, put: Any, said: str) -> None:
    lock = tmp_path / lockfile.LOCK_FILE
    put(lock)
    with pytest.raises(lockfile.Unsafe, match=said):
        lockfile.take(str(tmp_path), '{"run_id": "mine"}')
    assert not (tmp_path / "made-through-the-link").exists()
    assert [p for p in os.listdir(tmp_path) if p.endswith(".new")] == []


def test_an_unsafe_lock_directory_is_refused(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "link").symlink_to(elsewhere)
    with pytest.raises(lockfile.Unsafe, match="is a symlink .*never followed"):
        lockfile.take(str(tmp_path / "link"), "{}")
    open_to_all = tmp_path / "open"
    open_to_all.mkdir()
    open_to_all.chmod(0o777)  # no sticky bit: anyone could remove the lock
    with pytest.raises(lockfile.Unsafe, match="without the sticky bit"):
        lockfile.take(str(open_to_all), "{}")
    assert os.listdir(elsewhere) == [] and os.listdir(open_to_all) == []


def test_lock_dir_must_be_an_absolute_path(tmp_path: Path) -> None:
    path = write_config(tmp_path / "ok.toml", {HOST: {"address": "ct129"}})
    assert load_config(path).hosts[HOST].lock_dir == "/var/tmp"  # the default: root's, sticky, kept across reboots
    path.write_text(path.read_text().replace('address = "ct129"', 'address = "ct129"\nlock_dir = "locks"'))
    with pytest.raises(ConfigError) as bad:
        load_config(path)
    assert str(bad.value).startswith(f"{path}: `hosts.{HOST}.lock_dir`: expected an absolute directory path"), bad.value


# --- two real local accounts (as root only: nobody and daemon, the system's own) ------------------------

ACCOUNTS = ("nobody", "daemon")
SYSTEM_PYTHON = "/usr/bin/python3"


def as_account(account: str, *args: str) -> subprocess.CompletedProcess:
    """remote/lockfile.py run by the system's Python as `account`, as an operator's login would."""
    uid = pwd.getpwnam(account).pw_uid
    source = Path(lockfile.__file__).read_text(encoding="utf-8")
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", SYSTEM_PYTHON, "-I", "-c",
                           source, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.skipif(os.environ.get("CI") != "true" and (os.geteuid() != 0 or not shutil.which("setpriv")
                                                    or not os.path.exists(SYSTEM_PYTHON)),
                    reason="needs root (to act as two other accounts), setpriv and the system's Python")
def test_two_real_accounts_share_the_lock_and_only_its_account_removes_it() -> None:
    base = Path(tempfile.mkdtemp(prefix="dflash-ops-accounts-"))  # under /tmp: every account reaches it
    try:
        base.chmod(0o755)
        shared = base / "var-tmp"  # root's, sticky and 1777, as /var/tmp is
        shared.mkdir()
        shared.chmod(0o1777)
        nobody, daemon = ACCOUNTS
        assert json.loads(as_account(nobody, "take", str(shared), '{"run_id": "run-n"}').stdout) == {"taken": True}
        held = json.loads(as_account(daemon, "take", str(shared), '{"run_id": "run-d"}').stdout)
        assert held == {"text": '{"run_id": "run-n"}', "account": nobody}  # read across accounts, owner named
        refused = json.loads(as_account(daemon, "remove", str(shared), held["text"]).stdout)
        assert refused == {"removed": False, "why": "forbidden", "account": nobody}  # the sticky bit holds
        assert (shared / lockfile.LOCK_FILE).read_text() == '{"run_id": "run-n"}'
        assert json.loads(as_account(nobody, "remove", str(shared), held["text"]).stdout) == {"removed": True}

        own = base / "made-by-nobody"  # a directory an account made is its own: not trusted by the others
        base.chmod(0o1777)
        assert as_account(nobody, "take", str(own), "{}").returncode == 0
        taken = as_account(daemon, "take", str(own), "{}")
        assert taken.returncode == 2 and f"the lock directory {own} belongs to {nobody}" in taken.stderr, taken.stderr
    finally:
        shutil.rmtree(base)


class AsAccount:
    """The host lock's one `WindowHosts` call, run on this machine as another real account."""

    def __init__(self, account: str):
        self.account = account

    async def lock_file(self, host: str, op: str, args: list[str]) -> dict:
        done = as_account(self.account, op, *args)
        if done.returncode != 0:
            raise CommandFailed(host, ["lockfile", op], done.returncode, done.stderr)
        return json.loads(done.stdout)


@pytest.mark.skipif(os.environ.get("CI") != "true" and (os.geteuid() != 0 or not shutil.which("setpriv")
                                                    or not os.path.exists(SYSTEM_PYTHON)),
                    reason="needs root (to act as two other accounts), setpriv and the system's Python")
async def test_a_gone_console_of_another_account_is_not_taken_over_but_named(tmp_path: Path) -> None:
    base = Path(tempfile.mkdtemp(prefix="dflash-ops-accounts-"))
    try:
        base.chmod(0o1777)
        gone = subprocess.Popen(["true"])
        gone.wait()  # the first operator's console, ended without releasing its lock
        nobody, daemon = ACCOUNTS
        gone_console = Owner(nobody, os.uname().nodename, gone.pid, time.time() - 60, 1)
        first = OperatorsRun(config_with_lock_dir(tmp_path, base, nobody), AsAccount(nobody), gone_console, "run-gone")
        await host_lock.take(first)
        second = OperatorsRun(config_with_lock_dir(tmp_path, base, daemon), AsAccount(daemon), Owner.this_process(),
                              "run-next")
        with pytest.raises(StepFailed) as refused:
            await host_lock.take(second)
        lock = base / host_lock.LOCK_FILE
        assert f"the host lock {HOST}:{lock} belongs to the account {nobody} and names a run whose console is gone; " \
               f"only {nobody} (or root) can remove it" in str(refused.value), refused.value
        assert json.loads(lock.read_text())["run_id"] == "run-gone" and not second.holds_lock
    finally:
        shutil.rmtree(base)
