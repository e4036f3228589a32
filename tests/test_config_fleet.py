"""`[fleet]`: replicas behind SGLang's router, validated as [service] is, every mistake named; a
one-server config is unchanged; `config check` shows the fleet."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.config import (
    ConfigError,
    config_to_dict,
    dump_config,
    dump_toml,
    example_config_text,
    parse_config,
)
from console.config.fleet import FLEET_KEYS
from tests.standin_helpers import free_port
from tests.test_cli import assert_one_line_error, dflash_ops


def one_server() -> dict[str, Any]:
    return config_to_dict(parse_config(example_config_text()))


def fleet_data() -> dict[str, Any]:
    """The example with its [service] turned into two replicas on two hosts behind a router."""
    data = one_server()
    service = data.pop("service")
    second = {**service, "host": "ct200", "url": "http://127.0.0.1:30001"}
    data["fleet"] = {"router": "http://10.0.0.9:30000", "api_key_env": "ROUTER_KEY", "drain_timeout_s": 120,
                     "replicas": [{"name": "r1", **service}, {"name": "r2", **second}]}
    return data


def error_for(data: dict[str, Any]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_config(dump_toml(data), "fleet.toml")
    return info.value


def test_a_fleet_config_reads_its_router_and_replicas():
    config = parse_config(dump_toml(fleet_data()))
    fleet = config.fleet
    assert fleet is not None and fleet.router == "http://10.0.0.9:30000" and fleet.drain_timeout_s == 120
    assert [(r.name, r.service.host, r.worker_url) for r in fleet.replicas] == [
        ("r1", "ct129", "http://127.0.0.1:30000"), ("r2", "ct200", "http://127.0.0.1:30001")]
    assert config.service == fleet.replicas[0].service  # one-server code reads the first replica
    assert parse_config(dump_config(config)) == config  # written back and read again: the same


def test_one_server_configs_are_unchanged():
    config = parse_config(example_config_text())
    assert config.fleet is None
    assert "fleet" not in config_to_dict(config)


def test_router_url_overrides_the_url_the_router_lists():
    data = fleet_data()
    data["fleet"]["replicas"][1]["router_url"] = "http://10.0.0.5:30000"
    config = parse_config(dump_toml(data))
    assert config.fleet.replicas[1].worker_url == "http://10.0.0.5:30000"
    assert parse_config(dump_config(config)) == config


def test_the_admin_key_comes_from_the_console_environment(monkeypatch):
    fleet = parse_config(dump_toml(fleet_data())).fleet
    monkeypatch.delenv("ROUTER_KEY", raising=False)
    with pytest.raises(ConfigError, match=r"\[fleet\] api_key_env names ROUTER_KEY, which is not set"):
        fleet.api_key()
    monkeypatch.setenv("ROUTER_KEY", "s3cret")
    assert fleet.api_key() == "s3cret"


def _damaged(damage) -> dict[str, Any]:
    data = fleet_data()
    damage(data)
    return data


BAD = [
    (lambda d: d.update(service=d["fleet"]["replicas"][0]), "`service`: expected no [service] table with [fleet]"),
    (lambda d: d["fleet"].pop("router"), "`fleet.router`: expected the router's http:// or https:// URL, found nothing"),
    (lambda d: d["fleet"].update(router="10.0.0.9:30000"), "`fleet.router`: expected the router's http:// or https:// URL"),
    (lambda d: d["fleet"].update(replicas=d["fleet"]["replicas"][:1]), "`fleet.replicas`: expected at least two replicas"),
    (lambda d: d["fleet"].pop("replicas"), "`fleet.replicas`: expected the replicas behind the router"),
    (lambda d: d["fleet"].update(replicas="r1"), "`fleet.replicas`: expected an array of tables"),
    (lambda d: d["fleet"]["replicas"][1].update(name="r1"), "`fleet.replicas[1].name`: expected a name no other replica has"),
    (lambda d: d["fleet"]["replicas"][0].pop("name"), "`fleet.replicas[0].name`: expected a replica name"),
    (lambda d: d["fleet"]["replicas"][1].update(host="ct300"), "`fleet.replicas[1].host`: expected one of the configured hosts"),
    (lambda d: d["fleet"]["replicas"][1].pop("url"), "`fleet.replicas[1].url`: expected the replica's URL"),
    (lambda d: d["fleet"]["replicas"][1].update(url="http://127.0.0.1:30000"),
     "`fleet.replicas[1].url`: expected a URL no other replica has (the router knows each worker by its URL), "
     "found \"http://127.0.0.1:30000\" (a string), the URL of replica 'r1' too"),
    (lambda d: d["fleet"]["replicas"][0].update(router_url="http://10.0.0.9:30000"),
     "`fleet.replicas[0].router_url`: expected the replica's own URL, not the router's"),
    (lambda d: d["fleet"]["replicas"][1].update(manager="command"),
     "`fleet.replicas[1].unit`: expected no unit with manager = \"command\""),
    (lambda d: d["fleet"]["replicas"][0].update(drafter="nope"), "`fleet.replicas[0].drafter`: expected one of the configured drafters"),
    (lambda d: d["fleet"].update(drain_timeout_s=0), "`fleet.drain_timeout_s`: expected a positive number of seconds"),
    (lambda d: d["fleet"].update(api_key_env="1BAD"), "`fleet.api_key_env`: expected the name of an environment variable"),
    (lambda d: d["fleet"].update(router_host="gateway"), "`fleet.router_host`: expected one of the configured hosts"),
]


@pytest.mark.parametrize(("damage", "message"), BAD)
def test_each_mistake_is_named(damage, message):
    assert str(error_for(_damaged(damage))).startswith(f"fleet.toml: {message}")


def test_unknown_keys_in_fleet_and_replicas_suggest_the_close_one():
    assert "did you mean `router`?" in str(error_for(_damaged(lambda d: d["fleet"].update(routr="http://x:1"))))
    error = error_for(_damaged(lambda d: d["fleet"]["replicas"][1].update(ulr="http://x:1")))
    assert error.path == "fleet.replicas[1].ulr" and "did you mean `url`?" in str(error)


# A [fleet] table's fields, each either fine or wrong in one way: the validator accepts exactly the
# configs whose every field is fine, and otherwise names the first wrong field's path.
FIELDS = {
    "router": (st.sampled_from(["http://10.0.0.9:30000", "https://gw.example:443"]),
               st.sampled_from(["", "gw:30000", "ftp://gw", 3000])),
    "drain_timeout_s": (st.integers(1, 10_000) | st.floats(0.1, 1e5), st.sampled_from([0, -5, "60", True])),
    "api_key_env": (st.from_regex(r"[A-Z_][A-Z0-9_]{0,10}", fullmatch=True), st.sampled_from(["", "9X", "A-B", 7])),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(choices=st.fixed_dictionaries({key: st.sampled_from(["absent", "good", "bad"]) for key in FIELDS}),
       data=st.data())
def test_validator_accepts_exactly_the_good_fleet_tables(choices, data):
    config = fleet_data()
    fleet = config["fleet"]
    for key in FIELDS:
        fleet.pop(key, None)
    wrong = []
    for key in FLEET_KEYS:  # the validator's own order of fields
        if key not in FIELDS or choices[key] == "absent":
            if key == "router" and choices.get(key) == "absent":
                wrong.append("fleet.router")  # required
            continue
        good, bad = FIELDS[key]
        fleet[key] = data.draw(good if choices[key] == "good" else bad)
        if choices[key] == "bad":
            wrong.append(f"fleet.{key}")
    if not wrong:
        parsed = parse_config(dump_toml(copy.deepcopy(config)))
        assert parsed.fleet is not None and parse_config(dump_config(parsed)) == parsed
    else:
        assert error_for(config).path == wrong[0]


def test_config_check_prints_the_fleet(tmp_path):
    path = tmp_path / "fleet.toml"
    path.write_text(dump_toml(fleet_data()))
    done = dflash_ops("config", "check", "--config", str(path), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Fleet: router http://10.0.0.9:30000" in out and "$ROUTER_KEY" in out
    assert all(name in out for name in ("r1", "r2", "http://127.0.0.1:30001"))
    path.write_text(dump_toml(_damaged(lambda d: d["fleet"]["replicas"][1].update(url="http://127.0.0.1:30000"))))
    assert_one_line_error(dflash_ops("config", "check", "--config", str(path), cwd=tmp_path),
                          "fleet.replicas[1].url", "a URL no other replica has")


@pytest.mark.parametrize("mode", [("--headless", "--yes"), ("--plan",)])
def test_run_of_a_fleet_whose_router_does_not_answer_is_refused_before_anything(tmp_path, mode):
    path = tmp_path / "fleet.toml"
    data = fleet_data()
    del data["fleet"]["api_key_env"]
    data["fleet"]["router"] = router = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    path.write_text(dump_toml(data))
    done = dflash_ops("run", *mode, "--config", str(path), "--runs", str(tmp_path / "runs"), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "the fleet window is refused" in done.stderr and router in done.stderr
    assert "nothing was changed" in done.stderr and not (tmp_path / "runs").exists()
