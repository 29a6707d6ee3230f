#!/usr/bin/env bash
# Session 10's third call, after the search's default-first fix: the cuda-marked search, schedule and tile tests,
# search_context on the static 4096^3 (the search should now keep the default cp.async fill), issue 12's GPU suite
# searched on nvrtc and the matmul shapes searched on llvm-nvptx, then ONNX on CUDA (both pairs) while time lasts.
# $OUT: env.txt, COMMIT, bench.log, pytest_cuda.log, onnx_cuda.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-570}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
MOROK_CACHE_DIR=/tmp/morok-tests timeout 120 python3 -m pytest -q -m cuda -p no:cacheprovider tests/test_search.py \
  tests/test_schedule.py tests/test_gpu_tile.py > "$OUT/pytest_cuda.log" 2>&1; echo "rc $?" >> "$OUT/pytest_cuda.log"
tail -3 "$OUT/pytest_cuda.log" | tee -a "$B"
MOROK_CUDA_COMPILER=nvrtc TAILN=8 step ctx-matmul 60 python3 benchmarks/search_context.py --case matmul \
  --json "$R/search-context-matmul.json"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-gsuite TAILN=30 step suite-nvrtc 140 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --rounds 5 --beam 4 --beam-seconds 8 --results "$R/suite-nvrtc"
MOROK_CUDA_COMPILER=llvm-nvptx MOROK_CACHE_DIR=/tmp/morok-gbeam TAILN=14 step beam-llvm-nvptx 80 \
  python3 benchmarks/kernels.py --device CUDA --only matmul,matmul_sym,matmul_odd --no-sweep --rounds 5 --beam 4 \
  --beam-seconds 8 --results "$R/beam-llvm-nvptx"
LEFT=$(( DEADLINE - SECONDS - 15 ))
if (( LEFT > 150 )); then
  onnx_cuda $LEFT
else
  echo "== ONNX on CUDA: skipped, ${LEFT}s left" | tee -a "$B"
fi
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
