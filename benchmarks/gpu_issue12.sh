#!/usr/bin/env bash
# Issue 12's GPU proof in one device call: the cuda-marked tests of the schedule, lowering, tile and
# kernel families on both CUDA pairs (the `device` fixture runs nvrtc and llvm-nvptx), then
# benchmarks/kernels.py's general suite (column sum, batch-8 GEMV, vocabulary softmax, static,
# symbolic and odd matmuls, the demo MLP shapes) against torch and CuPy with the default schedules and
# with a search (--beam), and the five tuned kernels for regressions. STEP picks the part:
# STEP: a comma list of tests,suite,five,variants (default tests,suite,five; variants: benchmarks/schedule_variants.py); PAIR: the CUDA compiler of the benchmarks. Logs and JSON land in $OUT.
set -u
# the carried wheels, PYTHONPATH and $OUT/env.txt (the machine's description)
source tests/gpu_env.sh
STEP=${STEP:-tests,suite,five}
has() { [[ ",$STEP," == *",$1,"* ]]; }
PAIR=${PAIR:-nvrtc}
{
  date -u; nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
  python3 -c "import sys, llvmlite, numpy; print(sys.version); print('llvmlite', llvmlite.__version__, 'numpy', numpy.__version__)"
  python3 -c "import torch; print('torch', torch.__version__)" 2>&1 | tail -1
  python3 -c "import cupy; print('cupy', cupy.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
set -o pipefail
if has tests; then
  MOROK_CACHE_DIR=/tmp/morok-tests timeout ${TEST_TIMEOUT:-200} python3 -m pytest -q -rs -m cuda -p no:cacheprovider \
    tests/test_schedule.py tests/test_kernels.py tests/test_gpu_tile.py tests/test_gpu_lowering.py \
    tests/test_launch_bounds.py tests/test_loop_counters.py tests/test_accumulation.py 2>&1 \
    | tee "$OUT/pytest_cuda_issue12.log" | tail -15
  echo "pytest -m cuda exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_cuda_issue12.log"
fi
if has suite; then
  MOROK_CUDA_COMPILER=$PAIR MOROK_CACHE_DIR=/tmp/morok-bench-$PAIR timeout ${SUITE_TIMEOUT:-200} python3 \
    benchmarks/kernels.py --device CUDA --suite --no-sweep --beam ${BEAM:-6} --beam-seconds ${BEAM_SECONDS:-15} \
    --repeats 7 --results "$OUT/suite-$PAIR" 2>&1 | grep -v "^kernels \[" | tee "$OUT/kernels-suite-$PAIR.log" | tail -40
fi
if has variants; then
  (cd benchmarks && MOROK_CUDA_COMPILER=$PAIR timeout ${VARIANTS_TIMEOUT:-150} python3 schedule_variants.py --device CUDA \
    --cases ${VARIANT_CASES:-softmax_vocab,gemv8,matmul,matmul_sym} --rounds ${ROUNDS:-5} --json "$OUT/variants-$PAIR.json" 2>&1 \
    | tee "$OUT/variants-$PAIR.log" | tail -30)
fi
if has five; then
  MOROK_CUDA_COMPILER=$PAIR MOROK_CACHE_DIR=/tmp/morok-five-$PAIR timeout ${FIVE_TIMEOUT:-150} python3 \
    benchmarks/kernels.py --device CUDA --no-sweep --results "$OUT/five-$PAIR" 2>&1 | grep -v "^kernels \[" \
    | tee "$OUT/kernels-five-$PAIR.log" | tail -20
fi
ls -la "$OUT"
