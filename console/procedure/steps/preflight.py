"""preflight: every host connected, the inference host's lock taken, the probes (kernels, RAM, the
model's size), the drafters' provenance, the service up and serving the target, where a
zero-downtime extraction would fit, and the plan chosen from what was found."""

from __future__ import annotations

import asyncio
import json
import shlex
import time
from typing import TYPE_CHECKING, Any

from console.messages import PlanReady
from console.procedure import forecast as fc
from console.procedure import host_lock, run_jobs
from console.procedure.facts import layer_override, same_model, stage_decision
from console.procedure.fit import longest_tokens, where_it_fits
from console.procedure.host_lock import LOCK_FILE  # noqa: F401  (re-exported)
from console.procedure.outcomes import StepFailed
from console.procedure.step import planned
from console.procedure.steps import fleet, pause
from console.session import service_name
from console.views.units import duration

if TYPE_CHECKING:
    from console.procedure.window import Window



async def run_preflight(window: Window) -> str:
    config = window.config
    for name in needed_hosts(window):  # a resume: only the hosts its remaining steps need
        await window.connected(name, "preflight")
    if not window.plan_only:
        await take_host_lock(window)
    prompts = window.prompt_records()  # bad prompt files fail here, before anything else
    window.state.facts["prompt_ids"] = [p["id"] for p in prompts]
    # Facts from every host at once: probes (kernels, RAM, model size), drafter configs, the service.
    if window.windows_here and window.facts.probes:  # a fleet run's next window: the same hosts, probed this run
        probes, drafters, view = window.facts.probes, window.facts.drafters, await window.hosts.check_service()
    else:
        probes, drafters, view = await asyncio.gather(_probe_all(window), _read_drafters(window),
                                                      window.hosts.check_service())
    window.facts.probes = probes
    window.facts.drafters = drafters
    target_probe = probes.get(config.target.host, {})
    model = target_probe.get("model", {})
    if model.get("exists") is False:
        raise StepFailed("preflight", f"{config.target.model_path} does not exist on {config.target.host}")
    if model.get("error"):
        raise StepFailed("preflight", f"the target on {config.target.host}: {model['error']}")
    window.facts.model_bytes = model.get("tensor_bytes")
    window.facts.ram_available = target_probe.get("ram", {}).get("available")
    kernels = target_probe.get("kernels", {})
    if config.target.kernels == "fast" and config.target.host in probes and not kernels.get("fast") \
            and not window.hosts.simulated(config.target.host):
        raise StepFailed("preflight", f"kernels = \"fast\" but {config.target.host} binds "
                                      f"{', '.join(f'{k}={v}' for k, v in kernels.get('bound', {}).items()) or 'nothing'}")
    recorded = window.state.facts.get("layers") if window.resumed else None
    window.facts.layers = list(recorded) if recorded else _layers(window, drafters)  # a resume keeps its layers
    for name, facts in drafters.items():
        overridden = facts.get("layers_source") == "override"
        window.journal("preflight", f"drafter {name} on {facts.get('host')}: target layers {facts.get('target_layer_ids')}"
                     + (f" from the config's override (the checkpoint says {facts.get('config_target_layer_ids')})"
                        if overridden else " from its config.json")
                     + f", fc width {facts.get('fc_width')}, block size {facts.get('block_size')}, "
                       f"mask token {facts.get('mask_token_id')}, hidden {facts.get('hidden_size')}",
                     level="warning" if overridden else "info")
    # The service must be up and serving the target before anything is cached from it (a resumed
    # run that stopped it already is the exception).
    if not window.service_down_by_us and not window.server_held_by_us:
        if view.status is None:
            raise StepFailed("preflight", f"the service manager on {config.service.host} did not answer: {view.error}")
        if not view.status.active or view.health is None or not view.health.ready:
            why = view.error or (view.health.error if view.health else None) or view.status.state
            raise StepFailed("preflight", f"{service_name(config)} on {config.service.host} is not up and "
                                          f"ready ({why}); the window starts from a live server")
        window.facts.service_ready = True
        before = window.state.service  # the process the stop will end (a resume compares it: steps/stop.py)
        before.main_pid_before_stop, before.active_since_before_stop = view.status.main_pid, view.status.since
        window.facts.service_model = view.health.model_path
        if view.health.model_path and not same_model(view.health.model_path, config.target.model_path):
            raise StepFailed("preflight", f"the server serves {view.health.model_path}, the target is "
                                          f"{config.target.model_path}: completions would come from another model")
    await _where_it_fits(window, prompts)
    window.state.facts["preflight"] = window.facts.to_json()
    window.state.facts["layers"] = window.facts.layers
    window.run.save()
    if not window.plan_only:
        try:
            (window.run.dir / "probes.json").write_text(json.dumps({"format": "dflash-ops.probes/1", "hosts": probes}))
        except OSError as exc:  # a full disk: fails a run that changed nothing yet, never one that stopped the service
            window.run.failed_write(window.run.dir / "probes.json", exc)
    await _choose_plan(window)
    return f"{len(window.config.hosts)} hosts, layers {window.facts.layers}"


