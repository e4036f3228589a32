"""The resolved plan: what `config check` shows about hosts, service, layers, prompts and steps."""

from __future__ import annotations

import io
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from console.config import config_to_dict, dump_toml, example_config_text, load_config, parse_config
from console.procedure.steps import WINDOW as STEPS  # the engine's step table, window route
from console.service.control import manager_from_config
from console.views.plan import (
    procedure_steps,
    render_plan,
    service_commands,
    startup_log_command,
    summarize_prompts,
)

SHIPPED_IDS = ("fizzbuzz", "binary_search", "linked_list_reverse", "json_parser", "async_rate_limiter",
               "trie_autocomplete", "merge_sort", "lru_cache", "graph_bfs", "matrix_multiply")


def render(config) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    console.print(render_plan(config))
    return console.export_text()


@pytest.fixture
def example() -> dict[str, Any]:
    return config_to_dict(parse_config(example_config_text()))


def write_config(tmp_path: Path, data: dict) -> Path:
    path = tmp_path / "ops.toml"
    path.write_text(dump_toml(data))
    return path


def test_example_plan_shows_the_story(example: dict) -> None:
    text = render(parse_config(dump_toml(example)))
    for expected in ("ct129", "ct200", "10.1.230.172", "systemctl stop sglang-qwen", "systemctl start sglang-qwen",
                     "http://127.0.0.1:30000", "/root/models/Qwen3.6-27B", "auto: from drafter configs at run time",
                     "GPUs 0, 1 under 1024 MiB each", "ddtree-b8, ddtree-b16, ddtree-b64, top8", "ratio to z-lab"):
        assert expected in text, expected
    assert "10: " + ", ".join(SHIPPED_IDS) in text
    assert "warning" not in text
    # The procedure table numbers the steps in order.
    rows = re.findall(r"│\s*(\d+)\s*│\s*([a-z-]+)\s*│", text)
    assert rows == [(str(i), step) for i, step in enumerate(STEPS, 1)]


def test_reference_is_marked_and_missing_reference_warned(example: dict) -> None:
    text = render(parse_config(dump_toml(example)))
    z_lab_row = next(line for line in text.splitlines() if "z-lab-Qwen3.6-27B-DFlash" in line)
    assert "reference" in z_lab_row
    example["drafters"][0]["reference"] = False
    text = render(parse_config(dump_toml(example)))
    assert "warning: no drafter has `reference = true`" in text
    assert "no reference" in dict(procedure_steps(parse_config(dump_toml(example))))["report"]


def test_explicit_layers_are_listed(example: dict) -> None:
    example["target"]["layers"] = [1, 16, 31, 46, 61]
    config = parse_config(dump_toml(example))
    assert "1, 16, 31, 46, 61" in render(config)
    assert "layers 1, 16, 31, 46, 61" in dict(procedure_steps(config))["extract"]


def test_prompt_file_is_read_relative_to_the_config(tmp_path: Path, example: dict) -> None:
    lines = [{"id": f"p{i}", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 64} for i in range(3)]
    (tmp_path / "mine.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    example["prompts"] = {"file": "mine.jsonl"}
    config = load_config(write_config(tmp_path, example))
    summary = summarize_prompts(config)
    assert summary.ids == ("p0", "p1", "p2") and summary.problem is None
    assert summary.max_new_tokens == "64 (from the prompt file)"
    assert "fetch greedy completions of 3 prompts" in dict(procedure_steps(config))["cache"]


def test_default_prompts_and_override(example: dict) -> None:
    example["prompts"] = {"max_new_tokens": 256}
    summary = summarize_prompts(parse_config(dump_toml(example)))
    assert summary.ids == SHIPPED_IDS
    assert summary.max_new_tokens == "256 (override)"


def test_missing_or_broken_prompt_file_is_a_plan_problem(tmp_path: Path, example: dict) -> None:
    example["prompts"] = {"file": "absent.jsonl"}
    config = load_config(write_config(tmp_path, example))
    summary = summarize_prompts(config)
    assert summary.ids is None and "absent.jsonl does not exist here" in (summary.problem or "")
    assert "warning: prompts:" in render(config)

    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}], "max_new_tokens": 8}
    (tmp_path / "broken.jsonl").write_text(json.dumps(good) + "\n{nope\n")
    example["prompts"] = {"file": str(tmp_path / "broken.jsonl")}
    summary = summarize_prompts(load_config(write_config(tmp_path, example)))
    assert summary.ids is None
    assert "broken.jsonl:2: not valid JSON" in (summary.problem or "")
    assert "warning: prompts:" in render(load_config(write_config(tmp_path, example)))


