"""The procedure as data: the steps of each route, and what preflight learned that chooses the plan.

    window:        preflight → stage ‖ cache → stop → free-vram → extract → restart → evaluate → report → crosscheck
    zero-downtime: preflight → cache → extract → evaluate → report → crosscheck  (the server is never touched)

The cross-check comes last: it needs the service ready and the offline tau to stand beside.

`STEPS` below is the only list of steps: every view reads it.

Stage and cache run side by side while the server serves; the stop waits for both. A step is left
out of a plan with a reason (no `stage` when the target host lacks the RAM to pin the weights), and
at run time a step whose work is already done is skipped, saying why (resume).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from console.messages import PlannedStep


@dataclass(frozen=True)
class Step:
    """One step of the window, as data. The engine is a loop over `STEPS`; the plan, the stepper,
    `views/plan.py` and the console's state read the same table.

    `check`, `run` and `verify` name the engine's methods: `check` asks the hosts whether the
    step's work is already there (a resumed run trusts the hosts, not its saved state) and returns
    why it is satisfied or None; `run` does the work and returns its detail; `verify` confirms the
    work on the host after it ran. `compensate` says what an early end after this step has begun
    must undo. `asks` is the confirmation it asks before it changes a host. `group`: the steps of
    one group run side by side (the first failure cancels the others).
    """

    name: str
    title: str
    host_role: str  # "hosts" | "target" | "service" | "extract" | "eval" | "console"
    routes: tuple[str, ...]
    check: str | None
    run: str
    verify: str | None = None
    compensate: str | None = None  # "end our job" | "restart the service"
    asks: str | None = None
    left_out_when: str | None = None
    group: str | None = None
    while_down: bool = False  # runs while the service is down (window route)
    after_restart: bool = False  # runs once the service is back: a resume never re-runs the steps before it


_BOTH = ("window", "zero-downtime")
STEPS: tuple[Step, ...] = (
    Step("preflight", "check hosts, service, kernels, drafters and prompts", "hosts", _BOTH,
         check=None, run="run_preflight"),
    Step("stage", "read the target into host RAM and warm the kernels while the server serves", "target",
         ("window",), check="check_stage", run="run_stage", compensate="end our job",
         left_out_when="the target host lacks the RAM to pin the weights (or --no-stage)", group="serving"),
    Step("cache", "cache greedy completions from the live server", "service", _BOTH,
         check="check_cache", run="run_cache", verify="verify_cache", compensate="end our job", group="serving"),
    Step("stop", "stop the service", "service", ("window",), check="check_stop", run="run_stop",
         verify="verify_stop", compensate="restart the service", asks="stop the service", while_down=True),
    Step("free-vram", "wait until the service's GPUs are free", "service", ("window",), check="check_free_vram",
         run="run_free_vram", asks="end the processes still holding VRAM", while_down=True),
    Step("extract", "extract the target's hidden states", "extract", _BOTH, check="check_extract",
         run="run_extract", verify="verify_extract", compensate="end our job", while_down=True),
    Step("restart", "start the service and wait until it is ready", "service", ("window",), check="check_restart",
         run="run_restart", asks="start the service", while_down=True),
    Step("evaluate", "evaluate the drafters on the extracted states", "eval", _BOTH, check="check_evaluate",
         run="run_evaluate", verify="verify_evaluate", compensate="end our job", after_restart=True),
    Step("report", "fetch the results and write the report", "console", _BOTH, check=None, run="run_report",
         after_restart=True),
    Step("crosscheck", "replay the cached prompts through the server's own speculative decoding: online tau "
                       "beside the offline one", "service", _BOTH, check="check_crosscheck", run="run_crosscheck",
         left_out_when="the server does not decode speculatively (said in one line)", after_restart=True),
)
BY_NAME = {step.name: step for step in STEPS}
ROUTES = {route: tuple(s.name for s in STEPS if route in s.routes) for route in _BOTH}
WINDOW, ZERO_DOWNTIME = ROUTES["window"], ROUTES["zero-downtime"]
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


# Host RAM the staged worker needs beyond the weights it pins (Python, torch, the writer's buffers).
STAGE_RAM_MARGIN = 2 << 30


@dataclass
class Preflight:
    """What preflight found; the plan is chosen from it (and saved in the run's state)."""

    layers: list[int] = field(default_factory=list)
    layer_sources: dict[str, str] = field(default_factory=dict)  # drafter -> "config.json" | "override"
    drafters: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> its config facts
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    model_bytes: int | None = None
    ram_available: int | None = None
    service_ready: bool = False
    service_model: str | None = None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"layers": self.layers, "layer_sources": self.layer_sources, "drafters": self.drafters,
                "model_bytes": self.model_bytes, "ram_available": self.ram_available,
                "service_ready": self.service_ready, "service_model": self.service_model,
                "warnings": self.warnings}


def stage_decision(facts: Preflight) -> tuple[bool, str]:
    """Whether to stage the weights in pinned host RAM, and why (said in the plan either way)."""
    if facts.model_bytes is None or facts.ram_available is None:
        return False, "left out: the probe could not tell the model's size or the host's free RAM"
    need = facts.model_bytes + STAGE_RAM_MARGIN
    gib = 1 << 30
    if facts.ram_available < need:
        return False, (f"left out: the target host has {facts.ram_available / gib:.1f} GiB RAM available, "
                       f"staging needs {need / gib:.1f} GiB (weights {facts.model_bytes / gib:.1f} GiB + margin); "
                       f"the weights are read from disk inside the window instead")
    return True, (f"{facts.ram_available / gib:.1f} GiB RAM available for {size_text(facts.model_bytes)} of "
                  f"weights: read and warmed before the stop, so the window holds only the copy and the forward")


def size_text(n: int) -> str:
    """Bytes in the unit an operator reads at a glance: '54.2 GiB', '38.1 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def estimates(earlier_states: Iterable[dict[str, Any]]) -> dict[str, float]:
    """Median duration of each step (and of the downtime, key "downtime") over earlier finished runs."""
    durations: dict[str, list[float]] = {}
    for state in earlier_states:
        for name, step in state.get("steps", {}).items():
            if step.get("status") != "done" or step.get("found_on_resume"):
                continue
            if step.get("work_s"):  # the work alone, the operator's think time left out
                durations.setdefault(name, []).append(step["work_s"])
            elif step.get("started_at") is not None and step.get("ended_at") is not None:
                durations.setdefault(name, []).append(step["ended_at"] - step["started_at"])
        service = state.get("service", {})
        if service.get("stopped_at") is not None and service.get("ready_at") is not None:
            durations.setdefault("downtime", []).append(service["ready_at"] - service["stopped_at"])
    return {name: statistics.median(values) for name, values in durations.items()}


def planned(route: str, acts: dict[str, tuple[bool, str]], hosts: dict[str, str],
            argvs: dict[str, list[str]], earlier: dict[str, float]) -> tuple[PlannedStep, ...]:
    """The plan's steps: for each step of `route`, whether it acts and why, its host, argv, estimate."""
    steps = []
    for name in ROUTES[route]:
        act, why = acts.get(name, (True, STEP_TITLES[name]))
        steps.append(PlannedStep(name, act, why, hosts.get(name), tuple(argvs.get(name, ())), earlier.get(name)))
    return tuple(steps)
