"""The configuration file (`dflash-ops.toml`), handed on as one name space: `from console.config
import Config, load_config, ...`. The file as a whole is `file.py`; each table has a module of its
own (hosts, service, fleet, target, drafters, window); `checks.py` is what their parsers share."""

from console.config.checks import ConfigError
from console.config.drafters import DRAFTER_NAME_RE, CrosscheckConfig, DrafterConfig, EvalConfig
from console.config.file import (
    DEFAULT_CONFIG_NAME,
    Config,
    config_to_dict,
    dump_config,
    example_config_text,
    load_config,
    parse_config,
    validate,
)
from console.config.fleet import FleetConfig, ReplicaConfig
from console.config.hosts import HOST_NAME_RE, HostConfig
from console.config.service import ServiceConfig
from console.config.target import PromptsConfig, TargetConfig
from console.config.toml_writer import dump_toml
from console.config.window import NOTIFY_EVENTS, NotifyConfig, WindowConfig

__all__ = [
    "DEFAULT_CONFIG_NAME", "DRAFTER_NAME_RE", "HOST_NAME_RE", "NOTIFY_EVENTS", "Config", "ConfigError",
    "CrosscheckConfig", "DrafterConfig", "EvalConfig", "FleetConfig", "HostConfig", "NotifyConfig",
    "PromptsConfig", "ReplicaConfig", "ServiceConfig", "TargetConfig", "WindowConfig", "config_to_dict",
    "dump_config", "dump_toml", "example_config_text", "load_config", "parse_config", "validate",
]
