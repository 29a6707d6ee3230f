#!/usr/bin/env bash
# Session 8's first GPU call: the sm_90a warpgroup tensor cores (wgmma) on the H100, and issue 12's CPU
# numbers on the host's AVX-512 Xeon.
#   phase A, side by side: on the GPU (cores 0-3) the 4096^3 pipeline sweep (wgmma forms first, then three
#     mma.sync forms) on both pairs and issue 13's rows (matmul static/symbolic, dense 4096^3 and
#     4000x3001x1023) on both pairs; on cores 4-15 issue 12's CPU suite (native pool, 12 threads) and the
#     CPU matmul shapes searched;
#   phase B: the wgmma device tests, then the whole cuda-marked suite (both pairs).
# $OUT: env.txt, bench.log, pytest_wgmma.log, pytest_cuda.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-560}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"   # the copy's .git may be stale
( export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12
  MOROK_CACHE_DIR=/tmp/morok-cpu taskset -c 4-15 timeout 100 python3 benchmarks/kernels.py \
    --device CPU --suite --no-sweep --results "$R/cpu-suite" > "$R/cpu_suite.log" 2>&1; echo "rc $?" >> "$R/cpu_suite.log"
  MOROK_CACHE_DIR=/tmp/morok-cpu-beam taskset -c 4-15 timeout 100 python3 benchmarks/kernels.py --device CPU \
    --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 6 --results "$R/cpu-beam" > "$R/cpu_beam.log" 2>&1
  echo "rc $?" >> "$R/cpu_beam.log" ) &
for pair in nvrtc llvm-nvptx; do
  MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-sweep-$pair TAILN=16 step sweep-$pair 110 \
    taskset -c 0-3 python3 benchmarks/tensor_cores.py --sweep --repeats 10 --dtypes float16 --results "$R/tc-sweep-$pair"
done
for pair in nvrtc llvm-nvptx; do
  MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-tc-$pair TAILN=10 step tc-$pair 110 \
    taskset -c 0-3 python3 benchmarks/tensor_cores.py --repeats 10 --results "$R/tc-$pair"
done
wait
for f in cpu_suite cpu_beam; do
  echo "== $f" | tee -a "$B"; grep -v "\[#\|^kernels \[\|^kernels:" "$R/$f.log" | tail -20 | tee -a "$B"
done
echo "== phase A done at ${SECONDS}s" | tee -a "$B"
( timeout 100 python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_wgmma.py > "$OUT/pytest_wgmma.log" 2>&1 )
tail -5 "$OUT/pytest_wgmma.log" | tee -a "$B"
left=$(( DEADLINE - SECONDS - 15 ))
if (( left > 60 )); then
  ( timeout $left python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/ --ignore=tests/test_onnx_nodes.py \
      --ignore=tests/test_onnx_models.py --ignore=tests/test_wgmma.py > "$OUT/pytest_cuda.log" 2>&1 )
  tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
fi
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
