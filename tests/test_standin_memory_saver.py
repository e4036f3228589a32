"""The rehearsal server's pause, continue, release and resume routes against SGLang 0.5.23's behaviour
(docs/sglang.md, "Pause and release"), over real HTTP to real processes: the auth level, each pause
mode's effect on a request in flight, the idle check, repeated calls, the simulated GPU memory leaving
and coming back, the same greedy tokens after a resume, the /server_info report; the console's client
against it; and the load generator (bench/loadgen.py) on a paused server and on a stopped one."""

from __future__ import annotations

import hashlib
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bench.loadgen import Load, loopback_url
from console.service.sglang_api import (
    NoWeightsChecksum,
    ServerAnswerError,
    ServerUnreachable,
    SglangClient,
    memory_saver_of,
)
from remote.drill import simgpu
from tests.standin_helpers import GREEDY_PARAMS, running_standin, standin_in_process

SGLANG = json.loads((Path(__file__).parent / "data" / "sglang" / "0.5.23-memory-saver.json").read_text())["answers"]
KEY, ADMIN = "api-key", "admin-key"
GPU_MIB, KV_MIB, GRAPH_MIB = 40000, 14000, 1200
WEIGHTS_MIB = GPU_MIB - KV_MIB - GRAPH_MIB
STEP_S = 0.03  # --step-delay: a request of LONG tokens stays in flight for over a second
LONG = 40
PROMPT = [11, 22, 33, 44, 55, 66, 77]


def call(url: str, path: str, body: dict | None = None, key: str | None = None,
         method: str | None = None) -> tuple[int, object]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data, headers, method=method), timeout=120) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    return status, json.loads(raw) if raw else None


def generate(url: str, max_new_tokens: int = LONG) -> dict:
    body = {"input_ids": PROMPT, "sampling_params": {**GREEDY_PARAMS, "max_new_tokens": max_new_tokens,
                                                     "ignore_eos": True}}
    status, answer = call(url, "/generate", body, KEY)
    assert status == 200, answer
    assert isinstance(answer, dict)
    return answer


def info(url: str) -> dict:
    status, answer = call(url, "/server_info", key=KEY)
    assert status == 200 and isinstance(answer, dict)
    return answer


def until(what: Callable[[], bool], timeout: float = 60.0) -> None:
    """Wait until `what()` holds (polled: the state lives in another process)."""
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.02)


def requests_of(url: str) -> dict:
    return info(url)["requests"]


class InFlight:
    """A /generate sent from a thread; its answer (or the error) once it comes."""

    def __init__(self, url: str, max_new_tokens: int = LONG):
        self.answer: dict | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, max_new_tokens), daemon=True)
        self.thread.start()

    def _run(self, url: str, max_new_tokens: int) -> None:
        try:
            self.answer = generate(url, max_new_tokens)
        except BaseException as exc:  # noqa: BLE001 - kept for the test to assert
            self.error = exc

    def result(self, timeout: float = 120.0) -> dict:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "no answer"
        assert self.error is None and self.answer is not None, self.error
        return self.answer


def used_mib(gpu_file: Path) -> int:
    return simgpu.live_view(simgpu.read(gpu_file))["gpus"][0]["used_mib"]


def server_args(gpu_file: Path, *extra: str) -> list[str]:
    return ["--skip-server-warmup", "--api-key", KEY, "--step-delay", str(STEP_S), "--gpu-file", str(gpu_file),
            "--gpu-mib", str(GPU_MIB), "--kv-cache-mib", str(KV_MIB), "--cuda-graph-mib", str(GRAPH_MIB), *extra]