# The host lock (`console/procedure/host_lock.py`), by the names the engine and the steps call.
take_host_lock, release_host_lock = host_lock.take, host_lock.release


async def _where_it_fits(window: Window, prompts: list[dict[str, Any]]) -> None:
    """Which hosts could extract without the serving GPUs; the zero-downtime route needs one."""
    await window.hosts.wait_first_samples(15.0)
    samples = {name: window.hosts.telemetry(name).telemetry.latest for name in window.config.hosts}
    window.fits = where_it_fits(window.config, window.facts.probes, samples, longest_tokens(prompts),
                              len(window.facts.layers))
    for fit in window.fits:
        window.journal("preflight", f"zero-downtime on {fit.host}: {'fits' if fit.proposed else 'no'}: {fit.why}")
    if window.route == "auto":
        await _choose_route(window)
    if window.route != "zero-downtime":  # a fleet: the drained replica's GPUs take the extraction
        fleet.check_fits(window, samples, longest_tokens(prompts))
    chosen = window.state.facts.get("extract_on")
    if window.route == "zero-downtime" and chosen is None:
        fit = next((f for f in window.fits if f.proposed), None)
        if fit is None:
            raise StepFailed("preflight", "the zero-downtime route needs a host with room, the weights and "
                                          "the same kernels; none has: " + "; ".join(f"{f.host}: {f.why}" for f in window.fits))
        gpus = list(fit.gpus or (fit.gpu,))
        sample = samples[fit.host]
        free = {g.index: (g.mem_total_mib or 0) - (g.mem_used_mib or 0) for g in sample.gpus}
        window.state.facts["extract_on"] = {"host": fit.host, "gpu": fit.gpu, "gpus": gpus,
                                          "model_path": fit.model_path, "need_mib": fit.need_mib,
                                          "free_mib": {str(i): free.get(i, 0) for i in gpus}}
        window.journal("preflight", f"route zero-downtime: extracting on {fit.host} GPU{fit.gpu}; the server is "
                                  f"never touched")


def needed_hosts(window: Window) -> list[str]:
    """The hosts preflight requires: every one for a new run; for a resume only those its remaining
    steps need (the service host always: its state is asked), so a host the run is done with (the
    drafters' once evaluated, say) may be away without failing the resume."""
    config = window.config
    if not window.resumed:
        return list(config.hosts)
    roles = {"target": config.target.host, "service": config.service.host, "extract": window.extract_host()[0],
             "eval": config.eval.host}
    need = {config.service.host}
    for step in window.steps:
        if window.state.status_of(step.name) in ("done", "skipped", "left-out"):
            continue
        need.add(roles.get(step.host_role) or config.service.host)
        if step.name in ("cache", "stage", "extract"):  # the completions are checked and read on the target host
            need.add(config.target.host)
        if step.name == "evaluate":  # the drafters are read (and relayed) where they live
            need.update(d.host for d in config.drafters)
    return [name for name in config.hosts if name in need]


async def _probe_all(window: Window) -> dict[str, dict[str, Any]]:
    async def probe(name: str) -> tuple[str, dict[str, Any]]:
        workdir = await window.hosts.workdir(name)
        # The host's environment facts (torch, packages, kernel binding: ~10 CPU seconds) are kept in
        # its workdir under a fingerprint of what they depend on and reused while it is unchanged;
        # disk, RAM and the model are measured every window (remote/probe.py says what it covers).
        args = ["--workdir", workdir, "--cache-dir", f"{workdir}/probe-cache"]
        path = window.config.target.path_on(name)
        if path is not None:
            args += ["--model", path]
        outcome = await run_jobs.job(window, name, "probe", f"probe-{name}", args, step="preflight", fresh=True)
        if not isinstance(outcome.get("result"), dict):
            raise StepFailed("preflight", f"the probe on {name} gave no facts: {outcome.get('error')}")
        _say_environment(window, name, outcome["result"].get("environment"))
        return name, outcome["result"]
    return dict(await asyncio.gather(*(probe(name) for name in needed_hosts(window))))


