"""The GPU drill's server sizes its KV pool from the card it finds, as SGLang does
(`--mem-fraction-static`): on an H100 (80 GiB) its start no longer fails where an H200 (140 GiB)
had room (docs/gpu-results/window-gpu-tests-run5-h100-oom.log). The card is the real one on the
device (tests/gpu/test_window_gpu.py); here its total is given, since CI has no GPU."""

from __future__ import annotations

from console.drill import config as drill

H200_MIB, H100_MIB = 143771, 81559  # what NVML reports as mem_total on each card
MODEL_MIB = 3400  # the GPU drill's 1.7B target in bfloat16


def test_the_kv_pool_keeps_the_h200s_size_and_fits_an_h100() -> None:
    assert abs(drill.gpu_kv_cache_mib(H200_MIB) - drill.GPU_KV_CACHE_MIB) < 1024  # the window the H200 measured
    h100 = drill.gpu_kv_cache_mib(H100_MIB)
    held = drill.GPU_SERVICE_EXTRA_MIB + h100 + drill.GPU_CUDA_GRAPH_MIB + MODEL_MIB
    assert held < H100_MIB - 8192, held  # the server starts, with room for the CUDA context and more


def test_a_card_that_cannot_be_read_gets_the_h200s_pool(monkeypatch) -> None:
    import remote.gpu_source

    class NoDriver:
        def __init__(self) -> None:
            raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(remote.gpu_source, "NvmlSource", NoDriver)
    assert drill.gpu_kv_cache_mib() == drill.GPU_KV_CACHE_MIB
    assert drill.gpu_kv_cache_mib(0) == drill.GPU_KV_CACHE_MIB