@pytest.fixture(scope="module")
def saver(tiny_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A server with the memory saver, a weights backup, an API key and an admin key."""
    tmp = tmp_path_factory.mktemp("saver")
    gpu_file = tmp / "gpus.json"
    with running_standin(tiny_target, tmp / "log", *server_args(gpu_file, "--admin-api-key", ADMIN,
                                                                  "--enable-memory-saver",
                                                                  "--enable-weights-cpu-backup")) as url:
        until(lambda: gpu_file.exists() and used_mib(gpu_file) == GPU_MIB)
        reference = generate(url)["output_ids"]  # greedy, before any pause or release
        yield {"url": url, "gpu_file": gpu_file, "log": tmp / "log", "reference": reference}


def admin(url: str, path: str, body: dict | None = None) -> tuple[int, object]:
    return call(url, path, {} if body is None else body, ADMIN)


def test_server_info_reports_the_memory_saver_in_sglangs_shape(saver) -> None:
    report = memory_saver_of(info(saver["url"]))
    assert report.enabled and report.weights_cpu_backup
    assert report.memory_gib == {"weights": round(WEIGHTS_MIB / 1024, 3), "kv_cache": round(KV_MIB / 1024, 3),
                                 "cuda_graph": round(GRAPH_MIB / 1024, 3)}


def test_the_four_routes_are_admin_optional(saver) -> None:
    url = saver["url"]
    for path in ("/pause_generation", "/continue_generation", "/release_memory_occupation", "/resume_memory_occupation"):
        assert call(url, path, {}) == (401, {"error": "Unauthorized"})
        assert call(url, path, {}, KEY) == (401, {"error": "Unauthorized"})  # with an admin key, only that one
    assert call(url, "/generate", {"input_ids": [1]}, ADMIN)[0] == 401  # and the admin key is not the API key
    assert call(url, "/pause_generation", {}, ADMIN, method="GET")[0] == 405  # POST only
    assert admin(url, "/pause_generation", {"mode": "sideways"})[0] == 400
    assert admin(url, "/release_memory_occupation", {"tags": "kv_cache"})[0] == 400


def test_retract_holds_the_request_gives_the_kv_cache_back_and_answers_it_after_continue(saver) -> None:
    url, gpu_file = saver["url"], saver["gpu_file"]
    running = InFlight(url)
    until(lambda: requests_of(url)["running"] == 1)
    paused = SGLANG["pause_generation"]  # SGLang's answers, written from its source
    assert admin(url, "/pause_generation", {"mode": "retract"}) == (paused["status"], paused["body"])
    assert requests_of(url) == {"running": 0, "waiting": 1, "held": 0}  # back in the waiting queue
    assert call(url, "/ready")[0] == 503  # not ready while paused
    late = InFlight(url)  # a request sent while paused waits at the front
    until(lambda: requests_of(url)["held"] == 1)
    # idle now (the retracted one waits): the KV cache and the graphs leave the simulated GPU
    released = SGLANG["release_memory_occupation"]
    assert admin(url, "/release_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (
        released["status"], released["body"])
    assert used_mib(gpu_file) == WEIGHTS_MIB and sorted(info(url)["released"]) == ["cuda_graph", "kv_cache"]
    assert running.thread.is_alive() and late.thread.is_alive()
    assert admin(url, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]}) == (200, None)
    assert used_mib(gpu_file) == GPU_MIB
    continued = SGLANG["continue_generation"]
    assert admin(url, "/continue_generation") == (continued["status"], continued["body"])
    first, second = running.result(), late.result()
    assert first["output_ids"] == saver["reference"]  # its KV cache recomputed: the same greedy tokens
    assert first["meta_info"]["num_retractions"] == 1 and second["meta_info"]["num_retractions"] == 0
    assert second["output_ids"] == saver["reference"]
    assert call(url, "/ready")[0] == 200


def test_in_place_holds_the_running_request_where_it_is(saver) -> None:
    url = saver["url"]
    running = InFlight(url)
    until(lambda: requests_of(url)["running"] == 1)
    assert admin(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    assert requests_of(url)["running"] == 1 and running.thread.is_alive()  # still running, not advancing
    assert admin(url, "/pause_generation", {"mode": "in_place"})[0] == 200  # a repeated pause is answered
    assert admin(url, "/continue_generation")[0] == 200
    answer = running.result()
    assert answer["output_ids"] == saver["reference"] and answer["meta_info"]["num_retractions"] == 0
    assert admin(url, "/continue_generation")[0] == 200  # continuing what is not paused is answered too


def test_abort_fails_the_request_in_flight_and_holds_new_ones(saver) -> None:
    url = saver["url"]
    running = InFlight(url)
    until(lambda: requests_of(url)["running"] == 1)
    assert admin(url, "/pause_generation")[0] == 200  # no mode: SGLang's default, abort
    aborted = running.result(5)  # answered before the pause was
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert aborted["meta_info"]["finish_reason"]["message"] == "Aborted"
    assert len(aborted["output_ids"]) < LONG
    late = InFlight(url, 2)
    until(lambda: requests_of(url)["held"] == 1)
    assert admin(url, "/continue_generation")[0] == 200
    assert late.result()["meta_info"]["finish_reason"] == {"type": "length", "length": 2}


async def test_weights_released_with_a_backup_come_back_and_generate_the_same_tokens(saver) -> None:
    url, gpu_file = saver["url"], saver["gpu_file"]
    client = SglangClient(url, api_key=ADMIN)
    assert (await client.pause_generation())["status"] == "ok"  # ours: retract by default
    await client.release_memory_occupation(["kv_cache", "weights", "cuda_graph"])
    assert used_mib(gpu_file) == 0
    await client.resume_memory_occupation(["weights", "kv_cache", "cuda_graph"])
    assert used_mib(gpu_file) == GPU_MIB
    await client.continue_generation()
    assert generate(url)["output_ids"] == saver["reference"]


async def test_client_errors_name_the_route_and_the_server_s_answer(saver) -> None:
    url = saver["url"]
    with pytest.raises(ServerAnswerError, match=r"POST /pause_generation: HTTP 401 .*api_key_env.*refused"):
        await SglangClient(url, api_key=KEY).pause_generation()
    with pytest.raises(ServerAnswerError, match=r"POST /continue_generation: HTTP 401 .*api_key_env"):
        await SglangClient(url).continue_generation()


def test_loadgen_on_a_paused_server_fails_nothing_and_counts_the_wait(saver) -> None:
    url = saver["url"]
    with Load(url, rate=20, max_in_flight=8, max_new_tokens=2, api_key=KEY) as load:
        try:
            until(lambda: load.tally.completed >= 3)
            assert admin(url, "/pause_generation", {"mode": "retract"})[0] == 200
            assert admin(url, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
            paused_at = time.monotonic()
            until(lambda: load.tally.in_flight >= 3)  # they pile up, held (at the front or in the queue)
            assert requests_of(url)["running"] == 0
            until(lambda: time.monotonic() - paused_at > 0.5)
            assert admin(url, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
        finally:
            assert admin(url, "/continue_generation")[0] == 200  # never left paused: the load would wait
        done = load.tally.completed
        until(lambda: load.tally.completed >= done + 3)
    report = load.report
    assert report is not None and report.failed == 0 and report.failures == {}
    assert report.completed == report.sent and report.longest_wait_s >= 0.5 and report.max_in_flight >= 3


def test_loadgen_refuses_a_url_off_this_machine() -> None:
    assert loopback_url("http://127.0.0.1:30000/") == "http://127.0.0.1:30000"
    for url in ("http://10.0.0.5:30000", "https://127.0.0.1:1", "http://example.com"):
        with pytest.raises(ValueError, match="loopback"):
            loopback_url(url)


def checksum_of(answer: dict) -> str:
    """SGLang's per_engine_checksum recomputed from its ranks (tokenizer_control_mixin.check_weights,
    weight_checker.overall_checksum), so the answer's figures are checked, not only compared."""
    engine = hashlib.sha256()
    for rank in answer["ranks"]:
        overall = hashlib.sha256()
        for name in sorted(rank["checksums"]):
            overall.update(name.encode())
            overall.update(rank["checksums"][name].encode())
        assert rank["per_gpu_checksum"] == overall.hexdigest()
        engine.update(rank["per_gpu_checksum"].encode())
    return engine.hexdigest()


