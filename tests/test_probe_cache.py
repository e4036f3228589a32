"""The probe's environment facts, kept under a fingerprint of what they depend on (remote.probe
`--cache-dir`): what changes the fingerprint, which cache files are never trusted, and two real
probe processes of which the second imports no torch."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from remote import probe

REPO = Path(__file__).resolve().parent.parent


def _fingerprint(model_type: str = "qwen3_5") -> str:
    importlib.invalidate_caches()  # importlib.metadata caches a directory's listing by its mtime
    return probe.environment_fingerprint(model_type)[0]


@pytest.fixture
def no_gpu_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The driver's /proc directory, here one the test writes (absent on this machine otherwise)."""
    proc = tmp_path / "proc-nvidia"
    proc.mkdir()
    monkeypatch.setattr(probe, "NVIDIA_PROC", proc)
    return proc


def test_a_reinstalled_or_upgraded_distribution_changes_the_fingerprint(tmp_path: Path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    without = _fingerprint()
    assert _fingerprint() == without  # stable while nothing changes
    dist = site / "causal_conv1d-1.4.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: causal-conv1d\nVersion: 1.4.0\n")
    installed = _fingerprint()
    covered = probe.environment_fingerprint("qwen3_5")[1]["distributions"]["causal-conv1d"]
    assert installed != without and covered["version"] == "1.4.0" and covered["path"] == str(dist)
    os.utime(dist, ns=(1_000_000_000, 1_000_000_000))  # the same version installed again: a new dist-info
    reinstalled = _fingerprint()
    assert reinstalled != installed
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: causal-conv1d\nVersion: 1.5.0\n")
    os.utime(dist, ns=(1_000_000_000, 1_000_000_000))  # the mtime as before: only the version differs
    assert _fingerprint() not in (reinstalled, installed, without)


def test_a_package_without_dist_info_is_covered_by_its_file(tmp_path: Path, monkeypatch):
    """The test hosts' FAKE fla is a directory on PYTHONPATH, with no dist-info."""
    site = tmp_path / "site"
    (site / "fla").mkdir(parents=True)
    init = site / "fla" / "__init__.py"
    init.write_text("__version__ = '0.0.0+fake'\n")
    monkeypatch.syspath_prepend(str(site))
    # Blocked in this process as the rehearsal server blocks it on a CPU (or imported by an earlier
    # test): the fingerprint still looks where a fresh process would import it from.
    monkeypatch.setitem(sys.modules, "fla", None)
    before = _fingerprint()
    os.utime(init, ns=(2_000_000_000, 2_000_000_000))
    assert _fingerprint() != before
    assert sys.modules["fla"] is None  # found where it would be imported from, not imported


