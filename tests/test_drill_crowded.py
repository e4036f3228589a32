"""The crowded GPU drill (`drill up --gpu --crowded`): the card filled but for a little room once the
server is up, so that the pause route must release the weights too (issue 40's case). The GPU run
itself is `bench/gpu_suite.sh window-weights`; here, what can be checked without a GPU: that the
crowded figures make the console's own plan release the weights, and that the flag is refused
without --gpu."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from console.drill import config as drill_config
from console.drill.layout import DrillLayout
from console.procedure.fit import longest_tokens, need_mib
from console.procedure.steps.pause import release_plan
from console.service.memory_saver import MemorySaver
from remote.drill.assets import GPU_MAX_NEW_TOKENS, write_prompts

MIB = 1 << 20
LAYERS_SAVED = 5  # the drill's drafters' target layers


def gpu_target_bytes() -> int:
    """The GPU drill's target in bf16 (remote.drill.tinymodel.gpu_config), counted on the meta device."""
    import torch
    from transformers import Qwen3_5ForCausalLM

    from remote.drill.tinymodel import gpu_config

    config = gpu_config(1024)
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(config)
    return sum(p.numel() for p in model.parameters()) * 2


def test_the_crowded_card_makes_the_plan_release_the_weights(tmp_path: Path):
    """With what the crowded card leaves free, the KV cache and graphs are not room enough for the
    extraction and the weights make it so: the plan releases all three, with their CPU backup."""
    import json

    weights = gpu_target_bytes()
    prompts = [json.loads(line) for line in write_prompts(tmp_path / "p.jsonl", GPU_MAX_NEW_TOKENS).read_text().splitlines()]
    need = need_mib(weights, longest_tokens(prompts), 2048, LAYERS_SAVED, 1024)
    saver = MemorySaver(True, True, {"kv_cache": drill_config.CROWDED_KV_CACHE_MIB / 1024,
                                     "cuda_graph": drill_config.CROWDED_CUDA_GRAPH_MIB / 1024,
                                     "weights": weights / MIB / 1024}, "0.5.23")
    tags, why = release_plan(saver, drill_config.CROWDED_FREE_MIB, 1, need)
    assert tags == ["kv_cache", "cuda_graph", "weights"], why
    # and the sizes leave margin both ways: a few hundred MiB more or less free decides nothing
    for free in (drill_config.CROWDED_FREE_MIB - 600, drill_config.CROWDED_FREE_MIB + 600):
        assert release_plan(saver, free, 1, need)[0] == ["kv_cache", "cuda_graph", "weights"]


def test_the_crowded_servers_commands(tmp_path: Path):
    """Its server runs a small KV pool and graphs, and its CUDA worker takes all but the free room once
    the server is up; the plain GPU drill keeps its fixed worker."""
    crowded = " ".join(drill_config.service_commands(DrillLayout.at(tmp_path, gpu=True, crowded=True),
                                                     sys.executable, 1)["start"])
    assert f"--cuda-leave-mib {drill_config.CROWDED_FREE_MIB}" in crowded and "--cuda-mib" not in crowded
    assert f"--kv-cache-mib {drill_config.CROWDED_KV_CACHE_MIB}" in crowded
    plain = " ".join(drill_config.service_commands(DrillLayout.at(tmp_path, gpu=True), sys.executable, 1)["start"])
    assert f"--cuda-mib {drill_config.GPU_SERVICE_EXTRA_MIB}" in plain and "--cuda-leave-mib" not in plain


def test_crowded_needs_the_gpu(tmp_path: Path):
    from console.cli.main import build_parser
    from console.drill.hosts import DrillError, up

    with pytest.raises(DrillError, match="--crowded .* needs --gpu"):
        up(tmp_path / "drill", gpu=False, crowded=True)
    assert build_parser().parse_args(["drill", "up", "--gpu", "--crowded"]).crowded is True
    assert build_parser().parse_args(["drill", "--headless"]).crowded is False