async def test_the_weights_checker_answers_as_sglang_0_5_23(saver) -> None:
    """/weights_checker (http_server.py, check_weights): GET or POST, the body optional (a checksum of
    every runner), ADMIN_OPTIONAL; the target's checksum the same after a `weights` release and resume
    with a CPU backup; 400 with success false for what the checker refuses."""
    url = saver["url"]
    assert call(url, "/weights_checker", {}) == (401, {"error": "Unauthorized"})
    assert call(url, "/weights_checker", {}, KEY)[0] == 401  # the admin key is set: only it
    status, whole = call(url, "/weights_checker", None, ADMIN, method="GET")
    assert status == 200 and isinstance(whole, dict), whole
    assert whole["success"] is True and whole["message"] == "Success."
    (rank,) = whole["ranks"]
    assert rank["parallelism_info"] == [{"role": "target", "tp_rank": 0, "tp_size": 1, "dp_rank": 0, "dp_size": 1,
                                         "pp_rank": 0, "pp_size": 1, "rank": 0, "size": 1}]
    names = set(rank["checksums"])
    assert "lm_head.weight" in names and not any("inv_freq" in n for n in names)  # non-persistent buffers left out
    assert all(len(c) == 16 and int(c, 16) >= 0 for c in rank["checksums"].values())
    assert whole["per_engine_checksum"] == checksum_of(whole)
    client = SglangClient(url, api_key=ADMIN)
    before = await client.weights_checksum()  # what the console asks: the target's
    assert before == whole["per_engine_checksum"]  # no drafter here: "all" is the target alone
    skipped = admin(url, "/weights_checker", {"skip_tensor_list": ["lm_head"]})[1]
    assert isinstance(skipped, dict) and "lm_head.weight" not in skipped["ranks"][0]["checksums"]
    assert admin(url, "/weights_checker", {"action": "sideways"}) == (
        400, {"success": False, "message": "Unsupported action='sideways'"})
    assert admin(url, "/weights_checker", {"action": "compare"}) == (400, {"success": False, "message": ""})
    assert admin(url, "/weights_checker", {"action": "snapshot"}) == (200, {"success": True, "message": "Success."})
    assert admin(url, "/weights_checker", {"action": "compare"}) == (200, {"success": True, "message": "Success."})

    await client.pause_generation("retract")
    await client.release_memory_occupation(["kv_cache", "weights"])
    await client.resume_memory_occupation(["kv_cache", "weights"])
    await client.continue_generation()
    assert await client.weights_checksum() == before  # the CPU backup brought them back bit for bit
    assert generate(url)["output_ids"] == saver["reference"]


