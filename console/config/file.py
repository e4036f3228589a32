"""The configuration file (`dflash-ops.toml`) as a whole: read, validated, written back.

One TOML file describes the hosts, the inference service (or a fleet of them), the target model,
the prompts, the drafters and the evaluation. `load_config` reads and validates it into frozen
dataclasses, one module of this package per table; any problem is a `ConfigError` whose message
names the file, the field path (`drafters[1].host`), what was expected and what was found (and the
line, for TOML syntax errors). Unknown keys are errors, with a "did you mean" suggestion.
`dump_config` writes a `Config` back as TOML (the drill uses it to write its own config; the tests
use it for round trips).

`console/config_example.toml` documents every field for the two-host setup of the story.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

from console.config.checks import Checker, ConfigError, describe
from console.config.drafters import (
    CrosscheckConfig,
    DrafterConfig,
    EvalConfig,
    parse_crosscheck,
    parse_drafters,
    parse_eval,
)
from console.config.fleet import FleetConfig, fleet_to_dict, parse_fleet
from console.config.hosts import HostConfig, parse_hosts
from console.config.service import ServiceConfig, parse_service
from console.config.target import PromptsConfig, TargetConfig, parse_prompts, parse_target
from console.config.toml_writer import dump_toml, table_dict
from console.config.window import NotifyConfig, WindowConfig, parse_notify, parse_window

DEFAULT_CONFIG_NAME = "dflash-ops.toml"


@dataclass(frozen=True)
class Config:
    """The whole validated config. `source` is the file it came from (not part of equality)."""

    hosts: dict[str, HostConfig]
    service: ServiceConfig
    target: TargetConfig
    eval: EvalConfig
    prompts: PromptsConfig = field(default_factory=PromptsConfig)
    drafters: tuple[DrafterConfig, ...] = ()
    crosscheck: CrosscheckConfig = field(default_factory=CrosscheckConfig)
    source: Path | None = field(default=None, compare=False)
    window: WindowConfig = field(default_factory=WindowConfig)
    notify: NotifyConfig = field(default_factory=NotifyConfig)
    # Replicas behind SGLang's router (console/config/fleet.py); None: one server, [service]. With a
    # fleet, `service` is its first replica's.
    fleet: FleetConfig | None = None

    @property
    def reference(self) -> DrafterConfig | None:
        """The reference drafter, if one is marked."""
        return next((d for d in self.drafters if d.reference), None)

    def warnings(self) -> list[str]:
        """Things that are allowed but probably not what the operator wants."""
        notes = []
        if self.drafters and self.reference is None:
            notes.append("no drafter has `reference = true`: results will have no baseline to compare with")
        if not self.drafters:
            notes.append("no [[drafters]]: the window will extract hidden states but evaluate nothing")
        return notes

    def base_dir(self) -> Path:
        """Directory that relative local paths (the prompt file) are resolved against."""
        return self.source.resolve().parent if self.source else Path.cwd()


TOP_KEYS = ("hosts", "service", "target", "prompts", "drafters", "eval", "crosscheck", "window", "notify", "fleet")


def validate(data: Mapping[str, Any], file: str = DEFAULT_CONFIG_NAME) -> Config:
    """Check parsed TOML `data` against the schema and build a `Config`; raise `ConfigError`."""
    c = Checker(file)
    c.keys(data, "", TOP_KEYS)
    hosts = parse_hosts(c, data)
    fleet = None
    if "fleet" in data:  # a fleet behind SGLang's router: its replicas are the services (console/config/fleet.py)
        fleet = parse_fleet(c, data, hosts)
        service = fleet.replicas[0].service  # what one-server code reads; the fleet window picks its replica
    else:
        service = parse_service(c, data, hosts)
    target = parse_target(c, data, hosts, service.host)
    prompts = parse_prompts(c, data)
    drafters = parse_drafters(c, data, hosts)
    evaluation = parse_eval(c, data, hosts, target.host)
    names = [d.name for d in drafters]
    served = [(f"fleet.replicas[{i}]", r.service) for i, r in enumerate(fleet.replicas)] if fleet else [("service", service)]
    for p, one in served:
        if one.drafter is not None and one.drafter not in names:
            raise c.fail(f"{p}.drafter", f"one of the configured drafters ({', '.join(names) or 'there are none'})",
                         describe(one.drafter))
    if target.layers == "auto" and not drafters:
        raise c.fail("target.layers", 'a list of layer indices ("auto" reads them from the drafters, and there are none)', '"auto"')
    return Config(hosts=hosts, service=service, target=target, prompts=prompts, drafters=drafters, eval=evaluation,
                  crosscheck=parse_crosscheck(c, data), window=parse_window(c, data), notify=parse_notify(c, data),
                  fleet=fleet)


_LINE_RE = re.compile(r"\s*\(at line (\d+), column (\d+)\)\s*$")


def parse_config(text: str, file: str = DEFAULT_CONFIG_NAME, source: Path | None = None) -> Config:
    """Parse TOML `text` and validate it; `file` is the name used in messages."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        message = str(exc)
        match = _LINE_RE.search(message)
        line = int(match.group(1)) if match else None
        reason = _LINE_RE.sub("", message)
        where = f"{file}, line {line}, column {match.group(2)}" if match else file
        raise ConfigError(f"{where}: invalid TOML: {reason}", file=file, line=line) from None
    config = validate(data, file)
    return Config(**{f.name: getattr(config, f.name) for f in fields(Config) if f.name != "source"}, source=source)


def load_config(path: str | Path = DEFAULT_CONFIG_NAME) -> Config:
    """Read and validate the config file at `path`; every failure is a one-line `ConfigError`."""
    path = Path(path)
    file = str(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{file}: no such file (write an example with `dflash-ops config init {file}`)", file=file
        ) from None
    except IsADirectoryError:
        raise ConfigError(f"{file}: is a directory, expected a TOML file", file=file) from None
    except OSError as exc:
        raise ConfigError(f"{file}: cannot read: {exc.strerror}", file=file) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(f"{file}, line {line}: not UTF-8 text", file=file, line=line) from None
    return parse_config(text, file, source=path)


def example_config_text() -> str:
    """The commented example config for the two-host story (`dflash-ops config init`)."""
    return resources.files("console").joinpath("config_example.toml").read_text(encoding="utf-8")


def config_to_dict(config: Config) -> dict[str, Any]:
    """`config` as the nested dict its TOML file holds (what `validate` accepts)."""
    out = {
        "hosts": {name: table_dict(host, skip=("name",)) for name, host in config.hosts.items()},
        "service": table_dict(config.service),
        "target": table_dict(config.target),
        "prompts": table_dict(config.prompts),
        "drafters": [table_dict(d) for d in config.drafters],
        "eval": table_dict(config.eval),
        "crosscheck": table_dict(config.crosscheck),
        "window": table_dict(config.window),
        **({"notify": table_dict(config.notify)} if config.notify.urls else {}),  # no one to tell: no table
    }
    if config.fleet is not None:  # the replicas are the services: no [service] of its own
        del out["service"]
        out["fleet"] = fleet_to_dict(config.fleet)
    return out


def dump_config(config: Config) -> str:
    """Write `config` as TOML that `parse_config` reads back to an equal `Config`."""
    return dump_toml(config_to_dict(config))
