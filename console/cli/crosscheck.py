"""`dflash-ops crosscheck RUN`: replay a run's cached prompts through the service and put the online
tau beside the offline one (`console.procedure.crosscheck`).

RUN is a run directory or a run id of the store (`--runs`). The service is reached as the console
reaches it (SSH to `[service] host`, a port forward to `[service] url`); the config is `--config`,
else the one the run was made with (by the absolute path it recorded). The run's completions.json
is fetched from the service host's window directory when the run directory lacks it. Writes
RUN/crosscheck.json (where `runs` reads the online tau) and, when the run has results, its report
again with the "Online" section. It never writes the run's state.json: that file is the engine's,
saved whole at any moment by a live engine, and a read-modify-write here would race it. Exit status 0 when the taus agree or the server does not decode speculatively,
1 when they disagree or nothing could be compared, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from console.cli.usage import UsageError
from console.config import DEFAULT_CONFIG_NAME, load_config
from console.procedure import crosscheck as cc
from console.procedure.store import STATE, RunStore
from console.service.sglang_api import ServerAnswerError, ServerUnreachable
from console.ssh.hosts import HostError

CONNECT_TIMEOUT_S = 30.0


def add_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("crosscheck", help="replay a run's cached prompts: online tau beside the offline one",
                            description="Replay a run's cached prompts through the service (greedy, same token "
                                        "ids) and put the online tau beside the offline one; writes "
                                        "RUN/crosscheck.json and the report's Online section.")
    parser.add_argument("run_dir", metavar="RUN", help="a run directory, or a run id of the store")
    parser.add_argument("--config", default=None, help="the config (default: the one the run was made with)")
    parser.add_argument("--runs", default=None, metavar="DIR",
                        help="the run store (default: the user data dir's runs/, or $DFLASH_OPS_RUNS)")
    parser.set_defaults(run=run)


def run_directory(given: str, runs: str | None) -> Path:
    """The run's directory: `given` itself when it holds a state.json, else the store's run of that id."""
    path = Path(given).expanduser()
    if (path / STATE).is_file():
        return path
    store = RunStore(runs)
    if len(path.parts) == 1 and (store.root / given / STATE).is_file():
        return store.root / given
    raise UsageError(f"{given}: not a run (no {STATE} there nor in {store.root / given})")


def read_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / STATE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{path}: not a run state ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str):
        raise UsageError(f"{path}: not a run state (no run_id)")
    return data


async def check_run(config_path: str, run_dir: Path, state: dict[str, Any]) -> cc.CrossCheck:
    from console.session import Session

    config = load_config(config_path)
    session = Session(config)
    session.start(watch_service=False)
    try:
        return await cc.crosscheck_run(session, config, run_dir, state["run_id"], state.get("facts") or {},
                                       CONNECT_TIMEOUT_S)
    finally:
        await session.stop()


def prompts_table(online: dict[str, Any]) -> Table:
    table = Table(title=f"Online vs offline, per prompt ({online.get('drafter')})", title_justify="left")
    for name in cc.PROMPT_HEADERS:
        table.add_column(name, justify="left" if name == "prompt" else "right")
    for row in cc.prompt_rows(online):
        table.add_row(*row)
    return table


def run(args: argparse.Namespace) -> int:
    """`dflash-ops crosscheck RUN`."""
    run_dir = run_directory(args.run_dir, args.runs)
    state = read_state(run_dir)
    config_path = args.config or state.get("config") or DEFAULT_CONFIG_NAME
    console = Console()
    if not args.config and state.get("config"):  # by the absolute path the run recorded, from any directory
        Console(stderr=True).print(f"dflash-ops: using the config of run {state['run_id']}: {config_path}",
                                   soft_wrap=True)
    try:
        result = asyncio.run(check_run(config_path, run_dir, state))
    except (cc.CrossCheckError, ServerUnreachable, ServerAnswerError, HostError, TimeoutError) as exc:
        raise UsageError(f"crosscheck {run_dir.name}: {exc}") from None
    path = run_dir / cc.CROSSCHECK_FILE  # written by the cross-check; state.json stays the engine's
    online = result.to_json()
    console.print(result.line(), soft_wrap=True)
    if result.prompts:
        console.print(prompts_table(online))
    for line in cc.triage_lines(online):
        console.print(line, soft_wrap=True)
    written = [str(path)]
    if (run_dir / "results" / "results.json").is_file():
        from console.views.report import write_report

        written += [str(p) for p in write_report(run_dir / "results", run_dir)[1]]
    console.print(f"wrote {', '.join(written)}", soft_wrap=True)
    return 0 if result.agrees or result.status == "not-speculative" else 1