@pytest.fixture()
def wrong(tiny_target: Path, tmp_path: Path) -> Iterator[dict]:
    """A server whose weights come back from a `weights` release changed (the fault)."""
    gpu_file = tmp_path / "gpus.json"
    with running_standin(tiny_target, tmp_path / "log", *server_args(
            gpu_file, "--enable-memory-saver", "--enable-weights-cpu-backup", "--weights-come-back-wrong", "0.001")) as url:
        until(lambda: gpu_file.exists() and used_mib(gpu_file) == GPU_MIB)
        yield {"url": url, "log": tmp_path / "log"}


async def test_weights_that_come_back_wrong_change_the_checksum_not_the_greedy_tokens(wrong) -> None:
    """`--weights-come-back-wrong`: the greedy probe cannot tell, the checksum does. A checksum read while
    the weights are released ends the server (SGLang would hash unmapped memory)."""
    url = wrong["url"]
    client = SglangClient(url, api_key=KEY)
    before, tokens = await client.weights_checksum(), generate(url, 8)["output_ids"]
    await client.pause_generation("retract")
    await client.release_memory_occupation(["kv_cache"])
    await client.resume_memory_occupation(["kv_cache"])
    assert await client.weights_checksum() == before  # the weights stayed resident
    await client.release_memory_occupation(["weights"])
    await client.resume_memory_occupation(["weights"])
    await client.continue_generation()
    after = await client.weights_checksum()
    assert after != before and len(after) == 64
    assert generate(url, 8)["output_ids"] == tokens  # every logit moved alike: the same greedy tokens
    await client.pause_generation("retract")
    await client.release_memory_occupation(["weights"])
    with pytest.raises(ServerUnreachable, match="closed the connection without answering"):
        await client.weights_checksum()
    assert "illegal memory access" in wrong["log"].read_text()


