"""A fake of SGLang's memory-saver routes for the engine's sweep (no GPU here): the server of the
fake world (`tests/engine_fakes.py`), answering as SGLang 0.5.23's source does
(entrypoints/http_server.py, managers/scheduler_components/weight_updater.py; docs/sglang.md):

- `/pause_generation` "retract": running requests go back to the queue, held (none fails);
  calling it again while paused changes nothing;
- `/release_memory_occupation`: asserts the server is idle (nothing running: a retract pause puts the
  running batch back in the queue, an in_place pause does not; nothing waiting unless paused): a server
  that is not dies, as SGLang's scheduler does on the failed assert; a tag released twice is
  paused twice in torch_memory_saver (recorded as a violation); `frees_after_samples` N (the rehearsal
  server's `--release-frees-after`; slime PR #579): answered at once, its memory leaves the GPUs only
  at the N-th agent sample after it;
- `/resume_memory_occupation`: a tag that is not released is `offload_tags.remove`d and raises
  KeyError in the scheduler (it dies: recorded as a violation);
- `/continue_generation`: 200, paused or not (one over released memory is recorded as a violation:
  the requests it lets run would meet memory that is not there);
- `/server_info` in 0.5.23's shape (http_server.py `server_info`: the launch's resolved arguments,
  `enable_memory_saver` and `enable_weights_cpu_backup` among them, `internal_states` and `version`):
  `version` 0.5.23 unless a test sets an older one; each `internal_states` entry's `memory_usage`
  (internal_state.py `_add_memory_usage`, memory_usage.py `build_memory_usage`: `weight`, `kvcache`
  in GiB, `graph` GiB per capture phase) is what the tags hold at start-up, fixed: a release does not
  change it (`memory_usage`: "start-up", the default; "other", figures three times what moves, as a
  server whose figures disagree with its GPUs; None, no `memory_usage` at all);
- `/weights_checker` (`checker`: "0.5.23", the default, answers the target's checksum; "0.5.6" has no
  checksum, "Unsupported action"; None has no route, 404): its checksum changes when the weights come
  back wrong (`weights_come_back_wrong`: the greedy tokens stay the same) or lost (no CPU backup); read
  while the weights are released it is a violation (SGLang would hash unmapped memory);
- `/health` and `/ready` as 0.5.23's (http_server.py `health_generate`, `ready`): `/ready` is 503 while
  paused or unhealthy; a `/health` while paused waits out SGLANG_HEALTH_CHECK_TIMEOUT, answers 503 and
  marks the server unhealthy (a violation when the console sends it: it must not probe a paused
  server); a `/health` that passes marks it healthy again. `health_prober`: someone else's `/health`
  (a load balancer's) meets the pause, so after the continue `/ready` stays 503 until a `/health`;
- `near_ties`: the next N greedy probes after a continue answer one other token (greedy decoding
  is not batch-invariant under load);
- speculative decoding (`acceptance`: the acceptance length its answers report; None, the default:
  it does not speculate): a `weights` release and resume leaves its drafter wrong (acceptance 1.0),
  as SGLang 0.5.23 does (PR #31674), unless `drafter_survives` (a fixed SGLang); a new process loads it again.

A restart outside the run (`restarted`, from `FakeService.restart_outside`) is a new process: nothing
paused or released, the requests the old one held gone with it; `lives` keeps the control requests
each process was sent.

Every violation is recorded (`violations`) and the sweep asserts there is none. The memory moves
with the tags: the server process's GPU memory in the world shrinks at a release and grows back at a
resume, so the telemetry the engine reads sees it leave and come back.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from console.service.memory_saver import MemorySaver, memory_saver_of
from console.service.sglang_api import WEIGHTS_CHECKSUM_BODY, NoWeightsChecksum, ServerAnswerError

if TYPE_CHECKING:
    from tests.engine_fakes import FakeWorld
    from tests.fake_hosts import FakeHosts

# Per GPU, what the server process holds by tag (its 38000 MiB: weights, KV cache, CUDA graphs).
TAGS_MIB = {"weights": 24000, "kv_cache": 12000, "cuda_graph": 2000}
REQUEST_S = 0.05  # one request's round trip on the world's clock (releasing the KV cache took 0.03-0.06 s)


class FakeServer:
    def __init__(self, world: FakeWorld, service_pid: int):
        self.world = world
        self.service_pid = service_pid
        self.memory_saver = True
        self.weights_cpu_backup = True
        self.paused = False
        self.released: set[str] = set()
        self.running = 0  # requests running now (a load the test sets)
        self.held = 0  # requests retracted to the queue by a pause, waiting
        self.weights_intact = True
        self.dead: str | None = None  # why the scheduler died
        self.calls: list[tuple[float, str, Any]] = []  # (time, route, body)
        self.lives: list[list[tuple[str, Any]]] = [[]]  # (route, body) sent to each process of the server
        self.violations: list[str] = []
        self.version = "0.5.23"
        self.acceptance: float | None = None  # its drafter's acceptance length; None: not speculative
        self.drafter_survives = False  # a fixed SGLang: the drafter comes back from a weights release
        self.drafter_intact = True
        self.checker: str | None = "0.5.23"  # /weights_checker as that release has it (None: no route)
        self.weights_come_back_wrong = False  # a fault: the weights come back changed, the same greedy tokens
        self.weights_changed = False
        self.near_ties = 0  # the next N greedy probes after a continue answer one other token
        self.memory_usage: str | None = "start-up"  # /server_info's memory_usage: "start-up", "other" or None
        self.frees_after_samples = 0  # a release's memory leaves only at the N-th agent sample after it
        self.freeing: list[tuple[list[str], int]] = []  # (tags, samples left) released, memory still held
        self.health_prober = False  # another client's /health meets every pause (a load balancer's)
        self.unhealthy = False  # a /health timed out (SGLang's UnHealthy): /ready 503 until one passes
        self.noop_continues = 0  # continues that found the server not paused (a no-op on SGLang)

    def _log(self, route: str, body: Any) -> None:
        self.calls.append((self.world.clock.time(), route, body))
        self.lives[-1].append((route, body))

    def count(self, route: str) -> int:
        return sum(1 for _, r, _ in self.calls if r == route)

    def _die(self, why: str) -> None:
        self.dead = why
        self.violations.append(why)
        raise ServerAnswerError(f"the server closed the connection: its scheduler died ({why})")

    def _move(self, tags: list[str], sign: int) -> None:
        host, per_gpu, command = self.world.gpus[self.service_pid]
        for gpu in per_gpu:
            per_gpu[gpu] += sign * sum(TAGS_MIB[t] for t in tags)
        self.world.gpus[self.service_pid] = (host, per_gpu, command)

    def pause(self, mode: str) -> dict:
        self._log("pause_generation", {"mode": mode})
        if self.dead:
            self._die(self.dead)
        if not self.paused and mode == "retract":
            self.held, self.running = self.held + self.running, 0
        self.paused = True
        if self.health_prober:  # its /health waits at the front, times out, marks the server unhealthy
            self.unhealthy = True
        return {}

    def release(self, tags: list[str]) -> None:
        self._log("release_memory_occupation", {"tags": tags})
        # is_fully_idle(ignore_waiting=_engine_paused): nothing in the running batch (a retract pause put
        # it back in the queue; an in_place pause keeps it there), and nothing waiting unless paused.
        if self.running or (self.held and not self.paused):
            self._die("release_memory_occupation should be called only when server is idle")
        twice = [t for t in tags if t in self.released]
        if twice:
            self._die(f"released twice: {twice}")
        self.released |= set(tags)
        if "weights" in tags and not self.weights_cpu_backup:
            self.weights_intact = False  # without a CPU backup the weights' contents are gone
        if self.memory_saver and self.frees_after_samples:
            self.freeing.append((list(tags), self.frees_after_samples))  # answered; the memory still held
        elif self.memory_saver:
            self._move(tags, -1)
            self.world.sample(self.world.service_host)

    def tick(self) -> None:
        """Before each agent sample of the server's host: a release's memory due now leaves."""
        left = []
        for tags, samples in self.freeing:
            if samples <= 1:
                self._move(tags, -1)
            else:
                left.append((tags, samples - 1))
        self.freeing = left

    def resume(self, tags: list[str]) -> None:
        self._log("resume_memory_occupation", {"tags": tags})
        missing = [t for t in tags if t not in self.released]
        if missing:
            self._die(f"KeyError: resume of {missing}, never released")
        self.released -= set(tags)
        still_held = {t for pending, _ in self.freeing for t in pending}
        self.freeing = [([t for t in pending if t not in tags], n) for pending, n in self.freeing]
        self.freeing = [(pending, n) for pending, n in self.freeing if pending]
        moved = [t for t in tags if t not in still_held]  # memory that never left does not come back
        if "weights" in tags and self.weights_come_back_wrong:
            self.weights_changed = True
        if "weights" in tags and not self.drafter_survives:
            self.drafter_intact = False  # PR #31674: the target's weights come back, the drafter's do not
        if self.memory_saver:
            self._move(moved, +1)
            self.world.sample(self.world.service_host)

    def resume_all(self) -> None:
        """The unit started again: a new process holds all its memory, nothing paused or released."""
        self.paused, self.released, self.dead, self.unhealthy = False, set(), None, False
        self.freeing = []  # a release still freeing died with the old process
        self.drafter_intact = True  # a new process loads its drafter again
        self.weights_intact, self.weights_changed = True, False  # and its weights

    def restarted(self) -> None:
        """Restarted outside the run: a new process (`resume_all`); the requests held die with the old."""
        self.resume_all()
        self.held = self.running = 0
        self.lives.append([])

    def continue_(self) -> dict:
        self._log("continue_generation", {})
        if self.released:
            self.violations.append(f"a continue over released memory ({sorted(self.released)})")
        if not self.paused:
            self.noop_continues += 1
        self.paused = False
        self.running, self.held = self.running + self.held, 0
        return {}

    def ready(self) -> int:
        return 200 if self.serving() and not self.unhealthy else 503

    def health(self) -> int:
        if self.paused and self.dead is None and self.world.service.state == "active":
            self.violations.append("a /health sent while paused (it waits 20 s, then marks the server unhealthy)")
            self.unhealthy = True
            return 503
        if self.serving():
            self.unhealthy = False
            return 200
        return 503

    def serving(self) -> bool:
        service = self.world.service
        return service.state == "active" and service.ready and not self.paused and not self.released \
            and self.dead is None

    def generate(self, input_ids: list[int], max_new_tokens: int) -> dict:
        if self.paused or self.dead or self.released:
            self.violations.append("a /generate sent while the server was paused or released would wait forever")
            raise ServerAnswerError("POST /generate: no answer (the server is paused)")
        seed = 0 if self.weights_intact else 5
        answer: dict[str, Any] = {"output_ids": [(sum(input_ids) + 7 * i + seed) % 31 for i in range(max_new_tokens)]}
        if self.near_ties and self.count("continue_generation") and input_ids == list(range(1, 9)):
            self.near_ties -= 1  # the probe's last token turned by a near-tie
            answer["output_ids"][-1] = (answer["output_ids"][-1] + 1) % 31
        if self.acceptance is not None:  # outputs stay correct whatever the drafter: only its acceptance falls
            answer["meta_info"] = {"spec_accept_length": self.acceptance if self.drafter_intact else 1.0}
        return answer

    def weights_checksum(self) -> str:
        self._log("weights_checker", WEIGHTS_CHECKSUM_BODY)
        if self.checker is None:
            raise NoWeightsChecksum("POST /weights_checker: HTTP 404: the server has no weights checker")
        if self.checker == "0.5.6":
            raise NoWeightsChecksum("POST /weights_checker: HTTP 400 \"Unsupported action='checksum'\"")
        if self.memory_saver and "weights" in self.released:
            self._die("a checksum of released weights (unmapped memory)")
        return "sha-" + ("lost" if not self.weights_intact else "changed" if self.weights_changed else "intact")

    def server_info(self) -> dict:
        info: dict[str, Any] = {"version": self.version, "enable_memory_saver": self.memory_saver,
                                "enable_weights_cpu_backup": self.weights_cpu_backup,
                                "speculative_algorithm": "DFLASH" if self.acceptance is not None else None,
                                "internal_states": [{}]}
        if self.memory_usage is not None:  # fixed at start-up: what each tag holds per GPU, released or not
            scale = 3 if self.memory_usage == "other" else 1
            info["internal_states"][0]["memory_usage"] = {
                "weight": round(scale * TAGS_MIB["weights"] / 1024, 3),
                "kvcache": round(scale * TAGS_MIB["kv_cache"] / 1024, 3), "startup_available": 80.0,
                "token_capacity": 500000, "token_capacity_swa": None,
                "graph": {"prefill": 0.0, "decode": round(scale * TAGS_MIB["cuda_graph"] / 1024, 3)}}
        return info


class FakeServerClient:
    """What `WindowHosts.server()` gives one console: `SglangClient`'s calls over the fake world,
    dead with its console, each call a place a fault can be injected (`where` = the method's name;
    a fault with `after` lands the request and then drops the answer)."""

    def __init__(self, hosts: FakeHosts):
        self._hosts = hosts
        self._server: FakeServer = hosts.world.server

    async def _call(self, method: str, body: Any, do: Any) -> Any:
        hosts = self._hosts
        fault = hosts._fault(method)
        hosts._alive()
        await hosts.answer(method)
        hosts._alive()
        hosts.world.clock.advance(REQUEST_S)
        result = do()
        hosts.world.changed()
        if fault is not None:  # it landed, then the answer was lost
            from tests.engine_fakes import raise_fault

            raise_fault(fault, f"POST /{method} {json.dumps(body)}", hosts.world.service_host)
        return result

    async def pause_generation(self, mode: str = "retract") -> dict:
        return await self._call("pause_generation", {"mode": mode}, lambda: self._server.pause(mode))

    async def continue_generation(self) -> dict:
        return await self._call("continue_generation", {}, self._server.continue_)

    async def release_memory_occupation(self, tags: list[str]) -> None:
        return await self._call("release_memory_occupation", {"tags": tags}, lambda: self._server.release(list(tags)))

    async def resume_memory_occupation(self, tags: list[str]) -> None:
        return await self._call("resume_memory_occupation", {"tags": tags}, lambda: self._server.resume(list(tags)))

    async def memory_saver(self) -> MemorySaver:
        """As `SglangClient.memory_saver`: read from /server_info (`memory_saver_of`)."""
        return await self._call("server_info", {}, lambda: memory_saver_of(self._server.server_info()))

    async def server_info(self) -> dict:
        return await self._call("server_info", {}, self._server.server_info)

    async def weights_checksum(self) -> str:
        return await self._call("weights_checker", WEIGHTS_CHECKSUM_BODY, self._server.weights_checksum)

    async def ready(self) -> int:
        return await self._call("ready", {}, self._server.ready)

    async def health(self) -> int:
        return await self._call("health", {}, self._server.health)

    async def generate(self, input_ids: list[int], max_new_tokens: int, timeout: float | None = None) -> dict:
        return await self._call("generate", {}, lambda: self._server.generate(input_ids, max_new_tokens))
