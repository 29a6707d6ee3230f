#!/usr/bin/env bash
# Session 10's call: the cuda-marked suite (the settings now read through config's fast path), the CPU tests
# on the Xeon host (AVX-512: its 8x32 and 6x64 tiles with leftover rows, now one tile per partition), issue
# 12's CPU suite there (12 threads pinned, interleaved rounds), then issue 12's GPU suite (nvrtc) while time lasts.
# $OUT: env.txt, COMMIT, bench.log, pytest_cuda.log, pytest_cpu.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-565}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
MOROK_CACHE_DIR=/tmp/morok-tests timeout 240 python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 \
  | tail -25 > "$OUT/pytest_cuda.log"; tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
MOROK_CACHE_DIR=/tmp/morok-cpu-tests timeout 170 python3 -m pytest -q -p no:cacheprovider -m "not cuda and not rocm" \
  tests/test_cpu.py tests/test_cpu_levels.py tests/test_cpu_pool.py tests/test_config.py \
  > "$OUT/pytest_cpu.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cpu.log"; tail -3 "$OUT/pytest_cpu.log" | tee -a "$B"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=20 step cpu-suite 70 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --rounds 7 --results "$R/cpu-suite"
unset OPENBLAS_NUM_THREADS OMP_NUM_THREADS NUMBA_NUM_THREADS MOROK_CPU_THREADS
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-gsuite TAILN=30 step suite-nvrtc 75 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --rounds 5 --results "$R/suite-nvrtc"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
