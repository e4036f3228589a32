"""`[[drafters]]`, `[eval]` and `[crosscheck]`: the drafter checkpoints to evaluate, where and how
they are evaluated offline, and the online cross-check against the restarted server.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

from console.config.checks import Checker, describe, is_bool, is_positive_int, is_positive_number, is_text
from console.config.hosts import HostConfig

Device = Literal["auto", "cpu", "cuda"]
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
# Drafter names become result ids and file names.
DRAFTER_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class DrafterConfig:
    """A drafter checkpoint directory on a host; `reference` marks the baseline (z-lab)."""

    name: str
    host: str
    path: str
    reference: bool = False
    # Explicit target layers, overriding the checkpoint's `dflash_config.target_layer_ids` (shown as an
    # override everywhere); None: read them from the checkpoint, where they are required.
    layers: tuple[int, ...] | None = None


@dataclass(frozen=True)
class EvalConfig:
    """Where and how drafters are evaluated (EVAL-SPEC.md)."""

    host: str
    device: Device = "auto"
    budgets: tuple[int, ...] = (8, 16, 64)
    topk: int = 8
    batch_anchors: int = 64


@dataclass(frozen=True)
class CrosscheckConfig:
    """The online cross-check after the restart: at most `prompts` cached prompts, within `budget_s`."""

    prompts: int = 16
    budget_s: float = 120


DRAFTER_KEYS = tuple(f.name for f in fields(DrafterConfig))
EVAL_KEYS = tuple(f.name for f in fields(EvalConfig))
CROSSCHECK_KEYS = tuple(f.name for f in fields(CrosscheckConfig))


def parse_drafters(c: Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> tuple[DrafterConfig, ...]:
    """Check the `[[drafters]]` tables (at most one reference); raise the first problem."""
    if "drafters" not in data:
        return ()
    raw_list = data["drafters"]
    if not isinstance(raw_list, list) or not all(isinstance(d, dict) for d in raw_list):
        raise c.wrong("drafters", "an array of tables ([[drafters]])", raw_list)
    drafters: list[DrafterConfig] = []
    reference: str | None = None
    for i, raw in enumerate(raw_list):
        p = f"drafters[{i}]"
        c.keys(raw, p, DRAFTER_KEYS)
        name = c.get(raw, "name", p, lambda v: isinstance(v, str) and bool(DRAFTER_NAME_RE.match(v)),
                     "a name of letters, digits, '.', '-' or '_'", required=True)
        if any(d.name == name for d in drafters):
            raise c.fail(f"{p}.name", "a name not used by another drafter", f"{describe(name)}, already used")
        host = c.host_ref(c.get(raw, "host", p, is_text, "a host name", required=True), f"{p}.host", hosts)
        is_reference = c.get(raw, "reference", p, is_bool, "true or false", False)
        if is_reference and reference is not None:
            raise c.fail(f"{p}.reference", f"at most one reference drafter ({reference!r} is already one)", "true")
        if is_reference:
            reference = name
        drafters.append(DrafterConfig(
            name=name,
            host=host,
            path=c.get(raw, "path", p, is_text, "the checkpoint directory on the drafter's host", required=True),
            reference=is_reference,
            layers=c.int_list(raw, "layers", p, 0, "layer ids"),
        ))
    return tuple(drafters)


def parse_eval(c: Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig], default_host: str) -> EvalConfig:
    """Check the `[eval]` table (its host defaults to the target's); raise the first problem."""
    raw = c.table(data, "eval", "eval", required=False) or {}
    p = "eval"
    c.keys(raw, p, EVAL_KEYS)
    host = default_host
    if "host" in raw:
        host = c.host_ref(c.get(raw, "host", p, is_text, "a host name"), f"{p}.host", hosts)
    return EvalConfig(
        host=host,
        device=c.get(raw, "device", p, lambda v: v in DEVICES, '"auto", "cpu" or "cuda"', "auto"),
        budgets=c.int_list(raw, "budgets", p, 1, "positive integers") or (8, 16, 64),
        topk=c.get(raw, "topk", p, is_positive_int, "a positive integer", 8),
        batch_anchors=c.get(raw, "batch_anchors", p, is_positive_int, "a positive integer", 64),
    )


def parse_crosscheck(c: Checker, data: Mapping[str, Any]) -> CrosscheckConfig:
    """Check the `[crosscheck]` table; raise the first problem."""
    raw = c.table(data, "crosscheck", "crosscheck", required=False) or {}
    c.keys(raw, "crosscheck", CROSSCHECK_KEYS)
    return CrosscheckConfig(
        prompts=c.get(raw, "prompts", "crosscheck", is_positive_int, "a positive integer (prompts replayed)", 16),
        budget_s=c.get(raw, "budget_s", "crosscheck", is_positive_number, "a positive number of seconds", 120),
    )
