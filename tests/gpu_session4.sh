#!/usr/bin/env bash
# Session 4's GPU proof in one device call: the cuda-marked suite on both CUDA pairs (kernel names,
# math ops, half-precision accumulation incl. 4096^3 against PyTorch, WHERE-narrowed launches), the CPU
# level tests on this host's CPU (an AVX-512 host proves the x86-64-v4 path), and ONNX's node tests on
# CUDA with both pairs where examples/onnx exists. Logs land in $OUT.
set -u
# the carried wheels, PYTHONPATH and $OUT/env.txt (the machine's description)
source tests/gpu_env.sh
set -o pipefail
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/ \
  --ignore=tests/test_onnx_nodes.py --ignore=tests/test_onnx_models.py 2>&1 | tee "$OUT/pytest_cuda.log" | tail -25
echo "pytest -m cuda exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_cuda.log"
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider -m "not cuda and not rocm" tests/test_cpu_levels.py \
  tests/test_launch_bounds.py tests/test_cpu_builtins.py tests/test_accumulation.py tests/test_math.py 2>&1 \
  | tee "$OUT/pytest_cpu_host.log" | tail -8
if [ -f tests/test_onnx_nodes.py ]; then
  for pair in nvrtc llvm-nvptx; do
    MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair timeout ${ONNX_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider \
      tests/test_onnx_nodes.py ${ONNX_ARGS:-} 2>&1 | tee "$OUT/onnx_nodes_cuda_$pair.log" | tail -4
  done
fi
ls -la "$OUT"
