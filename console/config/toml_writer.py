"""Writing TOML: a nested dict of tables, arrays of tables and values as the text `tomllib` reads
back (the standard library reads TOML but does not write it). The drill writes its config with it;
the tests write their damaged configs with it.
"""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

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


def toml_value(value: Any) -> str:
    """One value (boolean, integer, float, string or array of them) as TOML text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def table_dict(obj: Any, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """A dataclass's fields as TOML values; unset ones (None, empty) are left out so defaults apply."""
    out = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if f.name in skip or value is None or value == () or value == {}:
            continue
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


def _is_table_array(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _emit_table(table: dict[str, Any], prefix: str, out: list[str], header: str | None) -> None:
    scalars = {k: v for k, v in table.items() if not isinstance(v, dict) and not _is_table_array(v)}
    if header is not None:
        out.append(header)
    out.extend(f"{_toml_key(k)} = {toml_value(v)}" for k, v in scalars.items())
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
