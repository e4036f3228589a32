"""The `dflash-ops` command line: through the installed entry point, and in-process for the details."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.cli.main import main
from console.config import example_config_text
from console.procedure.steps import WINDOW as STEPS  # the engine's step table, window route

ENTRY_POINT = Path(sys.executable).parent / "dflash-ops"


def dflash_ops(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the installed console script, as a user would."""
    assert ENTRY_POINT.exists(), f"{ENTRY_POINT} missing: install the package (README line 2)"
    env = {**os.environ, "COLUMNS": "160", "NO_COLOR": "1"}
    return subprocess.run([str(ENTRY_POINT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=60)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_init_then_check_prints_the_plan(tmp_path: Path) -> None:
    init = dflash_ops("config", "init", cwd=tmp_path)
    assert init.returncode == 0, init.stderr
    written = tmp_path / "dflash-ops.toml"
    assert written.read_text() == example_config_text()

    check = dflash_ops("config", "check", cwd=tmp_path)
    assert check.returncode == 0, check.stderr
    out = check.stdout
    assert "ct129" in out and "ct200" in out and "sglang-qwen" in out
    assert "auto: from drafter configs at run time" in out
    assert "fizzbuzz" in out and "matrix_multiply" in out
    for step in STEPS:
        assert step in out
    assert out.rstrip().endswith("dflash-ops.toml: OK")


def test_check_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    config = tmp_path / "ops.toml"
    config.write_text(example_config_text().replace("address = ", "adress = ", 1))
    assert_one_line_error(
        dflash_ops("config", "check", "--config", str(config), cwd=tmp_path),
        "unknown key `hosts.ct129.adress`", "did you mean `address`?",
    )
    assert_one_line_error(dflash_ops("config", "check", cwd=tmp_path), "dflash-ops.toml: no such file")
    assert_one_line_error(dflash_ops("config", "frobnicate", cwd=tmp_path), "invalid choice: 'frobnicate'")


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "sub" / "my.toml"
    assert main(["config", "init", str(path)]) == 0
    path.write_text("# my edits\n")
    assert main(["config", "init", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"dflash-ops: error: {path}: already exists; use --force to overwrite it\n"
    assert path.read_text() == "# my edits\n"
    assert main(["config", "init", "--force", str(path)]) == 0
    assert path.read_text() == example_config_text()
    assert [p.name for p in path.parent.iterdir()] == ["my.toml"]  # no temporary left behind


def test_init_into_a_directory_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "init", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_check_reports_bad_values_with_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ops.toml"
    config.write_text(example_config_text().replace("budgets = [8, 16, 64]", 'budgets = [8, "16", 64]'))
    assert main(["config", "check", "--config", str(config)]) == 2
    assert capsys.readouterr().err == (
        f'dflash-ops: error: {config}: `eval.budgets[1]`: expected a positive integer, found "16" (a string)\n'
    )


def test_check_reports_syntax_errors_with_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "ops.toml"
    config.write_text('[hosts.a]\naddress = "a"\nuser = root\n')
    assert main(["config", "check", "--config", str(config)]) == 2
    assert capsys.readouterr().err.startswith(f"dflash-ops: error: {config}, line 3, column ")


def test_no_command_shows_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "config" in capsys.readouterr().err


def test_usage_errors_exit_2_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "check", "--nope"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --nope" in err


def test_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "init" in out and "check" in out


# --- run --headless --step: the questions on the terminal ------------------------------------------

ASK_TWICE = """
import asyncio, signal, sys
# As a process started from a shell: Ctrl-C's default handler, the signal not blocked (a test
# process that ran other tests before may pass on what they left; CI saw SIGINT never arrive).
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
from console.messages import Confirmation
from console.procedure.decider import TerminalDecider

stop = Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang"), "goes down", True)
start = Confirmation("restart", "start the service", "ct129", ("systemctl", "start", "sglang"), "comes back", False)

async def main():
    decider = TerminalDecider()
    try:
        await decider.decide(stop)
    except asyncio.CancelledError:  # Ctrl-C under the question: the run's compensation asks the restart
        print("cancelled", flush=True)
        print(f"restart answered {await decider.decide(start)}", flush=True)

asyncio.run(main())
print("exited", flush=True)
"""


def test_ctrl_c_under_a_question_leaves_the_next_answer_to_the_next_question(tmp_path: Path) -> None:
    """A real process, a real pipe for stdin, a real SIGINT: the restart question asked after the
    Ctrl-C gets the operator's answer, and the process exits (no reader left blocking the exit)."""
    import select
    import signal

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    child = subprocess.Popen([sys.executable, "-c", ASK_TWICE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    read: dict[int, str] = {}  # per stream: what came so far
    taken: dict[int, int] = {}  # per stream: how much of it an earlier wait consumed

    def until(fragment: str, stream) -> str:
        """What the stream printed after the last wait, up to and including `fragment`."""
        fd = stream.fileno()
        while fragment not in read.get(fd, "")[taken.get(fd, 0):]:
            ready, _, _ = select.select([stream], [], [], 60)
            assert ready, f"no {fragment!r} from the child; so far: {read!r}"
            chunk = os.read(fd, 4096).decode()
            assert chunk, f"the child ended before {fragment!r}: {read!r}"
            read[fd] = read.get(fd, "") + chunk
        start = taken.get(fd, 0)
        end = read[fd].index(fragment, start) + len(fragment)
        taken[fd] = end
        return read[fd][start:end]

    try:
        assert "systemctl stop sglang" in until("Proceed?", child.stderr)
        child.send_signal(signal.SIGINT)
        until("cancelled", child.stdout)
        assert "systemctl start sglang" in until("Proceed?", child.stderr)
        child.stdin.write("y\n")
        child.stdin.flush()
        assert until("restart answered", child.stdout) and until("\n", child.stdout).strip() == "True"
        until("exited", child.stdout)
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()


def test_a_question_pauses_the_progress_bars_and_stands_on_its_own_lines() -> None:
    """The headless view's bars stop while the question waits (nothing redraws over it), and start
    again once it is answered."""
    import asyncio
    import io

    from rich.console import Console

    from console.messages import Confirmation, JobProgress
    from console.procedure.decider import TerminalDecider
    from console.session import MessageBus
    from console.views.headless import HeadlessView

    screen = io.StringIO()
    bus = MessageBus()
    view = HeadlessView(bus, Console(file=screen, force_terminal=True, width=100))
    bus.publish(JobProgress("extract-1", "extract", "ct129", 4, 10, "prompts", rate=0.4, key="prompts"))
    live_while_asked: list[bool] = []
    printed_before_answer: list[str] = []
    question = Confirmation("stop", "stop the service", "ct129", ("systemctl", "stop", "sglang-qwen"),
                            "SGLang on ct129 goes down", True)

    async def ask() -> bool:
        from prompt_toolkit.input import create_pipe_input

        with create_pipe_input() as keys:
            asked = asyncio.create_task(TerminalDecider(input=keys, out=screen).decide(question))
            while "Proceed?" not in screen.getvalue():
                await asyncio.sleep(0.01)
            live_while_asked.append(view.progress.live.is_started)
            printed_before_answer.append(screen.getvalue())
            keys.send_text("y\r")
            return await asked

    try:
        assert asyncio.run(ask()) is True
        assert view.progress.live.is_started  # the bars are back after the answer
    finally:
        view.close()
    assert live_while_asked == [False]
    shown = printed_before_answer[0]
    question_at = shown.rindex("stop: stop the service on ct129")
    assert shown[question_at - 1] == "\n"  # on a line of its own, not after a bar's frame
    tail = shown[question_at:]
    assert "command: systemctl stop sglang-qwen" in tail and tail.rstrip().endswith("[c]ontinue without asking:")


def test_the_drill_asset_build_reports_its_stages_as_it_goes(tmp_path: Path) -> None:
    """`ensure_assets` hands each line the build writes to `on_progress` (a stand-in builder that
    writes two stage lines and a complete entry); on a terminal `build_progress` shows them."""
    import io
    import json as json_

    from rich.console import Console

    from console.drill.assets import FORMAT, ensure_assets
    from console.views.headless import build_progress

    builder = tmp_path / "python"
    builder.write_text("#!/bin/sh\n# called as: python -m remote.drill.assets OUT\n"
                       "echo 'building the tiny target' >&2\necho 'fitting the reference and candidate drafters'\n"
                       f"echo '{json_.dumps({'format': FORMAT, 'drafters': {'reference': {'fit_check_tau': 3.0}}})}' "
                       '> "$3/assets.json"\n')
    builder.chmod(0o755)
    stages: list[str] = []
    assets = ensure_assets(python=str(builder), root=tmp_path / "cache", say=lambda msg: None, on_progress=stages.append)
    assert stages == ["building the tiny target", "fitting the reference and candidate drafters"]
    assert (assets.root / "assets.json").is_file()

    screen = io.StringIO()
    with build_progress("building the drill's assets", Console(file=screen, force_terminal=True, width=100)) as tell:
        for line in stages:
            tell(line)
    shown = screen.getvalue()
    assert "building the tiny target" in shown and "fitting the reference and candidate drafters" in shown


def test_the_drill_asset_build_shows_a_bar_and_the_time_left_once_it_counts(tmp_path: Path) -> None:
    """Issue 43 item 15: the drafters' fit (most of the build's two minutes) writes `[done/total]
    what` lines; the build line turns them into a bar, the count and the time left at the pace so far
    (10 s per 20 Adam steps here: 300 of 800 done after 150 s, so 250 s left)."""
    import io

    from rich.console import Console

    from console.views.headless import build_progress
    from remote.drill.assets import _progress_line

    now = [0.0]
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=140)
    with build_progress("building the drill's assets", console, clock=lambda: now[0]) as tell:
        tell("building the tiny target")
        for done in range(20, 320, 20):
            now[0] += 10.0
            tell(f"[{done}/800] fitting the reference drafter")
    shown = screen.getvalue()
    assert "fitting the reference drafter (300/800)" in shown, shown[-600:]
    assert "about 4 min 10 s left" in shown, shown[-600:]
    assert "━" in shown  # the bar

    import contextlib

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        _progress_line(40, 800, "fitting the reference drafter")
    assert err.getvalue() == "[40/800] fitting the reference drafter\n"  # the line the bar reads


def test_the_jobs_summary_keeps_every_size_rate_and_label_whole_at_any_width() -> None:
    """Piped (80 columns), the jobs' summary read `559.2 KiB / …` and `3500.3…`: rich's columns cut
    the values. Each value stays whole at any width: the bar shrinks, then values go to the next line."""
    import io

    from hypothesis import given, settings
    from hypothesis import strategies as st
    from rich.console import Console

    from console.messages import JobProgress
    from console.session import MessageBus
    from console.views.headless import HeadlessView

    @settings(max_examples=40, deadline=None)
    @given(width=st.integers(30, 200), label=st.sampled_from(["linked_list_reverse", "async_rate_limiter", ""]))
    def check(width: int, label: str) -> None:
        screen = io.StringIO()
        bus = MessageBus()
        view = HeadlessView(bus, Console(file=screen, width=width, no_color=True))
        bus.publish(JobProgress("x-1", "extract", "ct129", 572620.8, 572620.8, "bytes", rate=3500.3 * 1024, key="bytes"))
        bus.publish(JobProgress("x-1", "extract", "ct129", 33, 33, "tensors", rate=3500.3, key="tensors"))
        bus.publish(JobProgress("x-1", "extract", "ct129", 7, 10, "prompts", rate=1.2, message=label, key="prompts"))
        view.close()
        out = screen.getvalue()
        lines = out.splitlines()
        assert "…" not in out and all(len(line) <= width for line in lines), out
        for value in ("559.2 KiB / 559.2 KiB", "3.4 MiB/s", "33/33", "3500.3 tensors/s", "7/10", "1.2 prompts/s",
                      "ct129 extract bytes", label):
            assert any(value in line for line in lines), (value, out)

    check()


@contextlib.contextmanager
def drill_up(drill: Path) -> Iterator[subprocess.Popen]:
    """A drill that `console.drill.hosts` finds up in `drill`: its config, state and a live process
    named as the hosts' process is (its module and directory on its command line); ended after."""
    import json

    drill.mkdir()
    (drill / "dflash-ops.toml").write_text(example_config_text())
    hosts = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "console.drill.hosts", str(drill)])
    try:
        (drill / "drill.pid").write_text(str(hosts.pid))
        (drill / "drill.json").write_text(json.dumps({"state": "ready", "pid": hosts.pid}))
        yield hosts
    finally:
        hosts.kill()
        hosts.wait()


def test_a_missing_config_names_the_drill_that_is_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 43.13: after the drill, in a fresh directory, `status`, `run --plan` and `config check`
    said "write an example with `config init`": they name the drill's config while a drill is up."""
    drill = tmp_path / "drill"
    with drill_up(drill) as hosts:
        monkeypatch.setenv("DFLASH_OPS_DRILL_DIR", str(drill))
        monkeypatch.setenv("DFLASH_OPS_RUNS", str(tmp_path / "runs"))
        fresh = tmp_path / "fresh"
        fresh.mkdir()
        for args in (("status",), ("run", "--plan"), ("config", "check")):
            assert_one_line_error(dflash_ops(*args, cwd=fresh), "dflash-ops.toml: no such file; a drill is up",
                                  f"--config {drill / 'dflash-ops.toml'}")
        hosts.kill()
        hosts.wait()
        assert_one_line_error(dflash_ops("config", "check", cwd=fresh), "write an example with `dflash-ops config init")
        assert "drill" not in dflash_ops("config", "check", cwd=fresh).stderr


def test_crosscheck_help_names_the_runs_variable(capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43 (low): `crosscheck --help` omitted `$DFLASH_OPS_RUNS`, which its store honours."""
    with pytest.raises(SystemExit) as info:
        main(["crosscheck", "--help"])
    assert info.value.code == 0
    assert "$DFLASH_OPS_RUNS" in " ".join(capsys.readouterr().out.split())


def test_drill_down_says_what_it_ended(tmp_path: Path) -> None:
    """Issue 43 (low): `drill down` printed only "drill down". It names what it ended: the hosts'
    process, and what an earlier drill left running; or that nothing was up."""
    from console.drill.procs import MARK_ENV, mark_value

    drill = tmp_path / "drill"
    with drill_up(drill) as hosts:
        done = dflash_ops("drill", "down", "--dir", str(drill), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"drill down: ended the rehearsal hosts (pid {hosts.pid}) ({drill})"
        assert hosts.wait(timeout=10) is not None
    left = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, MARK_ENV: mark_value(drill)})
    try:
        done = dflash_ops("drill", "down", "--dir", str(drill), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"drill down: ended 1 process(es) an earlier drill left running ({drill})"
    finally:
        left.kill()
        left.wait()
    done = dflash_ops("drill", "down", "--dir", str(drill), cwd=tmp_path)
    assert done.stdout.strip() == f"drill down: nothing was up ({drill})"
