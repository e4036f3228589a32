"""The kernel check on real transformers releases, side by side (tests/transformers_matrix.py).

Hosts run whatever transformers they were set up with, often two different ones: the seed story is
two hosts whose kernels differ while nothing says so. Each release of `transformers-matrix.txt` (the
oldest supported, the last and first of each binding scheme, the newest) is probed as a training
host with fla and no causal-conv1d (the FAKE packages of `fake_kernel_paths`): each function must be
read as bound where that release really binds it, under that release's scheme, and the probe table
must flag exactly the torch-bound ones against a host with both (the lock's transformers).

With `DFLASH_TRANSFORMERS_NEWEST=registry` (`.ci/newest`) the newest entry is the registry's newest
release: a scheme that code does not know then fails loudly, naming the version.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from rich.console import Console

from console.views.probe_table import find_asymmetries, host_findings, probe_table
from remote import kernels
from tests.fixtures_models import result_of, run_module
from tests.transformers_matrix import matrix, read_lock

ROOT = Path(__file__).resolve().parent.parent
ENTRIES = matrix()
MODELING = "transformers.models.qwen3_5.modeling_qwen3_5"
TORCH = {fn: MODELING for fn in kernels.KERNEL_FUNCTIONS}
FLA_RULES = {**TORCH, "torch_chunk_gated_delta_rule": "fla.ops.gated_delta_rule.chunk",
             "torch_recurrent_gated_delta_rule": "fla.ops.gated_delta_rule.fused_recurrent"}
# What each release of the lock binds on a host with fla, no causal-conv1d and no GPU (this one):
# - up to 5.14 nothing fast binds without CUDA (`is_flash_linear_attention_available` asks for it);
# - 5.15 looks the recurrent rule up as `recurrent_gated_delta_rule`, a name fla never had, so only
#   the chunked rule is fla's (5.16 renamed it `fused_recurrent_gated_delta_rule`);
# - from 5.24 both delta rules are fla's; the convolution is torch's everywhere.
EXPECTED = {
    "5.2.0": (kernels.SCHEME_LEGACY, TORCH),
    "5.14.1": (kernels.SCHEME_LEGACY, TORCH),
    "5.15.0": (kernels.SCHEME_CLOSURE, {**FLA_RULES, "torch_recurrent_gated_delta_rule": MODELING}),
    "5.24.0": (kernels.SCHEME_CLOSURE, FLA_RULES),
    "5.24.0+kernels": (kernels.SCHEME_FUNC_MODULES, FLA_RULES),
    "5.25.0": (kernels.SCHEME_FUNC_MODULES, FLA_RULES),
}
KNOWN_SCHEMES = (kernels.SCHEME_LEGACY, kernels.SCHEME_CLOSURE, kernels.SCHEME_FUNC_MODULES)


@pytest.fixture(scope="module")
def matrix_probes(fake_kernel_paths, tmp_path_factory) -> dict[str, dict]:
    """entry name -> the real `remote.probe` result of a host with that release, fla and no causal-conv1d.
    Installs (import-only work) and probes run three at a time."""
    from tests.transformers_matrix import install

    tmp = tmp_path_factory.mktemp("matrix")

    def probe(entry):
        site = install(entry)
        out = tmp / re.sub(r"[^\w.+-]", "_", entry.name)
        out.mkdir()
        _, events = run_module("remote.probe", [], out, extra_path=[fake_kernel_paths["fla"], site])
        return entry.name, result_of(events)

    with ThreadPoolExecutor(3) as pool:
        return dict(pool.map(probe, ENTRIES))


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_each_release_is_read_under_its_scheme(entry, matrix_probes):
    facts = matrix_probes[entry.name]
    assert facts["packages"]["transformers"]["version"] == entry.version
    binding = facts["kernels"]
    assert binding["transformers"] == entry.version
    # The registry's newest (.ci/newest) is not in the table: it must bind as the lock's newest does.
    scheme, bound = EXPECTED.get(entry.name, EXPECTED[read_lock()[-1].name])
    if entry.name in EXPECTED:
        assert binding["scheme"] == scheme
    assert binding["bound"] == bound, f"transformers {entry.version}: {binding}"
    assert binding["fast"] is False


def test_the_newest_release_binds_under_a_known_scheme(matrix_probes):
    """On the lock's newest in CI; on the registry's newest in `.ci/newest`, where a new scheme shows."""
    newest = ENTRIES[-1]
    scheme = matrix_probes[newest.name]["kernels"]["scheme"]
    if scheme not in KNOWN_SCHEMES:
        pytest.fail(f"transformers {newest.version} (the newest tested) binds its Qwen3.5 kernels under a scheme "
                    f"remote/kernels.py does not know: {scheme!r}. Read its models/qwen3_5/modeling_qwen3_5.py, "
                    f"add the scheme to kernels.bound_kernels and the release to tests/transformers-matrix.txt.")


@pytest.mark.parametrize("entry", ENTRIES, ids=[e.name for e in ENTRIES])
def test_probe_table_flags_the_torch_functions_against_a_host_with_both(entry, matrix_probes, fake_probes):
    """The story's hosts on two releases: the table names each host's scheme, and exactly the functions
    the training host runs on torch are mismatches (the lock's inference host binds all four fast)."""
    probes = {"inference": fake_probes["inference"], "training": matrix_probes[entry.name]}
    found = {a.row: a for a in find_asymmetries(probes)}
    bound = matrix_probes[entry.name]["kernels"]["bound"]
    flagged = {fn for fn in kernels.KERNEL_FUNCTIONS if f"kernel {fn}" in found}
    assert flagged == {fn for fn, module in bound.items() if not kernels.is_fast_impl(module)}
    assert all(found[f"kernel {fn}"].severity == "error" for fn in flagged)
    assert {found[f"kernel {fn}"].values["training"] for fn in flagged} == {"torch fallback"}
    console = Console(record=True, width=300)
    console.print(probe_table(probes))
    scheme_line = next(line for line in console.export_text().splitlines() if line.startswith("│ kernel scheme"))
    cells = [cell.strip() for cell in scheme_line.split("│")[2:4]]
    assert cells == [fake_probes["inference"]["kernels"]["scheme"], matrix_probes[entry.name]["kernels"]["scheme"]]
    assert [f for f in host_findings(probes) if f.severity == "error"] == []


def test_the_lock_spans_the_tested_range_and_pyproject_states_it():
    """pyproject.toml's worker extra, remote.kernels and the lock say the same range: its ends are
    the oldest and the newest entries."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["worker"]
    (spec,) = [r for r in extra if r.startswith("transformers")]
    assert spec == "transformers" + kernels.TESTED_TRANSFORMERS
    lock = read_lock()
    assert f">={lock[0].version.removesuffix('.0')},<={lock[-1].version}" == kernels.TESTED_TRANSFORMERS
    assert set(EXPECTED) == {e.name for e in lock}
