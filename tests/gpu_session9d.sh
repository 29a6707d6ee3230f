#!/usr/bin/env bash
# Session 9's last call (final code, async_fill on by default): the whole cuda-marked suite (both pairs),
# issue 12's GPU suite on nvrtc with interleaved rounds and a search, the five tuned kernels, then the CPU
# suite on the Xeon host while time lasts.
# $OUT: env.txt, COMMIT, bench.log, pytest_cuda.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-570}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
MOROK_CACHE_DIR=/tmp/morok-tests timeout 300 python3 -m pytest -q -m cuda -p no:cacheprovider -x tests 2>&1 \
  | tail -25 > "$OUT/pytest_cuda.log"; tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-gsuite TAILN=30 step suite-nvrtc 130 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --rounds 5 --beam 4 --beam-seconds 8 --results "$R/suite-nvrtc"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-five TAILN=12 step five-nvrtc 50 \
  python3 benchmarks/kernels.py --device CUDA --no-sweep --rounds 3 --results "$R/five-nvrtc"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=20 step cpu-suite 60 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --rounds 7 --results "$R/cpu-suite"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
