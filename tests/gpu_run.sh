#!/usr/bin/env bash
# One call on a GPU machine: the cuda-marked test suite on both CUDA compiler pairs, the compile-only
# tests, and benchmarks/launch.py; logs and JSON land in $OUT (default: ./gpu-out).
# Carried wheels (llvmlite 0.50, pyelftools) in .whl/ are installed to /tmp/site first when present.
set -u
export NCCL_NVLS_ENABLE=0
source tests/gpu_env.sh     # the carried wheels, PYTHONPATH, $OUT
{
  date -u; nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
  python3 -c "import sys, llvmlite, numpy; print(sys.version); print('llvmlite', llvmlite.__version__, 'numpy', numpy.__version__)"
  python3 -m pip show cuda-bindings cuda-pathfinder nvidia-cuda-nvrtc nvidia-nvjitlink pyelftools ml_dtypes 2>/dev/null | grep -E '^(Name|Version)'
  python3 -c "from morok_py import Device; d = Device['CUDA']; print(d, d.info())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
set -o pipefail
timeout ${TEST_TIMEOUT:-420} python3 -m pytest -v -rs -m cuda -p no:cacheprovider tests/ \
  --junitxml="$OUT/pytest_cuda.xml" 2>&1 | tee "$OUT/pytest_cuda.log" | tail -60
echo "pytest -m cuda exit: $?" | tee -a "$OUT/pytest_cuda.log"
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_compile.py 2>&1 | tail -3 | tee "$OUT/pytest_compile.log"
timeout ${BENCH_TIMEOUT:-150} python3 benchmarks/launch.py --device CUDA --results "$OUT" 2>&1 | tee "$OUT/bench_launch.log" | tail -30
echo "launch.py exit: $?"
ls -la "$OUT"
