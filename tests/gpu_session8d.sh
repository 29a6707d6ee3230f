#!/usr/bin/env bash
# Session 8's fifth call, CPU only (the H100 machine's Xeon host, AVX-512; the GPU idle): the AVX-512 default
# tile is now 6x64 (was 8x32) and wide matrices get balanced row partitions. Issue 12's CPU suite with 12
# threads pinned to cores 4-15 and with all 16 unpinned; then benchmarks/cpu_tiles.py (15 rounds: the
# default against 8x32 and 12x32) at both thread counts.
# $OUT: env.txt, COMMIT, bench.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-240}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu12 TAILN=16 step suite-12 60 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --results "$R/cpu-suite-12"
TAILN=14 step tiles-12 60 taskset -c 4-15 python3 benchmarks/cpu_tiles.py --rounds 15 --reps 5 \
  --shapes 1024x1024x1024,256x784x512 --tiles 8x32,12x32 --json "$R/cpu-tiles-12.json"
export OPENBLAS_NUM_THREADS=16 OMP_NUM_THREADS=16 NUMBA_NUM_THREADS=16 MOROK_CPU_THREADS=16
MOROK_CACHE_DIR=/tmp/morok-cpu16 TAILN=16 step suite-16 60 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --results "$R/cpu-suite-16"
TAILN=14 step tiles-16 60 python3 benchmarks/cpu_tiles.py --rounds 15 --reps 5 \
  --shapes 1024x1024x1024,256x784x512 --tiles 8x32,12x32 --json "$R/cpu-tiles-16.json"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
