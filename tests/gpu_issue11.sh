#!/usr/bin/env bash
# Issue 11's GPU proof in one device call: ONNX's node tests and the nine light models on CUDA with both
# pairs (run side by side, each on its own cache), the narrow-dtype and math tests on CUDA, then the
# resnet50/densenet121 benchmark beside onnxruntime (CUDA, and this host's CPU) with nothing else running.
set -u
source tests/gpu_env.sh
for pair in nvrtc llvm-nvptx; do
  ( XDG_CACHE_HOME=/tmp/cache-$pair MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair /usr/bin/time -f "wall %e s" \
      timeout ${ONNX_TIMEOUT:-400} python3 -m pytest -q -rs -p no:cacheprovider -s tests/test_onnx_nodes.py tests/test_onnx_models.py \
      > "$OUT/onnx_cuda_$pair.log" 2>&1 ) &
done
XDG_CACHE_HOME=/tmp/cache-t timeout 300 python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_narrow_dtypes.py \
  tests/test_math.py > "$OUT/pytest_cuda_narrow_math.log" 2>&1
tail -3 "$OUT/pytest_cuda_narrow_math.log"
wait
for pair in nvrtc llvm-nvptx; do tail -4 "$OUT/onnx_cuda_$pair.log"; done
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/onnx_models.py --device CUDA --compiler nvrtc --compiler llvm-nvptx \
  --runs 20 --json "$OUT/onnx-models-cuda.json" 2>&1 | tee "$OUT/bench_cuda.log"
timeout 150 python3 benchmarks/onnx_models.py --device CPU --runs 5 --json "$OUT/onnx-models-cpu-gpuhost.json" 2>&1 \
  | tee "$OUT/bench_cpu.log"
ls -la "$OUT"
