"""The resolved plan of a config, as rich renderables (`dflash-ops config check` prints it).

It shows what the config means once defaults are filled in and references resolved: the hosts,
the service, the target and its layers, the prompts, the drafters (reference marked), the
evaluation, and what each step of the procedure will do with them. It reads nothing remote.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from rich.console import Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from console.config import Config
from console.messages import Forecast, PlanReady
from console.procedure.step import done_earlier
from console.procedure.steps import ROUTES, STEP_TITLES
from console.service.control import manager_from_config
from console.views.tables import FittedTable
from console.views.units import duration, mib
from remote.prompts import DEFAULT_PROMPTS, PromptFileError, load_prompts

KERNEL_MEANING = {
    "fast": "fla + causal-conv1d required; fails before touching the GPU if they are missing",
    "torch": "the torch fallback path, forced",
    "any": "fast kernels if available, else the torch path (the one used is recorded)",
}


@dataclass(frozen=True)
class PromptSummary:
    """What the plan can tell about the prompts without running anything."""

    source: str
    ids: tuple[str, ...] | None  # None when the file could not be read here
    max_new_tokens: str
    problem: str | None = None


def summarize_prompts(config: Config) -> PromptSummary:
    """Count and ids of the prompts: the configured file read and validated locally, else the shipped set."""
    if config.prompts.file is None:
        path, source = DEFAULT_PROMPTS, "the shipped default set"
    else:
        path = Path(config.prompts.file).expanduser()
        if not path.is_absolute():
            path = config.base_dir() / path
        source = str(path)
    override = config.prompts.max_new_tokens
    if not path.exists():
        return PromptSummary(
            source, None, str(override) if override else "from the prompt file",
            problem=f"{path} does not exist here; it is needed when the run starts",
        )
    try:
        prompts = load_prompts(path)
    except PromptFileError as exc:
        return PromptSummary(source, None, str(override) if override else "from the prompt file", problem=exc.msg)
    if override:
        tokens = f"{override} (override)"
    else:
        budgets = sorted({p.max_new_tokens for p in prompts.prompts})
        tokens = ", ".join(map(str, budgets)) + " (from the prompt file)"
    return PromptSummary(source, tuple(p.id for p in prompts.prompts), tokens)


def describe_layers(config: Config) -> str:
    """The target layers as the plan states them."""
    if config.target.layers == "auto":
        return "auto: from drafter configs at run time"
    return ", ".join(str(layer) for layer in config.target.layers)


class _RunsNothing:
    """The runner of the plan's managers: they are built only to say their argv, never to run it."""

    async def run(self, argv: list[str], check: bool = True, timeout: float | None = None) -> None:
        raise RuntimeError(f"the plan runs nothing (asked to run {shlex.join(argv)})")


def service_argv(config: Config) -> dict[str, list[str] | None]:
    """The argv the service's manager will run for start / stop / status / log (None: no log
    command), from the very manager the window uses, so what is shown is what runs."""
    manager = manager_from_config(config.service, _RunsNothing())
    return {"start": manager.start_argv(), "stop": manager.stop_argv(), "status": manager.status_argv(),
            "log": manager.log_argv()}


def service_commands(config: Config) -> dict[str, str]:
    """The literal start/stop/status commands the service manager will run on its host (`shlex.join`
    of the manager's argv)."""
    return {verb: shlex.join(argv) for verb, argv in service_argv(config).items() if verb != "log" and argv}


def startup_log_command(config: Config) -> str | None:
    """The command whose output is read for start-up progress after a restart; None: there is none."""
    argv = service_argv(config)["log"]
    return shlex.join(argv) if argv else None


def _gpus(config: Config) -> str:
    gpus = config.service.gpus
    return "GPUs " + ", ".join(map(str, gpus)) if gpus else "every GPU"


