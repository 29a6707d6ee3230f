#!/usr/bin/env bash
# Session 9's fifth call: the native pool's tickets (a launch waits only for the workers that joined) and
# the search's warm pass on real hardware: the CPU tests on the Xeon host (16 cores: real concurrency), issue
# 12's CPU suite there (12 threads, interleaved rounds) and the CPU matmul shapes searched; then issue 12's GPU
# suite searched (nvrtc) and the cuda-marked search and schedule tests.
# $OUT: env.txt, COMMIT, bench.log, pytest_cpu.log, pytest_cuda.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-560}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
MOROK_CACHE_DIR=/tmp/morok-cpu-tests timeout 200 python3 -m pytest -q -p no:cacheprovider -m "not cuda and not rocm" \
  tests/test_cpu.py tests/test_cpu_pool.py tests/test_cpu_levels.py tests/test_plan.py tests/test_search.py \
  > "$OUT/pytest_cpu.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cpu.log"; tail -3 "$OUT/pytest_cpu.log" | tee -a "$B"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=20 step cpu-suite 70 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --rounds 7 --results "$R/cpu-suite"
MOROK_CACHE_DIR=/tmp/morok-cpu-beam TAILN=10 step cpu-beam 90 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
  --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 8 --rounds 7 --results "$R/cpu-beam"
unset OPENBLAS_NUM_THREADS OMP_NUM_THREADS NUMBA_NUM_THREADS MOROK_CPU_THREADS
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-gsuite TAILN=30 step suite-nvrtc 130 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --rounds 5 --beam 4 --beam-seconds 8 --results "$R/suite-nvrtc"
MOROK_CACHE_DIR=/tmp/morok-tests timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_search.py \
  tests/test_schedule.py tests/test_gpu_tile.py > "$OUT/pytest_cuda.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cuda.log"
tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
