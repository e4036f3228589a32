"""The configuration file (`dflash-ops.toml`): schema, validation and a TOML writer.

One TOML file describes the hosts, the inference service, the target model, the prompts, the
drafters and the evaluation. `load_config` reads and validates it into frozen dataclasses; any
problem is a `ConfigError` whose message names the file, the field path (`drafters[1].host`), what
was expected and what was found (and the line, for TOML syntax errors). Unknown keys are errors,
with a "did you mean" suggestion. `dump_config` writes a `Config` back as TOML (the drill uses it
to write its own config; the tests use it for round trips).

`console/config_example.toml` documents every field for the two-host setup of the story.
"""

from __future__ import annotations

import difflib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from console.config_fleet import FleetConfig

DEFAULT_CONFIG_NAME = "dflash-ops.toml"

Manager = Literal["systemd", "command"]
KernelPolicy = Literal["fast", "torch", "any"]
Device = Literal["auto", "cpu", "cuda"]
Command = str | tuple[str, ...]

MANAGERS: tuple[str, ...] = ("systemd", "command")
KERNEL_POLICIES: tuple[str, ...] = ("fast", "torch", "any")
DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")

# Host names become TOML keys, field paths and run-directory names: keep them plain.
HOST_NAME_RE = re.compile(r"^[A-Za-z0-9_-]+$")
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Drafter names become result ids and file names.
DRAFTER_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


class ConfigError(Exception):
    """A problem in the config file, told in one line: file, field path, expected, found."""

    def __init__(
        self,
        message: str,
        *,
        file: str,
        path: str | None = None,
        expected: str | None = None,
        found: str | None = None,
        line: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.file = file
        self.path = path
        self.expected = expected
        self.found = found
        self.line = line

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class HostConfig:
    """A machine reached over SSH. Unset fields are left to `~/.ssh/config` and asyncssh's defaults."""

    name: str
    address: str
    user: str | None = None
    port: int | None = None
    python: str = "python3"
    workdir: str = "~/dflash-ops"
    identity_file: str | None = None
    known_hosts: str | None = None
    ssh_config: str | None = None  # an ssh_config file to read instead of ~/.ssh/config (drill hosts: an empty one)
    connect_timeout: float = 10
    keepalive_interval: float = 15
    # A drill host whose GPUs are simulated: telemetry reads `simulated-gpu.json` in its workdir and it
    # receives the drill's workers (remote/drill/) too. Set by the drill's config, never inferred.
    simulated_gpus: bool = False


@dataclass(frozen=True)
class ServiceConfig:
    """The inference server whose GPUs the window borrows."""

    host: str
    manager: Manager = "systemd"
    unit: str | None = None
    sudo: bool = False
    start: Command | None = None
    stop: Command | None = None
    status: Command | None = None
    log: Command | None = None  # manager "command": prints the server's log (start-up progress)
    url: str = "http://127.0.0.1:30000"
    ready_timeout_s: float = 900
    vram_free_mib: int = 1024
    stop_grace_s: float = 10
    vram_wait_s: float = 30  # after a stop: how long VRAM may stay held before its holders are offered to end
    gpus: tuple[int, ...] = ()
    # Which [[drafters]] NAME the server drafts with (speculative decoding), for the online cross-check;
    # None: matched by the draft model path /server_info reports.
    drafter: str | None = None
    # The NAME of an environment variable on the console's side holding the server's --api-key (the
    # key itself never goes in the file, a log or the journal).
    api_key_env: str | None = None

    def api_key(self) -> str | None:
        """The server's API key from the console's environment (None when no api_key_env is set);
        ConfigError when the variable named is not set."""
        return key_from_env(self.api_key_env, "service")


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


@dataclass(frozen=True)
class WindowConfig:
    """The downtime window's budget: the run refuses the stop when the forecast downtime exceeds
    `max_downtime_s` (None: no budget)."""

    max_downtime_s: float | None = None
    route: str | None = None  # the route a run is made for when `run --route` is not given (None: window)


WINDOW_ROUTES = ("window", "pause", "zero-downtime", "auto")

# What a notification can be sent for (`[notify] events`); console/notify/ says what each one carries.
NOTIFY_EVENTS: tuple[str, ...] = ("stop-approved", "overrun", "service-back", "run-ended", "left-down")


@dataclass(frozen=True)
class NotifyConfig:
    """Who is told about the window (apprise URLs: Slack, Matrix, ntfy, e-mail, webhooks), about which
    events, and when an overrun is worth saying: the downtime past its forecast by `overrun_margin_s`."""

    urls: tuple[str, ...] = ()
    events: tuple[str, ...] = NOTIFY_EVENTS
    overrun_margin_s: float = 60


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
    # Replicas behind SGLang's router (console/config_fleet.py); None: one server, [service]. With a
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


# --------------------------------------------------------------------------------------------
# Describing found values


def key_from_env(variable: str | None, table: str) -> str | None:
    """A key the config names by its environment variable (the key itself never goes in the file, a
    log or the journal): None when no variable is named; ConfigError naming `[table] api_key_env`
    when the variable is not set in this console's environment."""
    if variable is None:
        return None
    key = os.environ.get(variable, "")
    if not key:
        raise ConfigError(f"[{table}] api_key_env names {variable}, which is not set in this console's "
                          f"environment (export it, or remove api_key_env)", file="", path=f"{table}.api_key_env")
    return key


def _kind(value: Any) -> str:
    """TOML's name for the type of `value`, with an article."""
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return "a date/time" if hasattr(value, "isoformat") else f"a {type(value).__name__}"


def describe(value: Any) -> str:
    """A short rendering of a found value and its type: `"16" (a string)`, `a table`."""
    if isinstance(value, dict):
        return "a table"
    if isinstance(value, str):
        text = value if len(value) <= 60 else value[:57] + "..."
        escaped = text.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}" ({_kind(value)})'
    if isinstance(value, bool):
        return f"{str(value).lower()} ({_kind(value)})"
    if isinstance(value, list):
        text = _toml_value(value) if _is_plain(value) else "[...]"
        text = text if len(text) <= 60 else text[:57] + "..."
        return f"{text} ({_kind(value)})"
    return f"{value} ({_kind(value)})"


