"""Files on the hosts, for the engine: small reads and writes, completeness checks, and copies
between hosts through the console (sha256-verified, content-addressed).

A host's own Python does the hashing (`hashlib` over the files where they lie), so the console
compares digests without reading a file twice, and an unchanged checkpoint is never sent again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import asyncssh

import remote.lockfile
from console.ssh.hosts import Host, HostError

Progress = Callable[[int, int], None]

# Prints {relative path: [size, sha256]} for every file under argv[1] (sorted, no dot-files); for a
# file, {its name: [size, sha256]} alone.
_HASH_TREE = r"""
import hashlib, json, os, sys
root = sys.argv[1]
out = {}
walk = [(os.path.dirname(root), [], [os.path.basename(root)])] if os.path.isfile(root) else os.walk(root)
for dirpath, dirs, files in walk:
    dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    for name in sorted(files):
        if name.startswith("."):
            continue
        path = os.path.join(dirpath, name)
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        out[os.path.relpath(path, root) if path != root else name] = [os.path.getsize(path), h.hexdigest()]
print(json.dumps(out, sort_keys=True))
"""

_VERIFY_MANIFEST = ("import sys; from remote.artifacts import read_manifest; "
                    "read_manifest(sys.argv[1], verify=True)")

_EXPORT_HEADS = r"""
import os, sys
from remote.target_io import read_target_heads, save_target_heads
model, out = sys.argv[1], sys.argv[2]
if not os.path.exists(os.path.join(out, "config.json")):
    heads = read_target_heads(model)
    tmp = out + ".incoming"
    save_target_heads(tmp, heads.embed, None if heads.tied else heads.lm_head, shard=False)
    os.replace(tmp, out)
"""


async def python(host: Host) -> str:
    """The host's interpreter, `~` expanded (`Host.resolve_python`)."""
    return await host.resolve_python()


# The host lock's file operations (remote/lockfile.py), sent whole in the command: the lock is taken
# before anything is shipped to the host.
_LOCKFILE = Path(remote.lockfile.__file__).read_text(encoding="utf-8")


async def lock_file(host: Host, op: str, args: list[str]) -> dict:
    """One operation of the host lock (`remote.lockfile`: take, read, rewrite, remove) and its answer;
    CommandFailed (exit 2, the reason on stderr) when the lock's path is not safe to use."""
    result = await host.run([await python(host), "-I", "-c", _LOCKFILE, op, *args])
    return json.loads(result.stdout)


async def read_text(host: Host, path: str) -> str:
    """A remote file's text; FileNotFoundError when it does not exist."""
    sftp = await host.sftp()
    with host.errors(f"reading {path}"):
        try:
            async with sftp.open(path, "rb") as f:
                return (await f.read()).decode()
        except asyncssh.SFTPNoSuchFile:
            raise FileNotFoundError(f"{host.name}:{path}") from None


async def write_text(host: Host, path: str, text: str) -> None:
    """Write a remote file atomically (temporary name, then rename)."""
    sftp = await host.sftp()
    tmp = f"{path}.incoming-{uuid.uuid4().hex[:8]}"
    with host.errors(f"writing {path}"):
        async with sftp.open(tmp, "wb", attrs=asyncssh.SFTPAttrs(permissions=0o600)) as f:
            await f.write(text.encode())
        await sftp.posix_rename(tmp, path)


async def manifest_complete(host: Host, code_dir: str, directory: str) -> bool:
    """True when `directory` on the host holds a complete manifest whose files match their sha256."""
    argv = ["env", f"PYTHONPATH={code_dir}", await python(host), "-c", _VERIFY_MANIFEST, directory]
    result = await host.run(argv, check=False, timeout=600)
    return result.exit_status == 0


async def hash_tree(host: Host, root: str) -> dict[str, tuple[int, str]]:
    """{relative path: (size, sha256)} of every file under `root` on the host."""
    result = await host.run([await python(host), "-c", _HASH_TREE, root], check=False, timeout=1800)
    if result.exit_status != 0:
        raise HostError(host.name, f"cannot read {root}: {result.stderr.strip()[-300:] or 'no such directory?'}")
    return {rel: (int(size), sha) for rel, (size, sha) in json.loads(result.stdout).items()}


def tree_digest(files: dict[str, tuple[int, str]]) -> str:
    digest = hashlib.sha256()
    for rel, (size, sha) in sorted(files.items()):
        digest.update(f"{rel}\0{size}\0{sha}\n".encode())
    return digest.hexdigest()