@pytest.mark.parametrize("version", ["0.5.6", "0.5.5"])
async def test_an_older_sglang_has_no_checksum_and_the_client_says_so(tiny_target: Path, version: str) -> None:
    """0.5.6's /weights_checker: POST only, an action required, snapshot and compare but no checksum (400
    "Unsupported action='checksum'"), the API key; 0.5.5 has none (404). The console's client raises
    NoWeightsChecksum for both: the pause route falls back to the probe. (The front and model worker in
    this process.)"""
    with standin_in_process(tiny_target, "--api-key", KEY, "--sglang-version", version) as (url, _):
        client = SglangClient(url, api_key=KEY)
        if version == "0.5.5":
            assert call(url, "/weights_checker", {"action": "checksum"}, KEY) == (404, {"detail": "Not Found"})
            with pytest.raises(NoWeightsChecksum, match="HTTP 404"):
                await client.weights_checksum()
            return
        assert call(url, "/weights_checker", {"action": "checksum"}) == (401, {"error": "Unauthorized"})
        assert call(url, "/weights_checker", None, KEY, method="GET") == (405, {"detail": "Method Not Allowed"})
        assert call(url, "/weights_checker", {}, KEY)[0] == 400  # the action is required
        assert call(url, "/weights_checker", {"action": "checksum"}, KEY) == (
            400, {"success": False, "message": "Unsupported action='checksum'"})
        assert call(url, "/weights_checker", {"action": "snapshot"}, KEY) == (200, {"success": True, "message": "Success."})
        assert call(url, "/weights_checker", {"action": "compare"}, KEY) == (200, {"success": True, "message": "Success."})
        with pytest.raises(NoWeightsChecksum, match="Unsupported action='checksum'"):
            await client.weights_checksum()