def procedure_steps(config: Config) -> list[tuple[str, str]]:
    """(step, what it will do) for each step of the window, in order."""
    service, target, ev = config.service, config.target, config.eval
    prompts = summarize_prompts(config)
    count = f"{len(prompts.ids)} prompts" if prompts.ids is not None else "the prompts"
    hosts = ", ".join(config.hosts)
    drafter_hosts = sorted({d.host for d in config.drafters})
    commands = service_commands(config)
    names = ", ".join(d.name + (" (reference)" if d.reference else "") for d in config.drafters) or "none"
    remote_drafters = sorted({d.host for d in config.drafters if d.host != ev.host})
    copies = f"; checkpoints copied from {', '.join(remote_drafters)}" if remote_drafters else ""
    checks = ["Python, torch, CUDA, transformers, fla and causal-conv1d versions", "disk and RAM free",
              f"{target.model_path} on {target.host}"]
    if config.drafters:
        checks.append(f"drafter checkpoints on {', '.join(drafter_hosts)}")
    layers = (
        "the layers named in the drafters' configs (their union)"
        if target.layers == "auto" else f"layers {describe_layers(config)}"
    )
    what = dict([
        ("preflight", f"connect to {hosts}; probe {'; '.join(checks)}; compare kernels across hosts "
                      f"and flag asymmetry"),
        ("stage", f"on {target.host}: read the target into host RAM and compile the Triton kernels while "
                  f"the server still serves; then wait for the go"),
        ("cache", f"fetch greedy completions of {count} from the live server at {service.url} "
                  f"(on {service.host}) and verify them; nothing is stopped before this is done"),
        ("stop", f"on {service.host}: `{commands['stop']}`"),
        ("free-vram", f"on {service.host}: wait until {_gpus(config)} hold < {service.vram_free_mib} MiB each; "
                      f"offer to end exactly the PIDs still holding memory (TERM, KILL after "
                      f"{service.stop_grace_s:g} s)"),
        ("extract", f"on {target.host}: load {target.model_path} on the GPUs with kernels={target.kernels} "
                    f"({KERNEL_MEANING[target.kernels]}); save per prompt the hidden states (bf16) of {layers}, "
                    f"the argmax and top-k; release the GPUs first, then flush files"),
        ("restart", f"on {service.host}: `{commands['start']}`; ready when {service.url}/health answers 200 "
                    f"and a one-token generation succeeds, within {service.ready_timeout_s:g} s"),
        ("evaluate", f"on {ev.host} (device {ev.device}): drafters {names}; DDTree budgets "
                     f"{', '.join(map(str, ev.budgets))}; top-{ev.topk}; {ev.batch_anchors} anchors per batch{copies}"),
        ("report", "summary table (drafters side by side"
                   + (f", ratio to {config.reference.name}" if config.reference else ", no reference")
                   + "), per-prompt and per-position acceptance, hidden-state parity, kernels of both hosts"),
    ])
    # The step table is the one list of steps: a step without a line here still shows, by its title.
    return [(name, what.get(name, STEP_TITLES[name])) for name in ROUTES["window"]]


def _kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    table = Table(title=title, title_justify="left", show_header=False, box=None, padding=(0, 1))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows:
        table.add_row(key, value)
    return table


def _hosts_table(config: Config) -> Table:
    table = Table(title="Hosts", title_justify="left")
    for column in ("name", "address", "user", "port", "python", "workdir", "roles"):
        table.add_column(column, overflow="fold")
    for host in config.hosts.values():
        roles = []
        if config.service.host == host.name:
            roles.append("service")
        if config.target.host == host.name:
            roles.append("target")
        if config.eval.host == host.name:
            roles.append("eval")
        if any(d.host == host.name for d in config.drafters):
            roles.append("drafters")
        table.add_row(
            host.name, host.address, host.user or "(ssh config)", str(host.port or "(ssh config)"),
            host.python, host.workdir, ", ".join(roles) or "unused",
        )
    return table


def _drafters_table(config: Config) -> RenderableType:
    if not config.drafters:
        return Text("Drafters: none", style="yellow")
    table = Table(title="Drafters", title_justify="left")
    for column in ("name", "host", "path", "role"):
        table.add_column(column, overflow="fold")
    for drafter in config.drafters:
        role = Text("reference", style="bold green") if drafter.reference else Text("candidate")
        table.add_row(drafter.name, drafter.host, drafter.path, role)
    return table


