"""Reading the config's TOML, field by field: what every table's parser shares (`[fleet]` too).

A problem is a `ConfigError` in one line that names the file, the field path (`drafters[1].host`),
what was expected and what was found; `Checker` raises the first one it meets, and the `is_*`
checks say whether a found value is of the kind a field takes.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from console.config.toml_writer import toml_value

Command = str | tuple[str, ...]

# The name of an environment variable (an API key's, never the key itself).
ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
        text = toml_value(value) if _is_plain(value) else "[...]"
        text = text if len(text) <= 60 else text[:57] + "..."
        return f"{text} ({_kind(value)})"
    return f"{value} ({_kind(value)})"


def _is_plain(value: list) -> bool:
    return all(isinstance(v, str | int | float | bool) for v in value)


class Checker:
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
            if not is_int(item) or item < minimum:
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


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def is_positive_number(v: Any) -> bool:
    return is_number(v) and v > 0


def is_positive_int(v: Any) -> bool:
    return is_int(v) and v > 0


def is_text(v: Any) -> bool:
    return isinstance(v, str) and v.strip() != ""


def is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def is_http_url(v: Any) -> bool:
    if not isinstance(v, str):
        return False
    parts = urlsplit(v)
    return parts.scheme in ("http", "https") and bool(parts.hostname)


def is_env_name(v: Any) -> bool:
    return isinstance(v, str) and bool(ENV_NAME_RE.match(v))