async def _copy(src: Host, src_path: str, dst: Host, dst_path: str, size: int, sha: str,
                done: list[int], total: int, progress: Progress | None) -> None:
    """One file from `src` to `dst` through a local temporary file, its sha256 checked on the way."""
    with tempfile.TemporaryDirectory(prefix="dflash-relay-") as tmp:
        local = Path(tmp) / "file"
        base = done[0]

        def step(n: int, _total: int) -> None:
            if progress:
                progress(base + n, total)
        await src.get(src_path, local, progress=step)
        digest = hashlib.sha256()
        with open(local, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        if digest.hexdigest() != sha:
            raise HostError(src.name, f"{src_path} changed while it was copied (sha256 differs)")
        await dst.put(local, dst_path)
    done[0] += size
    if progress:
        progress(done[0], total)


async def relay_file(src: Host, src_path: str, dst: Host, dst_path: str, progress: Progress | None = None) -> None:
    """Copy one file between hosts, verified by sha256 on both sides, renamed into place last."""
    files = await hash_tree_file(src, src_path)
    size, sha = files
    tmp = f"{dst_path}.incoming-{uuid.uuid4().hex[:8]}"
    await _copy(src, src_path, dst, tmp, size, sha, [0], size, progress)
    got = await hash_tree_file(dst, tmp)
    if got[1] != sha:
        raise HostError(dst.name, f"{tmp} does not match the sha256 of {src.name}:{src_path}")
    sftp = await dst.sftp()
    with dst.errors(f"renaming {tmp}"):
        await sftp.posix_rename(tmp, dst_path)


async def hash_tree_file(host: Host, path: str) -> tuple[int, str]:
    """(size, sha256) of one file on the host (that file alone is read)."""
    name = path.rsplit("/", 1)[1]
    files = await hash_tree(host, path)
    if name not in files:
        raise FileNotFoundError(f"{host.name}:{path}")
    return files[name]


async def relay_tree(src: Host, src_dir: str, dst: Host, dst_root: str,
                     progress: Progress | None = None) -> tuple[str, int]:
    """Copy directory `src_dir` to `dst_root/<digest>` on `dst`, unless a verified copy is there.

    Returns (the path on `dst`, bytes sent: 0 when it was already there).
    """
    files = await hash_tree(src, src_dir)
    if not files:
        raise HostError(src.name, f"{src_dir} holds no files")
    digest = tree_digest(files)
    final = f"{dst_root}/{digest[:24]}"
    sftp = await dst.sftp()
    with dst.errors(f"looking for {final}"):
        if await sftp.exists(final):
            return final, 0
    staging = f"{dst_root}/.incoming-{digest[:12]}-{uuid.uuid4().hex[:6]}"
    total = sum(size for size, _ in files.values())
    done = [0]
    try:
        for rel, (size, sha) in sorted(files.items()):
            parent = f"{staging}/{rel}".rsplit("/", 1)[0]
            await dst.run(["mkdir", "-p", "-m", "700", parent])
            await _copy(src, f"{src_dir}/{rel}", dst, f"{staging}/{rel}", size, sha, done, total, progress)
        if await hash_tree(dst, staging) != files:
            raise HostError(dst.name, f"the copy of {src.name}:{src_dir} in {staging} does not match its sha256")
        with dst.errors(f"renaming {staging}"):
            await sftp.rename(staging, final)
    except BaseException:
        with contextlib.suppress(Exception):
            await dst.run(["rm", "-rf", "--", staging], check=False)
        raise
    return final, total


async def export_heads(host: Host, code_dir: str, model_path: str, out: str) -> None:
    """Write the target's embed_tokens/lm_head alone to `out` on the host (once)."""
    argv = ["env", f"PYTHONPATH={code_dir}", await python(host), "-c", _EXPORT_HEADS, model_path, out]
    result = await host.run(argv, check=False, timeout=1800)
    if result.exit_status != 0:
        raise HostError(host.name, f"exporting the target's heads from {model_path} failed: "
                                   f"{result.stderr.strip()[-300:]}")


async def fetch_tree(host: Host, remote_dir: str, local_dir: Path, progress: Progress | None = None) -> list[str]:
    """Copy every file of `remote_dir` into `local_dir`, each checked against its sha256."""
    files = await hash_tree(host, remote_dir)
    local_dir.mkdir(parents=True, exist_ok=True)
    total = sum(size for size, _ in files.values())
    done = 0
    for rel, (size, sha) in sorted(files.items()):
        target = local_dir / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".incoming")
        await host.get(f"{remote_dir}/{rel}", tmp)
        if hashlib.sha256(tmp.read_bytes()).hexdigest() != sha:
            raise HostError(host.name, f"{remote_dir}/{rel} does not match its sha256 after the copy")
        tmp.replace(target)
        done += size
        if progress:
            progress(done, total)
    return sorted(files)
