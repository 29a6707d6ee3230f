#!/usr/bin/env bash
# Session 7's GPU proof in one device call (session 7 had 817 s of device time, start included, so
# this is session 6's integrated script cut to what decides issues 12, 13 and 15):
#   phase A, side by side on separate cores: the whole cuda-marked suite (both CUDA pairs) pinned to
#     cores 0-3, and issue 12's CPU suite on the host's AVX-512 Xeon pinned to cores 4-15 (ours and
#     OpenBLAS with 12 threads each);
#   phase B, with nothing else running, in order of what they decide: the checked call and DLPack
#     (launch.py, issue 15), batch-8 GEMV's default and searched schedules on both pairs (issue 12),
#     half-precision bandwidth, the default tensor-core tile and implicit-GEMM convolutions (issue 13).
# Each phase-B step is skipped once the call nears its limit (DEADLINE seconds after the start).
# $OUT gets env.txt, pytest_cuda.log, bench.log and results.tgz (every JSON and each step's log).
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-520}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
( taskset -c 0-3 /usr/bin/time -f "wall %e s" timeout ${SUITE_TIMEOUT:-200} python3 -m pytest -q -rs -m cuda \
    -p no:cacheprovider tests/ --ignore=tests/test_onnx_nodes.py --ignore=tests/test_onnx_models.py \
    > "$OUT/pytest_cuda.log" 2>&1 ) &
( export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CACHE_DIR=/tmp/morok-cpu-suite
  taskset -c 4-15 timeout ${CPU_TIMEOUT:-200} python3 benchmarks/kernels.py --device CPU --suite --no-sweep \
    --results "$R" > "$R/cpu_suite.log" 2>&1; echo "rc $?" >> "$R/cpu_suite.log" ) &
wait
echo "== phase A done at ${SECONDS}s" | tee -a "$B"
tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
grep -v "\[#\|^kernels \[" "$R/cpu_suite.log" | tail -22 | tee -a "$B"
step launch 80 python3 benchmarks/launch.py --device CUDA --results "$R"
for pair in nvrtc llvm-nvptx; do
  MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-gemv-$pair TAILN=8 step gemv-$pair 60 \
    python3 benchmarks/kernels.py --device CUDA --only gemv8 --no-sweep --beam 8 --beam-seconds 25 --results "$R/gemv-$pair"
done
step half_bandwidth 70 python3 benchmarks/half_bandwidth.py --device CUDA --results "$R"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-tc step tc-nvrtc 75 \
  python3 benchmarks/tensor_cores.py --results "$R/tc-nvrtc"
step conv 60 python3 benchmarks/conv.py --device CUDA --results "$R"
tar -C /tmp -czf "$OUT/results.tgz" res
ls -la "$OUT" "$R"
echo "total ${SECONDS}s"
