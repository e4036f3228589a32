"""The procedure as data: the steps of each route, and what preflight learned that chooses the plan.

    window:        preflight → stage → cache → stop → free-vram → extract → restart → evaluate → report
    zero-downtime: preflight → cache → extract → evaluate → report      (the server is never touched)

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

WINDOW = ("preflight", "stage", "cache", "stop", "free-vram", "extract", "restart", "evaluate", "report")
ZERO_DOWNTIME = ("preflight", "cache", "extract", "evaluate", "report")
ROUTES = {"window": WINDOW, "zero-downtime": ZERO_DOWNTIME}
STEP_TITLES = {
    "preflight": "check hosts, service, kernels, drafters and prompts",
    "stage": "read the target into host RAM and warm the kernels while the server serves",
    "cache": "cache greedy completions from the live server",
    "stop": "stop the service",
    "free-vram": "wait until the service's GPUs are free",
    "extract": "extract the target's hidden states",
    "restart": "start the service and wait until it is ready",
    "evaluate": "evaluate the drafters on the extracted states",
    "report": "fetch the results and write the report",
}
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
            if step.get("status") == "done" and step.get("started_at") is not None and step.get("ended_at") is not None:
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
