"""`dflash-ops run` and `runs` off the happy path, through the installed entry point as a user runs
them: a damaged run store, a run store on a full filesystem (a real 64 KiB tmpfs), and output read
through a pipe or on a narrow terminal (ids, taus and commands never cut)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.cli.main import main
from console.procedure.store import STATE, RunStore
from tests.cli_hosts import ThreadedHosts, write_config
from tests.small_fs import fill, small_filesystem
from tests.tui.rundir import build_run, evaluation

ENTRY_POINT = str(Path(sys.executable).parent / "dflash-ops")
GOOD = ("20261201-090000-aa01", "20261201-100000-bb02")


def dflash_ops(*args: str, columns: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The entry point with stdout piped; `columns`: as a terminal that wide reports (None: a pipe
    with no terminal anywhere, what rich sees in CI or under `| less` from a script)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["NO_COLOR"] = "1"
    if columns is not None:
        env["COLUMNS"] = str(columns)
    return subprocess.run([ENTRY_POINT, *args], capture_output=True, text=True, timeout=timeout, env=env,
                          stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two finished runs as the engine leaves them (a real evaluation in results/), long drafter
    names so that a narrow table would cut them."""
    root = tmp_path_factory.mktemp("runs")
    evaluated = evaluation(root / "eval")
    results = json.loads((evaluated / "results.json").read_text())
    for name in ("copy", "random"):  # the evaluator's drafters, renamed as an operator names checkpoints
        results["drafters"][f"{name}-step00004000-lr3e-4"] = results["drafters"].pop(name)
    results["reference"] = "copy-step00004000-lr3e-4"
    (evaluated / "results.json").write_text(json.dumps(results))
    store = root / "store"
    for i, run_id in enumerate(GOOD):
        build_run(store, evaluated, run_id=run_id, headline_shift=0.125 * i)
    return store


def good_lines_are_whole(out: str, store: Path) -> None:
    lines = out.splitlines()
    for run_id in GOOD:
        headline = json.loads((store / run_id / STATE).read_text())["headline"]
        assert any(run_id in line for line in lines), (run_id, out)
        for name, tau in headline.items():
            assert any(f"{name} {tau:.2f}" in line for line in lines), (name, out)
    assert "…" not in out


damaged_states = st.one_of(
    st.binary(max_size=64),
    st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                 lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                 max_leaves=6).map(lambda value: json.dumps(value).encode()),
    st.sampled_from([b"[]", b"null", b'{"format": "dflash-ops.run/9", "run_id": "x"}',
                     b'{"format": "dflash-ops.run/2", "run_id": 7, "steps": []}']),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=damaged_states, columns=st.sampled_from([40, 80, 200]))