def _steps_table(config: Config) -> Table:
    table = Table(title="Procedure", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("step", style="bold", no_wrap=True)
    table.add_column("what it will do", overflow="fold")
    for number, (step, what) in enumerate(procedure_steps(config), 1):
        table.add_row(str(number), step, what)
    return table


def _fleet_table(config: Config) -> Table:
    """[fleet]: the router and each replica, as config check resolved them."""
    fleet = config.fleet
    assert fleet is not None
    where = f"as seen from {fleet.router_host}" if fleet.router_host else "reached from the console"
    key = f"admin key from ${fleet.api_key_env}" if fleet.api_key_env else "no admin key"
    table = Table(title=f"Fleet: router {fleet.router} ({where}; {key}; a drain waits up to "
                        f"{fleet.drain_timeout_s:g} s)", title_justify="left")
    for column in ("replica", "host", "manager", "unit / start", "url (from its host)", "listed by the router as"):
        table.add_column(column, overflow="fold")
    for replica in fleet.replicas:
        service = replica.service
        start = service.unit if service.manager == "systemd" else service.start
        table.add_row(replica.name, service.host, service.manager,
                      start if isinstance(start, str) else " ".join(start or ()), service.url, replica.worker_url)
    return table


def render_plan(config: Config) -> RenderableType:
    """The whole resolved plan of `config` as one rich renderable."""
    service, target = config.service, config.target
    commands = service_commands(config)
    prompts = summarize_prompts(config)
    service_rows = [("host", service.host), ("manager", service.manager)]
    if service.manager == "systemd":
        service_rows.append(("unit", service.unit or ""))
    service_rows += [
        ("start", commands["start"]), ("stop", commands["stop"]), ("status", commands["status"]),
        ("start-up log", startup_log_command(config) or "- (no `log` command: no start-up progress, only readiness)"),
        ("url", f"{service.url} (as seen from {service.host})"),
        ("ready within", f"{service.ready_timeout_s:g} s"),
        ("free when", f"{_gpus(config)} under {service.vram_free_mib} MiB each"),
        ("stop grace", f"{service.stop_grace_s:g} s between TERM and KILL"),
    ]
    target_rows = [
        ("host", target.host), ("model", target.model_path),
        ("kernels", f"{target.kernels}: {KERNEL_MEANING[target.kernels]}"),
        ("layers", describe_layers(config)),
        ("python", target.python or f"{config.hosts[target.host].python} (the host's)"),
    ]
    if prompts.ids is None:
        prompt_count = "unknown"
    else:
        prompt_count = f"{len(prompts.ids)}: {', '.join(prompts.ids)}" if prompts.ids else "0"
    prompt_rows = [("source", prompts.source), ("prompts", prompt_count),
                   ("max_new_tokens", prompts.max_new_tokens)]
    if prompts.problem:
        prompt_rows.append(("problem", prompts.problem))
    ev = config.eval
    eval_rows = [("host", ev.host), ("device", ev.device),
                 ("methods", ", ".join(["vanilla", *(f"ddtree-b{b}" for b in ev.budgets), f"top{ev.topk}"])),
                 ("anchors per batch", str(ev.batch_anchors))]
    parts: list[RenderableType] = [
        _hosts_table(config),
        *([_fleet_table(config)] if config.fleet is not None else []),
        _kv_table("Service" if config.fleet is None else f"Service (replica {config.fleet.replicas[0].name}, as each "
                  "replica's window will run it)", service_rows),
        _kv_table("Target", target_rows),
        _kv_table("Prompts", prompt_rows),
        _drafters_table(config),
        _kv_table("Eval", eval_rows),
        _steps_table(config),
    ]
    notes = config.warnings() + ([f"prompts: {prompts.problem}"] if prompts.problem else [])
    for note in notes:
        parts.append(Text(f"warning: {note}", style="yellow"))
    title = f"plan for {config.source}" if config.source else "plan"
    return Panel(Group(*parts), title=title, title_align="left")


# --------------------------------------------------------------------------------------------
# `run --plan`: the plan chosen at preflight (a `PlanReady`), for a terminal or a pipe.


def forecast_unknown_steps(plan: PlanReady) -> set[str]:
    """The plan's steps whose phase of the forecast is unknown (their estimate reads "unknown", not "-")."""
    from console.procedure import forecast as fc

    if plan.forecast is None:
        return set()
    return {fc.STEP_OF_PHASE[name] for name in fc.unknown(plan.forecast) if name in fc.STEP_OF_PHASE}


def forecast_view(made: Forecast) -> list[RenderableType]:
    """The downtime forecast before any run begins: one line with the figure and the budget, then
    each phase with its basis in words (what `run --plan` and the console's plan screen show)."""
    from console.procedure import forecast as fc

    budget = ""
    if made.budget_s is not None:
        verdict = ("OVER it: the stop will be refused" if made.over_budget else
                   "cannot be checked with a phase unknown: the stop will be refused" if fc.unknown(made) else "fits")
        budget = f" (budget [window] max_downtime_s = {made.budget_s:g} s: {verdict})"
    rows = [[p.name, duration(p.seconds) if p.seconds is not None else "unknown", p.basis]
            for p in made.phases]  # a basis names config keys ("[service] stop_grace_s"): the table keeps them
    return [Text(f"forecast downtime: {fc.figure(made)}{budget}", style="bold red" if made.over_budget else "bold"),
            FittedTable((["phase", "forecast", "basis"], rows, ["yellow" if p.seconds is None else ""
                                                                 for p in made.phases]),
                        "forecast downtime by phase (stop, VRAM free, extraction, start to ready)", fold=2,
                        justify="left")]


def plan_view(plan: PlanReady, commands_whole: bool = True, ended: Mapping[str, str] | None = None) -> Group:
    """The chosen plan, as `run --plan`, the headless run and the console's `p` screen all show it:
    per step whether it acts and why, where, the estimate; then each step's literal command on a
    line of its own, as it will run (never folded across table cells); where the target fits
    without the serving GPUs, and the route proposed.

    `commands_whole`: each command on one line that is never cut (print with `crop=False`, so that
    the terminal wraps a line wider than itself and a copy gets the command whole); otherwise (a
    screen of fixed width) it wraps at the width, between its words where it can.

    `ended`: a resumed run's steps already ended before this plan (step -> status): a resume's plan
    shows only what it will do, so those read "no" (done earlier in this run) and their commands are
    not listed among those that will run."""
    steps = done_earlier(plan.steps, ended or {})
    unknown = forecast_unknown_steps(plan)
    rows = [[step.name, "yes" if step.acts else "no", step.host or "-", step.why,
             "unknown" if step.name in unknown and step.acts else duration(step.estimate_s)] for step in steps]
    parts: list[RenderableType] = [FittedTable((["step", "acts", "host", "why", "estimate"], rows,
                                                ["" if step.acts else "dim" for step in steps]),
                                               f"plan ({plan.route} route)", fold=3, justify="left")]
    if plan.forecast is not None:
        parts.extend(forecast_view(plan.forecast))
    commands = [step for step in steps if step.argv]
    if commands:
        parts.append(Text("commands, exactly as they will run:", style="bold"))
        for step in commands:
            parts.append(Text(f"  {step.name} on {step.host or '?'}" + ("" if step.acts else " (left out)") + ":",
                              style="bold" if step.acts else "dim"))
            command = f"$ {shlex.join(step.argv)}"
            parts.append(Text(f"    {command}", style="cyan", no_wrap=True, overflow="ignore") if commands_whole
                         else Padding(Text(command, style="cyan", overflow="fold"), (0, 0, 0, 4)))
    if plan.fits:
        rows = [[fit.host, "yes" if fit.proposed else "no",
                 ",".join(map(str, fit.gpus)) if fit.gpus else ("-" if fit.gpu is None else str(fit.gpu)),
                 mib(fit.free_mib) if fit.free_mib is not None else "-",
                 mib(fit.need_mib) if fit.need_mib is not None else "-", fit.why] for fit in plan.fits]
        parts.append(FittedTable((["host", "fits", "GPU", "free", "needs", "why"], rows,
                                  ["green" if fit.proposed else "" for fit in plan.fits]),
                                 "where the target fits without stopping the server", fold=5, justify="left"))
    if plan.proposal:
        parts.append(Text(f"proposed: {plan.proposal}" + ("" if plan.route == "zero-downtime" else
                                                          " (take it with --route zero-downtime)"), style="bold cyan"))
    return Group(*parts)