def test_release_while_a_request_runs_ends_the_server_as_sglangs_assertion_does(saver) -> None:
    """Last in this file: the server dies (SGLang's scheduler fails its idle assertion, SIGQUIT, the
    process tree killed). An in_place pause does not make it idle: its request is still running."""
    url = saver["url"]
    running = InFlight(url)
    until(lambda: requests_of(url)["running"] == 1)
    assert admin(url, "/pause_generation", {"mode": "in_place"})[0] == 200
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # the connection closes unanswered
        admin(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
    running.thread.join(30)
    assert running.error is not None  # its request is lost with the server
    log = saver["log"].read_text()
    assert "AssertionError: release_memory_occupation should be called only when server is idle." in log
    until(lambda: used_mib(saver["gpu_file"]) == 0)  # the scheduler's memory went with it


@pytest.fixture()
def no_backup(tiny_target: Path, tmp_path: Path) -> Iterator[dict]:
    gpu_file = tmp_path / "gpus.json"
    with running_standin(tiny_target, tmp_path / "log", *server_args(gpu_file, "--enable-memory-saver")) as url:
        until(lambda: gpu_file.exists() and used_mib(gpu_file) == GPU_MIB)
        yield {"url": url, "gpu_file": gpu_file, "log": tmp_path / "log"}


async def test_weights_without_a_backup_are_lost_and_a_second_release_ends_the_server(no_backup) -> None:
    url, gpu_file = no_backup["url"], no_backup["gpu_file"]
    client = SglangClient(url, api_key=KEY)  # no admin key: the API key opens the admin routes
    saver_report = await client.memory_saver()
    assert saver_report.enabled and not saver_report.weights_cpu_backup
    assert "CPU backup" in (saver_report.why_not(["weights"]) or "")
    before = generate(url, 8)["output_ids"]
    await client.pause_generation("retract")
    await client.release_memory_occupation(["weights"])
    assert used_mib(gpu_file) == KV_MIB + GRAPH_MIB
    await client.resume_memory_occupation(["weights"])
    await client.continue_generation()
    assert generate(url, 8)["output_ids"] != before  # the weights came back as fresh memory
    await client.release_memory_occupation(["kv_cache"])
    with pytest.raises(ServerUnreachable, match="closed the connection without answering"):
        await client.release_memory_occupation(["kv_cache"])  # torch_memory_saver: not active
    assert "Cannot pause allocation that is not active" in no_backup["log"].read_text()


async def test_without_the_memory_saver_a_release_frees_nothing_and_a_stray_resume_ends_the_server(
        tiny_target: Path, tmp_path: Path) -> None:
    gpu_file = tmp_path / "gpus.json"
    with running_standin(tiny_target, tmp_path / "log", *server_args(gpu_file)) as url:
        until(lambda: gpu_file.exists() and used_mib(gpu_file) == GPU_MIB)
        client = SglangClient(url, api_key=KEY)
        report = await client.memory_saver()
        assert not report.enabled and "--enable-memory-saver" in (report.why_not(["kv_cache"]) or "")
        await client.pause_generation()
        await client.release_memory_occupation(["kv_cache"])
        await client.release_memory_occupation(["kv_cache"])  # the no-op adapter: answered, nothing freed
        assert used_mib(gpu_file) == GPU_MIB
        await client.resume_memory_occupation(["kv_cache"])
        await client.continue_generation()
        with Load(url, rate=20, max_new_tokens=2, api_key=KEY) as load:
            until(lambda: load.tally.completed >= 2)
            with pytest.raises(ServerUnreachable):
                await client.resume_memory_occupation(["kv_cache"])  # not released: KeyError, the server dies
            until(lambda: load.tally.failures.get("refused", 0) >= 2)  # the server is gone
        assert "KeyError: 'kv_cache'" in (tmp_path / "log").read_text()
    report = load.report
    assert report is not None and report.failed >= 3 and report.completed >= 2
    assert set(report.failures) <= {"refused", "no answer"} and report.failures["refused"] >= 2


def test_a_fresh_server_dies_on_a_resume_of_memory_it_never_released(tmp_path: Path) -> None:
    """A server process starts with nothing released (SGLang 0.5.23: `WeightUpdater.offload_tags`, an
    empty set), and a resume of a tag not in it is a KeyError in its scheduler, which ends the server
    (`offload_tags.remove`): what a console resuming a server restarted since its release would meet
    (issue 40). With the memory saver on, as the drill runs it; its model worker in this process."""
    from remote.drill import memory_saver
    from remote.drill.standin.arguments import parse_args
    from remote.drill.standin.server import Server

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    fresh = Server(parse_args(["--model", str(tmp_path), "--port", "0", "--enable-memory-saver",
                               "--enable-weights-cpu-backup"]))
    deaths: list[str] = []

    def die(reason: str) -> None:  # the real one kills the process (SIGKILL), as SGLang's SIGQUIT does
        deaths.append(reason)
        raise SystemExit(reason)
    fresh.die = die  # type: ignore[method-assign]
    with pytest.raises(SystemExit):
        memory_saver.answer(fresh.saver, "/resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})
    assert deaths and deaths[0].startswith("KeyError: 'kv_cache'"), deaths
