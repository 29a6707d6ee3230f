#!/usr/bin/env bash
# Session 10's second call: the CPU tests on the Xeon host after the tail-tile simplification, then why the
# nvrtc search keeps the register fill for static matmuls that the benchmark times slower
# (benchmarks/search_context.py, with nvidia-smi clock and power samples).
# $OUT: env.txt, COMMIT, bench.log, pytest_cpu.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-400}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
MOROK_CACHE_DIR=/tmp/morok-cpu-tests timeout 120 python3 -m pytest -q -p no:cacheprovider -m "not cuda and not rocm" \
  tests/test_cpu.py tests/test_cpu_levels.py > "$OUT/pytest_cpu.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cpu.log"
tail -3 "$OUT/pytest_cpu.log" | tee -a "$B"
for c in matmul matmul_odd; do
  MOROK_CUDA_COMPILER=nvrtc TAILN=12 step ctx-$c 120 python3 benchmarks/search_context.py --case $c \
    --smi "$R/smi-$c.csv" --json "$R/search-context-$c.json"
done
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
