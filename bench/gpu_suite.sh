#!/usr/bin/env bash
# Everything that needs the GPU machine, in one go (a fresh machine costs minutes, so batch it).
# From the repo root on the GPU host, with ../shared/device copied to .dev/:
#   bash bench/gpu_suite.sh [tests|bench-extract|window|window-tests|window-bench|window-weights|all]
# Each stage fits one 10-minute call, but `window` (its tests, then its bench), which takes two:
# window-tests and window-bench (WINDOW_ROUTES=staged,pause: the bench runs only those). Logs and figures go to $OUT (or ./gpu-out): gpu-tests.log,
# bench-*.txt, *.json; the window stage's window-gpu-tests.log, bench-window-gpu.txt, window-gpu.json.
# The window stage runs the console and the drill there: asyncssh, textual and their dependencies,
# fetched as wheels into .whl/ on a machine with a registry (the device README's pip download
# recipe) and carried, are installed into /tmp/site first.
# window-weights: the pause route that must release the weights (the drill's crowded card, issue 40),
# beside the staged stop route, under load, with the weights' and the drafter's checks
# (bench-window-weights-gpu.txt, window-weights-gpu.json). Not part of `all`: its own call.
# WINDOW_DIR=<dir> keeps its drill (the hosts', the server's and the CUDA worker's logs) there.
# WINDOW_TESTS="<pytest -k expression>" runs a part of window-tests (on a slower card the five may
# not fit one 10-minute call: split them over two).
# --noconftest: tests/conftest.py loads every fixture module, which the GPU tests do not need.
set -uo pipefail
out="${OUT:-gpu-out}"; mkdir -p "$out"
what="${1:-all}"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
source .dev/setup-device.sh
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-/tmp/triton-dflash}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# The device runs a copy of the working tree whose .git may be older than the tree: the commit is
# said with "+ changes" when the tree differs from it, and the code's own hash (the same command on
# this machine, at a commit, gives the same figure) says which code ran.
rev="$(git rev-parse --short HEAD 2>/dev/null || echo '?')"
git diff --quiet HEAD -- console remote bench tests 2>/dev/null || rev="$rev + changes"
code="$(find console remote bench tests -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-12)"
echo "== gpu_suite $what: $(date -u +%FT%TZ), git $rev, code $code" | tee -a "$out/gpu-tests.log"
if [[ "$what" == tests || "$what" == all ]]; then
  # The window's GPU tests are the window stage's (each stage fits one 10-minute call).
  python3 -m pytest --noconftest -p no:cacheprovider -q -rs --durations=12 tests/gpu --ignore=tests/gpu/test_window_gpu.py 2>&1 \
    | tee -a "$out/gpu-tests.log"
  python3 bench/telemetry.py --skip-console --json "$out/telemetry.json" 2>&1 | tee "$out/bench-telemetry.txt"
  python3 bench/evaluate.py --device cuda 2>&1 | tee "$out/bench-evaluate.txt"
  # The GPU tests record their figures into docs/gpu-results/extract.json (only that one: the
  # telemetry figures are already in $out, and a copy of the committed file would overwrite them).
  cp docs/gpu-results/extract.json "$out/" 2>/dev/null
fi
if [[ "$what" == bench-extract || "$what" == all ]]; then
  python3 bench/extract.py --json "$out/bench-extract.json" 2>&1 | tee "$out/bench-extract.txt"
fi
# The drill's hosts run `python -m console...` / `remote...` from their homes: the repo is on the path.
export PYTHONPATH="$PYTHONPATH:$PWD" DFLASH_OPS_DRILL_CACHE="${DFLASH_OPS_DRILL_CACHE:-/tmp/dflash-drill-assets}"
if [[ "$what" == window || "$what" == window-tests || "$what" == all ]]; then
  python3 -m pytest --noconftest -p no:cacheprovider -q -rs --timeout 400 ${WINDOW_TESTS:+-k "$WINDOW_TESTS"} tests/gpu/test_window_gpu.py 2>&1 \
    | tee "$out/window-gpu-tests.log"
fi
if [[ "$what" == window || "$what" == window-bench || "$what" == all ]]; then
  # --load: users' requests throughout each route (failed and held counted: the pause route must fail none)
  python3 bench/window.py --gpu --load --runs "${WINDOW_RUNS:-1}" --routes "${WINDOW_ROUTES:-staged,cold,zero-downtime,pause}" --json "$out/window-gpu.json" 2>&1 | tee "$out/bench-window-gpu.txt"
fi
if [[ "$what" == window-weights ]]; then
  python3 bench/window.py --gpu --crowded --load --runs 1 --routes staged,pause --json "$out/window-weights-gpu.json" ${WINDOW_DIR:+--dir "$WINDOW_DIR"} 2>&1 \
    | tee "$out/bench-window-weights-gpu.txt"
fi
nvidia-smi --query-gpu=index,memory.used --format=csv,noheader >> "$out/gpu-tests.log" 2>&1
echo "== gpu_suite $what done in ${SECONDS} s" >> "$out/gpu-tests.log"
