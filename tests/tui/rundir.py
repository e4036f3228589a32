"""A finished run directory as the engine leaves it, from the real producers: the evaluation by
`remote.evaluate` (copying drafter as the reference, a random one beside it), parity by
`remote.parity`, the state and journal through the run store, telemetry lines of real samples."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from console import messages as m
from console.procedure import forecast as fc
from console.procedure.state import RunState, StepState
from console.procedure.store import JOURNAL, TELEMETRY, Run
from remote.drafter import save_random_drafter
from remote.drill.synthetic import build_copying_setup, random_sequences, write_extraction
from remote.evaluate import main as evaluate_main
from remote.events import EventWriter
from remote.parity import compare_dirs
from tests.tui.standin import PLAN_STEPS, STOP_FORECAST, T0, gpu, sample

RUN_ID = "20251201-093500-ab12"
STOPPED, READY = T0 + 90, T0 + 284  # the service was down 3 min 14 s


def evaluation(root: Path) -> Path:
    """A real evaluation output directory (CPU, a few seconds)."""
    setup = build_copying_setup(root / "copying", block_size=16)
    random = save_random_drafter(root / "random", 34, 32, [1, 2], 4, block_size=16, mask_token_id=31, seed=3)
    out = root / "eval"
    evaluate_main(EventWriter(path=str(root / "events.jsonl")), [
        "--states", str(setup["states"]), "--target", str(setup["target"]), "--drafter", f"copy={setup['drafter']}",
        "--drafter", f"random={random}", "--reference", "copy", "--out", str(out), "--device", "cpu",
        "--budgets", "8,16"])
    return out


def parity(root: Path) -> dict:
    """A real remote.parity comparison of two extractions that differ on one layer."""
    seqs = random_sequences(2, 8, 20, 32, seed=1)
    hidden = [torch.randn(20, 2, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    a = write_extraction(root / "a", [{**s, "hidden": h} for s, h in zip(seqs, hidden, strict=True)], [1, 2], 16)
    noisy = [h.clone() for h in hidden]
    for h in noisy:
        h[:, 1] = -h[:, 1]
    b = write_extraction(root / "b", [{**s, "hidden": h} for s, h in zip(seqs, noisy, strict=True)], [1, 2], 16)
    return compare_dirs(a, b)


def _telemetry_lines() -> list[dict]:
    """ct129 over the window: serving, stopped (VRAM stuck, then freed), extracting, serving again."""
    lines = []
    for i in range(0, 400, 5):
        t = T0 + i
        if t < STOPPED:
            used = 44950
        elif t < STOPPED + 20:
            used = 40400  # stuck after the stop
        elif t < STOPPED + 40:
            used = 300
        elif t < READY - 60:
            used = 30000  # the target loaded for the extraction
        elif t < READY - 10:
            used = 300
        else:
            used = min(44950, int(44950 * (t - READY + 10) / 60))
        s = sample("ct129", [gpu(0, used), gpu(1, used)], t=t, seq=i)
        lines.append({"host": "ct129", "t": t, "sample": dataclasses.asdict(s)})
        s = sample("ct200", [gpu(j, 71000, 81559) for j in range(8)], t=t, seq=i)
        lines.append({"host": "ct200", "t": t, "sample": dataclasses.asdict(s)})
    return lines


def build_run(runs_root: Path, evaluation_dir: Path, parity_report: dict | None = None,
              run_id: str = RUN_ID, headline_shift: float = 0.0, created: float = T0) -> Path:
    """runs_root/run_id: state.json, journal.jsonl, telemetry.jsonl and results/ (the evaluation)."""
    directory = runs_root / run_id
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copytree(evaluation_dir, directory / "results", dirs_exist_ok=True)
    if parity_report is not None:
        (directory / "results" / "parity.json").write_text(json.dumps(parity_report))
    results = json.loads((directory / "results" / "results.json").read_text())
    headline = {n: d["tau"]["vanilla"]["macro"] + headline_shift for n, d in results["drafters"].items()}
    state = RunState(run_id=run_id, created_at=created, status="done", route="window", started=True,
                     headline=headline)
    t = created
    for step in PLAN_STEPS:
        took = {"stop": 4, "free-vram": 36, "restart": 96}.get(step.name, step.estimate_s or 1)
        state.steps[step.name] = StepState("done", t, t + took, work_s=took)
        t += took
    state.service.stopped_at, state.service.ready_at, state.service.stops, state.service.starts = STOPPED, READY, 1, 1
    # the forecast the stop was asked with, and the marks its phases are measured by (4 s to stop, 36 s
    # until the VRAM was free, the extraction until the GPUs were released, 96 s to start)
    state.forecast = fc.to_state(STOP_FORECAST)
    state.service.stop_returned_at, state.service.vram_free_at = STOPPED + 4, STOPPED + 40
    state.extraction.gpu_released_at = state.service.start_issued_at = READY - 96
    run = Run(directory, state)
    run.save()  # the store's own writer, as the engine saves it
    with (directory / JOURNAL).open("w") as f:
        for entry in (m.JournalEntry(T0, run_id, "stop", "stopped sglang-qwen", host="ct129"),
                      m.JournalEntry(READY, run_id, "restart", "ready after 96.0 s", host="ct129")):
            f.write(json.dumps({k: v for k, v in dataclasses.asdict(entry).items() if v is not None}) + "\n")
    with (directory / TELEMETRY).open("w") as f:
        for line in _telemetry_lines():
            f.write(json.dumps(line) + "\n")
    run.close()
    return directory
