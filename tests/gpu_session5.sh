#!/usr/bin/env bash
# Session 5's integrated GPU proof in one device call, after the schedule layer, tensor cores, the launch
# layer, DLPack, the MLIR pair and the narrow dtypes landed together: the whole cuda-marked suite (both
# CUDA pairs; the mlir pair where its extra is installed), ONNX's node tests on CUDA with both pairs (side
# by side, each on its own cache), then the launch benchmark with nothing else running. Logs in $OUT.
set -u
source tests/gpu_env.sh
git_rev=$(cat COMMIT 2>/dev/null || echo "working tree")
echo "tree: $git_rev" | tee -a "$OUT/env.txt"
( /usr/bin/time -f "wall %e s" timeout ${SUITE_TIMEOUT:-420} python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/ \
    --ignore=tests/test_onnx_nodes.py --ignore=tests/test_onnx_models.py > "$OUT/pytest_cuda.log" 2>&1 ) &
for pair in nvrtc llvm-nvptx; do
  ( XDG_CACHE_HOME=/tmp/cache-$pair MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair /usr/bin/time -f "wall %e s" \
      timeout ${ONNX_TIMEOUT:-360} python3 -m pytest -q -rs -p no:cacheprovider tests/test_onnx_nodes.py tests/test_onnx_models.py \
      > "$OUT/onnx_cuda_$pair.log" 2>&1 ) &
done
# the MLIR pair's CUBINs (built on the CI machine: its extra cannot travel here) run against the CPU pair
if [ -f .mlir-replay/bundle.pkl ]; then
  timeout 200 python3 tests/mlir_cuda_replay.py run .mlir-replay > "$OUT/mlir_cuda_replay.log" 2>&1
  tail -2 "$OUT/mlir_cuda_replay.log"
fi
wait
tail -5 "$OUT/pytest_cuda.log"
for pair in nvrtc llvm-nvptx; do tail -3 "$OUT/onnx_cuda_$pair.log"; done
timeout ${BENCH_TIMEOUT:-100} python3 benchmarks/launch.py --device CUDA --results "$OUT" 2>&1 \
  | grep -v "\[####" > "$OUT/bench_launch.log"; grep -E "pair|Program|bare|ExecutionPlan|MISSED|met" "$OUT/bench_launch.log" | head -20
ls -la "$OUT"
