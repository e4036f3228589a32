"""The workers the console runs on the hosts (`python -m remote.<worker>`) and the drill's parts.

A worker's start is mostly importing torch and transformers and loading the target's modeling code:
hundreds of thousands of objects that live as long as the process. With CPython's default first
threshold (700 allocations) the cyclic collector walks them again and again while they are made,
for nothing: on a 2-core machine that was a fifth of a worker's start (6.3 -> 4.9 CPU-s to load the
drill's tiny Qwen3.5: `bench/cpu_by_process.py` has the per-window figure). A higher threshold keeps
the collection of real cycles, only later; the memory it lets wait is a few megabytes.
"""

import gc

if gc.get_threshold()[0] < 50_000:  # a process that chose its own thresholds keeps them
    gc.set_threshold(50_000, 20, 100)
