#!/usr/bin/env bash
# Session 8's fourth call, CPU only (the Xeon host of the H100 machine, AVX-512, the GPU idle):
#   the CPU tests at this HEAD (the wide-matrix row partitions, forced AVX-512 tiles), then the register
#   tiles of three matmul shapes against numpy in interleaved rounds (benchmarks/cpu_tiles.py), 12 threads
#   pinned to cores 4-15, then the same with all 16 threads unpinned.
# $OUT: env.txt, COMMIT, bench.log, pytest_cpu.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-300}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
timeout 120 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cpu.py tests/test_cpu_pool.py tests/test_cpu_levels.py \
  > "$OUT/pytest_cpu.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cpu.log"
tail -3 "$OUT/pytest_cpu.log" | tee -a "$B"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 MOROK_CPU_THREADS=12
TAILN=40 step tiles-12 100 taskset -c 4-15 python3 benchmarks/cpu_tiles.py --tiles 8x32,12x32,6x64,4x32,14x32,6x32,8x64 \
  --json "$R/cpu-tiles-12.json"
export OPENBLAS_NUM_THREADS=16 OMP_NUM_THREADS=16 MOROK_CPU_THREADS=16
TAILN=40 step tiles-16 60 python3 benchmarks/cpu_tiles.py --shapes 1024x1024x1024 --tiles 8x32,12x32,6x64,4x32 \
  --json "$R/cpu-tiles-16.json"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
