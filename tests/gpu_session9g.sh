#!/usr/bin/env bash
# Session 9's last call: ONNX's node tests and the light models on CUDA, both pairs at once (the float32
# cp.async fill is the default since 80b49af; last run in session 8).
# $OUT: env.txt, COMMIT, bench.log, onnx_cuda.log.
set -u
source tests/gpu_env.sh
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
for pair in nvrtc llvm-nvptx; do
  ( MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-onnx-$pair timeout ${LEFT:-420} python3 -m pytest \
      -q -rs -p no:cacheprovider tests/test_onnx_nodes.py tests/test_onnx_models.py > /tmp/onnx_cuda_$pair.log 2>&1 ) &
done
wait
for pair in nvrtc llvm-nvptx; do
  { echo "== ONNX on CUDA, $pair"; grep -E "FAILED|ERROR" /tmp/onnx_cuda_$pair.log | head -20; tail -3 /tmp/onnx_cuda_$pair.log; } >> "$OUT/onnx_cuda.log"
done
grep -E "==|passed|failed" "$OUT/onnx_cuda.log" | tee -a "$B"
echo "total ${SECONDS}s" | tee -a "$B"
