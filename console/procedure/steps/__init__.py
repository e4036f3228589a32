"""The procedure as data: the steps of each route, and what preflight learned that chooses the plan.

    window:        preflight → stage ‖ cache → acceptance → [drain] → stop → free-vram → extract → restart → drafter
                   → [rejoin] → evaluate → report → crosscheck
    pause:         preflight → stage ‖ cache → acceptance → [drain] → pause → release → free-vram → extract → resume
                   → continue → drafter → [rejoin] → evaluate → report → crosscheck  (the server gives its GPU memory back and takes it
                   again, never stopped)
    [drain], [rejoin]: a fleet behind SGLang's router only (`fleet`): the window runs on one replica, out of
                   the router; a one-server config leaves them out
    zero-downtime: preflight → cache → extract → evaluate → report → crosscheck  (the server is never touched)

acceptance and drafter: the served drafter's acceptance length before the window and once the server
is back (`drafter`): a drafter the window left wrong ends the run degraded (`steps/drafter.py`).
The cross-check comes last: it needs the service ready and the offline tau to stand beside.

`STEPS` below is the only list of steps: every view reads it. Each step family's check, run, verify
and compensation lives in a module of its own: `preflight`, `serving` (stage, cache), `stop` (stop,
free-vram, restart), `pause` (pause, release, the pause route's free-vram, resume, continue),
`extract`, `results` (evaluate, report, crosscheck), `fleet` (drain, rejoin); each function takes the
window (`console/procedure/window.py`) as its first argument, and no step module imports this table or
the engine: the engine imports the table.

Stage and cache run side by side while the server serves; the stop waits for both. A step is left
out of a plan with a reason (no `stage` when the target host lacks the RAM to pin the weights), and
at run time a step whose work is already done is skipped, saying why (resume).
"""

from __future__ import annotations

from console.procedure.facts import STAGE_RAM_MARGIN, Preflight, size_text, stage_decision
from console.procedure.forecast import estimates
from console.procedure.step import Step, by_route
from console.procedure.steps import drafter, extract, fleet, pause, preflight, results, serving, stop

__all__ = ["BY_NAME", "ROUTES", "STAGE_RAM_MARGIN", "STEPS", "STEP_NAMES", "STEP_TITLES", "PAUSE", "WINDOW", "ZERO_DOWNTIME",
           "Preflight", "Step", "by_route", "estimates", "route_steps", "size_text", "stage_decision", "units"]

