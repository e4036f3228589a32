"""Property tests: any valid config survives TOML and back; any single bad field is named."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from console.config import (
    DRAFTER_NAME_RE,
    HOST_NAME_RE,
    Config,
    ConfigError,
    DrafterConfig,
    EvalConfig,
    HostConfig,
    PromptsConfig,
    ServiceConfig,
    TargetConfig,
    config_to_dict,
    dump_config,
    dump_toml,
    parse_config,
)

# Any Unicode text (control characters, quotes, backslashes included) that is not blank.
text = st.text(min_size=1, max_size=20).filter(lambda s: s.strip() != "")
maybe_text = st.none() | text
seconds = st.integers(1, 10_000) | st.floats(0.001, 1e6, allow_nan=False, allow_infinity=False)
host_names = st.lists(st.from_regex(HOST_NAME_RE, fullmatch=True).filter(lambda s: len(s) < 20),
                      min_size=1, max_size=3, unique=True)
argv = st.lists(st.text(max_size=10), min_size=1, max_size=4).filter(lambda a: a[0] != "").map(tuple)
command = text | argv
distinct_ints = lambda lo: st.lists(st.integers(lo, 200), min_size=1, max_size=6, unique=True).map(tuple)  # noqa: E731
url = st.builds(
    lambda scheme, host, port: f"{scheme}://{host}:{port}",
    st.sampled_from(["http", "https"]), st.from_regex(r"[a-z][a-z0-9.-]{0,15}", fullmatch=True),
    st.integers(1, 65535),
)


@st.composite
def configs(draw: st.DrawFn) -> Config:
    names = draw(host_names)
    host_of = st.sampled_from(names)
    hosts = {
        name: HostConfig(
            name=name, address=draw(text), user=draw(maybe_text), port=draw(st.none() | st.integers(1, 65535)),
            python=draw(text), workdir=draw(text), identity_file=draw(maybe_text), known_hosts=draw(maybe_text),
            connect_timeout=draw(seconds), keepalive_interval=draw(seconds),
        )
        for name in names
    }
    if draw(st.booleans()):
        manager = dict(manager="systemd", unit=draw(text))
    else:
        manager = dict(manager="command", start=draw(command), stop=draw(command), status=draw(command),
                       log=draw(st.none() | command))
    service = ServiceConfig(
        host=draw(host_of), **manager, sudo=draw(st.booleans()), url=draw(url),
        ready_timeout_s=draw(seconds), vram_free_mib=draw(st.integers(1, 200_000)),
        stop_grace_s=draw(seconds), gpus=draw(st.just(()) | distinct_ints(0)),
    )
    drafter_names = draw(st.lists(st.from_regex(DRAFTER_NAME_RE, fullmatch=True).filter(lambda s: len(s) < 20),
                                  max_size=4, unique=True))
    reference = draw(st.none() | st.sampled_from(drafter_names)) if drafter_names else None
    drafters = tuple(
        DrafterConfig(name=n, host=draw(host_of), path=draw(text), reference=n == reference) for n in drafter_names
    )
    # "auto" takes the layers from the drafters, so it needs at least one.
    layers = draw(st.just("auto") | distinct_ints(0)) if drafters else draw(distinct_ints(0))
    target = TargetConfig(
        host=draw(host_of), model_path=draw(text), kernels=draw(st.sampled_from(["fast", "torch", "any"])),
        layers=layers, python=draw(maybe_text),
    )
    evaluation = EvalConfig(
        host=draw(host_of), device=draw(st.sampled_from(["auto", "cpu", "cuda"])), budgets=draw(distinct_ints(1)),
        topk=draw(st.integers(1, 64)), batch_anchors=draw(st.integers(1, 4096)),
    )
    prompts = PromptsConfig(file=draw(maybe_text), max_new_tokens=draw(st.none() | st.integers(1, 1 << 20)))
    return Config(hosts=hosts, service=service, target=target, eval=evaluation, prompts=prompts, drafters=drafters)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs())
def test_valid_configs_round_trip_through_toml(config: Config) -> None:
    assert parse_config(dump_config(config)) == config


# Single-field corruptions: (field path, how to damage the dict). Each must be reported at that path.
def _host(data: dict) -> str:
    return next(iter(data["hosts"]))


def _corruptions(data: dict) -> list[tuple[str, tuple, st.SearchStrategy]]:
    """(field path reported, where in the dict, bad values) for this config dict."""
    h = _host(data)
    out: list[tuple[str, tuple, st.SearchStrategy]] = [
        (f"hosts.{h}.address", ("hosts", h, "address"), st.sampled_from([5, "", "  ", True, [1]])),
        (f"hosts.{h}.port", ("hosts", h, "port"), st.sampled_from(["22", 0, 70_000, 1.5, True])),
        (f"hosts.{h}.connect_timeout", ("hosts", h, "connect_timeout"), st.sampled_from([0, -1, "10", False])),
        (f"hosts.{h}.workdir", ("hosts", h, "workdir"), st.sampled_from([1, ["a"], ""])),
        ("service.host", ("service", "host"), st.sampled_from(["no-such-host", 3, ""])),
        ("service.manager", ("service", "manager"), st.sampled_from(["upstart", "", 1])),
        ("service.url", ("service", "url"), st.sampled_from(["localhost:30000", "ftp://x", 30000, "http://"])),
        ("service.vram_free_mib", ("service", "vram_free_mib"), st.sampled_from([0, -5, 1.5, "1024"])),
        ("service.sudo", ("service", "sudo"), st.sampled_from(["yes", 1, "true"])),
        ("service.ready_timeout_s", ("service", "ready_timeout_s"), st.sampled_from([0, -1.0, "900"])),
        ("service.log", ("service", "log"), st.sampled_from([5, "", "  ", [], [1], ["", "-f"], True])),
        ("target.model_path", ("target", "model_path"), st.sampled_from([5, "", ["/m"]])),
        ("target.kernels", ("target", "kernels"), st.sampled_from(["fla", "FAST", 1])),
        ("target.layers", ("target", "layers"), st.sampled_from(["all", [], 3, [1, 1]])),
        ("target.host", ("target", "host"), st.sampled_from(["no-such-host", 0])),
        ("prompts.max_new_tokens", ("prompts", "max_new_tokens"), st.sampled_from([0, -1, "10", 2.5])),
        ("eval.device", ("eval", "device"), st.sampled_from(["gpu", "", 0])),
        ("eval.topk", ("eval", "topk"), st.sampled_from([0, -8, "8", True])),
        ("eval.budgets", ("eval", "budgets"), st.sampled_from([8, [], "8,16", [8, 8]])),
        ("eval.host", ("eval", "host"), st.sampled_from(["no-such-host"])),
        ("eval.batch_anchors", ("eval", "batch_anchors"), st.sampled_from([0, 1.0])),
        (f"hosts.{h}.adress", ("hosts", h, "adress"), st.just("x")),
        ("service.gpu", ("service", "gpu"), st.just([0])),
        ("evaluation", ("evaluation",), st.just({"host": h})),
    ]
    for i, _ in enumerate(data["drafters"]):
        out += [
            (f"drafters[{i}].host", ("drafters", i, "host"), st.sampled_from(["no-such-host", 1])),
            (f"drafters[{i}].path", ("drafters", i, "path"), st.sampled_from([1, ""])),
            (f"drafters[{i}].name", ("drafters", i, "name"), st.sampled_from(["a/b", "", ".hidden", 7])),
            (f"drafters[{i}].reference", ("drafters", i, "reference"), st.sampled_from(["true", 1])),
            (f"drafters[{i}].weights", ("drafters", i, "weights"), st.just("x")),
        ]
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(), st.data())
def test_any_single_bad_field_is_reported_at_its_path(config: Config, data: st.DataObject) -> None:
    raw = config_to_dict(config)
    path, where, values = data.draw(st.sampled_from(_corruptions(raw)))
    value = data.draw(values)
    damaged = copy.deepcopy(raw)
    container = damaged
    for part in where[:-1]:
        container = container[part]
    container[where[-1]] = value
    with pytest.raises(ConfigError) as info:
        parse_config(dump_toml(damaged), "ops.toml")
    error = info.value
    # A list item may be named more precisely (`eval.budgets[1]`), never a different field.
    assert error.path == path or error.path.startswith(path + "[")
    assert f"`{error.path}`" in str(error)
    assert "ops.toml" in str(error)
    assert "\n" not in str(error)
