"""A replica's GPUs are never offered to an extraction while it serves (issue 41, section 2: with r1
drained, the stop question proposed a zero-downtime extraction "on ct129 GPU2 (9140 MiB free)"; GPU2
was r2's, the replica carrying all the traffic). `where_it_fits` counts every fleet replica's GPUs on
a host as serving, not only the service's (the drained replica's)."""

from __future__ import annotations

from pathlib import Path

from console.config import load_config
from console.procedure.fit import serving_gpus, where_it_fits
from remote import probe
from tests.test_zero_downtime import gpu_sample


def fleet_on_one_host(tmp_path: Path, target: Path, r2_gpus: str | None = "[2, 3]"):
    """r1 (GPUs 0, 1) and r2 (`r2_gpus`; None: none named) on ct129 behind a router; the target's
    weights on ct129 too."""
    path = tmp_path / "fleet.toml"
    path.write_text(f'''
[hosts.ct129]
address = "ct129"
[hosts.ct200]
address = "ct200"
[target]
model_path = "{target}"
paths = {{ ct129 = "{target}" }}
[[drafters]]
name = "ref"
host = "ct200"
path = "/d"
[fleet]
router = "http://127.0.0.1:30000"
[[fleet.replicas]]
name = "r1"
host = "ct129"
unit = "sglang-r1.service"
url = "http://127.0.0.1:30001"
gpus = [0, 1]
[[fleet.replicas]]
name = "r2"
host = "ct129"
unit = "sglang-r2.service"
url = "http://127.0.0.1:30002"
''' + (f"gpus = {r2_gpus}\n" if r2_gpus is not None else ""))
    return load_config(path)


def test_the_serving_replicas_gpus_are_never_offered(tiny_target: Path, tmp_path: Path) -> None:
    facts = probe.probe(str(tiny_target))
    config = fleet_on_one_host(tmp_path, tiny_target)
    assert config.service.url.endswith(":30001")  # the config's service: r1, the replica whose window this is
    # r1 drained and stopped (its GPUs near empty), r2 serving with room on GPU2 (the walk's 9140 MiB free)
    samples = {"ct129": gpu_sample("ct129", [300, 300, 40000, 47000]), "ct200": gpu_sample("ct200", [47000])}
    assert serving_gpus(config, "ct129", samples["ct129"]) == {0, 1, 2, 3}
    fits = {f.host: f for f in where_it_fits(config, {"ct129": facts, "ct200": facts}, samples, 500, 3)}
    assert not fits["ct129"].proposed and "every GPU there serves the model" in fits["ct129"].why
    assert "GPU2" not in fits["ct129"].why
    # A GPU of ct129 that no replica uses is offered as before.
    samples["ct129"] = gpu_sample("ct129", [300, 300, 40000, 47000, 0])
    fits = {f.host: f for f in where_it_fits(config, {"ct129": facts, "ct200": facts}, samples, 500, 3)}
    assert fits["ct129"].proposed and fits["ct129"].gpus == (4,)


def test_a_replica_that_names_no_gpus_serves_on_all_of_its_host(tiny_target: Path, tmp_path: Path) -> None:
    config = fleet_on_one_host(tmp_path, tiny_target, r2_gpus=None)
    sample = gpu_sample("ct129", [300, 300, 0, 0, 0])
    assert serving_gpus(config, "ct129", sample) == {0, 1, 2, 3, 4}
    assert serving_gpus(config, "ct200", gpu_sample("ct200", [0])) == set()
