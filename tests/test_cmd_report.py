"""`dflash-ops report RUN_DIR` on the output of a real `remote.evaluate` run (copying drafter as the
reference, a random drafter beside it), with a real parity report and real probes beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from console.cli.main import main
from console.views.tables import ratio_text
from tests.tui.rundir import evaluation, parity


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An evaluation output directory written by the real evaluator (in-process, on CPU)."""
    return evaluation(tmp_path_factory.mktemp("report"))


def report_warnings(run_dir: Path) -> list[str]:
    warnings = json.loads((run_dir / "report.json").read_text())["warnings"]
    assert any("off-policy" in w for w in warnings)
    return warnings


@pytest.fixture(autouse=True)
def wide_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "220")


def test_report_prints_tables_and_writes_exports(run_dir: Path, tmp_path: Path, fake_probes: dict,
                                                 capsys: pytest.CaptureFixture[str]):
    results = json.loads((run_dir / "results.json").read_text())
    (run_dir / "parity.json").write_text(json.dumps(parity(tmp_path)))
    (run_dir / "probes.json").write_text(json.dumps({"format": "dflash-ops.probes/1", "hosts": fake_probes,
                                                     "failed": {}}))

    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "copy (reference)" in line)
    assert "random" in header and header.index("copy (reference)") < header.index("random")
    tau_random = results["drafters"]["random"]["tau"]["vanilla"]["macro"]
    vanilla = next(line for line in out.splitlines() if "tau vanilla (macro" in line)
    assert "16.00" in vanilla and ratio_text(tau_random, 16.0) in vanilla  # the copying drafter's tau = B
    assert "prompt00" in out and "j=15" in out and "100.0%" in out
    assert "Hidden-state parity per layer" in out and "-1.000000000000" in out
    assert "Kernels on both hosts" in out and "torch fallback" in out
    # every tau labelled: SpecForge's number beside tau, z-lab's histogram drawn, g != x flagged with its meaning
    assert "simulated_acc_len (SpecForge: teacher-forced, no bonus; not tau)" in out
    assert "share of vanilla rounds accepting exactly r draft tokens (z-lab histogram)" in out and "r=15" in out
    assert "Layer provenance per drafter" in out and "Feature soundness per extracted layer" in out
    assert "Feature soundness of both parity runs" in out
    warning = next(line for line in out.splitlines() if "g != x on" in line)
    assert "above 2%" in warning and "(!)" in next(line for line in out.splitlines() if "g != x (serving" in line)
    assert report_warnings(run_dir)

    markdown = (run_dir / "report.md").read_text()
    assert "## Summary" in markdown and "| metric | copy (reference) | random |" in markdown
    assert ratio_text(tau_random, 16.0) in markdown
    assert "| 2 (!) |" in markdown  # the flipped layer is flagged
    assert "## Kernels" in markdown and "| causal_conv1d_fn (!) |" in markdown
    report = json.loads((run_dir / "report.json").read_text())
    assert report["format"] == "dflash-ops.report/1" and report["results"] == results
    assert report["tables"]["summary"]["headers"][1:] == ["copy (reference)", "random"]
    # the argmax row comes from what remote.parity really writes (argmax_agreement): same g on both sides
    assert report["tables"]["parity"]["flagged"] == [False, True, False]
    assert report["tables"]["parity"]["rows"][-1][0].startswith("argmax g, whole output (")
    assert report["tables"]["parity"]["rows"][-1][-1] == "100.0%"
    assert report["tables"]["parity_soundness"]["rows"] and not any(report["tables"]["parity_soundness"]["flagged"])
    assert report["tables"]["provenance"]["rows"][0][:2] == ["copy", "[1, 2]"]
    assert report["tables"]["soundness"]["rows"] and not any(report["tables"]["soundness"]["flagged"])
    assert set(report["probes"]) == {"inference", "training"}


def test_results_json_path_is_accepted_too(run_dir: Path, capsys: pytest.CaptureFixture[str]):
    for name in ("parity.json", "probes.json"):
        (run_dir / name).unlink(missing_ok=True)
    assert main(["report", str(run_dir / "results.json")]) == 0
    out = capsys.readouterr().out
    assert "copy (reference)" in out and "Hidden-state parity" not in out
    assert "## Kernels" not in (run_dir / "report.md").read_text()


