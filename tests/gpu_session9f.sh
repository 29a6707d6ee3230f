#!/usr/bin/env bash
# Session 9's sixth call: the search with WARM_SECONDS of untimed passes, on the GPU shapes where it had kept a
# slower candidate (4096^3) and where it wins (GEMV, 256x784x512), nvrtc and llvm-nvptx; then the Xeon's CPU
# matmul shapes searched again.
# $OUT: env.txt, COMMIT, bench.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-400}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
for pair in nvrtc llvm-nvptx; do
  MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-beam-$pair TAILN=20 step beam-$pair 110 \
    python3 benchmarks/kernels.py --device CUDA --only gemv8,matmul,matmul_sym,mlp1 --no-sweep --rounds 5 --beam 4 \
    --beam-seconds 10 --results "$R/beam-$pair"
done
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu-beam TAILN=10 step cpu-beam 90 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
  --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 8 --rounds 7 --results "$R/cpu-beam"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
