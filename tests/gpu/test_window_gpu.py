"""On the GPU machine: the downtime window on the drill with a real GPU (REAL GPU, not SIMULATED).

The rehearsal server serves a random 1.7 B hybrid Qwen3.5 from the GPU, a real CUDA process holds
16 GiB beside it and outlives the first stop, telemetry is NVML's through the agent, the staged
extractor runs the fast kernels (fla + causal-conv1d), the evaluation runs on CUDA, and both
rehearsal hosts share the one GPU (the zero-downtime route's fit works from its real free bytes).

    source .dev/setup-device.sh && PYTHONPATH=$PYTHONPATH:. python3 -m pytest --noconftest tests/gpu/test_window_gpu.py

One drill serves the module, in file order: its first stop is the end-to-end test's.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("asyncssh")  # carried to the GPU machine as wheels (bench/gpu_suite.sh)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.timeout(900),
]

from console.drill.assets import CACHE_ENV  # noqa: E402
from console.drill.hosts import down, up  # noqa: E402
from console.operator import Operator  # noqa: E402
from console.procedure.engine import EXIT_DONE, EXIT_FAILED  # noqa: E402
from remote.drill.service import CUDA_LOG_FILE  # noqa: E402
from tests.window_fixtures import Drill, kill, read_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("preflight", "stage", "cache", "stop", "free-vram", "extract", "restart", "evaluate", "report")
SLACK_MIB = 2048  # what the training host's other work leaves free beyond the extraction's estimate
INTRUDER_MIB = 3072  # more than the slack: the extraction would no longer fit

# A process that takes GPU memory when told, as another user's job would: `take N` MiB, or `leave N`
# MiB free on the GPU (measured by the driver, its own context included). Its CUDA context exists
# from the start, so the plan counts it.
HOG = """
import sys, torch
torch.empty(1, device="cuda")
held = []
print("ready", flush=True)
for line in sys.stdin:
    verb, mib = line.split()
    if verb == "leave":
        mib = torch.cuda.mem_get_info()[0] // 2**20 - int(mib)
    held.append(torch.empty(int(mib) << 20, dtype=torch.uint8, device="cuda").fill_(1))
    torch.cuda.synchronize()
    print("took", torch.cuda.mem_get_info()[0] // 2**20, flush=True)
"""


class Hog:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", HOG], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def take(self, mib: int, verb: str = "take") -> int:
        """Take `mib` MiB (or leave that much free); returns the MiB left free on the GPU."""
        self.proc.stdin.write(f"{verb} {mib}\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline().split()
        assert answer[:1] == ["took"], f"pid {self.pid} could not {verb} {mib} MiB"
        return int(answer[1])

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait(30)


def cli(drill: Drill, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cli_argv(drill, *args), capture_output=True, text=True, timeout=timeout, env=_env(), cwd=ROOT)


def cli_argv(drill: Drill, *args: str) -> list[str]:
    return [sys.executable, "-m", "console.cli.main", *args, "--config", str(drill.config_path), "--runs", str(drill.runs)]


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(ROOT)) if p)
    return {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path}


def telemetry(drill: Drill, run_id: str, host: str = "ct129") -> list[dict]:
    lines = (drill.runs / run_id / "telemetry.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["host"] == host and r.get("sample")]


def used(record: dict) -> int:
    return next(g["mem_used_mib"] for g in record["sample"]["gpus"] if g["index"] == 0)


def only_new_run(drill: Drill, before: set[str]) -> tuple[str, dict]:
    from console.procedure.store import RunStore

    store = RunStore(drill.runs)
    (run_id,) = set(store.run_ids()) - before
    return run_id, store.open(run_id).state.to_json()


def wait_new_journal(drill: Drill, before: set[str], prefix: str | tuple[str, ...], proc: subprocess.Popen,
                     timeout: float = 400) -> dict:
    """Until the run started after `before` journals a message starting with `prefix` (an older
    run's journal never answers)."""
    from console.procedure.store import RunStore

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for run_id in run_ids(drill) - before:
            for entry in RunStore(drill.runs).open(run_id).read_journal():
                if entry["message"].startswith(prefix):
                    return entry
        if proc.poll() is not None:
            raise AssertionError(f"the console exited ({proc.returncode}) first:\n{proc.stdout.read()[-4000:]}")
        time.sleep(0.05)
    raise TimeoutError(f"no journal entry starting with {prefix!r}")


def run_ids(drill: Drill) -> set[str]:
    from console.procedure.store import RunStore

    return set(RunStore(drill.runs).run_ids()) if drill.runs.exists() else set()


@pytest.fixture(scope="module")
def gpu_drill() -> Iterator[Drill]:
    with tempfile.TemporaryDirectory(prefix="gpu-drill-") as tmp:
        root = Path(os.environ.get("DFLASH_GPU_DRILL_ROOT") or tmp)  # kept there for its logs when set
        os.environ.setdefault(CACHE_ENV, str(root / "assets"))  # the suite shares one across its stages
        os.environ["PYTHONPATH"] = _env()["PYTHONPATH"]  # the hosts run `python -m remote...` from their homes
        config = up(root / "drill", fresh=True, gpu=True, say=lambda line: print(line, file=sys.stderr))
        try:
            yield Drill(root / "drill", config, root / "runs")
        finally:
            down(root / "drill", say=lambda _: None)


def test_headless_window_end_to_end_on_the_gpu(gpu_drill: Drill) -> None:
    drill = gpu_drill
    config = drill.config
    assert not any(h.simulated_gpus for h in config.hosts.values())  # REAL GPU
    assert config.target.kernels == "fast" and config.eval.device == "cuda"
    before = drill.service_pid()
    done = subprocess.run([sys.executable, "-m", "console.cli.main", "drill", "--gpu", "--headless", "--yes", "--dir",
                           str(drill.dir), "--runs", str(drill.runs)], capture_output=True, text=True, timeout=600,
                          env=_env(), cwd=ROOT)
    print(done.stdout[-3000:])
    assert done.returncode == EXIT_DONE, done.stdout[-4000:] + done.stderr[-4000:]
    run_id, state = drill.only_run()
    assert [state["steps"][s]["status"] for s in STEPS] == ["done"] * 9, state["steps"]
    # The first stop left a real CUDA process holding VRAM: listed with its command, ended, then free.
    journal = drill.journal()
    held = [e["message"] for e in journal if e["message"].startswith("VRAM still held")]
    assert held and "hold-vram" in held[0], held
    assert any("approved: end 1 process holding VRAM" in e["message"] for e in journal)
    assert "still holding" in (drill.dir / "ct129" / "home" / "standin" / CUDA_LOG_FILE).read_text()
    assert drill.service_pid() not in (None, before)  # a new server, serving from the GPU again
    # NVML's view over the window, through the agent: real readings, the held memory gone during the stop.
    samples = telemetry(drill, run_id)
    assert samples and all(r["sample"]["source"] == "nvml" and not r["sample"]["simulated"] for r in samples)
    serving = max(used(r) for r in samples if not r.get("service_down"))
    down_low = min(used(r) for r in samples if r.get("service_down"))
    assert serving > 16384 and down_low < serving - 16384, (serving, down_low)
    # Staged, with the fast kernels bound on the GPU; the restart began at gpu_released.
    window = state["extraction"]["window"]
    assert window.get("staged") is True, window
    manifest = next(Path(config.hosts["ct129"].workdir).glob(f"windows/{run_id}/states/manifest.json"))
    facts = read_json(manifest)
    assert facts["kernels_fast"] is True and facts["kernel_decision"]["effective"] == "fast"
    service = state["service"]
    assert state["extraction"]["gpu_released_at"] <= service["restart_begun_at"]
    results = read_json(drill.runs / run_id / "results" / "results.json")
    assert results["device"].startswith("cuda") and set(results["drafters"]) == {"reference", "candidate"}
    print(f"downtime {service['ready_at'] - service['stopped_at']:.2f} s; window {window}")


def test_console_killed_mid_extraction_then_resumed_extracts_once(gpu_drill: Drill) -> None:
    drill = gpu_drill
    before = run_ids(drill)
    extracts_before = len(drill.job_dirs("ct129", "extract"))
    console = subprocess.Popen(cli_argv(drill, "run", "--headless", "--yes"), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT, stdin=subprocess.DEVNULL)
    try:
        # The go is written: the staged extractor is copying the weights to the GPU, the server down.
        wait_new_journal(drill, before, "go: the staged extractor", console)
        kill(console)
    finally:
        if console.poll() is None:
            console.kill()
            console.wait(10)
    resumed = cli(drill, "run", "--resume", "--headless", "--yes")
    assert resumed.returncode == EXIT_DONE, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    run_id, state = only_new_run(drill, before)
    assert state["status"] == "done"
    assert len(drill.job_dirs("ct129", "extract")) == extracts_before + 1  # extracted once, never again
    assert drill.service_pid() is not None and state["service"].get("down") is False


async def _plan_fit(drill: Drill):
    operator = Operator(drill.config, runs_dir=drill.runs)
    operator.start()
    try:
        plan = await operator.plan(route="zero-downtime")
    finally:
        await operator.stop()
    return next(f for f in plan.fits if f.host == "ct200")


def _fill_to_slack(drill: Drill) -> tuple[Hog, int]:
    """The training host's other work: a real process taking all the GPU's free memory but the
    extraction's estimate and SLACK_MIB. Returns it and the estimate (MiB)."""
    fit = asyncio.run(_plan_fit(drill))
    assert fit.proposed, fit.why
    filler = Hog()
    left = filler.take(fit.need_mib + SLACK_MIB, "leave")
    print(f"the training host's other work leaves {left} MiB free for ~{fit.need_mib} MiB")
    return filler, fit.need_mib


def test_zero_downtime_on_the_shared_gpu_completes_and_never_stops_the_server(gpu_drill: Drill) -> None:
    drill = gpu_drill
    pid = drill.service_pid()
    before = run_ids(drill)
    # Room for the extraction and SLACK_MIB more: our own extractor's memory must not count against it.
    filler, need = _fill_to_slack(drill)
    console = subprocess.Popen(cli_argv(drill, "run", "--headless", "--yes", "--route", "zero-downtime"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT,
                               stdin=subprocess.DEVNULL)
    try:
        wait_new_journal(drill, before, ("extract: done", "extract: failed"), console)
        filler.close()  # the evaluation on the same GPU needs room of its own
        out, _ = console.communicate(timeout=400)
    finally:
        filler.close() if filler.proc.poll() is None else None
        if console.poll() is None:
            console.kill()
    assert console.returncode == EXIT_DONE, out[-4000:]
    _, state = only_new_run(drill, before)
    assert state["facts"]["extract_on"]["host"] == "ct200" and state["facts"]["extract_on"]["need_mib"] == need
    assert state["service"]["stopped_at"] is None  # never stopped
    assert drill.service_pid() == pid


def test_a_real_intruder_mid_extraction_stops_the_route_cleanly_and_offers_the_window(gpu_drill: Drill) -> None:
    drill = gpu_drill
    pid = drill.service_pid()
    before = run_ids(drill)
    intruder = Hog()  # its context first: only its allocation comes mid-extraction
    filler, _ = _fill_to_slack(drill)
    console = subprocess.Popen(cli_argv(drill, "run", "--headless", "--yes", "--route", "zero-downtime"),
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=ROOT,
                               stdin=subprocess.DEVNULL)
    try:
        # The extractor has started on ct200 (still importing torch): the intruder takes more than the slack.
        wait_new_journal(drill, before, "started extract on ct200", console)
        intruder.take(INTRUDER_MIB)
        out, _ = console.communicate(timeout=300)
    finally:
        filler.close()
        if console.poll() is None:
            console.kill()
    try:
        assert intruder.proc.poll() is None  # it got its memory and lives: no OOM met it
        assert console.returncode == EXIT_FAILED, out[-4000:]
        flat = " ".join(out.split())
        assert "GPU0 on ct200 was taken by" in flat and f"pid {intruder.pid} (" in flat, flat[-3000:]
        assert "The window route remains: dflash-ops run --route window" in flat
        _, state = only_new_run(drill, before)
        assert state["steps"]["extract"]["status"] == "failed"
        handle = state["jobs"]["extract"].get("handle")
        if handle:  # started, then stopped: gone (or a zombie), never left running
            stat = Path(f"/proc/{handle['pid']}/stat")
            assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
        assert state["service"]["stopped_at"] is None and drill.service_pid() == pid  # the server untouched
    finally:
        intruder.close()


def test_pause_route_gives_the_extraction_the_kv_cache_and_never_stops_the_server(gpu_drill: Drill) -> None:
    """SGLang's memory saver for real (torch_memory_saver on the H200): the drill's server pauses,
    releases its KV cache (its weights stay when the extraction fits beside them), the extraction runs
    on the same GPU, and the memory comes back, the server process the same throughout."""
    drill = gpu_drill
    pid = drill.service_pid()
    before = run_ids(drill)
    done = cli(drill, "run", "--headless", "--yes", "--route", "pause")
    assert done.returncode == EXIT_DONE, done.stdout[-4000:] + done.stderr[-4000:]
    run_id, state = only_new_run(drill, before)
    steps = ("pause", "release", "free-vram", "extract", "resume", "continue", "evaluate", "report")
    assert [state["steps"][s]["status"] for s in steps] == ["done"] * len(steps), state["steps"]
    service = state["service"]
    assert service["stopped_at"] is None and drill.service_pid() == pid  # never stopped
    # One pause, one release, one resume, one continue; the KV cache went, and came back.
    assert (service["pauses"], service["releases"], service["resumes"], service["continues"]) == (1, 1, 1, 1)
    assert "kv_cache" in service["released_tags"] and not service["released"] and not service["paused"]
    gpu = next(iter(service["used_before_release_mib"]))
    freed = service["used_before_release_mib"][gpu] - service["used_after_release_mib"][gpu]
    assert freed >= 1024, (service["used_before_release_mib"], service["used_after_release_mib"])
    # NVML through the agent saw the memory leave the GPU while paused.
    samples = telemetry(drill, run_id)
    assert samples and all(r["sample"]["source"] == "nvml" for r in samples)
    results = read_json(drill.runs / run_id / "results" / "results.json")
    assert results["device"].startswith("cuda")
    print(f"pause route: freed {freed} MiB on GPU {gpu}; paused {service['continued_at'] - service['paused_at']:.2f} s")
