"""Which replicas of a fleet can take the window (console/procedure/fit.py, `replica_fits`): the
extraction runs on the target's host, on the GPUs the replica's drain and stop free, with the
drafters' kernels. Facts as the probe (`remote.probe`) and the telemetry agent report them; the
example config's fleet: r1 on ct129 GPU0-1 (the target's host), r2 on ct200 (the drafters' host).
Over the whole engine and the fake router: tests/test_fleet_sweep.py (a replica that cannot take it
is refused before the drain)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from console.config import dump_toml, parse_config
from console.procedure.fit import CUDA_CONTEXT_MIB, MIB, SPLIT_FILL, replica_fits
from tests.test_config_fleet import fleet_data
from tests.tui.standin import gpu, sample

BOUND = {"causal_conv1d_fn": "causal_conv1d", "chunk_gated_delta_rule": "fla"}
WEIGHTS = 20_000 * MIB


def config(r1_gpus: list[int] | None = None, kernels: str = "fast", r2_host: str = "ct200") -> Any:
    data = fleet_data()
    r1, r2 = data["fleet"]["replicas"]
    if r1_gpus is not None:
        r1["gpus"] = r1_gpus
    r2["host"] = r2_host
    if r2_host == "ct129":
        r2["url"] = "http://127.0.0.1:30001"
    data["target"]["kernels"] = kernels
    return parse_config(dump_toml(data), "fleet.toml")


def probe(bound: dict[str, str] = BOUND, fast: bool = True, weights: int = WEIGHTS) -> dict[str, Any]:
    return {"kernels": {"fast": fast, "bound": dict(bound)},
            "model": {"exists": True, "tensor_bytes": weights, "hidden_size": 1024, "vocab_size": 32000}}


def readings(host: str, totals: list[int]):
    return sample(host, [gpu(i, 100, total) for i, total in enumerate(totals)])


def verdicts(cfg: Any, probes: dict, samples: dict, tokens: int = 100) -> dict[str, tuple[bool, str]]:
    return {f.name: (f.fits, f.why) for f in replica_fits(cfg, probes, samples, tokens, 3)}


def test_the_target_hosts_replica_fits_and_one_on_another_host_never_does():
    found = verdicts(config(), {"ct129": probe(), "ct200": probe()}, {"ct129": readings("ct129", [49140, 49140])})
    assert found["r1"][0] and found["r1"][1].startswith("its GPUs (GPU0+GPU1 on ct129) hold 88452 MiB for ~")
    assert found["r2"] == (False, "it serves on ct200; the extraction runs on the target's host ct129 ([target] host)")


def test_a_replica_without_room_names_its_gpus_and_the_numbers():
    cfg = config(r1_gpus=[1], r2_host="ct129")  # r1 on GPU1 alone, r2 on every GPU of ct129
    found = verdicts(cfg, {"ct129": probe(), "ct200": probe()}, {"ct129": readings("ct129", [16000, 16000])})
    assert not found["r1"][0] and found["r1"][1].startswith(
        "its GPUs (GPU1 on ct129) hold 16000 MiB, the extraction needs ~20")
    assert found["r2"][0] and "GPU0+GPU1 on ct129) hold 28800 MiB" in found["r2"][1]


def test_kernels_are_checked_on_the_replicas_host():
    samples = {"ct129": readings("ct129", [49140, 49140])}
    unbound = {"causal_conv1d_fn": "torch fallback", "chunk_gated_delta_rule": "fla"}
    found = verdicts(config(), {"ct129": probe(unbound, fast=False), "ct200": probe()}, samples)
    assert found["r1"] == (False, "ct129 binds causal_conv1d_fn=torch fallback, chunk_gated_delta_rule=fla, not the "
                                  "fast kernels ([target] kernels = \"fast\")")
    found = verdicts(config(kernels="any"), {"ct129": probe(unbound, fast=False), "ct200": probe()}, samples)
    assert found["r1"] == (False, "ct129 binds other kernels than ct200, where the drafters were trained "
                                  "(causal_conv1d_fn)")


def test_gpus_the_host_does_not_report_and_a_host_without_readings():
    found = verdicts(config(r1_gpus=[3]), {"ct129": probe(), "ct200": probe()}, {"ct129": readings("ct129", [100, 100])})
    assert found["r1"] == (False, "its GPUs 3 are not among ct129's (0, 1)")
    found = verdicts(config(), {"ct129": probe(), "ct200": probe()}, {"ct129": None})
    assert found["r1"][0] and found["r1"][1].startswith("its GPUs' memory is not checked (no GPU readings from ct129)")


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 100_000), min_size=1, max_size=4), st.integers(1, 60_000), st.integers(1, 4000))
def test_a_replica_fits_exactly_when_its_gpus_hold_what_the_extraction_needs(totals, weights_mib, tokens):
    cfg = config(r1_gpus=list(range(len(totals))))
    (r1, _r2) = replica_fits(cfg, {"ct129": probe(weights=weights_mib * MIB), "ct200": probe()},
                             {"ct129": readings("ct129", totals)}, tokens, 3)
    room = totals[0] if len(totals) == 1 else sum(int(t * SPLIT_FILL) for t in totals)
    assert r1.need_mib is not None and r1.need_mib >= weights_mib + CUDA_CONTEXT_MIB
    assert r1.fits == (room >= r1.need_mib) and r1.room_mib == room
