"""`dflash-ops probe`: run `remote.probe` on every configured host at once and show them side by side.

Each host is reached over SSH, gets the worker code (`JobRunner.ensure_code`), and runs the probe as
a job (on the target host with the target's model path, so its size is in the table). The hosts'
environments are then printed as one table with the asymmetries flagged (`console.views.probe_table`).
Exit status 1 when a probe failed, a kernel asymmetry was found (the story's bug: causal-conv1d
missing on one host only) or a host binds its kernels under a scheme the workers cannot read, else 0.
A host whose transformers is outside the tested range is warned about, naming both. Progress goes to stderr, the table to stdout.

It probes everything anew: it is the operator's explicit check. `--cached` reuses a host's
environment facts (torch, packages, kernel binding) from its workdir's probe cache while their
fingerprint is unchanged, as a window's preflight does (remote/probe.py says what it covers).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.text import Text

from console.config import Config, load_config
from console.messages import JobLog
from console.ssh.host_specs import host_spec, probe_python
from console.ssh.hosts import Host, HostError
from console.ssh.jobs import JobRunner, collect
from console.views.probe_table import Asymmetry, HostFinding, find_asymmetries, host_findings, probe_table
from remote.artifacts import write_json_atomic

PROBES_FORMAT = "dflash-ops.probes/1"
DEFAULT_TIMEOUT_S = 300.0

Say = Callable[[str], None]


@dataclass(frozen=True)
class HostProbe:
    """One host's probe: its facts, or the one-line reason there are none."""

    host: str
    facts: dict[str, Any] | None = None
    error: str | None = None
    seconds: float = 0.0


async def probe_host(config: Config, name: str, timeout: float, say: Say, cached: bool = False) -> HostProbe:
    """Connect to host `name`, run the probe there as a job and return what it found; never raises
    for a host problem (it becomes `HostProbe.error`)."""
    started = time.monotonic()
    host = Host(host_spec(config, name, python=probe_python(config, name)))
    try:
        await host.connect()
        runner = JobRunner(host)
        await runner.ensure_code()
        if runner.uploaded_files:
            say(f"{name}: shipped the worker code ({runner.uploaded_files} files)")
        workdir = await runner.workdir()
        args = ["--workdir", workdir] + (["--cache-dir", f"{workdir}/probe-cache"] if cached else [])
        if name == config.target.host:
            model = config.target.model_path
            args += ["--model", await host.expand(model) if model.startswith("~") else model]
        handle = await runner.start("probe", args)
        say(f"{name}: probe running (pid {handle.pid}, {handle.run_dir})")
        try:
            outcome = await asyncio.wait_for(
                collect(runner, handle, on_message=lambda m: say(f"{name}: {m.message}")
                        if isinstance(m, JobLog) and m.kind == "log" else None), timeout)
            if outcome.state != "exited":  # dead or stalled: the message names the host and the job
                return HostProbe(name, None, outcome.error, time.monotonic() - started)
            facts = outcome.result if isinstance(outcome.result, dict) and outcome.error is None else None
            error = outcome.error or (None if facts is not None else "finished without a result")
        except TimeoutError:
            await runner.cancel(handle, grace=2.0)
            facts, error = None, f"did not finish within {timeout:g} s (cancelled; see {handle.stderr_path})"
        if error is not None:
            error = f"{name}: probe failed: {error}"
        return HostProbe(name, facts, error, time.monotonic() - started)
    except HostError as exc:  # unreachable, unknown host key, auth, lost link, dead job: one line each
        return HostProbe(name, None, str(exc), time.monotonic() - started)
    finally:
        await host.close()


async def probe_all(config: Config, timeout: float = DEFAULT_TIMEOUT_S, say: Say = lambda _: None,
                    cached: bool = False) -> list[HostProbe]:
    """Probe every configured host in parallel, in the config's host order."""
    return list(await asyncio.gather(*(probe_host(config, name, timeout, say, cached) for name in config.hosts)))


def summary_lines(probes: dict[str, dict[str, Any]], asymmetries: list[Asymmetry],
                  findings: list[HostFinding] = ()) -> list[Text]:
    """The verdict under the table: a host's own trouble (an unknown kernel scheme red, a transformers
    outside the tested range yellow), kernel asymmetry (red), other differences (yellow), or all clear."""
    lines = [Text(f.text, style="bold red" if f.severity == "error" else "yellow") for f in findings]
    errors = [a for a in asymmetries if a.severity == "error"]
    warnings = [a for a in asymmetries if a.severity == "warning"]
    if errors:
        lines.append(Text(f"KERNEL ASYMMETRY between {', '.join(probes)}: {', '.join(a.row for a in errors)} "
                          f"differ; hidden states extracted on one host will not match the other's.", style="bold red"))
    if warnings:
        lines.append(Text("differs between hosts: " + "; ".join(f"{a.row} ({a.why})" for a in warnings),
                          style="yellow"))
    unknown = any(f.severity == "error" for f in findings)
    if not errors and not unknown and len(probes) > 1:
        lines.append(Text(f"no kernel asymmetry between {', '.join(probes)}", style="green"))
    return lines


def run(args: argparse.Namespace) -> int:
    """`dflash-ops probe`: probe all hosts, print the table, exit 1 on asymmetry or failure."""
    config = load_config(args.config)
    out, err = Console(), Console(stderr=True)
    results = asyncio.run(probe_all(config, args.timeout, say=lambda line: err.print(Text(line, style="dim"), soft_wrap=True),
                                    cached=getattr(args, "cached", False)))
    probes = {r.host: r.facts for r in results if r.facts is not None}
    failures = [r for r in results if r.error is not None]
    asymmetries = find_asymmetries(probes)
    findings = host_findings(probes)
    if probes:
        out.print(probe_table(probes))
    # soft_wrap: a message stays one line (the terminal wraps it), so it can be grepped and copied.
    for line in summary_lines(probes, asymmetries, findings):
        out.print(line, soft_wrap=True)
    for failure in failures:
        out.print(Text(f"probe failed: {failure.error}", style="bold red"), soft_wrap=True)
    if args.out:
        path = write_json_atomic(Path(args.out), {"format": PROBES_FORMAT, "hosts": probes,
                                                   "failed": {r.host: r.error for r in failures}})
        out.print(Text(f"wrote {path}"), soft_wrap=True)
    kernel_trouble = any(a.severity == "error" for a in [*asymmetries, *findings])
    return 1 if failures or kernel_trouble else 0