def _say_environment(window: Window, name: str, environment: Any) -> None:
    """One line per host: its environment facts reused from an earlier probe (and from when), or
    probed now and kept for the next window."""
    if not isinstance(environment, dict) or not isinstance(environment.get("fingerprint"), str):
        return  # a probe of an older worker, or a simulated host: nothing to say
    fingerprint = environment["fingerprint"][:12]
    if environment.get("cached") and isinstance(environment.get("probed_at"), (int, float)):
        when = time.localtime(environment["probed_at"])
        shown = time.strftime("%H:%M:%S" if when[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M:%S", when)
        window.journal("preflight", f"probe on {name}: environment unchanged since {shown} (fingerprint "
                                    f"{fingerprint}…): torch, packages and kernel binding from that probe", host=name)
    else:
        kept = f"; not kept: {environment['not_kept']}" if environment.get("not_kept") else ", kept for the next window"
        window.journal("preflight", f"probe on {name}: environment probed now (fingerprint {fingerprint}…){kept}",
                       host=name)


async def _read_drafters(window: Window) -> dict[str, dict[str, Any]]:
    """Each drafter's provenance, checked where it lives (`remote.provenance`, no torch): every
    config field the forward uses, `target_layer_ids` (required, or the config's explicit
    override), the fc width from the weights, finite weights. One job per drafter host."""
    by_host: dict[str, list[Any]] = {}
    needed = needed_hosts(window)
    for drafter in (d for d in window.config.drafters if d.host in needed):
        by_host.setdefault(drafter.host, []).append(drafter)

    async def check(host_name: str, drafters: list[Any]) -> dict[str, dict[str, Any]]:
        args = [arg for d in drafters for arg in ("--provenance", f"{d.name}={d.path}")]
        args += [arg for d in drafters if d.layers for arg in ("--layers-override", layer_override(d))]
        outcome = await run_jobs.job(window, host_name, "provenance", f"provenance-{host_name}", args, step="preflight",
                                  fresh=True)
        found = (outcome.get("result") or {}).get("drafters")
        if not isinstance(found, dict):
            raise StepFailed("preflight", f"the drafter check on {host_name} gave no provenance")
        for drafter in drafters:
            found[drafter.name] = {**found[drafter.name], "host": host_name}
        return found

    results = await asyncio.gather(*(check(h, ds) for h, ds in by_host.items()))
    return {name: facts for found in results for name, facts in found.items()}


def _layers(window: Window, drafters: dict[str, dict[str, Any]]) -> list[int]:
    if window.config.target.layers != "auto":
        return sorted(set(window.config.target.layers))
    layers = sorted({int(i) for d in drafters.values() for i in d["target_layer_ids"]})
    if not layers:
        raise StepFailed("preflight", "layers = \"auto\" but no drafter is configured to take them from")
    return layers


async def _choose_plan(window: Window) -> None:
    acts: dict[str, tuple[bool, str]] = {}
    facts = window.state.facts
    if window.route in ("window", "pause"):
        stage, why = stage_decision(window.facts)
        if window.stage_override is False:
            stage, why = False, "left out: --no-stage (the weights are read inside the window)"
        if "stage" in facts.get("plan_stage", {}):  # a resumed run keeps its plan
            stage, why = facts["plan_stage"]["stage"], facts["plan_stage"]["why"]
        facts["plan_stage"] = {"stage": stage, "why": why}
        acts["stage"] = (stage, why)
    manager = await window.hosts.service_manager(window.connect_s)
    acts.update(fleet.plan_acts(window))
    acts["stop"] = (True, f"{service_name(window.config)} on {window.config.service.host} goes down")
    role_hosts = {"hosts": None, "target": window.config.target.host, "service": window.config.service.host,
                  "extract": window.extract_host()[0], "eval": window.config.eval.host, "console": None}
    hosts = {s.name: role_hosts[s.host_role] for s in window.steps if role_hosts[s.host_role]}
    argvs = {"stop": manager.stop_argv(), "restart": manager.start_argv()}
    if window.route == "pause":
        acts.update(await _pause_acts(window))
        tags = facts["plan_release"]["tags"]
        argvs = {"pause": list(pause.request_argv(window, "/pause_generation", {"mode": "retract"})),
                 "release": list(pause.request_argv(window, "/release_memory_occupation", {"tags": tags})),
                 "resume": list(pause.request_argv(window, "/resume_memory_occupation", {"tags": tags})),
                 "continue": list(pause.request_argv(window, "/continue_generation", {}))}
    elif window.route == "window":
        await _say_pause_route(window)
    steps = planned(window.steps, acts, hosts, argvs, window.earlier)
    window.plan = PlanReady(window.run.run_id, window.route, steps, tuple(window.fits), preview=window.plan_only)
    made = None
    if window.route == "window" and not window.state.service.stops:  # by phase, before any run begins (`run --plan`)
        made, _ = await window.make_forecast(manager)
        window.journal("preflight", f"forecast downtime: {fc.summary(made)}"
                     + "".join(f"; {p.name}: {p.basis}" for p in made.phases))
        steps = fc.planned_with(steps, made)  # one figure per step: its phase of the forecast
    fit = next((f for f in window.fits if f.proposed), None)
    proposal = alternative = None
    if fit is not None:
        alternative = f"zero-downtime: extract on {fit.host} GPU{fit.gpu} ({fit.why})"
        proposal = (f"{alternative}; the window route would "
                    f"stop the server" + (f" for {fc.figure(made)} (the forecast: {fc.basis_words(made)})"
                                          if made is not None else ""))
        window.journal("preflight", f"proposed route: {proposal}; chosen: {window.route}"
                     + (" (--route zero-downtime to take it)" if window.route == "window" else ""))
    facts["proposal"] = proposal
    facts["alternative"] = alternative  # the stop's question names it without a second downtime figure
    window.plan = PlanReady(window.run.run_id, window.route, steps, tuple(window.fits), proposal,
                            preview=window.plan_only, forecast=made)
    window.state.plan = [{"name": s.name, "acts": s.acts, "why": s.why, "host": s.host, "argv": list(s.argv),
                        "estimate_s": s.estimate_s} for s in steps]
    window.run.save()
    window.bus.publish(window.shown_plan())  # a resume's: the steps done earlier do not act again
    for step in steps:
        window.journal("preflight", f"plan: {step.name}: {'acts' if step.acts else 'left out'}: {step.why}"
                     + (f" ({shlex.join(step.argv)} on {step.host})" if step.argv else ""))


async def _pause_acts(window: Window) -> dict[str, tuple[bool, str]]:
    """The pause route's plan: what is released and why; not possible (the reason said) without the
    memory saver, or when the extraction would need weights the server keeps no backup of."""
    tags, why = await pause.plan_release(window)
    if tags is None:
        raise StepFailed("preflight", f"the pause route is not possible on this server: {why}")
    made = await pause.pause_forecast(window, tags)
    window.journal("preflight", f"forecast pause (pause -> continue): {fc.summary(made)}"
                   + "".join(f"; {p.name}: {p.basis}" for p in made.phases))
    server = f"{service_name(window.config)} on {window.config.service.host}"
    return {"pause": (True, f"{server} holds its requests (running ones go back to its queue; none fails); its "
                            f"process is never stopped; forecast {duration(made.downtime_s)} paused"
                            + (" (OVER the budget)" if made.over_budget else "")),
            "release": (True, f"releases {why}"),
            "free-vram": (True, "waits for the room the extraction needs; the server's own processes stay"),
            "resume": (True, f"takes back exactly {', '.join(tags)}; the memory is seen back on the GPUs"),
            "continue": (True, "the held requests run; /health passes and the weights are checked: "
                               + ("/weights_checker's checksum as before the release (a greedy /generate where "
                                  "the server has none)" if "weights" in tags else
                                  "a greedy /generate answers as before the pause (the weights stay resident)"))}


async def _say_pause_route(window: Window) -> None:
    """On the stop route, one line on whether the pause route would be possible (an SGLang whose pause
    holds requests, and its memory saver): without the saver, the one change that makes later
    windows need no restart."""
    try:
        server = await window.hosts.server()
        saver = await server.memory_saver()
    except Exception as exc:  # the plan goes on: this line is advice
        window.journal("preflight", f"pause route: could not ask the server ({exc})", level="warning")
        return
    aborts = saver.why_no_pause()
    if aborts is not None:
        window.state.facts["pause_route"] = f"not possible: {aborts}"
    elif saver.enabled:
        window.state.facts["pause_route"] = "possible: the server runs with the memory saver (--route pause)"
    else:
        window.state.facts["pause_route"] = f"not possible: {pause.SAVER_HINT}"
    window.journal("preflight", f"pause route: {window.state.facts['pause_route']}")


async def _choose_route(window: Window) -> None:
    """`--route auto`: the least harm these hosts allow, fixed for the run from here: zero-downtime
    where another host has room, else pause where the server's pause holds requests (SGLang 0.5.6 and
    later), it runs with the memory saver and the extraction fits what it can release, else the stop
    route, saying why (`pause.release_plan`)."""
    fit = next((f for f in window.fits if f.proposed), None)
    if fit is not None:
        route, why = "zero-downtime", f"{fit.host} has room ({fit.why})"
    else:
        try:
            tags, release_why = await pause.plan_release(window)
        except Exception as exc:  # the server could not say: the stop route, saying why
            tags, release_why = None, f"the server's memory saver could not be asked ({exc})"
        if tags is not None:
            route, why = "pause", f"no host has room for zero-downtime; the server releases {release_why}"
        else:
            window.state.facts.pop("plan_release", None)
            route, why = "window", f"no host has room for zero-downtime; pause: {release_why}"
    window.choose_route(route)
    window.state.facts["route_chosen"] = {"route": route, "why": why}
    window.run.save()
    window.journal("preflight", f"route auto: {route}: {why}")
