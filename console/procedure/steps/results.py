"""After the service is back: evaluate the drafters on the extracted states, fetch the results and
write the report, and cross-check against the server's own speculative decoding."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from console.messages import ResultsReady
from console.procedure import run_jobs
from console.procedure.facts import layer_override
from console.procedure.outcomes import Found, Skip, StepFailed
from console.procedure.steps import between_hosts
from console.service.control import ServiceError
from console.ssh.hosts import HostError

if TYPE_CHECKING:
    from console.procedure.window import Window


async def check_evaluate(window: Window) -> Skip | None:
    ev = window.config.eval
    wdir = await window.dir_on(ev.host)
    if await window.hosts.manifest_complete(ev.host, f"{wdir}/eval"):
        return Found(f"already evaluated (manifest complete): {ev.host}:{wdir}/eval")
    if not window.config.drafters:
        return Skip("no drafters configured")
    return None


async def run_evaluate(window: Window) -> str:
    ev = window.config.eval
    wdir = await window.dir_on(ev.host)
    out = f"{wdir}/eval"
    extract_host, extract_model = window.extract_host()
    states = f"{await window.dir_on(extract_host)}/states"
    target_model = window.config.target.path_on(ev.host)
    if ev.host != extract_host:
        states = await between_hosts.relay_tree(window, extract_host, states, ev.host, "evaluate")
    if target_model is None:  # the eval host has no copy: the heads alone, exported where one is
        target_model = await between_hosts.relay_heads(window, extract_host, extract_model, ev.host)
    args = ["--states", states, "--target", target_model, "--out", out, "--device", ev.device,
            "--budgets", ",".join(map(str, ev.budgets)), "--topk", str(ev.topk)]
    for drafter in window.config.drafters:
        path = drafter.path
        if drafter.host != ev.host:
            path = await between_hosts.relay_tree(window, drafter.host, path, ev.host, "evaluate")
        args += ["--drafter", f"{drafter.name}={path}"]
        if drafter.layers:
            args += ["--layers-override", layer_override(drafter)]
    if window.config.reference:
        args += ["--reference", window.config.reference.name]
    await run_jobs.job(window, ev.host, "evaluate", "evaluate", args, step="evaluate")
    window.crash_point("evaluated")
    return f"{len(window.config.drafters)} drafters evaluated on {ev.host}"


async def verify_evaluate(window: Window) -> None:
    ev = window.config.eval
    wdir = await window.dir_on(ev.host)
    if not await window.hosts.manifest_complete(ev.host, f"{wdir}/eval"):
        raise StepFailed("evaluate", f"the evaluator finished but {ev.host}:{wdir}/eval has no complete manifest")


async def run_report(window: Window) -> str:
    from console.views.report import write_report

    ev = window.config.eval
    wdir = await window.dir_on(ev.host)
    results_dir = window.run.results_dir
    await window.hosts.fetch_tree(ev.host, f"{wdir}/eval", results_dir, between_hosts.relay_progress(window, "report"))
    probes = window.run.dir / "probes.json"
    if probes.exists():
        (results_dir / "probes.json").write_text(probes.read_text())
    results, paths = write_report(results_dir, window.run.dir)
    headline = {name: (d.get("tau", {}).get("vanilla") or {}).get("macro")
                for name, d in results.get("drafters", {}).items()}
    window.state.headline = headline
    window.run.save()
    window.bus.publish(ResultsReady(window.run.run_id, str(window.run.dir)))
    window.crash_point("reported")
    return "; ".join(f"{k} tau {v:.2f}" for k, v in headline.items() if v is not None) + f"; {paths[0]}"


async def check_crosscheck(window: Window) -> Skip | None:
    from console.procedure.crosscheck import load

    with contextlib.suppress(Exception):
        done = load(window.run.dir)
        if done is not None:
            return Found(f"already cross-checked: {done.line()}")
    return None


def no_online_check(window: Window, exc: Exception) -> str:
    """Record "no online check: why" (crosscheck.json, which the report and `runs` read) and say it."""
    from console.procedure.crosscheck import NO_CHECK, CrossCheck, CrossCheckError, save
    from console.service.sglang_api import ServerAnswerError, ServerUnreachable

    known = (CrossCheckError, ServerUnreachable, ServerAnswerError, HostError, ServiceError, TimeoutError, OSError)
    why = str(exc) if isinstance(exc, known) and str(exc) else f"{type(exc).__name__}: {exc}"
    line = f"{NO_CHECK}: {why}"
    with contextlib.suppress(OSError):  # a full disk: the journal still says it
        save(window.run.dir, CrossCheck(status="no-check", message=line))
    window.journal("crosscheck", line, level="warning")
    return line


async def run_crosscheck(window: Window) -> str:
    """Bounded (a prompt count and a time budget) and after the service is ready: it never slows
    the restart. A server that does not decode speculatively gives a one-line "no online check";
    a check that cannot be made is said, and the run (its work done) still ends done."""
    from console.views.report import write_report

    try:
        result = await window.hosts.crosscheck(window.config, window.run.dir, window.run.run_id, window.state.facts)
    except Exception as exc:  # noqa: BLE001 - whatever it is (CrossCheckError, an unreachable server, a bad
        # answer), the run's work is done: it ends done, saying why there is no online figure
        return no_online_check(window, exc)
    window.state.facts["headline_online"] = result.headline()
    window.run.save()
    if (window.run.results_dir / "results.json").exists():
        write_report(window.run.results_dir, window.run.dir)  # report.json's `online`, report.md's "Online"
    return result.line()
