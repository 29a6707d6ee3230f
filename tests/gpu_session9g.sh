#!/usr/bin/env bash
# Session 9's last call: ONNX's node tests and the light models on CUDA, both pairs at once (the float32
# cp.async fill is the default since 80b49af; last run in session 8).
# $OUT: env.txt, COMMIT, bench.log, onnx_cuda.log.
set -u
source tests/gpu_env.sh
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
onnx_cuda ${LEFT:-420}
echo "total ${SECONDS}s" | tee -a "$B"