def _is_plain(value: list) -> bool:
    return all(isinstance(v, str | int | float | bool) for v in value)


# --------------------------------------------------------------------------------------------
# Validation


class _Checker:
    """Walks the parsed TOML, raising the first problem as a ConfigError."""

    def __init__(self, file: str) -> None:
        self.file = file

    def fail(self, path: str, expected: str, found: str) -> ConfigError:
        return ConfigError(
            f"{self.file}: `{path}`: expected {expected}, found {found}",
            file=self.file,
            path=path,
            expected=expected,
            found=found,
        )

    def wrong(self, path: str, expected: str, value: Any) -> ConfigError:
        return self.fail(path, expected, describe(value))

    def missing(self, path: str, expected: str) -> ConfigError:
        return self.fail(path, expected, "nothing (the key is missing)")

    def keys(self, table: Mapping[str, Any], prefix: str, allowed: tuple[str, ...]) -> None:
        """Reject keys not in `allowed`, suggesting the closest allowed one."""
        for key in table:
            if key in allowed:
                continue
            path = f"{prefix}.{key}" if prefix else key
            close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else f"; allowed keys: {', '.join(allowed)}"
            raise ConfigError(
                f"unknown key `{path}` in {self.file}{hint}",
                file=self.file,
                path=path,
                expected=f"one of {', '.join(allowed)}",
                found=key,
            )

    def table(self, data: Mapping[str, Any], key: str, path: str, required: bool) -> dict[str, Any] | None:
        expected = "at least one [hosts.<name>] table" if path == "hosts" else f"a [{path}] table"
        if key not in data:
            if required:
                raise self.missing(path, expected)
            return None
        value = data[key]
        if not isinstance(value, dict):
            raise self.wrong(path, expected, value)
        return value

    def get(
        self,
        table: Mapping[str, Any],
        key: str,
        path: str,
        check: Callable[[Any], bool],
        expected: str,
        default: Any = None,
        required: bool = False,
    ) -> Any:
        full = f"{path}.{key}"
        if key not in table:
            if required:
                raise self.missing(full, expected)
            return default
        value = table[key]
        if not check(value):
            raise self.wrong(full, expected, value)
        return value

    def int_list(self, table: Mapping[str, Any], key: str, path: str, minimum: int, what: str) -> Any:
        """A non-empty array of distinct integers >= minimum (`what` names them); None if absent."""
        full = f"{path}.{key}"
        if key not in table:
            return None
        value = table[key]
        if not isinstance(value, list) or not value:
            raise self.wrong(full, f"a non-empty array of {what}", value)
        item_expected = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        for i, item in enumerate(value):
            if not _is_int(item) or item < minimum:
                raise self.wrong(f"{full}[{i}]", item_expected, item)
        if len(set(value)) != len(value):
            dup = next(v for v in value if value.count(v) > 1)
            raise self.fail(full, f"distinct {what}", f"{dup} twice in {describe(value)}")
        return tuple(value)

    def command(self, table: Mapping[str, Any], key: str, path: str) -> Command | None:
        full = f"{path}.{key}"
        if key not in table:
            return None
        value = table[key]
        expected = "a shell command string or a non-empty array of strings (argv)"
        if isinstance(value, str):
            if not value.strip():
                raise self.wrong(full, expected, value)
            return value
        if not isinstance(value, list) or not value:
            raise self.wrong(full, expected, value)
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise self.wrong(f"{full}[{i}]", "a string", item)
        if not value[0]:
            raise self.wrong(f"{full}[0]", "a program name", value[0])
        return tuple(value)

    def host_ref(self, name: Any, path: str, hosts: Mapping[str, Any]) -> str:
        if name not in hosts:
            known = ", ".join(hosts)
            raise self.fail(path, f"one of the configured hosts ({known})", f"{describe(name)}, which has no [hosts.{name}] table")
        return name


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _positive_number(v: Any) -> bool:
    return _is_number(v) and v > 0


