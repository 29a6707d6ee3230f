#!/usr/bin/env bash
# Session 7's second GPU call (about 500 s of device time left, start included): after the fixes the first
# call (tests/gpu_session7.sh) led to.
#   phase A, side by side on separate cores: the whole cuda-marked suite (both CUDA pairs) on cores 0-3;
#     on cores 4-15 the CPU tests of the native worker pool on this 16-core AVX-512 Xeon (test_cpu,
#     test_cpu_pool, test_cpu_levels), then issue 12's CPU suite with the native pool, with the Python
#     executor (the same kernels, for the pool's effect), and the CPU matmul shapes searched (--beam);
#   phase B, the GPU quiet: batch-8 GEMV's default on both pairs (llvm-nvptx's is now the upcast split)
#     and half-precision bandwidth (the half reductions' 16-byte loads).
# $OUT: env.txt, pytest_cuda.log, pytest_cpu.log, bench.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-360}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
( taskset -c 0-3 /usr/bin/time -f "wall %e s" timeout ${SUITE_TIMEOUT:-200} python3 -m pytest -q -rs -m cuda \
    -p no:cacheprovider tests/ --ignore=tests/test_onnx_nodes.py --ignore=tests/test_onnx_models.py \
    > "$OUT/pytest_cuda.log" 2>&1 ) &
( export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12
  taskset -c 4-15 timeout 90 python3 -m pytest -q -rs -p no:cacheprovider tests/test_cpu.py tests/test_cpu_pool.py \
    tests/test_cpu_levels.py > "$OUT/pytest_cpu.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cpu.log"
  for pool in native python; do
    MOROK_CPU_POOL=$pool MOROK_CACHE_DIR=/tmp/morok-cpu-$pool taskset -c 4-15 timeout 60 python3 benchmarks/kernels.py \
      --device CPU --suite --no-sweep --results "$R/cpu-$pool" > "$R/cpu_suite_$pool.log" 2>&1; echo "rc $?" >> "$R/cpu_suite_$pool.log"
  done
  MOROK_CACHE_DIR=/tmp/morok-cpu-beam taskset -c 4-15 timeout 90 python3 benchmarks/kernels.py --device CPU \
    --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 6 --results "$R/cpu-beam" > "$R/cpu_beam.log" 2>&1
  echo "rc $?" >> "$R/cpu_beam.log" ) &
wait
echo "== phase A done at ${SECONDS}s" | tee -a "$B"
tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
tail -3 "$OUT/pytest_cpu.log" | tee -a "$B"
for f in cpu_suite_native cpu_suite_python cpu_beam; do
  echo "== $f" | tee -a "$B"; grep -v "\[#\|^kernels \[\|^kernels:" "$R/$f.log" | tail -20 | tee -a "$B"
done
for pair in nvrtc llvm-nvptx; do
  MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-gemv-$pair TAILN=6 step gemv-$pair 40 \
    python3 benchmarks/kernels.py --device CUDA --only gemv8 --no-sweep --results "$R/gemv-$pair"
done
step half_bandwidth 70 python3 benchmarks/half_bandwidth.py --device CUDA --results "$R"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s"
