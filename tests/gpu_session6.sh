#!/usr/bin/env bash
# Session 6's integrated GPU proof in one device call, after the checked-call, DLPack, schedule (GPU and
# CPU) and tensor-core changes landed together: the whole cuda-marked suite (both CUDA pairs), ONNX's node
# tests and models on CUDA with both pairs (side by side, each on its own cache), the MLIR pair's CUBIN
# replay; then, with nothing else running, the launch benchmark and the CPU general suite on this host's
# AVX-512 Xeon (issue 12's CPU targets on an AVX-512 host). Logs and JSON in $OUT: at most 8 files
# (env.txt, pytest_cuda.log, two onnx logs, bench_launch.log with the CPU runs, three JSONs).
set -u
source tests/gpu_env.sh
echo "tree: $(cat COMMIT 2>/dev/null || echo 'working tree')" | tee -a "$OUT/env.txt"
( /usr/bin/time -f "wall %e s" timeout ${SUITE_TIMEOUT:-420} python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/ \
    --ignore=tests/test_onnx_nodes.py --ignore=tests/test_onnx_models.py > "$OUT/pytest_cuda.log" 2>&1 ) &
if [ -z "${NO_ONNX:-}" ]; then
  for pair in nvrtc llvm-nvptx; do
    ( XDG_CACHE_HOME=/tmp/cache-$pair MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair /usr/bin/time -f "wall %e s" \
        timeout ${ONNX_TIMEOUT:-360} python3 -m pytest -q -rs -p no:cacheprovider tests/test_onnx_nodes.py tests/test_onnx_models.py \
        > "$OUT/onnx_cuda_$pair.log" 2>&1 ) &
  done
fi
if [ -f .mlir-replay/bundle.pkl ]; then
  timeout 200 python3 tests/mlir_cuda_replay.py run .mlir-replay > /tmp/mlir_cuda_replay.log 2>&1
  { echo "== mlir_cuda_replay"; tail -30 /tmp/mlir_cuda_replay.log; } >> "$OUT/env.txt"; tail -2 /tmp/mlir_cuda_replay.log
fi
wait
tail -5 "$OUT/pytest_cuda.log"
for pair in nvrtc llvm-nvptx; do [ -f "$OUT/onnx_cuda_$pair.log" ] && tail -3 "$OUT/onnx_cuda_$pair.log"; done
set -o pipefail
timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/launch.py --device CUDA --results "$OUT" 2>&1 \
  | grep -v "\[####" > "$OUT/bench_launch.log"; grep -E "pair|Program|bare|ExecutionPlan|MISSED|met|DLPack|torch ->|from_dlpack" "$OUT/bench_launch.log" | head -30
timeout ${HALF_TIMEOUT:-150} python3 benchmarks/half_bandwidth.py --device CUDA --results "$OUT" 2>&1 | grep -v "\[#" \
  | tee -a "$OUT/bench_launch.log" | tail -22
timeout ${CONV_TIMEOUT:-120} python3 benchmarks/conv.py --device CUDA --results "$OUT" 2>&1 | grep -v "\[#" \
  | tee -a "$OUT/bench_launch.log" | tail -14
timeout 40 python3 benchmarks/cpu_launch.py --calls 5000 --repeats 5 --results "$OUT" 2>&1 | grep -v "\[#" \
  | tee -a "$OUT/bench_launch.log" | tail -6
if [ -z "${NO_CPU_SUITE:-}" ]; then
  MOROK_CACHE_DIR=/tmp/morok-cpu-suite timeout ${CPU_TIMEOUT:-180} python3 benchmarks/kernels.py --device CPU --suite --no-sweep \
    --results "$OUT/cpu" 2>&1 | grep -v "\[#\|^kernels \[" | tee -a "$OUT/bench_launch.log" | tail -25
fi
ls -la "$OUT"
