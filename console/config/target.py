"""`[target]` and `[prompts]`: the model whose hidden states the window extracts (where it lives,
which kernels it may run on, which layers), and the prompts it is run on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from console.config.checks import Checker, is_positive_int, is_text
from console.config.hosts import HostConfig

KernelPolicy = Literal["fast", "torch", "any"]
KERNEL_POLICIES: tuple[str, ...] = ("fast", "torch", "any")


@dataclass(frozen=True)
class TargetConfig:
    """The target model whose hidden states are extracted."""

    host: str
    model_path: str
    kernels: KernelPolicy = "fast"
    layers: tuple[int, ...] | Literal["auto"] = "auto"
    python: str | None = None
    # Where other hosts hold a copy of the target's weights ({host = path}): such a host, with a free
    # GPU, can extract without stopping the server (the zero-downtime route).
    paths: dict[str, str] = field(default_factory=dict)

    def path_on(self, host: str) -> str | None:
        """The target's directory on `host`, or None when that host has no copy."""
        return self.model_path if host == self.host else self.paths.get(host)


@dataclass(frozen=True)
class PromptsConfig:
    """Which prompts to complete; `file=None` means the ten coding prompts shipped in `remote/data`."""

    file: str | None = None
    max_new_tokens: int | None = None


TARGET_KEYS = tuple(f.name for f in fields(TargetConfig))
PROMPTS_KEYS = tuple(f.name for f in fields(PromptsConfig))


def parse_target(c: Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig], default_host: str) -> TargetConfig:
    """Check the `[target]` table (its host defaults to the service's); raise the first problem."""
    raw = c.table(data, "target", "target", required=True)
    assert raw is not None
    p = "target"
    c.keys(raw, p, TARGET_KEYS)
    host = default_host
    if "host" in raw:
        host = c.host_ref(c.get(raw, "host", p, is_text, "a host name"), f"{p}.host", hosts)
    layers: tuple[int, ...] | Literal["auto"] = "auto"
    if "layers" in raw and raw["layers"] != "auto":
        if not isinstance(raw["layers"], list):
            raise c.wrong(f"{p}.layers", '"auto" or a non-empty array of layer indices', raw["layers"])
        layers = c.int_list(raw, "layers", p, 0, "layer indices")
    return TargetConfig(
        host=host,
        model_path=c.get(raw, "model_path", p, is_text, "the model directory on the target host", required=True),
        kernels=c.get(raw, "kernels", p, lambda v: v in KERNEL_POLICIES, '"fast", "torch" or "any"', "fast"),
        layers=layers,
        python=c.get(raw, "python", p, is_text, "a Python interpreter (name or path)"),
        paths=_target_paths(c, raw, hosts),
    )


def _target_paths(c: Checker, raw: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> dict[str, str]:
    value = raw.get("paths", {})
    if not isinstance(value, dict):
        raise c.wrong("target.paths", "a table of host = model directory", value)
    paths = {}
    for host, path in value.items():
        name = c.host_ref(host, f"target.paths.{host}", hosts)
        if not is_text(path):
            raise c.wrong(f"target.paths.{host}", "the target's model directory on that host", path)
        paths[name] = path
    return paths


def parse_prompts(c: Checker, data: Mapping[str, Any]) -> PromptsConfig:
    """Check the `[prompts]` table (absent: the shipped prompts); raise the first problem."""
    raw = c.table(data, "prompts", "prompts", required=False)
    if raw is None:
        return PromptsConfig()
    p = "prompts"
    c.keys(raw, p, PROMPTS_KEYS)
    return PromptsConfig(
        file=c.get(raw, "file", p, is_text, "a JSON-lines prompt file path"),
        max_new_tokens=c.get(raw, "max_new_tokens", p, is_positive_int, "a positive integer"),
    )