def test_runs_lists_an_unreadable_run_as_such_and_the_others_whole(runs_dir: Path, content: bytes, columns: int,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    damaged = runs_dir / "20261201-110000-cc03"
    damaged.mkdir(exist_ok=True)
    (damaged / STATE).write_bytes(content)
    monkeypatch.setenv("COLUMNS", str(columns))
    try:
        assert main(["runs", "--runs", str(runs_dir)]) == 0
    finally:
        shutil.rmtree(damaged)
    out = capsys.readouterr().out
    good_lines_are_whole(out, runs_dir)
    (line,) = [line for line in out.splitlines() if line.startswith("unreadable run")]
    assert line.startswith(f"unreadable run {damaged.name}: {damaged / STATE}")


def test_runs_piped_keeps_every_id_and_tau_whole(runs_dir: Path) -> None:
    for columns in (None, 40):
        done = dflash_ops("runs", "--runs", str(runs_dir), columns=columns)
        assert done.returncode == 0, done.stderr
        good_lines_are_whole(done.stdout, runs_dir)


def test_runs_at_120_columns_is_a_table_and_its_blocks_keep_each_tau_line_whole() -> None:
    """The walk's `runs` at 120 columns fell back to blocks (a status "refused (console gone),
    SERVICE DOWN" made the table too wide) whose second tau line started at column 0. The status
    wraps between its words; where blocks are drawn (80 columns), each tau line is indented alike."""
    import io

    from rich.console import Console

    from console.cli.run import runs_rows
    from console.procedure.store import RunSummary
    from console.views.tables import FittedTable

    summaries = [
        RunSummary("20261202-051437-77bc", 1_764_652_477.0, "refused", "window", 626.4,
                   {"candidate": 2.69, "reference": 8.0}, None, Path("/x"), service_down=True, console_gone=True,
                   online={"reference": 8.0}, forecast_s=38.0, windows=2),
        RunSummary("20261202-052118-84c8", 1_764_652_878.0, "done", "window", 26.4,
                   {"candidate": 2.69, "reference": 8.0}, None, Path("/x"), online={"reference": 8.0}, forecast_s=16.0,
                   forecast_error=-0.184, answers_s=6.8),  # the forecast's error, the answers apart (issue 43)
    ]

    def shown(width: int) -> list[str]:
        out = io.StringIO()
        Console(file=out, width=width, no_color=True).print(
            FittedTable(runs_rows(summaries), "runs in /store", justify="left", wrap=(2,)))
        return out.getvalue().splitlines()

    wide = shown(120)
    assert any(line.startswith("┏") for line in wide), "\n".join(wide)  # a table, not blocks
    assert all(len(line) <= 120 for line in wide) and "…" not in "\n".join(wide)
    for tau in ("candidate 2.69", "reference 8.00", "10 min 26 s (38 s)", "20261202-051437-77bc", "forecast -18%",
                "answering 6.8 s"):
        assert any(tau in line for line in wide), tau
    narrow = shown(60)
    taus = [line for line in narrow if line.strip() in ("candidate 2.69", "reference 8.00")]
    assert len(taus) == 4 and {len(line) - len(line.lstrip()) for line in taus} == {4}, "\n".join(narrow)
    assert any("status: refused (console gone), SERVICE DOWN" in line for line in narrow)


@pytest.fixture
def config(tmp_path: Path) -> Iterator[Path]:
    """A config of two real SSH hosts (embedded servers on loopback)."""
    rig = ThreadedHosts(tmp_path, ["ct129", "ct200"])
    try:
        yield write_config(tmp_path / "dflash-ops.toml", {name: rig.host_table(name) for name in rig.servers})
    finally:
        rig.close()


def test_resuming_an_unreadable_run_says_why_exit_2(config: Path, tmp_path: Path) -> None:
    store = tmp_path / "store"
    (store / "20261201-120000-dd04").mkdir(parents=True)
    (store / "20261201-120000-dd04" / STATE).write_bytes(b"\x00\xff not json")
    done = dflash_ops("run", "--headless", "--yes", "--resume", "20261201-120000-dd04", "--config", str(config),
                      "--runs", str(store))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(store / "20261201-120000-dd04" / STATE) in line and "not JSON" in line


@pytest.fixture(scope="module")
def offline_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A config whose hosts are never reached (what is tested is said before connecting)."""
    table = {"address": "127.0.0.1", "port": 9, "user": "nobody", "connect_timeout": 1}
    return write_config(tmp_path_factory.mktemp("offline") / "dflash-ops.toml", {"ct129": table, "ct200": table})


def a_real_state() -> bytes:
    """state.json as the store writes it for an unfinished run."""
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        run = RunStore(root).create("/etc/dflash-ops.toml", None)
        run.state.status, run.state.started = "running", True
        run.save()
        return (run.dir / STATE).read_bytes()


REAL_STATE = a_real_state()
damaged_latest = st.one_of(
    # cut mid-write (0 bytes included; the closing brace gone, not only the final newline)
    st.integers(0, len(REAL_STATE.rstrip()) - 1).map(lambda cut: REAL_STATE[:cut]),
    st.sampled_from([b"", b"[]", b"null", b"0", b'"running"']),
    st.binary(min_size=1, max_size=64),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=damaged_latest, older=st.booleans())
def test_a_damaged_latest_run_is_named_by_resume_never_passed_over(offline_config: Path, tmp_path: Path,
                                                                   content: bytes, older: bool,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`run --resume` with the latest run's state.json damaged (cut, 0 bytes, `[]`, `null`, random
    bytes): that run may be the one that left the service down, so it is named with its path and why
    (as `runs` does), never answered with "no unfinished run to resume" nor passed over for an older
    run; exit 2 before anything is connected."""
    store = tmp_path / f"store-{uuid.uuid4().hex[:6]}"
    if older:
        kept = RunStore(store).create(str(offline_config), None)
        kept.state.status = "paused"
        kept.save()
    damaged = store / "29991231-235959-ffff"  # the newest id
    damaged.mkdir(parents=True)
    (damaged / STATE).write_bytes(content)
    assert main(["run", "--headless", "--yes", "--resume", "--config", str(offline_config), "--runs", str(store)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "no unfinished run to resume" not in err
    assert f"run {damaged.name} cannot be resumed: {damaged / STATE}" in err
    if older:
        assert f"`dflash-ops run --resume {kept.run_id}` resumes the older run" in err


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A real small filesystem, filled to the last byte, created and removed by the test."""
    with small_filesystem(tmp_path / "small", size_kib=64) as mount:
        fill(mount)
        yield mount


@pytest.mark.parametrize("how", [("--headless", "--yes")], ids=["headless"])  # a plan writes no run (its own test)
def test_a_run_store_on_a_full_disk_is_named_exit_2(config: Path, full_disk: Path, how: tuple[str, ...]) -> None:
    runs = full_disk / "runs"
    done = dflash_ops("run", *how, "--config", str(config), "--runs", str(runs))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert str(runs) in line and "No space left on device" in line
    assert not RunStore(runs).readable()  # nothing half-written taken as a run


def test_plan_prints_each_command_whole_on_its_own_line_piped_and_at_40_columns(drill) -> None:
    """`run --plan` on the drill: the literal stop and start commands (longer than any terminal here)
    stand whole on lines of their own, never folded across table cells; every step is listed."""
    from console.views.plan import service_commands

    commands = service_commands(drill.config)
    for columns in (None, 40):
        done = dflash_ops("run", "--plan", "--config", str(drill.config_path), "--runs", str(drill.runs),
                          columns=columns, timeout=240)
        assert done.returncode == 0, done.stdout + done.stderr
        lines = done.stdout.splitlines()
        for verb in ("stop", "start"):
            assert f"    $ {commands[verb]}" in lines, (verb, done.stdout)
        for step in ("preflight", "stage", "cache", "stop", "free-vram", "extract", "restart", "evaluate", "report"):
            assert any(step in line for line in lines), step
        assert "…" not in done.stdout
