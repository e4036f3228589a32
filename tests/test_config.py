"""Config validation: every mistake is one clear ConfigError naming the file, field, expectation."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from console.config import (
    ConfigError,
    DrafterConfig,
    config_to_dict,
    dump_toml,
    example_config_text,
    load_config,
    parse_config,
)


@pytest.fixture
def example() -> dict[str, Any]:
    """The shipped example as a plain dict, for tests to damage one field at a time."""
    return config_to_dict(parse_config(example_config_text()))


def error_for(data: dict[str, Any], file: str = "dflash-ops.toml") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(dump_toml(data), file)
    return info.value


def test_example_is_the_two_host_story() -> None:
    config = parse_config(example_config_text())
    assert set(config.hosts) == {"ct129", "ct200"}
    assert config.service.host == "ct129" and config.service.unit == "sglang-qwen"
    assert config.service.manager == "systemd" and config.service.gpus == (0, 1)
    assert config.service.url == "http://127.0.0.1:30000"
    assert config.target.model_path.endswith("Qwen3.6-27B")
    assert config.target.kernels == "fast" and config.target.layers == "auto"
    assert config.reference is not None and config.reference.name == "z-lab"
    assert all(d.host == "ct200" for d in config.drafters)
    assert config.eval.host == "ct129" and config.eval.device == "auto"
    assert config.eval.budgets == (8, 16, 64) and config.eval.topk == 8
    assert config.warnings() == []


def test_defaults_fill_in_a_minimal_config() -> None:
    config = parse_config(
        """
        [hosts.box]
        address = "box.example"
        [service]
        host = "box"
        unit = "sglang"
        [target]
        model_path = "/models/t"
        layers = [1, 16, 31]
        """
    )
    host = config.hosts["box"]
    assert (host.name, host.python, host.workdir, host.port, host.user) == ("box", "python3", "~/dflash-ops", None, None)
    assert (host.connect_timeout, host.keepalive_interval) == (10, 15)
    assert config.service.manager == "systemd" and config.service.sudo is False
    assert (config.service.ready_timeout_s, config.service.vram_free_mib) == (900, 1024)
    assert config.target.host == "box" and config.target.kernels == "fast"
    assert config.target.layers == (1, 16, 31)
    assert config.eval.host == "box" and config.eval.budgets == (8, 16, 64) and config.eval.topk == 8
    assert config.prompts.file is None and config.drafters == ()
    assert any("no [[drafters]]" in w for w in config.warnings())


REQUIRED = [
    ("hosts", lambda d: d.pop("hosts")),
    ("service", lambda d: d.pop("service")),
    ("target", lambda d: d.pop("target")),
    ("hosts.ct129.address", lambda d: d["hosts"]["ct129"].pop("address")),
    ("service.host", lambda d: d["service"].pop("host")),
    ("service.unit", lambda d: d["service"].pop("unit")),
    ("target.model_path", lambda d: d["target"].pop("model_path")),
    ("drafters[1].name", lambda d: d["drafters"][1].pop("name")),
    ("drafters[0].host", lambda d: d["drafters"][0].pop("host")),
    ("drafters[1].path", lambda d: d["drafters"][1].pop("path")),
]


@pytest.mark.parametrize(("path", "damage"), REQUIRED, ids=[p for p, _ in REQUIRED])
def test_each_required_field_missing_is_named(example: dict, path: str, damage) -> None:
    damage(example)
    error = error_for(example)
    assert error.path == path
    assert str(error).startswith(f"dflash-ops.toml: `{path}`: expected ")
    assert str(error).endswith("found nothing (the key is missing)")


@pytest.mark.parametrize("key", ["start", "stop", "status"])
def test_command_manager_needs_all_three_commands(example: dict, key: str) -> None:
    service = example["service"]
    service.pop("unit")
    service.update(manager="command", start="/opt/s/start", stop=["pkill", "-f", "sglang"], status="true")
    assert parse_config(dump_toml(example)).service.stop == ("pkill", "-f", "sglang")
    service.pop(key)
    error = error_for(example)
    assert error.path == f"service.{key}" and 'manager = "command"' in str(error)


def test_systemd_manager_rejects_commands_it_would_ignore(example: dict) -> None:
    example["service"]["stop"] = "kill -9 1234"
    error = error_for(example)
    assert error.path == "service.stop"
    assert 'systemd' in str(error) and '"kill -9 1234" (a string)' in str(error)


def test_command_manager_takes_an_optional_log_command(example: dict) -> None:
    service = example["service"]
    service.pop("unit")
    service.update(manager="command", start="/opt/s/start", stop="/opt/s/stop", status="/opt/s/status")
    assert parse_config(dump_toml(example)).service.log is None  # optional: no start-up progress then
    service["log"] = "tail -n +1 -F /var/log/sglang.log"
    assert parse_config(dump_toml(example)).service.log == "tail -n +1 -F /var/log/sglang.log"
    service["log"] = ["journalctl", "--user", "-u", "sglang", "-f"]
    assert parse_config(dump_toml(example)).service.log == ("journalctl", "--user", "-u", "sglang", "-f")
    service["log"] = ""
    error = error_for(example)
    assert error.path == "service.log" and "a shell command string or a non-empty array" in str(error)
    service["log"] = ["tail", 5]
    assert error_for(example).path == "service.log[1]"


def test_systemd_manager_rejects_a_log_command(example: dict) -> None:
    example["service"]["log"] = "tail -F /var/log/sglang.log"
    error = error_for(example)
    assert error.path == "service.log" and "journalctl" in str(error)


def test_wrong_type_message_names_field_expectation_and_found_value(example: dict) -> None:
    example["eval"]["budgets"] = [8, "16", 64]
    assert str(error_for(example)) == (
        'dflash-ops.toml: `eval.budgets[1]`: expected a positive integer, found "16" (a string)'
    )


WRONG = [
    ("hosts.ct129.port", "22", '"22" (a string)'),
    ("hosts.ct129.port", 0, "0 (an integer)"),
    ("hosts.ct129.connect_timeout", -1.5, "-1.5 (a float)"),
    ("hosts.ct129.address", True, "true (a boolean)"),
    ("service.manager", "upstart", '"upstart" (a string)'),
    ("service.sudo", "yes", '"yes" (a string)'),
    ("service.url", "127.0.0.1:30000", '"127.0.0.1:30000" (a string)'),
    ("service.vram_free_mib", 1.5, "1.5 (a float)"),
    ("target.kernels", "fla", '"fla" (a string)'),
    ("target.layers", "all", '"all" (a string)'),
    ("target.layers", [], "[] (an array)"),
    ("eval.device", "gpu", '"gpu" (a string)'),
    ("eval.topk", 0, "0 (an integer)"),
    ("eval.budgets", 8, "8 (an integer)"),
    ("prompts.max_new_tokens", {"a": 1}, "a table"),
]


def _set(data: dict, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        data = data.setdefault(part, {})
    data[last] = value


@pytest.mark.parametrize(("path", "value", "found"), WRONG, ids=[f"{p}={v!r}" for p, v, _ in WRONG])
def test_wrong_types_and_values(example: dict, path: str, value: Any, found: str) -> None:
    _set(example, path, value)
    error = error_for(example)
    assert error.path == path
    assert error.found == found
    assert str(error) == f"dflash-ops.toml: `{path}`: expected {error.expected}, found {found}"


def test_bad_list_item_is_named_by_index(example: dict) -> None:
    example["target"]["layers"] = [1, 16, -3]
    assert error_for(example).path == "target.layers[2]"
    example["target"]["layers"] = [1, 16, 16]
    error = error_for(example)
    assert error.path == "target.layers" and "16 twice" in str(error)


def test_unknown_key_suggests_the_close_one(example: dict) -> None:
    example["hosts"]["ct129"]["adress"] = example["hosts"]["ct129"].pop("address")
    assert str(error_for(example)) == "unknown key `hosts.ct129.adress` in dflash-ops.toml; did you mean `address`?"


@pytest.mark.parametrize(
    ("where", "key", "path"),
    [
        ((), "servce", "servce"),
        (("service",), "ready_timeout", "service.ready_timeout"),
        (("drafters", 1), "refrence", "drafters[1].refrence"),
        (("eval",), "zzz", "eval.zzz"),
    ],
)
def test_unknown_keys_at_every_level(example: dict, where: tuple, key: str, path: str) -> None:
    table = example
    for part in where:
        table = table[part]
    table[key] = 1
    error = error_for(example)
    assert error.path == path
    assert str(error).startswith(f"unknown key `{path}` in dflash-ops.toml")


def test_unknown_key_without_a_close_match_lists_the_allowed(example: dict) -> None:
    example["prompts"]["zzzz"] = 1
    assert "allowed keys: file, max_new_tokens" in str(error_for(example))


@pytest.mark.parametrize(
    ("path", "damage"),
    [
        ("service.host", lambda d: d["service"].update(host="ct300")),
        ("target.host", lambda d: d["target"].update(host="ct300")),
        ("eval.host", lambda d: d["eval"].update(host="ct300")),
        ("drafters[1].host", lambda d: d["drafters"][1].update(host="ct300")),
    ],
)
def test_reference_to_a_missing_host_names_it(example: dict, path: str, damage) -> None:
    damage(example)
    error = error_for(example)
    assert error.path == path
    assert '"ct300"' in str(error) and "[hosts.ct300]" in str(error)
    assert "ct129, ct200" in str(error)


def test_drafter_names_unique_and_one_reference(example: dict) -> None:
    dup = copy.deepcopy(example)
    dup["drafters"][1]["name"] = "z-lab"
    assert error_for(dup).path == "drafters[1].name"
    two_refs = copy.deepcopy(example)
    two_refs["drafters"][1]["reference"] = True
    error = error_for(two_refs)
    assert error.path == "drafters[1].reference" and "'z-lab'" in str(error)


def test_no_reference_is_a_warning_not_an_error(example: dict) -> None:
    example["drafters"][0]["reference"] = False
    config = parse_config(dump_toml(example))
    assert config.reference is None
    assert any("reference" in w for w in config.warnings())


def test_auto_layers_need_a_drafter(example: dict) -> None:
    example["drafters"] = []
    error = error_for(example)
    assert error.path == "target.layers" and "auto" in str(error)
    example["target"]["layers"] = [59, 60, 61, 62, 63]
    assert parse_config(dump_toml(example)).target.layers == (59, 60, 61, 62, 63)


def test_drafters_must_be_an_array_of_tables(example: dict) -> None:
    example["drafters"] = {"name": "x"}
    error = error_for(example)
    assert error.path == "drafters" and "[[drafters]]" in str(error)


def test_bad_host_table_name(example: dict) -> None:
    example["hosts"]["gpu box"] = {"address": "x"}
    assert error_for(example).path == "hosts.gpu box"


def test_syntax_error_gives_the_line() -> None:
    text = example_config_text().replace('unit = "sglang-qwen"', "unit = sglang-qwen", 1)
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.startswith("unit = sglang-qwen"))
    with pytest.raises(ConfigError) as info:
        parse_config(text, "ops.toml")
    assert info.value.line == line
    assert str(info.value).startswith(f"ops.toml, line {line}, column ")
    assert "invalid TOML" in str(info.value)


def test_duplicate_table_is_a_syntax_error_with_line() -> None:
    text = '[hosts.a]\naddress = "a"\n\n[hosts.a]\naddress = "b"\n'
    with pytest.raises(ConfigError) as info:
        parse_config(text)
    assert info.value.line == 4


def test_load_config_file_problems(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"nope\.toml: no such file .*config init"):
        load_config(tmp_path / "nope.toml")
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b'[hosts.a]\naddress = "\xff"\n')
    with pytest.raises(ConfigError, match=r"bin\.toml, line 2: not UTF-8"):
        load_config(binary)


def test_load_config_keeps_source_and_resolves_relative_paths(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "ops.toml"
    path.parent.mkdir()
    path.write_text(example_config_text())
    config = load_config(path)
    assert config.source == path
    assert config.base_dir() == path.parent.resolve()
    assert config == parse_config(example_config_text())  # source is not part of equality


def test_config_objects_are_frozen() -> None:
    drafter = DrafterConfig(name="a", host="h", path="/p")
    with pytest.raises(AttributeError):
        drafter.name = "b"  # type: ignore[misc]