def test_incomplete_or_missing_runs_are_refused_in_one_line(run_dir: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]):
    assert main(["report", str(tmp_path / "nope")]) == 2
    assert "nope: no such directory" in capsys.readouterr().err

    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "results.json").write_text((run_dir / "results.json").read_text())  # no manifest: interrupted
    assert main(["report", str(partial)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no manifest.json: the output is incomplete" in err
    assert not (partial / "report.md").exists()


def test_a_runs_own_directory_is_reported_from_its_results(run_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]):
    """`report RUNS/<id>` (what `runs` lists) reads the run's results/ and refreshes its report beside
    state.json, as the engine's report step writes it; a bare id is looked up in --runs."""
    from tests.tui.rundir import RUN_ID, build_run

    runs = tmp_path / "runs"
    directory = build_run(runs, run_dir)
    assert main(["report", str(directory)]) == 0
    out = capsys.readouterr().out
    assert "copy (reference)" in out and "tau vanilla (macro" in out
    assert f"wrote {directory / 'report.md'}" in out
    # the window, forecast against measured, on the terminal as in report.md (issue 28: report.md only)
    lines = out.splitlines()
    assert any("Window: forecast against measured" in line for line in lines), out
    for phase, forecast, measured in (("stop", "11 s", "4.0 s"), ("start", "1 min 50 s", "1 min 36 s"),
                                      ("downtime", "3 min 14 s", "3 min 14 s")):
        assert any(phase in line and forecast in line and measured in line for line in lines), (phase, out)
    report = json.loads((directory / "report.json").read_text())
    assert report["run_dir"] == str((directory / "results").resolve())
    assert "## Summary" in (directory / "report.md").read_text()

    assert main(["report", RUN_ID, "--runs", str(runs)]) == 0
    assert "copy (reference)" in capsys.readouterr().out


def test_a_run_without_results_is_refused_saying_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from console.procedure.store import RunStore

    run = RunStore(tmp_path / "runs").create(None, None)
    assert main(["report", str(run.dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(run.dir) in err and "no results yet" in err and "running" in err
    assert f"`dflash-ops run --resume {run.run_id}` continues it" in err


@pytest.mark.parametrize("status", ["failed", "refused", "cancelled", "discarded"])
def test_a_finished_run_without_results_is_never_advised_a_resume(tmp_path: Path, status: str,
                                                                  capsys: pytest.CaptureFixture[str]):
    """One rule for finished runs (issue 27, item 10): `report` says what `run --resume` does with it,
    as `run` and `status` do: a finished run is never resumed (the command would refuse)."""
    from console.procedure.store import RunStore

    run = RunStore(tmp_path / "runs").create(None, None)
    run.state.status = status
    run.save()
    assert main(["report", str(run.dir)]) == 2
    err = capsys.readouterr().err
    assert "--resume" not in err and f"run {run.run_id} ended {status}: a finished run is never resumed" in err
    run.state.service.down, run.state.service.stopped_at = True, 1.0  # it left the service down: only the restart
    run.save()
    assert main(["report", str(run.dir)]) == 2
    err = capsys.readouterr().err
    assert f"`dflash-ops run --resume {run.run_id}` restarts the service (a finished run is never run again)" in err


@pytest.mark.parametrize("columns", [None, "40", "80"], ids=["piped", "40", "80"])
def test_piped_or_narrow_the_summary_keeps_drafter_names_and_taus_whole(run_dir: Path, columns: str | None):
    """Through a pipe (rich's 80 columns, no terminal anywhere) or on a 40- or 80-column terminal,
    the summary never cuts a drafter's name or its tau (the issue's `8.… │ 2.…`)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"} | ({"COLUMNS": columns} if columns else {})
    done = subprocess.run([str(Path(sys.executable).parent / "dflash-ops"), "report", str(run_dir)], env=env,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    results = json.loads((run_dir / "results.json").read_text())
    lines = done.stdout.splitlines()
    for name, metrics in results["drafters"].items():
        assert any(name in line for line in lines)
        tau = metrics["tau"]["vanilla"]
        assert any(f"{tau['macro']:.2f} [{tau['ci95'][0]:.2f}, {tau['ci95'][1]:.2f}]" in line for line in lines), name
    assert "…" not in done.stdout


def test_without_a_run_dir_the_latest_run_is_reported(run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture[str]):
    """Issue 43 (low): `report` needed an argument; without one it reports the store's latest run."""
    from console.procedure.store import STATE
    from tests.tui.rundir import RUN_ID, build_run

    runs = tmp_path / "runs"
    assert main(["report", "--runs", str(runs)]) == 2  # an empty store: said in one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no run in {runs}: give RUN_DIR" in err
    older = runs / "20251130-080000-0000"
    older.mkdir(parents=True)
    (older / STATE).write_text("{}")  # older than RUN_ID: not the one reported
    directory = build_run(runs, run_dir)
    monkeypatch.setenv("DFLASH_OPS_RUNS", str(runs))
    assert main(["report"]) == 0
    captured = capsys.readouterr()
    assert f"the latest run: {RUN_ID} ({directory})" in captured.err
    assert "copy (reference)" in captured.out and f"wrote {directory / 'report.md'}" in captured.out
