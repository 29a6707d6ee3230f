#!/usr/bin/env bash
# Session 9's third call: async_fill with only 16-byte copies (B's vectors; A along k stays register-staged,
# gpu_tile.ASYNC_MIN_BYTES) against the register fill, float32 4096^3 static and symbolic on both CUDA pairs
# (schedule_variants.py, then kernels.py's pair with ASYNC_FILL_DEFAULT on and off); then the Xeon's CPU
# matmul shapes with the split's thread cap (runtime.SPLIT_WORK_PER_THREAD), default and searched.
# $OUT: env.txt, COMMIT, bench.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-500}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
for pair in nvrtc llvm-nvptx; do
  (cd benchmarks && MOROK_CUDA_COMPILER=$pair TAILN=8 step variants-$pair 90 python3 schedule_variants.py --device CUDA \
    --cases matmul,matmul_sym --rounds 9 --json "$R/variants-$pair.json")
done
cat > /tmp/suite.py <<'PY'
import runpy, sys
sys.path.insert(0, "benchmarks")
from morok_py.codegen import schedule
schedule.ASYNC_FILL_DEFAULT = sys.argv[1] == "True"
sys.argv = ["kernels.py", "--device", "CUDA", "--only", "matmul,matmul_sym,mlp1", "--no-sweep",
            "--rounds", "7", "--results", sys.argv[2]]
runpy.run_path("benchmarks/kernels.py", run_name="__main__")
PY
for pair in nvrtc llvm-nvptx; do
  for a in True False; do
    MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-suite-$pair-$a TAILN=9 step suite-$pair-async$a 50 \
      python3 /tmp/suite.py $a "$R/suite-$pair-async$a"
  done
done
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=10 step cpu-mm 60 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --only matmul,matmul_sym,mlp1,mlp2 --no-sweep --rounds 7 --results "$R/cpu-mm"
MOROK_CACHE_DIR=/tmp/morok-cpu-beam TAILN=10 step cpu-beam 100 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
  --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 8 --rounds 7 --results "$R/cpu-beam"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
