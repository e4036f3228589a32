"""SGLang's memory saver as the console reads it (`console.service.memory_saver`): `/server_info`'s
report, in SGLang 0.5.23's shape (`tests/data/sglang/0.5.23-memory-saver.json`, written from its
source) and in the rehearsal server's; the client's checks before it sends anything."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from console.service.memory_saver import CUDA_GRAPH, KV_CACHE, MEMORY_TAGS, WEIGHTS, check_tags
from console.service.sglang_api import MemorySaver, SglangClient, memory_saver_of

SAMPLE = json.loads((Path(__file__).parent / "data" / "sglang" / "0.5.23-memory-saver.json").read_text())


def test_sglang_server_info_with_the_memory_saver() -> None:
    saver = memory_saver_of(SAMPLE["server_info"])
    assert saver.enabled and saver.weights_cpu_backup
    # weight, kvcache and the graph phases' sum, per GPU, keyed by the tag that releases each
    assert saver.memory_gib == {WEIGHTS: 25.391, KV_CACHE: 14.062, CUDA_GRAPH: 1.214}
    assert saver.why_not([KV_CACHE, CUDA_GRAPH]) is None and saver.why_not([WEIGHTS]) is None


def test_a_server_without_it_or_without_a_weights_backup() -> None:
    info = copy.deepcopy(SAMPLE["server_info"])
    info["enable_weights_cpu_backup"] = False
    saver = memory_saver_of(info)
    assert saver.enabled and not saver.weights_cpu_backup
    assert saver.why_not([KV_CACHE]) is None
    assert "CPU backup" in (saver.why_not([KV_CACHE, WEIGHTS]) or "")
    info["enable_memory_saver"] = False
    assert "--enable-memory-saver" in (memory_saver_of(info).why_not([KV_CACHE]) or "")
    # a release without the keys (older servers) counts as off; no memory_usage is None, not zeros
    bare = memory_saver_of({"version": "0.4.6", "internal_states": [{"last_gen_throughput": 1.0}]})
    assert bare == MemorySaver(enabled=False, weights_cpu_backup=False, memory_gib=None, version="0.4.6")


@pytest.mark.parametrize(("version", "holds"), [
    ("0.5.23", True), ("0.5.6", True), ("0.5.6.post2", True), ("0.5.23-standin", True), ("0.6.0rc1", True),
    ("0.5.5", False), ("0.5.5.post3", False), ("0.4.6", False), ("0.5.5-standin", False),
    (None, False), ("nightly", False)])
def test_the_pause_route_needs_an_sglang_whose_pause_holds_requests(version: str | None, holds: bool) -> None:
    """/pause_generation takes a mode from SGLang 0.5.6 (io_struct.py, PauseGenerationReqInput); 0.5.5 and
    earlier read no body and abort every request in flight (docs/sglang.md). A version that cannot be
    read cannot be told: refused too, saying so."""
    info = {**SAMPLE["server_info"], "version": version}
    why = memory_saver_of(info).why_no_pause()
    assert (why is None) == holds, why
    if version is not None and not holds and version[0].isdigit():
        assert f"SGLang {version}" in why and "aborts every request" in why and "0.5.6" in why


@settings(max_examples=40, deadline=None)
@given(st.lists(st.fixed_dictionaries({
    "weight": st.floats(0, 200), "kvcache": st.floats(0, 200),
    "graph": st.dictionaries(st.sampled_from(["prefill", "decode", "target_verify"]), st.floats(0, 10))}),
    min_size=1, max_size=4))
def test_the_largest_rank_per_tag(ranks: list[dict]) -> None:
    """One internal_states entry per DP rank, each its own GPU's figures: the plan needs the largest."""
    saver = memory_saver_of({"enable_memory_saver": True, "internal_states": [{"memory_usage": r} for r in ranks]})
    assert saver.memory_gib is not None
    assert saver.memory_gib[WEIGHTS] == max(r["weight"] for r in ranks)
    assert saver.memory_gib[KV_CACHE] == max(r["kvcache"] for r in ranks)
    assert saver.memory_gib[CUDA_GRAPH] == pytest.approx(max(sum(r["graph"].values()) for r in ranks), abs=1e-3)


def test_bad_server_info_is_named() -> None:
    with pytest.raises(ValueError, match="/server_info"):
        memory_saver_of([])  # type: ignore[arg-type]
    # a malformed memory_usage is not taken for figures
    assert memory_saver_of({"internal_states": [{"memory_usage": {"weight": "lots"}}]}).memory_gib is None


def test_tags_are_checked_before_anything_is_sent() -> None:
    assert check_tags([KV_CACHE, CUDA_GRAPH, KV_CACHE], "x") == [KV_CACHE, CUDA_GRAPH]  # a repeat would crash a resume
    with pytest.raises(ValueError, match="every tag, the weights included"):
        check_tags([], "POST /release_memory_occupation")
    with pytest.raises(ValueError, match="unknown tag.*'kv'"):
        check_tags(["kv"], "x")
    with pytest.raises(ValueError, match="list"):
        check_tags("kv_cache", "x")  # type: ignore[arg-type]
    assert set(MEMORY_TAGS) == {KV_CACHE, WEIGHTS, CUDA_GRAPH}


async def test_the_client_refuses_a_bad_mode_or_tag_without_a_server() -> None:
    client = SglangClient("http://127.0.0.1:9")  # nothing listens: nothing must be sent
    with pytest.raises(ValueError, match="in_place"):
        await client.pause_generation("inplace")
    with pytest.raises(ValueError, match="no tags given"):
        await client.release_memory_occupation([])
    with pytest.raises(ValueError, match="unknown tag"):
        await client.resume_memory_occupation(["graphs"])