def test_command_manager_shows_literal_commands_with_sudo(example: dict) -> None:
    service = example["service"]
    service.pop("unit")
    service.update(manager="command", sudo=True, start=["/opt/sglang/start.sh", "--port", "30000"],
                   stop="pkill -TERM -f 'sglang serve'", status=["true"])
    config = parse_config(dump_toml(example))
    commands = service_commands(config)
    # Exactly what the manager runs: `sudo -n` (never a password prompt), a string through `sh -c`.
    stop = shlex.join(["sudo", "-n", "sh", "-c", "pkill -TERM -f 'sglang serve'"])
    assert commands == {"start": "sudo -n /opt/sglang/start.sh --port 30000", "stop": stop, "status": "sudo -n true"}
    assert f"`{stop}`" in dict(procedure_steps(config))["stop"]


def test_plan_names_the_start_up_log_command(example: dict) -> None:
    assert startup_log_command(parse_config(dump_toml(example))) == "journalctl -u sglang-qwen -f -n 0 -o cat --no-pager"
    service = example["service"]
    service.pop("unit")
    service.update(manager="command", start="/opt/s/start", stop="/opt/s/stop", status="/opt/s/status")
    assert startup_log_command(parse_config(dump_toml(example))) is None
    assert "no `log` command" in render(parse_config(dump_toml(example)))
    service.update(log=["tail", "-n", "+1", "-F", "/var/log/sglang.log"], sudo=True)
    config = parse_config(dump_toml(example))
    assert startup_log_command(config) == "sudo -n tail -n +1 -F /var/log/sglang.log"
    assert "sudo -n tail -n +1 -F /var/log/sglang.log" in render(config)


def test_systemd_with_sudo(example: dict) -> None:
    example["service"]["sudo"] = True
    commands = service_commands(parse_config(dump_toml(example)))
    assert commands["stop"] == "sudo -n systemctl stop sglang-qwen"
    assert commands["status"] == "sudo -n systemctl is-active sglang-qwen"


def test_evaluate_step_says_where_checkpoints_come_from(example: dict) -> None:
    steps = dict(procedure_steps(parse_config(dump_toml(example))))
    assert "checkpoints copied from ct200" in steps["evaluate"]
    example["eval"]["host"] = "ct200"
    steps = dict(procedure_steps(parse_config(dump_toml(example))))
    assert "copied" not in steps["evaluate"]
    assert steps["evaluate"].startswith("on ct200 (device auto)")


def test_every_step_is_described(example: dict) -> None:
    steps = procedure_steps(parse_config(dump_toml(example)))
    assert [name for name, _ in steps] == list(STEPS)
    assert all(len(what) > 20 for _, what in steps)


@pytest.mark.parametrize("service", [
    {"manager": "systemd", "unit": "sglang-qwen"},
    {"manager": "systemd", "unit": "sglang-qwen", "sudo": True},
    {"manager": "command", "start": "/opt/s/start --port 30000", "stop": ["kill", "-TERM", "4242"],
     "status": "test -e /run/s.pid", "log": ["tail", "-n", "+1", "-F", "/var/log/s.log"]},
    {"manager": "command", "sudo": True, "start": ["/opt/s/start"], "stop": "/opt/s/stop 'all of it'",
     "status": ["true"]},
])
def test_the_plan_shows_exactly_the_argv_the_manager_runs(example: dict, service: dict) -> None:
    example["service"] = {"host": example["service"]["host"], **service}
    config = parse_config(dump_toml(example))
    manager = manager_from_config(config.service, runner=None)
    commands = service_commands(config)
    assert commands == {"start": shlex.join(manager.start_argv()), "stop": shlex.join(manager.stop_argv()),
                        "status": shlex.join(manager.status_argv())}
    log = manager.log_argv()
    assert startup_log_command(config) == (shlex.join(log) if log else None)
    steps = dict(procedure_steps(config))
    assert f"`{commands['stop']}`" in steps["stop"] and f"`{commands['start']}`" in steps["restart"]
    text = render(config)
    for command in commands.values():
        assert command in text.replace("\n", ""), command
