"""The workers the console runs on the hosts (`python -m remote.<worker>`) and the drill's parts.

A worker's start is mostly importing torch and transformers and loading the target's modeling code:
hundreds of thousands of objects that live as long as the process. With CPython's default first
threshold (700 allocations) the cyclic collector walks them again and again while they are made,
for nothing: a fifth of a rehearsal server's start on a 2-core machine (6.7 -> 5.8 CPU-s). So a
worker's own process collects later. Only there: in a process that imports these modules to do
Python-heavy work of its own (the console, the tests' in-process engine) the large young generation
made that work 15 % slower (`pytest tests/test_pause_sweep.py`, 36.5 vs 41.5 CPU-s).
"""

import gc
import sys

# `python -m remote.<worker>`: while runpy imports this package to find the module, argv[0] is "-m".
if sys.argv[:1] == ["-m"] and gc.get_threshold()[0] < 50_000:  # a process that chose its own keeps them
    gc.set_threshold(50_000, 20, 100)
