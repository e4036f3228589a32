"""What preflight learned that chooses the plan, and the small facts the steps share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def layer_override(drafter: Any) -> str:
    """`NAME=1,2,3`: the config's explicit layers for a drafter (`[[drafters]] layers`)."""
    return f"{drafter.name}={','.join(map(str, drafter.layers))}"


def same_model(a: str, b: str) -> bool:
    return a.rstrip("/") == b.rstrip("/") or Path(a).name == Path(b).name and Path(a).name != ""
