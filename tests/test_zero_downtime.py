"""The routes that never stop the server: zero-downtime (extract on a host with room: the drill's
training host has one free simulated GPU and a copy of the target) and pause (the rehearsal server
runs with SGLang's memory saver: it releases its KV cache and CUDA graphs and takes them back)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from console.config import load_config
from console.messages import GpuReading, TelemetrySample
from console.procedure.engine import EXIT_DONE, EXIT_FAILED
from console.procedure.fit import where_it_fits
from console.procedure.store import RunStore
from remote import probe
from remote.drill import simgpu
from tests.standin_helpers import wait_status
from tests.window_fixtures import ENTRY_POINT, Drill, cli_env, kill, read_json

pytestmark = pytest.mark.timeout(600)


def test_plan_shows_both_routes_with_their_reasons(drill: Drill) -> None:
    done = drill.run_cli("run", "--plan")
    assert done.returncode == 0, done.stdout + done.stderr
    out = " ".join(done.stdout.split())
    assert "where the target fits without stopping the server" in out
    assert "every GPU there serves the model" in out  # ct129: its GPUs are the server's
    assert "GPU7 has 97887 MiB free" in out  # ct200's free GPU
    assert "proposed: zero-downtime: extract on ct200 GPU7" in out and "--route zero-downtime" in out
    # ct200 is where the drafters live: its kernels are not "compared" with its own.
    assert "same kernels as ct200" not in out and "the drafters were trained here" in out


def test_zero_downtime_never_touches_the_server_and_matches_the_window(drill: Drill) -> None:
    pid = drill.service_pid()
    done = drill.run_cli("run", "--headless", "--yes", "--route", "zero-downtime")
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    assert drill.service_pid() == pid  # the same server process: its uptime continued
    run_id, state = drill.only_run()
    assert state["route"] == "zero-downtime" and state["service"]["stopped_at"] is None and state["service"]["stops"] == 0
    assert state["facts"]["extract_on"]["host"] == "ct200" and state["facts"]["extract_on"]["gpu"] == 7
    journal = drill.journal()
    assert not any("remote.drill.service" in " ".join(e.get("argv") or []) and "stop" in (e.get("argv") or [])
                   for e in journal)
    assert not any(e.get("decision") for e in journal)  # nothing changed a host, so nothing was asked
    assert len(drill.job_dirs("ct200", "extract")) == 1 and not drill.job_dirs("ct129", "extract")
    zero = read_json(drill.runs / run_id / "results" / "results.json")
    # The window route on the same drill: same states on the same kernels, so the same numbers.
    window = drill.run_cli("run", "--headless", "--yes", "--route", "window")
    assert window.returncode == EXIT_DONE, window.stdout + window.stderr
    store_ids = sorted(p.name for p in drill.runs.iterdir())
    windowed = read_json(drill.runs / store_ids[-1] / "results" / "results.json")
    # Its stop question names the route that never stops the server, with one downtime figure: the forecast.
    asked = next(e for e in RunStore(drill.runs).open(store_ids[-1]).read_journal()
                 if e.get("kind") == "question" and e.get("step") == "stop")
    impact = asked["data"]["impact"]
    assert "the alternative: zero-downtime: extract on ct200 GPU7" in impact and "never stopped" in impact
    assert impact.count("forecast downtime") == 1 and "would stop the server" not in impact, impact
    for name in ("reference", "candidate"):
        assert zero["drafters"][name]["tau"] == windowed["drafters"][name]["tau"]
        assert zero["drafters"][name]["pos1_acc"] == windowed["drafters"][name]["pos1_acc"]


def test_the_pause_route_gives_the_memory_back_and_never_stops_the_server(drill: Drill) -> None:
    """Issue 26 on `drill up`'s config: the same server process throughout; only the KV cache and
    the CUDA graphs released, seen leaving the GPUs and coming back; one pause, one continue; the
    runs table's downtime is pause -> continue."""
    pid = drill.service_pid()
    done = drill.run_cli("run", "--headless", "--yes", "--route", "pause")
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    assert drill.service_pid() == pid  # never stopped
    run_id, state = drill.only_run()
    svc = state["service"]
    assert state["route"] == "pause" and svc["stops"] == svc["starts"] == 0
    assert [state["steps"][s]["status"] for s in ("pause", "release", "free-vram", "extract", "resume", "continue",
                                                   "evaluate", "report")] == ["done"] * 8
    assert svc["released_tags"] == ["kv_cache", "cuda_graph"] and svc["released"] == [] and not svc["paused"]
    assert svc["pauses"] == svc["continues"] == 1 and svc["releases"] == svc["resumes"] == 1
    assert svc["paused_at"] < svc["released_at"] < svc["resumed_at"] < svc["continued_at"]
    before, after = svc["used_before_release_mib"], svc["used_after_release_mib"]
    assert all(after[g] < before[g] for g in before), (before, after)  # the simulated GPUs saw it leave
    journal = " ".join(e["message"] for e in drill.journal())
    assert 'POST /release_memory_occupation {"tags": ["kv_cache", "cuda_graph"]}' in journal
    (summary,) = RunStore(drill.runs).summaries()
    assert summary.route == "pause" and summary.downtime_s == svc["continued_at"] - svc["paused_at"]
    assert not summary.server_paused and not summary.service_down