_ALL = ("window", "pause", "zero-downtime")
_SERVED = ("window", "pause")  # the routes that extract on the serving GPUs
STEPS: tuple[Step, ...] = (
    Step("preflight", "check hosts, service, kernels, drafters and prompts", "hosts", _ALL,
         check=None, run=preflight.run_preflight),
    Step("stage", "read the target into host RAM and warm the kernels while the server serves", "target",
         _SERVED, check=serving.check_stage, run=serving.run_stage, compensate="end our job",
         left_out_when="the target host lacks the RAM to pin the weights (or --no-stage)", group="serving"),
    Step("cache", "cache greedy completions from the live server", "service", _ALL,
         check=serving.check_cache, run=serving.run_cache, verify=serving.verify_cache, compensate="end our job",
         group="serving"),
    Step("acceptance", "measure the served drafter's acceptance length (a few cached prompts replayed)", "service",
         _SERVED, check=drafter.check_acceptance, run=drafter.run_acceptance,
         left_out_when="the server is never touched (zero-downtime)"),
    Step("drain", "take the replica out of the router and let its requests finish", "service", _SERVED,
         check=fleet.check_drain, run=fleet.run_drain, verify=fleet.verify_drain, compensate="rejoin the replica",
         asks="take the replica out of the router", left_out_when="one server (no [fleet] router)"),
    Step("stop", "stop the service", "service", ("window",), check=stop.check_stop, run=stop.run_stop,
         verify=stop.verify_stop, compensate="restart the service", asks="stop the service", while_down=True),
    Step("pause", "pause the server's generation (requests held, none failed)", "service", ("pause",),
         check=pause.check_pause, run=pause.run_pause, compensate="resume and continue the server",
         asks="pause the server's generation", while_down=True),
    Step("release", "release the GPU memory the extraction needs (the KV cache first)", "service", ("pause",),
         check=pause.check_release, run=pause.run_release, compensate="resume and continue the server",
         asks="release the server's memory", while_down=True),
    Step("free-vram", "wait until the service's GPUs are free", "service", _SERVED,
         check=by_route(window=stop.check_free_vram, pause=pause.check_room),
         run=by_route(window=stop.run_free_vram, pause=pause.run_room),
         asks="end the processes still holding VRAM (window route; the pause route ends none)", while_down=True),
    Step("extract", "extract the target's hidden states", "extract", _ALL, check=extract.check_extract,
         run=extract.run_extract, verify=extract.verify_extract, compensate="end our job", while_down=True),
    Step("restart", "start the service and wait until it is ready", "service", ("window",), check=stop.check_restart,
         run=stop.run_restart, asks="start the service", while_down=True),
    Step("resume", "give the server its memory back and see it on the GPUs", "service", ("pause",),
         check=pause.check_resume, run=pause.run_resume, verify=pause.verify_resume,
         asks="give the server its memory back", while_down=True),
    Step("continue", "let the server take requests again; /health, and the weights checked (/weights_checker's "
                     "checksum, else a greedy /generate as before the pause)",
         "service", ("pause",), check=pause.check_continue, run=pause.run_continue, verify=pause.verify_continue,
         asks="let the server take requests again", while_down=True),
    Step("drafter", "measure the served drafter again: a fall beyond the margin ends the run degraded, its "
                    "restart offered", "service", _SERVED, check=drafter.check_drafter, run=drafter.run_drafter,
         asks="restart the server to reload its drafter (only when it came back degraded)",
         left_out_when="the server is never touched (zero-downtime)"),
    Step("rejoin", "put the replica back in the router once it generates; requests reach it again", "service",
         _SERVED, check=fleet.check_rejoin, run=fleet.run_rejoin, verify=fleet.verify_rejoin,
         asks="put the replica back in the router", left_out_when="one server (no [fleet] router)"),
    Step("evaluate", "evaluate the drafters on the extracted states", "eval", _ALL, check=results.check_evaluate,
         run=results.run_evaluate, verify=results.verify_evaluate, compensate="end our job", after_restart=True),
    Step("report", "fetch the results and write the report", "console", _ALL, check=None, run=results.run_report,
         after_restart=True),
    Step("crosscheck", "replay the cached prompts through the server's own speculative decoding: online tau "
                       "beside the offline one", "service", _ALL, check=results.check_crosscheck,
         run=results.run_crosscheck,
         left_out_when="the server does not decode speculatively (said in one line)", after_restart=True),
)
BY_NAME = {step.name: step for step in STEPS}
ROUTES = {route: tuple(s.name for s in STEPS if route in s.routes) for route in _ALL}
WINDOW, PAUSE, ZERO_DOWNTIME = ROUTES["window"], ROUTES["pause"], ROUTES["zero-downtime"]
STEP_NAMES = tuple(s.name for s in STEPS)  # every step of every route, in order
STEP_TITLES = {s.name: s.title for s in STEPS}


def route_steps(route: str) -> tuple[Step, ...]:
    return tuple(s for s in STEPS if route in s.routes)


def units(route: str) -> list[tuple[Step, ...]]:
    """The route's steps in the order they run: a group's steps together, side by side."""
    out: list[tuple[Step, ...]] = []
    for step in route_steps(route):
        if step.group is not None and out and out[-1][0].group == step.group:
            out[-1] = (*out[-1], step)
        else:
            out.append((step,))
    return out


