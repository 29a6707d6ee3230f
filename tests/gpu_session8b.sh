#!/usr/bin/env bash
# Session 8's third GPU call (the second ran tests/gpu_session8.sh: wgmma on the H100).
#   phase A, the GPU idle: issue 12's CPU suite on the AVX-512 Xeon alone (cores 4-15, 12 threads, nothing
#     else running: in the earlier calls the GPU benchmarks' processes on cores 0-3 ran beside it), the
#     CPU matmul shapes searched, and the three matmul shapes again (run-to-run spread);
#   phase B: the five tuned CUDA kernels and issue 12's GPU suite on nvrtc (everything now compiles for
#     sm_90a: no regressions?), half-precision bandwidth, then ONNX on CUDA (both pairs) while time lasts.
# $OUT: env.txt, COMMIT, bench.log, onnx_cuda.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-470}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=20 step cpu-suite 110 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --results "$R/cpu-suite"
MOROK_CACHE_DIR=/tmp/morok-cpu-beam TAILN=8 step cpu-beam 80 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
  --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 6 --results "$R/cpu-beam"
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=6 step cpu-again 40 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
  --only matmul,mlp1,mlp2 --no-sweep --results "$R/cpu-again"
unset OPENBLAS_NUM_THREADS OMP_NUM_THREADS NUMBA_NUM_THREADS
echo "== phase A done at ${SECONDS}s" | tee -a "$B"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-five TAILN=12 step five-nvrtc 70 \
  python3 benchmarks/kernels.py --device CUDA --no-sweep --results "$R/five-nvrtc"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-gsuite TAILN=16 step suite-nvrtc 110 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --results "$R/suite-nvrtc"
step half_bandwidth 70 python3 benchmarks/half_bandwidth.py --device CUDA --results "$R"
left=$(( DEADLINE - SECONDS - 10 ))
if (( left > 60 )); then
  onnx_cuda $left
fi
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