def test_a_server_restarted_while_paused_is_named_and_never_resumed(drill: Drill) -> None:
    """Issue 40, as the drill found it: a pause-route console killed while the server is paused and its
    KV cache released (the give-back's question unanswered), the server restarted with its own stop
    and start commands, then `run --resume`. The new process has released nothing: nothing is
    resumed or continued on it (SGLang would die on the resume: `KeyError: 'kv_cache'`); the run
    names both processes, says the window's memory came back by the restart, and finishes."""
    service = drill.config.service
    console = subprocess.Popen([ENTRY_POINT, "run", "--headless", "--step", "--route", "pause", "--config",
                                str(drill.config_path), "--runs", str(drill.runs)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env())
    said = Said(console)
    for answered in range(2):  # pause, release: yes; the third question (the resume) stays unanswered
        said.wait_for(lambda text, n=answered: text.count("Proceed?") > n)
        console.stdin.write("y\n")
        console.stdin.flush()
    said.wait_for(lambda text: text.count("Proceed?") == 3 and "give the server its memory back" in text)
    paused_pid = drill.service_pid()
    kill(console)
    run_id, state = drill.only_run()
    assert state["service"]["released"] == ["kv_cache", "cuda_graph"] and state["service"]["paused"], state["service"]
    for command in (service.stop, service.start):  # the server's own commands, outside the run
        drill.service_command(command)
    wait_status(service.url + "/health", 200, timeout=60)
    restarted_pid = drill.service_pid()
    assert restarted_pid not in (None, paused_pid)
    done = drill.run_cli("run", "--headless", "--yes", "--resume", run_id)
    assert done.returncode == EXIT_DONE, done.stdout + done.stderr
    assert drill.service_pid() == restarted_pid  # alive: never sent a resume of memory it never released
    logs = Path(service.log[-1]).parent
    assert not any("KeyError" in log.read_text() for log in logs.glob("standin*.log"))
    svc = RunStore(drill.runs).open(run_id).state.service
    assert svc.restarted_outside == f"pid {restarted_pid} now, pid {paused_pid} when paused", svc.restarted_outside
    assert not svc.held and svc.resumes == 0 and svc.continues == 0
    assert "the window's memory came back by that restart" in " ".join((done.stdout + done.stderr).split())
    journal = [e["message"] for e in drill.journal()]
    assert not any(m.startswith("POST /resume_memory_occupation") for m in journal), journal


class Said:
    """A console's output as it comes (read in a thread: its questions end without a newline)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.text, self._more = proc, "", threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while chunk := os.read(self.proc.stdout.fileno(), 4096):
            with self._more:
                self.text += chunk.decode(errors="replace")
                self._more.notify_all()
        with self._more:
            self._more.notify_all()

    def wait_for(self, seen: Callable[[str], bool], timeout: float = 180) -> None:
        with self._more:
            if not self._more.wait_for(lambda: seen(self.text) or self.proc.poll() is not None, timeout):
                raise TimeoutError(self.text[-3000:])
            assert seen(self.text), f"the console exited ({self.proc.returncode}) first:\n{self.text[-3000:]}"


def test_a_host_without_room_is_not_proposed_and_the_route_refused(drill: Drill) -> None:
    gpu_file = Path(drill.config.hosts["ct200"].workdir) / "simulated-gpu.json"
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # Someone else's job takes the free GPU and what the training run left on the others.
        simgpu.hold(gpu_file, holder.pid, 97800, gpus=[7])
        simgpu.hold(gpu_file, other.pid, 6850, gpus=[0, 1, 2, 3, 4, 5, 6])  # not even a split has room
        time.sleep(1.5)
        pid = drill.service_pid()
        done = drill.run_cli("run", "--headless", "--yes", "--route", "zero-downtime")
        assert done.returncode == EXIT_FAILED
        text = " ".join(done.stderr.split())
        assert "the zero-downtime route needs a host with room" in text
        assert "the freest GPU (GPU7) has 87 MiB free and all of them together 309 MiB usable" in text
        assert drill.service_pid() == pid
    finally:
        for proc in (holder, other):
            proc.kill()
            proc.wait()


def two_host_config(tmp_path: Path, target: Path, copy_on: str = "ct300", extra_host: str | None = None):
    """A real config file: the service on ct129, the drafters on ct200, a copy of the target on `copy_on`."""
    extra = f'[hosts.{extra_host}]\naddress = "{extra_host}"\n' if extra_host else ""
    path = tmp_path / "ops.toml"
    path.write_text(f'''
[hosts.ct129]
address = "ct129"
[hosts.ct200]
address = "ct200"
{extra}[service]
host = "ct129"
unit = "sglang"
[target]
model_path = "{target}"
paths = {{ {copy_on} = "{target}" }}
[[drafters]]
name = "ref"
host = "ct200"
path = "/d"
''')
    return load_config(path)


def gpu_sample(host: str, used: list[int], total: int = 49140) -> TelemetrySample:
    """One telemetry sample of `host`: a GPU per entry of `used` (MiB), each `total` MiB."""
    gpus = tuple(GpuReading(i, "GPU", None, u, total, 0.0, 30.0, 50.0) for i, u in enumerate(used))
    return TelemetrySample(host, 1, time.time(), 1.0, "nvml", False, None, gpus, ())


def test_no_weights_or_other_kernels_are_not_proposed(tiny_target: Path, tmp_path: Path) -> None:
    # Probes from the real producer, on the tiny target; the training host's kernels then differ
    # in one function (the story's causal-conv1d missing on one host).
    facts = probe.probe(str(tiny_target))
    other = {**facts, "kernels": {**facts["kernels"], "bound": {**facts["kernels"]["bound"],
                                                                "causal_conv1d_fn": "causal_conv1d.cpp_functions"}}}
    config = two_host_config(tmp_path, tiny_target, extra_host="ct300")
    samples = {"ct129": gpu_sample("ct129", [47000, 47000]), "ct200": gpu_sample("ct200", [0]),
               "ct300": gpu_sample("ct300", [0])}
    fits = {f.host: f for f in where_it_fits(config, {"ct129": facts, "ct200": facts, "ct300": other}, samples, 500, 3)}
    assert not fits["ct129"].proposed and "serves the model" in fits["ct129"].why
    assert not fits["ct200"].proposed and "the target's weights are not on ct200" in fits["ct200"].why
    assert not fits["ct300"].proposed and "binds other kernels than ct200" in fits["ct300"].why
    assert "causal_conv1d_fn" in fits["ct300"].why
    same = where_it_fits(config, {"ct129": facts, "ct200": facts, "ct300": facts}, samples, 500, 3)
    assert [f.host for f in same if f.proposed] == ["ct300"]


def test_a_gpu_taken_during_the_route_stops_the_extraction_and_offers_the_window(drill: Drill) -> None:
    gpu_file = Path(drill.config.hosts["ct200"].workdir) / "simulated-gpu.json"
    pid = drill.service_pid()
    console = drill.start_cli("run", "--headless", "--yes", "--route", "zero-downtime")
    thief = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        # Taken after preflight chose GPU 7, while the completions are being cached.
        drill.wait_journal(lambda e: e["message"].startswith("started completions"), proc=console)
        simgpu.hold(gpu_file, thief.pid, 97500, gpus=[7])
        out, _ = console.communicate(timeout=240)
    finally:
        thief.kill()
        thief.wait()
    assert console.returncode == EXIT_FAILED, out
    flat = " ".join(out.split())
    assert f"GPU7 on ct200 was taken by pid {thief.pid} (97500 MiB)" in flat
    assert "The window route remains: dflash-ops run --route window" in flat
    _, state = drill.only_run()
    assert state["steps"]["extract"]["status"] == "failed" and "manifest" not in str(state["extraction"]["window"])
    handle = state["jobs"]["extract"].get("handle")
    if handle:  # started before it was stopped: it is gone now (or a zombie), never left running
        stat = Path(f"/proc/{handle['pid']}/stat")
        assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"), \
            [e["message"] for e in drill.journal()][-8:]
    assert drill.service_pid() == pid  # the server was never touched


def test_a_target_too_big_for_one_free_gpu_is_split_over_several(tiny_target: Path, tmp_path: Path) -> None:
    facts = probe.probe(str(tiny_target))
    gib = 1 << 30
    big = {**facts, "model": {**facts["model"], "tensor_bytes": 52 * gib}}  # the story's 52 GB target
    config = two_host_config(tmp_path, tiny_target, copy_on="ct200")
    # ct200: eight 95 GiB GPUs, six busy training, two with ~30 GiB free each: no one GPU has 52 GB.
    used = [97000] * 6 + [62000, 63000]
    samples = {"ct129": gpu_sample("ct129", [47000, 47000]), "ct200": gpu_sample("ct200", used, total=97887)}
    fits = {f.host: f for f in where_it_fits(config, {"ct129": big, "ct200": big}, samples, 2048, 5)}
    split = fits["ct200"]
    assert split.proposed and split.gpus == (6, 7) and "split across GPU6+GPU7" in split.why
    assert split.free_mib >= split.need_mib > 52 * 1024
    samples["ct200"] = gpu_sample("ct200", [97000] * 6 + [80000, 80000], total=97887)
    (short,) = [f for f in where_it_fits(config, {"ct129": big, "ct200": big}, samples, 2048, 5) if f.host == "ct200"]
    assert not short.proposed and "all of them together" in short.why
