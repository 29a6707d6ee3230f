#!/usr/bin/env bash
# Session 8's sixth call, CPU only (the H100 machine's Xeon host, AVX-512; the GPU idle), at the final CPU
# code: row partitions for the target's thread count, the split trial's order A S S A S A. Issue 12's CPU
# suite with 12 threads pinned to cores 4-15 (twice, separate processes: the 256x512x10 trial) and with all
# 16 unpinned; then benchmarks/cpu_tiles.py (15 rounds, 6x64 default against 8x32 and 12x32) at both counts.
# First the CPU tests (test_cpu, test_cpu_pool, test_cpu_levels, test_kernels) on this AVX-512 host.
# $OUT: env.txt, COMMIT, bench.log, pytest_cpu.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-330}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cpu.py tests/test_cpu_pool.py tests/test_cpu_levels.py \
  tests/test_kernels.py -k "not cuda and not rocm" > "$OUT/pytest_cpu.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cpu.log"
tail -3 "$OUT/pytest_cpu.log" | tee -a "$B"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu12 TAILN=16 step suite-12 60 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --results "$R/cpu-suite-12"
MOROK_CACHE_DIR=/tmp/morok-cpu12b TAILN=8 step suite-12b 40 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --only matmul,mlp1,mlp2 --no-sweep --results "$R/cpu-suite-12b"
TAILN=14 step tiles-12 60 taskset -c 4-15 python3 benchmarks/cpu_tiles.py --rounds 15 --reps 5 \
  --shapes 1024x1024x1024,256x784x512 --tiles 8x32,12x32 --json "$R/cpu-tiles-12.json"
export OPENBLAS_NUM_THREADS=16 OMP_NUM_THREADS=16 NUMBA_NUM_THREADS=16 MOROK_CPU_THREADS=16
MOROK_CACHE_DIR=/tmp/morok-cpu16 TAILN=16 step suite-16 60 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --results "$R/cpu-suite-16"
TAILN=14 step tiles-16 60 python3 benchmarks/cpu_tiles.py --rounds 15 --reps 5 \
  --shapes 1024x1024x1024,256x784x512 --tiles 8x32,12x32 --json "$R/cpu-tiles-16.json"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