def test_devices_driver_gpus_and_model_type_change_the_fingerprint(no_gpu_text: Path, monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    base = _fingerprint()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    visible0 = _fingerprint()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    visible1 = _fingerprint()
    assert len({base, visible0, visible1}) == 3
    (no_gpu_text / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  570.86.15\n")
    driver570 = _fingerprint()
    (no_gpu_text / "version").write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  575.51.03\n")
    driver575 = _fingerprint()
    assert len({visible1, driver570, driver575}) == 3
    gpu = no_gpu_text / "gpus" / "0000:18:00.0"
    gpu.mkdir(parents=True)
    (gpu / "information").write_text("Model: NVIDIA H200\nGPU UUID: GPU-aaaa\n")
    first_card = _fingerprint()
    (gpu / "information").write_text("Model: NVIDIA H200\nGPU UUID: GPU-bbbb\n")  # the card swapped
    assert len({driver575, first_card, _fingerprint()}) == 3
    assert _fingerprint("qwen3_next") != _fingerprint("qwen3_5")
    assert _fingerprint("qwen3_5") == _fingerprint("qwen3_5")


@settings(max_examples=12, deadline=None)
@given(visible=st.one_of(st.none(), st.text("0123456789,", max_size=6)),
       model_type=st.sampled_from(["qwen3_5", "qwen3_5_moe", "qwen3_next"]),
       other=st.one_of(st.none(), st.text("0123456789,", max_size=6)),
       other_model=st.sampled_from(["qwen3_5", "qwen3_5_moe", "qwen3_next"]))
def test_the_fingerprint_is_a_function_of_what_it_covers(visible, model_type, other, other_model):
    def fingerprint(devices: str | None, kind: str) -> str:
        saved = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        try:
            if devices is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = devices
            return probe.environment_fingerprint(kind)[0]
        finally:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            if saved is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved

    first = fingerprint(visible, model_type)
    assert fingerprint(visible, model_type) == first
    assert (fingerprint(other, other_model) == first) == ((other, other_model) == (visible, model_type))


def _count_environment_probes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Stand in for the torch-importing part (the real one runs in the two-process test below):
    each call's facts differ, so which probe a document's facts came from shows."""
    calls: list[str] = []

    def counted(model_type: str):
        calls.append(model_type)
        return {"python": {"version": "3.11"}, "torch": {"importable": True, "cuda_available": False, "probe": len(calls)},
                "packages": {"fla": {"importable": False}}, "kernels": {"model_type": model_type, "bound": {}},
                "h2d": {"measured": False, "why": "no CUDA device"}}

    monkeypatch.setattr(probe, "environment_facts", counted)
    return calls


@pytest.mark.parametrize("damage", ["truncated", "not json", "other format", "other fingerprint", "facts missing",
                                    "empty"])
def test_a_damaged_or_foreign_cache_file_is_never_trusted(damage: str, tmp_path: Path, monkeypatch):
    calls = _count_environment_probes(monkeypatch)
    cache = tmp_path / "probe-cache"
    first = probe.probe(None, str(tmp_path), "qwen3_5", str(cache))
    assert first["environment"]["cached"] is False and len(calls) == 1
    fingerprint = first["environment"]["fingerprint"]
    path = probe.cache_file(cache, fingerprint)
    assert Path(first["environment"]["cache_file"]) == path
    sound = path.read_text()
    document = json.loads(sound)
    assert document["covers"]["model_type"] == "qwen3_5" and document["probed_at"] == first["environment"]["probed_at"]
    damaged = {
        "truncated": sound[: len(sound) // 2],
        "not json": "this is not JSON\n",
        "other format": json.dumps({**document, "format": "dflash-ops.probe-environment/0"}),
        "other fingerprint": json.dumps({**document, "fingerprint": "0" * 64}),
        "facts missing": json.dumps({**document, "facts": {k: v for k, v in document["facts"].items() if k != "kernels"}}),
        "empty": "",
    }[damage]
    path.write_text(damaged)
    again = probe.probe(None, str(tmp_path), "qwen3_5", str(cache))
    assert again["environment"]["cached"] is False and len(calls) == 2  # probed anew ...
    rewritten = probe.read_cached_environment(cache, fingerprint)  # ... and the file made sound again
    assert rewritten is not None and rewritten["probed_at"] == again["environment"]["probed_at"]
    third = probe.probe(None, str(tmp_path), "qwen3_5", str(cache))
    assert third["environment"]["cached"] is True and len(calls) == 2 and third["torch"]["probe"] == 2
    assert {k: third[k] for k in probe.ENVIRONMENT_KEYS} == {k: again[k] for k in probe.ENVIRONMENT_KEYS}


@pytest.mark.parametrize("state", ["copy failed", "torch broken", "driver lost"])
def test_a_passing_failure_is_not_kept(state: str, tmp_path: Path, monkeypatch):
    """Failures may pass (a busy server, an install half-done, a driver in a bad state): not kept, so
    the next probe looks again."""
    facts = {
        "copy failed": {"torch": {"importable": True, "cuda_available": True},
                        "h2d": {"measured": False, "why": "the copy failed: CUDA out of memory"}},
        "torch broken": {"torch": {"importable": False, "error": "ImportError: libcudart.so.13", "devices": []},
                         "h2d": {"measured": False, "why": "torch does not import"}},
        "driver lost": {"torch": {"importable": True, "cuda_available": False},
                        "h2d": {"measured": False, "why": "no CUDA device"}},
    }[state]
    monkeypatch.setattr(probe, "environment_facts",
                        lambda model_type: {"python": {}, "packages": {}, "kernels": {}, **facts})
    monkeypatch.setattr(probe, "_device_nodes", lambda: [["/dev/nvidia0", 0]] if state == "driver lost" else [])
    cache = tmp_path / "cache"
    first = probe.probe(None, str(tmp_path), "qwen3_5", str(cache))
    assert first["environment"]["cached"] is False and first["speeds"]["h2d"] == facts["h2d"]
    assert {"copy failed": "host-to-GPU copy was not measured", "torch broken": "torch did not import",
            "driver lost": "1 NVIDIA device nodes but torch sees no CUDA"}[state] in first["environment"]["not_kept"]
    assert not list(cache.glob("environment-*.json"))
    assert probe.probe(None, str(tmp_path), "qwen3_5", str(cache))["environment"]["cached"] is False


def _run_probe(cache: Path, model: Path, tmp_path: Path) -> tuple[dict, set[str]]:
    """`python -X importtime -m remote.probe` as a real process: its result and the modules it imported."""
    env = {k: v for k, v in os.environ.items() if k != "DFLASH_EVENTS"}  # events on stdout
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "remote.probe", "--cache-dir", str(cache),
                           "--model", str(model), "--workdir", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    result = next(e["data"] for e in events if e["type"] == "result")
    imported = {line.rsplit("|", 1)[1].strip() for line in done.stderr.splitlines() if line.startswith("import time:")}
    return result, imported


def test_the_second_probe_process_takes_the_environment_from_the_cache_without_torch(tiny_target: Path,
                                                                                     tmp_path: Path):
    cache = tmp_path / "probe-cache"
    first, first_imports = _run_probe(cache, tiny_target, tmp_path)
    second, second_imports = _run_probe(cache, tiny_target, tmp_path)
    assert first["environment"]["cached"] is False and "torch" in first_imports  # the check can see torch
    assert second["environment"]["cached"] is True
    assert "torch" not in second_imports and "transformers" not in second_imports
    assert second["environment"]["fingerprint"] == first["environment"]["fingerprint"]
    assert second["environment"]["probed_at"] == first["environment"]["probed_at"]
    for key in probe.ENVIRONMENT_KEYS:
        assert second[key] == first[key], key
    assert second["speeds"]["h2d"] == first["speeds"]["h2d"]
    assert second["torch"]["importable"] is True and second["kernels"]["bound"]  # torch's facts, from the cache
    # The facts of now are measured again: the model read and described by the second process too.
    assert second["model"] == first["model"] and second["speeds"]["disk_read"]["measured"] is True
    assert second["format"] == probe.FORMAT and set(second) == set(first)


def test_preflight_says_where_each_hosts_environment_facts_came_from():
    from console.procedure.steps.preflight import _say_environment

    class Journal:
        def __init__(self) -> None:
            self.lines: list[tuple[str, str, dict]] = []

        def journal(self, step: str, message: str, **fields) -> None:
            self.lines.append((step, message, fields))

    engine = Journal()
    earlier = time.mktime(time.localtime()[:3] + (14, 2, 11, 0, 0, -1))  # today, 14:02:11 local
    _say_environment(engine, "ct129", {"fingerprint": "3f2a" + "0" * 60, "cached": True, "probed_at": earlier})
    _say_environment(engine, "ct200", {"fingerprint": "9b" * 32, "cached": False, "probed_at": time.time()})
    _say_environment(engine, "gpu1", {"fingerprint": "77" * 32, "cached": False, "probed_at": time.time(),
                                      "not_kept": "the host-to-GPU copy was not measured (the copy failed)"})
    _say_environment(engine, "old", None)  # a probe of an older worker: nothing said
    assert [(step, fields) for step, _, fields in engine.lines] == [
        ("preflight", {"host": "ct129"}), ("preflight", {"host": "ct200"}), ("preflight", {"host": "gpu1"})]
    cached, fresh, failed = (line for _, line, _ in engine.lines)
    assert cached == ("probe on ct129: environment unchanged since 14:02:11 (fingerprint 3f2a00000000…): torch, "
                      "packages and kernel binding from that probe")
    assert fresh == f"probe on ct200: environment probed now (fingerprint {'9b' * 6}…), kept for the next window"
    assert failed.endswith("not kept: the host-to-GPU copy was not measured (the copy failed)")


FINGERPRINT_OF_THIS_CODE = ("import json; from remote import probe; fingerprint, covers = probe.environment_fingerprint('qwen3_5'); "
                            "print(json.dumps([fingerprint, covers['sys_path'][0]]))")


def test_the_same_probe_shipped_in_another_code_directory_keeps_the_fingerprint(tmp_path: Path):
    """Each console version ships its code to <workdir>/code/<hash> and runs from there: a second
    version (or another drill on this machine) with the same probe code reuses the facts kept;
    a different probe.py does not."""
    import shutil

    def shipped(name: str) -> Path:
        code = tmp_path / "code" / name
        shutil.copytree(REPO / "remote", code / "remote", ignore=shutil.ignore_patterns("__pycache__"))
        return code

    def fingerprint(code: Path) -> tuple[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        done = subprocess.run([sys.executable, "-c", FINGERPRINT_OF_THIS_CODE], cwd=code, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr[-2000:]
        return tuple(json.loads(done.stdout))

    first, second, changed = shipped("ab07e5"), shipped("c91d20"), shipped("ffee00")
    (changed / "remote" / "probe.py").write_text((changed / "remote" / "probe.py").read_text() + "\n# another probe\n")
    (one, entry), (two, _), (other, _) = fingerprint(first), fingerprint(second), fingerprint(changed)
    assert entry == "<the console's shipped code>"  # the directory the code runs from, by a fixed name
    assert one == two and other != one
