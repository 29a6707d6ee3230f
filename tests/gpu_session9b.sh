#!/usr/bin/env bash
# Session 9's second call: the float32 tiled matmul filled by cp.async (Schedule.async_fill) against the
# register-staged fill, on the H100, both CUDA pairs: schedule_variants.py (static and symbolic 4096^3, best
# rounds, torch beside) and kernels.py's GPU suite with ASYNC_FILL_DEFAULT on and off (interleaved rounds;
# the symbolic-against-static pair); the cuda-marked tiled-matmul tests with async fills as the default;
# then the CPU suite's matmul shapes on the Xeon (the one-thread verdict retaken: RETRIAL_FIRST).
# $OUT: env.txt, COMMIT, bench.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-560}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
for pair in nvrtc llvm-nvptx; do
  (cd benchmarks && MOROK_CUDA_COMPILER=$pair TAILN=8 step variants-$pair 90 python3 schedule_variants.py --device CUDA \
    --cases matmul,matmul_sym --rounds 9 --json "$R/variants-$pair.json")
done
# kernels.py's GPU suite with schedule.ASYNC_FILL_DEFAULT set: python3 /tmp/suite.py TRUE_OR_FALSE RESULTS
cat > /tmp/suite.py <<'PY'
import runpy, sys
sys.path.insert(0, "benchmarks")
from morok_py.codegen import schedule
schedule.ASYNC_FILL_DEFAULT = sys.argv[1] == "True"
sys.argv = ["kernels.py", "--device", "CUDA", "--only", "matmul,matmul_sym,matmul_odd,mlp1,mlp2", "--no-sweep",
            "--rounds", "5", "--results", sys.argv[2]]
runpy.run_path("benchmarks/kernels.py", run_name="__main__")
PY
for pair in nvrtc llvm-nvptx; do
  for a in True False; do
    MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-suite-$pair-$a TAILN=14 step suite-$pair-async$a 60 \
      python3 /tmp/suite.py $a "$R/suite-$pair-async$a"
  done
done
# the tiled-matmul tests on the GPU with async fills as the default (both pairs: the device fixture)
MOROK_CACHE_DIR=/tmp/morok-tests TAILN=4 step tests-async 120 python3 -c "
import sys, pytest
from morok_py.codegen import schedule
schedule.ASYNC_FILL_DEFAULT = True
sys.exit(pytest.main(['-q', '-m', 'cuda', '-p', 'no:cacheprovider', 'tests/test_gpu_tile.py', 'tests/test_kernels.py',
                      'tests/test_schedule.py', '-k', 'matmul or tile or contraction or mlp or dense']))"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=10 step cpu-mm 60 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --only matmul,matmul_sym,mlp1,mlp2 --no-sweep --rounds 7 --results "$R/cpu-mm"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
