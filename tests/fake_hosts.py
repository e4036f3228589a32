"""One console's view of the fake world (`tests/engine_fakes.py`): the `WindowHosts` the engine is
given, over the world's service, jobs, telemetry and server. A console killed at a crash point is
this view raising `SimulatedCrash` from then on, while the world goes on."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shlex
import shutil
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

from console.config import Config
from console.messages import EndOutcome, ServiceHealth, ServiceView, StartupProgress, VramHolder
from console.procedure.engine import SimulatedCrash
from console.service.control import ReadyTimeout
from console.service.vram import endpids_argv
from console.session.bus import MessageBus
from console.ssh.hosts import CommandFailed, HostDisconnected
from console.ssh.jobs import JobDead, JobHandle, JobStalledError, JobStatus
from remote import lockfile
from tests.engine_fakes import INFERENCE, UNIT, FakeJob, FakeManager, FakeWorld, Fault, _Watch, raise_fault
from tests.fake_sglang import FakeServerClient


class FakeHosts:
    """`WindowHosts` over the fake world, for one console. `kill()` is its SIGKILL."""

    def __init__(self, world: FakeWorld):
        self.world = world
        self.bus = MessageBus()
        self.dead = False
        self.calls: list[tuple[str, str]] = []  # (method, host)

    def kill(self) -> None:
        self.dead = True

    def _alive(self) -> None:
        if self.dead:
            raise SimulatedCrash("the console is dead")

    def _fault(self, where: str, host: str = INFERENCE, **facts: Any) -> Fault | None:
        """An injected fault on this call: a dropped link or a timeout raises here; others are returned."""
        fault = self.world.take_fault(where, host=host, **facts)
        if fault is not None and not fault.after:
            raise_fault(fault, where, host)
        return fault

    def _call(self, method: str, host: str, **facts: Any) -> None:
        self._alive()
        self.calls.append((method, host))
        self._fault(method, host=host, **facts)

    async def answer(self, method: str) -> None:
        """The call's answer coming back over the link. With `world.swallow_cancels` set, a cancel
        that lands now is lost, as Python 3.11's `asyncio.wait_for` (asyncssh's wait on each
        command) loses one that lands as the command completes: the call returns as if none came."""
        if self.world.swallow_cancels <= 0:
            return
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.world.swallow_cancels -= 1
            self.world.swallowed.append(method)

    def simulated(self, host: str) -> bool:
        return True

    def link_state(self, host: str) -> str:
        return "connected"

    async def connect(self, host: str, timeout: float) -> None:
        self._call("connect", host)
        await self.answer("connect")

    async def workdir(self, host: str) -> str:
        self._alive()
        return str(self.world.workdir(host))

    async def code_dir(self, host: str) -> str:
        self._alive()
        return str(self.world.workdir(host) / "code")

    async def run(self, host: str, argv: list[str], timeout: float | None = None) -> None:
        """The few commands the engine runs itself: its directories, the go file, removals."""
        self._call("run", host, argv0=argv[0])
        await self.answer("run")
        if argv[:3] == ["mkdir", "-p", "-m"]:
            Path(argv[4]).mkdir(mode=int(argv[3], 8), parents=True, exist_ok=True)
        elif argv[:2] == ["sh", "-c"] and argv[2].startswith("umask 077; : > "):
            (path,) = shlex.split(argv[2].removeprefix("umask 077; : > "))
            Path(path).touch()
            self.world.go_files.append(path)
            self.world.changed()
        elif argv[:3] == ["rm", "-f", "--"]:
            for path in argv[3:]:
                Path(path).unlink(missing_ok=True)
        elif argv[:2] == ["touch", "--"]:  # the staged worker's lease (the fake workers do not read it)
            Path(argv[2]).touch()
        else:
            raise AssertionError(f"the fake host {host} does not know the command {shlex.join(argv)}")

    async def read_text(self, host: str, path: str) -> str:
        self._call("read_text", host, path=Path(path).name)
        await self.answer("read_text")
        try:
            return Path(path).read_text()
        except FileNotFoundError:
            raise FileNotFoundError(f"{host}:{path}") from None

    async def write_text(self, host: str, path: str, text: str) -> None:
        self._call("write_text", host, path=Path(path).name)
        await self.answer("write_text")
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(f"{path}.incoming")
        tmp.write_text(text)
        tmp.replace(path)
        self.world.changed()

    async def lock_file(self, host: str, op: str, args: list[str]) -> dict:
        """The host lock's file operations, done as the host does them (remote/lockfile.py); a path
        not safe to use fails as the command does (exit 2, the reason on stderr)."""
        self._call("lock_file", host, op=op)
        await self.answer("lock_file")
        try:
            found = lockfile.answer(op, *args)
        except (lockfile.Unsafe, OSError) as exc:
            raise CommandFailed(host, ["lockfile", op, *args], 2, str(exc)) from None
        if op != "read":
            self.world.changed()
        return found

    async def manifest_complete(self, host: str, path: str) -> bool:
        from remote.artifacts import read_manifest

        self._call("manifest_complete", host)
        await self.answer("manifest_complete")
        try:
            read_manifest(path, verify=True)
        except ValueError:
            return False
        return True

    async def relay_file(self, src: str, src_path: str, dst: str, dst_path: str, progress: Any) -> None:
        self._call("relay_file", dst)
        await self.answer("relay_file")
        Path(dst_path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src_path, f"{dst_path}.incoming")
        Path(f"{dst_path}.incoming").replace(dst_path)
        size = Path(dst_path).stat().st_size
        progress(size, size)
        self.world.changed()

    async def relay_tree(self, src: str, src_path: str, dst: str, progress: Any) -> tuple[str, int]:
        self._call("relay_tree", dst)
        await self.answer("relay_tree")
        files = sorted(p for p in Path(src_path).rglob("*") if p.is_file())
        digest = hashlib.sha256(b"".join(p.relative_to(src_path).as_posix().encode() + p.read_bytes() for p in files))
        path = self.world.workdir(dst) / "relayed" / digest.hexdigest()[:16]
        if path.is_dir():
            return str(path), 0
        shutil.copytree(src_path, path)
        sent = sum(p.stat().st_size for p in files)
        progress(sent, sent)
        return str(path), sent

    async def export_heads(self, host: str, model_path: str, out: str) -> None:
        self._call("export_heads", host)
        await self.answer("export_heads")
        if not Path(out).exists():
            shutil.copytree(model_path, out)

    async def fetch_tree(self, host: str, remote_dir: str, local_dir: Path, progress: Any) -> None:
        self._call("fetch_tree", host)
        await self.answer("fetch_tree")
        shutil.copytree(remote_dir, local_dir, dirs_exist_ok=True)
        progress(1, 1)

    async def start_job(self, host: str, worker: str, args: list[str], env: dict[str, str] | None,
                        job_id: str) -> JobHandle:
        self._call("start_job", host, worker=worker)
        await self.answer("start_job")
        return self.world.start_job(host, worker, args, job_id).handle

    async def find_job(self, host: str, job_id: str) -> JobHandle | None:
        self._call("find_job", host)
        await self.answer("find_job")
        job = self.world.jobs.get((host, job_id))
        return job.handle if job is not None else None

    def _job(self, handle: JobHandle) -> FakeJob:
        return self.world.jobs[(handle.host, handle.job_id)]

    async def job_status(self, handle: JobHandle) -> JobStatus:
        self._call("job_status", handle.host)
        await self.answer("job_status")
        job = self._job(handle)
        return JobStatus(job.state, job.exit_code, job.stderr)  # type: ignore[arg-type]

    async def cancel_job(self, handle: JobHandle, grace: float) -> JobStatus:
        """SIGTERM (the worker writes `exit` 143), waited for."""
        self._call("cancel_job", handle.host)
        await self.answer("cancel_job")
        job = self._job(handle)
        if job.state == "running" and job.task is not None:
            job.task.cancel(msg="SIGTERM")
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.shield(job.task)
        self._alive()
        return JobStatus(job.state, job.exit_code, job.stderr)  # type: ignore[arg-type]

    async def follow_job(self, handle: JobHandle, offset: int, connect_timeout: float) -> AsyncIterator[tuple[int, dict]]:
        """(offset after the line, event) from `offset` on, ending after `exit`; JobDead when the
        process is gone without one; JobStalledError when it is alive and silent."""
        self._call("follow_job", handle.host, worker=handle.worker)
        await self.answer("follow_job")
        job = self._job(handle)
        if self.world.take_fault("follow", host=handle.host, worker=handle.worker, kind=job.kind) is not None:
            raise TimeoutError(f"{handle.host} did not reconnect (injected)")
        position = offset
        while True:
            self._alive()
            newline = job.log.data.find(b"\n", position)
            if newline >= 0:
                event = json.loads(bytes(job.log.data[position:newline]))
                position = newline + 1
                yield position, event
                self._alive()
                if event.get("type") == "exit":
                    return
                continue
            if job.state != "running":  # gone, and no `exit` after `offset` (as the real follow says)
                raise JobDead(handle.host, handle, job.stderr)
            if job.stalled:
                raise JobStalledError(handle.host, handle, 300.0, None, job.stderr)
            await self.world.wait_changed()

    async def stderr_tail(self, handle: JobHandle) -> str:
        self._alive()
        return self._job(handle).stderr

    async def service_manager(self, timeout: float) -> FakeManager:
        self._call("service_manager", INFERENCE)
        await self.answer("service_manager")
        return FakeManager(self)

    async def start_service_and_wait(self, timeout: float, on_progress: Callable[[StartupProgress], Any]) -> ServiceHealth:
        self._call("start", INFERENCE)
        await self.answer("start")
        service = self.world.service
        service.start()
        on_progress(StartupProgress("loading", f"{UNIT}: loading"))
        return await self._ready(timeout)

    async def wait_service_ready(self, timeout: float) -> ServiceHealth:
        self._call("wait_ready", INFERENCE)
        await self.answer("wait_ready")
        return await self._ready(timeout)

    async def _ready(self, timeout: float) -> ServiceHealth:
        service = self.world.service
        fault = self.world.take_fault("ready", host=INFERENCE)
        if fault is not None and fault.how == "crash":
            self.kill()  # the console dies while the unit is still loading
        while not (service.state == "active" and service.ready):
            self._alive()
            if service.state != "activating" or service.start_hangs or fault is not None and fault.how == "timeout":
                self.world.clock.advance(timeout)
                raise ReadyTimeout(f"{UNIT} not ready after {timeout:.0f} s ({service.state})")
            await self.world.wait_changed()
        self._alive()
        return service.health()

    async def check_service(self) -> ServiceView:
        self._call("check_service", INFERENCE)
        await self.answer("check_service")
        service = self.world.service
        status = service.status()
        return ServiceView(status, service.health() if status.active else None, self.world.clock.time())

    def poke_service(self) -> None:
        self._alive()

    def telemetry(self, host: str) -> _Watch:
        self._alive()
        return _Watch(self, self.world.streams[host])

    async def wait_first_samples(self, timeout: float) -> None:
        self._alive()
        for name in self.world.streams:
            self.world.sample(name)

    async def endpids_argv(self, host: str, holders: Sequence[VramHolder], grace_s: float, sudo: bool) -> list[str]:
        self._alive()
        return endpids_argv("python3", await self.code_dir(host), holders, grace_s, sudo=sudo)

    async def end_holders(self, host: str, holders: Sequence[VramHolder], grace_s: float, sudo: bool) -> list[EndOutcome]:
        self._call("end_holders", host)
        await self.answer("end_holders")
        outcomes = []
        for holder in holders:
            self.world.ended.append(holder.pid)
            if self.world.holders_survive:
                outcomes.append(EndOutcome(holder.pid, "survived", "still there after SIGKILL", grace_s))
                continue
            self.world.gpus.pop(holder.pid, None)
            outcomes.append(EndOutcome(holder.pid, "terminated", "ended by SIGTERM", 0.1))
        self.world.sample(host)
        return outcomes

    async def server(self) -> FakeServerClient:
        self._call("server", INFERENCE)
        return FakeServerClient(self)

    async def crosscheck(self, config: Config, run_dir: Path, run_id: str, facts: dict[str, Any]) -> Any:
        """The online cross-check, the real one (`console.procedure.crosscheck`), against the fake
        server: it does not decode speculatively, so there is nothing to replay."""
        from console.procedure.crosscheck import crosscheck, save

        self._call("crosscheck", INFERENCE)
        await self.answer("crosscheck")
        if self.world.service.state != "active":
            raise HostDisconnected(INFERENCE, f"{UNIT} is {self.world.service.state}: no server to ask")
        result = await crosscheck(_ServerSession(self.world), config, run_dir, facts)
        save(run_dir, result)
        return result


class _ServerSession:
    """What the cross-check asks of a session: `service.client()`, a client with `server_info()`."""

    def __init__(self, world: FakeWorld):
        self.service = self
        self._world = world

    async def client(self, timeout: float | None = None) -> _ServerSession:
        return self

    async def server_info(self) -> dict[str, Any]:
        return {"model_path": str(self._world.config.target.model_path), "speculative_algorithm": None}
