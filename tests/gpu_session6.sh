#!/usr/bin/env bash
# Session 6's integrated GPU proof in one device call, after the checked-call, DLPack, schedule (GPU and
# CPU), tensor-core, half-vector and implicit-GEMM changes landed together: the whole cuda-marked suite
# (both CUDA pairs), ONNX's node tests and models on CUDA with both pairs (side by side, each on its own
# cache), the MLIR pair's CUBIN replay; then, with nothing else running: the tensor-core benchmark (both
# pairs), the launch and DLPack benchmark, half-precision bandwidth, implicit-GEMM convolutions, and the
# CPU launch overhead and general suite on this host's AVX-512 Xeon (issue 12's CPU targets there).
# $OUT gets at most 8 files: env.txt, pytest_cuda.log, onnx_cuda.log, bench.log, the CUDA JSON (launch,
# half_bandwidth, conv), the CPU JSON (cpu_launch, kernels), tc-nvrtc.json, tc-llvm-nvptx.json.
set -u
source tests/gpu_env.sh
echo "tree: $(cat COMMIT 2>/dev/null || echo 'working tree')" | tee -a "$OUT/env.txt"
( /usr/bin/time -f "wall %e s" timeout ${SUITE_TIMEOUT:-300} python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/ \
    --ignore=tests/test_onnx_nodes.py --ignore=tests/test_onnx_models.py > "$OUT/pytest_cuda.log" 2>&1 ) &
if [ -z "${NO_ONNX:-}" ]; then
  for pair in nvrtc llvm-nvptx; do
    ( XDG_CACHE_HOME=/tmp/cache-$pair MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair /usr/bin/time -f "wall %e s" \
        timeout ${ONNX_TIMEOUT:-280} python3 -m pytest -q -rs -p no:cacheprovider tests/test_onnx_nodes.py tests/test_onnx_models.py \
        > /tmp/onnx_cuda_$pair.log 2>&1 ) &
  done
fi
if [ -f .mlir-replay/bundle.pkl ]; then
  timeout 200 python3 tests/mlir_cuda_replay.py run .mlir-replay > /tmp/mlir_cuda_replay.log 2>&1
  { echo "== mlir_cuda_replay"; tail -30 /tmp/mlir_cuda_replay.log; } >> "$OUT/env.txt"; tail -2 /tmp/mlir_cuda_replay.log
fi
wait
tail -4 "$OUT/pytest_cuda.log"
for pair in nvrtc llvm-nvptx; do
  [ -f /tmp/onnx_cuda_$pair.log ] && { echo "== ONNX on CUDA, $pair"; grep -E "FAILED|ERROR" /tmp/onnx_cuda_$pair.log | head -40; tail -3 /tmp/onnx_cuda_$pair.log; } >> "$OUT/onnx_cuda.log"
done
cat "$OUT/onnx_cuda.log" 2>/dev/null | grep -E "==|passed|failed" | head
B="$OUT/bench.log"
for pair in nvrtc llvm-nvptx; do
  MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-tc-$pair timeout ${TC_TIMEOUT:-75} python3 benchmarks/tensor_cores.py \
    --results "$OUT/tc-$pair" 2>&1 | sed "s/^/[tc $pair] /" | tee -a "$B" | tail -8
done
timeout ${BENCH_TIMEOUT:-90} python3 benchmarks/launch.py --device CUDA --results "$OUT" 2>&1 | grep -v "\[####" >> "$B"
grep -E "Program|bare|self-captured, to|DLPack|torch ->|from_dlpack" "$B" | head -24
timeout ${HALF_TIMEOUT:-100} python3 benchmarks/half_bandwidth.py --device CUDA --results "$OUT" 2>&1 | grep -v "\[#" | tee -a "$B" | tail -22
timeout ${CONV_TIMEOUT:-100} python3 benchmarks/conv.py --device CUDA --results "$OUT" 2>&1 | grep -v "\[#" | tee -a "$B" | tail -14
timeout 40 python3 benchmarks/cpu_launch.py --calls 5000 --repeats 5 --results "$OUT" 2>&1 | grep -v "\[#" | tee -a "$B" | tail -6
if [ -z "${NO_CPU_SUITE:-}" ]; then
  MOROK_CACHE_DIR=/tmp/morok-cpu-suite timeout ${CPU_TIMEOUT:-120} python3 benchmarks/kernels.py --device CPU --suite --no-sweep \
    --results "$OUT" 2>&1 | grep -v "\[#\|^kernels \[" | tee -a "$B" | tail -25
fi
ls -la "$OUT"
