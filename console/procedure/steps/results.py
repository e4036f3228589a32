"""After the service is back: evaluate the drafters on the extracted states, fetch the results and
write the report, and cross-check against the server's own speculative decoding."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from console.messages import ResultsReady
from console.procedure import run_jobs
from console.procedure.outcomes import Found, Skip, StepFailed
from console.procedure.steps import between_hosts
from console.procedure.steps.facts import layer_override
from console.service.control import ServiceError
from console.ssh.hosts import HostError

if TYPE_CHECKING:
    from console.procedure.engine import Engine


async def check_evaluate(engine: Engine) -> Skip | None:
    ev = engine.config.eval
    window = await engine._window_dir(ev.host)
    if await engine.hosts.manifest_complete(ev.host, f"{window}/eval"):
        return Found(f"already evaluated (manifest complete): {ev.host}:{window}/eval")
    if not engine.config.drafters:
        return Skip("no drafters configured")
    return None


async def run_evaluate(engine: Engine) -> str:
    ev = engine.config.eval
    window = await engine._window_dir(ev.host)
    out = f"{window}/eval"
    extract_host, extract_model = engine._extract_host()
    states = f"{await engine._window_dir(extract_host)}/states"
    target_model = engine.config.target.path_on(ev.host)
    if ev.host != extract_host:
        states = await between_hosts.relay_tree(engine, extract_host, states, ev.host, "evaluate")
    if target_model is None:  # the eval host has no copy: the heads alone, exported where one is
        target_model = await between_hosts.relay_heads(engine, extract_host, extract_model, ev.host)
    args = ["--states", states, "--target", target_model, "--out", out, "--device", ev.device,
            "--budgets", ",".join(map(str, ev.budgets)), "--topk", str(ev.topk)]
    for drafter in engine.config.drafters:
        path = drafter.path
        if drafter.host != ev.host:
            path = await between_hosts.relay_tree(engine, drafter.host, path, ev.host, "evaluate")
        args += ["--drafter", f"{drafter.name}={path}"]
        if drafter.layers:
            args += ["--layers-override", layer_override(drafter)]
    if engine.config.reference:
        args += ["--reference", engine.config.reference.name]
    await run_jobs.job(engine, ev.host, "evaluate", "evaluate", args, step="evaluate")
    engine._crash("evaluated")
    return f"{len(engine.config.drafters)} drafters evaluated on {ev.host}"


async def verify_evaluate(engine: Engine) -> None:
    ev = engine.config.eval
    window = await engine._window_dir(ev.host)
    if not await engine.hosts.manifest_complete(ev.host, f"{window}/eval"):
        raise StepFailed("evaluate", f"the evaluator finished but {ev.host}:{window}/eval has no complete manifest")


async def run_report(engine: Engine) -> str:
    from console.views.report import write_report

    ev = engine.config.eval
    window = await engine._window_dir(ev.host)
    results_dir = engine.run.results_dir
    await engine.hosts.fetch_tree(ev.host, f"{window}/eval", results_dir, between_hosts.relay_progress(engine, "report"))
    probes = engine.run.dir / "probes.json"
    if probes.exists():
        (results_dir / "probes.json").write_text(probes.read_text())
    results, paths = write_report(results_dir, engine.run.dir)
    headline = {name: (d.get("tau", {}).get("vanilla") or {}).get("macro")
                for name, d in results.get("drafters", {}).items()}
    engine.state.headline = headline
    engine.run.save()
    engine.bus.publish(ResultsReady(engine.run.run_id, str(engine.run.dir)))
    engine._crash("reported")
    return "; ".join(f"{k} tau {v:.2f}" for k, v in headline.items() if v is not None) + f"; {paths[0]}"


async def check_crosscheck(engine: Engine) -> Skip | None:
    from console.procedure.crosscheck import load

    with contextlib.suppress(Exception):
        done = load(engine.run.dir)
        if done is not None:
            return Found(f"already cross-checked: {done.line()}")
    return None


def no_online_check(engine: Engine, exc: Exception) -> str:
    """Record "no online check: why" (crosscheck.json, which the report and `runs` read) and say it."""
    from console.procedure.crosscheck import NO_CHECK, CrossCheck, CrossCheckError, save
    from console.service.sglang_api import ServerAnswerError, ServerUnreachable

    known = (CrossCheckError, ServerUnreachable, ServerAnswerError, HostError, ServiceError, TimeoutError, OSError)
    why = str(exc) if isinstance(exc, known) and str(exc) else f"{type(exc).__name__}: {exc}"
    line = f"{NO_CHECK}: {why}"
    with contextlib.suppress(OSError):  # a full disk: the journal still says it
        save(engine.run.dir, CrossCheck(status="no-check", message=line))
    engine.journal("crosscheck", line, level="warning")
    return line


async def run_crosscheck(engine: Engine) -> str:
    """Bounded (a prompt count and a time budget) and after the service is ready: it never slows
    the restart. A server that does not decode speculatively gives a one-line "no online check";
    a check that cannot be made is said, and the run (its work done) still ends done."""
    from console.views.report import write_report

    try:
        result = await engine.hosts.crosscheck(engine.config, engine.run.dir, engine.run.run_id, engine.state.facts)
    except Exception as exc:  # noqa: BLE001 - whatever it is (CrossCheckError, an unreachable server, a bad
        # answer), the run's work is done: it ends done, saying why there is no online figure
        return no_online_check(engine, exc)
    engine.state.facts["headline_online"] = result.headline()
    engine.run.save()
    if (engine.run.results_dir / "results.json").exists():
        write_report(engine.run.results_dir, engine.run.dir)  # report.json's `online`, report.md's "Online"
    return result.line()