def _positive_int(v: Any) -> bool:
    return _is_int(v) and v > 0


def _text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _http_url(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    parts = urlsplit(v)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


TOP_KEYS = ("hosts", "service", "target", "prompts", "drafters", "eval", "crosscheck", "window", "notify", "fleet")
HOST_KEYS = tuple(f.name for f in fields(HostConfig) if f.name != "name")
SERVICE_KEYS = tuple(f.name for f in fields(ServiceConfig))
TARGET_KEYS = tuple(f.name for f in fields(TargetConfig))
PROMPTS_KEYS = tuple(f.name for f in fields(PromptsConfig))
DRAFTER_KEYS = tuple(f.name for f in fields(DrafterConfig))
EVAL_KEYS = tuple(f.name for f in fields(EvalConfig))
CROSSCHECK_KEYS = tuple(f.name for f in fields(CrosscheckConfig))
WINDOW_KEYS = tuple(f.name for f in fields(WindowConfig))
NOTIFY_KEYS = tuple(f.name for f in fields(NotifyConfig))


def _hosts(c: _Checker, data: Mapping[str, Any]) -> dict[str, HostConfig]:
    table = c.table(data, "hosts", "hosts", required=True)
    assert table is not None
    if not table:
        raise c.fail("hosts", "at least one [hosts.<name>] table", "an empty table")
    hosts = {}
    for name, raw in table.items():
        path = f"hosts.{name}"
        if not HOST_NAME_RE.match(name):
            raise c.fail(path, "a host name of letters, digits, '-' or '_'", describe(name))
        if not isinstance(raw, dict):
            raise c.wrong(path, "a table ([hosts.<name>] describes one host, e.g. [hosts.ct129])", raw)
        c.keys(raw, path, HOST_KEYS)
        hosts[name] = HostConfig(
            name=name,
            address=c.get(raw, "address", path, _text, "a host name, IP address or ~/.ssh/config alias", required=True),
            user=c.get(raw, "user", path, _text, "a user name"),
            port=c.get(raw, "port", path, lambda v: _is_int(v) and 1 <= v <= 65535, "a port number (1-65535)"),
            python=c.get(raw, "python", path, _text, "a Python interpreter (name or path)", "python3"),
            workdir=c.get(raw, "workdir", path, _text, "a directory path", "~/dflash-ops"),
            identity_file=c.get(raw, "identity_file", path, _text, "a key file path"),
            known_hosts=c.get(raw, "known_hosts", path, _text, "a known_hosts file path"),
            ssh_config=c.get(raw, "ssh_config", path, _text, "an ssh_config file path"),
            connect_timeout=c.get(raw, "connect_timeout", path, _positive_number, "a positive number of seconds", 10),
            keepalive_interval=c.get(
                raw, "keepalive_interval", path, _positive_number, "a positive number of seconds", 15
            ),
            simulated_gpus=c.get(raw, "simulated_gpus", path, _bool, "true or false", False),
        )
    return hosts


def _service(c: _Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> ServiceConfig:
    raw = c.table(data, "service", "service", required=True)
    assert raw is not None
    return service_table(c, raw, "service", hosts)


def service_table(c: _Checker, raw: Mapping[str, Any], p: str, hosts: Mapping[str, HostConfig]) -> ServiceConfig:
    """One service's table at field path `p` ([service], or a fleet's replica)."""
    c.keys(raw, p, SERVICE_KEYS)
    host = c.host_ref(c.get(raw, "host", p, _text, "a host name", required=True), f"{p}.host", hosts)
    manager = c.get(raw, "manager", p, lambda v: v in MANAGERS, '"systemd" or "command"', "systemd")
    unit = c.get(raw, "unit", p, _text, "a systemd unit name", required=manager == "systemd")
    start, stop, status, log = (c.command(raw, k, p) for k in ("start", "stop", "status", "log"))
    if manager == "systemd":
        for key in ("start", "stop", "status", "log"):
            if key in raw:
                used = "journalctl -u is used" if key == "log" else "systemctl is used"
                raise c.fail(f"{p}.{key}", f'no command with manager = "systemd" ({used})', describe(raw[key]))
    else:
        if unit is not None:
            raise c.fail(f"{p}.unit", 'no unit with manager = "command" (start/stop/status are used)', describe(unit))
        for key, value in (("start", start), ("stop", stop), ("status", status)):
            if value is None:
                raise c.missing(f"{p}.{key}", 'a command (required with manager = "command")')
    gpus = c.int_list(raw, "gpus", p, 0, "GPU indices")
    return ServiceConfig(
        host=host,
        manager=manager,
        unit=unit,
        sudo=c.get(raw, "sudo", p, _bool, "true or false", False),
        start=start,
        stop=stop,
        status=status,
        log=log,
        url=c.get(raw, "url", p, _http_url, "an http:// or https:// URL with a host", "http://127.0.0.1:30000"),
        ready_timeout_s=c.get(raw, "ready_timeout_s", p, _positive_number, "a positive number of seconds", 900),
        vram_free_mib=c.get(raw, "vram_free_mib", p, _positive_int, "a positive integer (MiB per GPU)", 1024),
        stop_grace_s=c.get(raw, "stop_grace_s", p, _positive_number, "a positive number of seconds", 10),
        vram_wait_s=c.get(raw, "vram_wait_s", p, _positive_number, "a positive number of seconds", 30),
        gpus=gpus or (),
        drafter=c.get(raw, "drafter", p, _text, "the name of one of the [[drafters]]"),
        api_key_env=c.get(raw, "api_key_env", p, lambda v: isinstance(v, str) and bool(ENV_NAME_RE.match(v)),
                          "the name of an environment variable (letters, digits and _, not starting with a digit)"),
    )


def _target(c: _Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig], default_host: str) -> TargetConfig:
    raw = c.table(data, "target", "target", required=True)
    assert raw is not None
    p = "target"
    c.keys(raw, p, TARGET_KEYS)
    host = default_host
    if "host" in raw:
        host = c.host_ref(c.get(raw, "host", p, _text, "a host name"), f"{p}.host", hosts)
    layers: tuple[int, ...] | Literal["auto"] = "auto"
    if "layers" in raw and raw["layers"] != "auto":
        if not isinstance(raw["layers"], list):
            raise c.wrong(f"{p}.layers", '"auto" or a non-empty array of layer indices', raw["layers"])
        layers = c.int_list(raw, "layers", p, 0, "layer indices")
    return TargetConfig(
        host=host,
        model_path=c.get(raw, "model_path", p, _text, "the model directory on the target host", required=True),
        kernels=c.get(raw, "kernels", p, lambda v: v in KERNEL_POLICIES, '"fast", "torch" or "any"', "fast"),
        layers=layers,
        python=c.get(raw, "python", p, _text, "a Python interpreter (name or path)"),
        paths=_target_paths(c, raw, hosts),
    )


def _target_paths(c: _Checker, raw: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> dict[str, str]:
    value = raw.get("paths", {})
    if not isinstance(value, dict):
        raise c.wrong("target.paths", "a table of host = model directory", value)
    paths = {}
    for host, path in value.items():
        name = c.host_ref(host, f"target.paths.{host}", hosts)
        if not _text(path):
            raise c.wrong(f"target.paths.{host}", "the target's model directory on that host", path)
        paths[name] = path
    return paths


def _prompts(c: _Checker, data: Mapping[str, Any]) -> PromptsConfig:
    raw = c.table(data, "prompts", "prompts", required=False)
    if raw is None:
        return PromptsConfig()
    p = "prompts"
    c.keys(raw, p, PROMPTS_KEYS)
    return PromptsConfig(
        file=c.get(raw, "file", p, _text, "a JSON-lines prompt file path"),
        max_new_tokens=c.get(raw, "max_new_tokens", p, _positive_int, "a positive integer"),
    )


def _drafters(c: _Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig]) -> tuple[DrafterConfig, ...]:
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
        host = c.host_ref(c.get(raw, "host", p, _text, "a host name", required=True), f"{p}.host", hosts)
        is_reference = c.get(raw, "reference", p, _bool, "true or false", False)
        if is_reference and reference is not None:
            raise c.fail(f"{p}.reference", f"at most one reference drafter ({reference!r} is already one)", "true")
        if is_reference:
            reference = name
        drafters.append(DrafterConfig(
            name=name,
            host=host,
            path=c.get(raw, "path", p, _text, "the checkpoint directory on the drafter's host", required=True),
            reference=is_reference,
            layers=c.int_list(raw, "layers", p, 0, "layer ids"),
        ))
    return tuple(drafters)


def _eval(c: _Checker, data: Mapping[str, Any], hosts: Mapping[str, HostConfig], default_host: str) -> EvalConfig:
    raw = c.table(data, "eval", "eval", required=False) or {}
    p = "eval"
    c.keys(raw, p, EVAL_KEYS)
    host = default_host
    if "host" in raw:
        host = c.host_ref(c.get(raw, "host", p, _text, "a host name"), f"{p}.host", hosts)
    return EvalConfig(
        host=host,
        device=c.get(raw, "device", p, lambda v: v in DEVICES, '"auto", "cpu" or "cuda"', "auto"),
        budgets=c.int_list(raw, "budgets", p, 1, "positive integers") or (8, 16, 64),
        topk=c.get(raw, "topk", p, _positive_int, "a positive integer", 8),
        batch_anchors=c.get(raw, "batch_anchors", p, _positive_int, "a positive integer", 64),
    )


def _crosscheck(c: _Checker, data: Mapping[str, Any]) -> CrosscheckConfig:
    raw = c.table(data, "crosscheck", "crosscheck", required=False) or {}
    c.keys(raw, "crosscheck", CROSSCHECK_KEYS)
    return CrosscheckConfig(
        prompts=c.get(raw, "prompts", "crosscheck", _positive_int, "a positive integer (prompts replayed)", 16),
        budget_s=c.get(raw, "budget_s", "crosscheck", _positive_number, "a positive number of seconds", 120),
    )


def _window(c: _Checker, data: Mapping[str, Any]) -> WindowConfig:
    raw = c.table(data, "window", "window", required=False) or {}
    c.keys(raw, "window", WINDOW_KEYS)
    return WindowConfig(
        max_downtime_s=c.get(raw, "max_downtime_s", "window", _positive_number, "a positive number of seconds"),
        route=c.get(raw, "route", "window", lambda v: v in WINDOW_ROUTES, " or ".join(f'"{r}"' for r in WINDOW_ROUTES)),
    )


def _notify_url(v: Any) -> bool:
    """A URL apprise has a plugin for (it parses it the way it will send to it)."""
    if not _text(v):
        return False
    import apprise  # only when there is a [notify] table: the rest of the config needs no apprise

    return apprise.Apprise.instantiate(v, suppress_exceptions=True) is not None


def _notify(c: _Checker, data: Mapping[str, Any]) -> NotifyConfig:
    raw = c.table(data, "notify", "notify", required=False) or {}
    p = "notify"
    c.keys(raw, p, NOTIFY_KEYS)
    urls = c.get(raw, "urls", p, lambda v: isinstance(v, list), "an array of notification URLs", [])
    for i, url in enumerate(urls):
        if not _notify_url(url):
            raise c.wrong(f"{p}.urls[{i}]", "a notification URL apprise knows (json://, ntfy://, slack://, "
                                            "matrix://, mailto://, ...: see apprise's list of services)", url)
    events = c.get(raw, "events", p, lambda v: isinstance(v, list) and bool(v),
                   f"a non-empty array of events ({', '.join(NOTIFY_EVENTS)})", list(NOTIFY_EVENTS))
    for i, event in enumerate(events):
        if event not in NOTIFY_EVENTS:
            raise c.wrong(f"{p}.events[{i}]", f"one of {', '.join(NOTIFY_EVENTS)}", event)
    return NotifyConfig(
        urls=tuple(urls),
        events=tuple(dict.fromkeys(events)),
        overrun_margin_s=c.get(raw, "overrun_margin_s", p, lambda v: _is_number(v) and v >= 0,
                               "a number of seconds, 0 or more", 60),
    )


def validate(data: Mapping[str, Any], file: str = DEFAULT_CONFIG_NAME) -> Config:
    """Check parsed TOML `data` against the schema and build a `Config`; raise `ConfigError`."""
    c = _Checker(file)
    c.keys(data, "", TOP_KEYS)
    hosts = _hosts(c, data)
    fleet = None
    if "fleet" in data:  # a fleet behind SGLang's router: its replicas are the services (console/config_fleet.py)
        from console.config_fleet import parse_fleet

        fleet = parse_fleet(c, data, hosts)
        service = fleet.replicas[0].service  # what one-server code reads; the fleet window picks its replica
    else:
        service = _service(c, data, hosts)
    target = _target(c, data, hosts, service.host)
    prompts = _prompts(c, data)
    drafters = _drafters(c, data, hosts)
    evaluation = _eval(c, data, hosts, target.host)
    names = [d.name for d in drafters]
    served = [(f"fleet.replicas[{i}]", r.service) for i, r in enumerate(fleet.replicas)] if fleet else [("service", service)]
    for p, one in served:
        if one.drafter is not None and one.drafter not in names:
            raise c.fail(f"{p}.drafter", f"one of the configured drafters ({', '.join(names) or 'there are none'})",
                         describe(one.drafter))
    if target.layers == "auto" and not drafters:
        raise c.fail("target.layers", 'a list of layer indices ("auto" reads them from the drafters, and there are none)', '"auto"')
    return Config(hosts=hosts, service=service, target=target, prompts=prompts, drafters=drafters, eval=evaluation,
                  crosscheck=_crosscheck(c, data), window=_window(c, data), notify=_notify(c, data), fleet=fleet)


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


# --------------------------------------------------------------------------------------------
# Writing TOML


_BARE_KEY_RE = re.compile(r"^[A-Za-z0-9_-]+$")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _toml_key(key: str) -> str:
    return key if _BARE_KEY_RE.match(key) else _toml_string(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _table_dict(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields as TOML values; unset ones (None, empty) are left out so defaults apply."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip or value is None or value == () or value == {}:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def config_to_dict(config: Config) -> dict[str, Any]:
    """`config` as the nested dict its TOML file holds (what `validate` accepts)."""
    out = {
        "hosts": {name: _table_dict(host, skip=("name",)) for name, host in config.hosts.items()},
        "service": _table_dict(config.service),
        "target": _table_dict(config.target),
        "prompts": _table_dict(config.prompts),
        "drafters": [_table_dict(d) for d in config.drafters],
        "eval": _table_dict(config.eval),
        "crosscheck": _table_dict(config.crosscheck),
        "window": _table_dict(config.window),
        **({"notify": _table_dict(config.notify)} if config.notify.urls else {}),  # no one to tell: no table
    }
    if config.fleet is not None:  # the replicas are the services: no [service] of its own
        from console.config_fleet import fleet_to_dict

        del out["service"]
        out["fleet"] = fleet_to_dict(config.fleet)
    return out


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _emit_table(table: dict[str, Any], prefix: str, out: list[str], header: str | None) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and not _is_table_array(v)}
    if header is not None:
        out.append(header)
    out.extend(f"{_toml_key(k)} = {_toml_value(v)}" for k, v in scalars.items())
    if header is not None or scalars:
        out.append("")
    for key, value in table.items():
        path = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
        if isinstance(value, dict):
            # A table holding only sub-tables needs no header of its own.
            only_tables = value and all(isinstance(v, dict) or _is_table_array(v) for v in value.values())
            _emit_table(value, path, out, None if only_tables else f"[{path}]")
        elif _is_table_array(value):
            for item in value:
                if any(isinstance(v, dict) or _is_table_array(v) for v in item.values()):
                    raise TypeError(f"nested tables inside [[{path}]] are not supported")
                _emit_table(item, path, out, f"[[{path}]]")


def dump_toml(data: dict[str, Any]) -> str:
    """Write a nested dict of TOML values (tables, arrays of tables, scalars, arrays) as TOML text."""
    out: list[str] = []
    _emit_table(data, "", out, None)
    return "\n".join(out)


def dump_config(config: Config) -> str:
    """Write `config` as TOML that `parse_config` reads back to an equal `Config`."""
    return dump_toml(config_to_dict(config))
