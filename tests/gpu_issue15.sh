#!/usr/bin/env bash
# Issue 15's GPU proof in one device call: DLPack with PyTorch and CuPy, the checked call, self-capturing
# plans and the launch tests on the H100; benchmarks/launch.py (checked call, plans captured and not,
# DLPack round trip, CuPy and PyTorch as peers) and the CPU launch overhead on that host's CPU.
# Runs from a snapshot of the commit under test when one is carried in .issue15/tree (the working
# tree that travels holds other sessions' uncommitted work); logs and JSON land in $OUT.
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
WHL=$PWD/.whl
[ -d .issue15/tree ] && cd .issue15/tree
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }
else
  export PYTHONPATH=$PWD
fi
export MOROK_BENCH_GIT=${MOROK_BENCH_GIT:-$(cat COMMIT 2>/dev/null || echo unknown)}
{
  date -u; echo "commit $MOROK_BENCH_GIT"
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import sys, llvmlite, numpy, torch, cupy; print(sys.version); print('llvmlite', llvmlite.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__, 'cupy', cupy.__version__)"
  python3 -c "from morok_py import Device; d = Device['CUDA']; print(d, d.info())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
set -o pipefail
timeout ${BENCH_TIMEOUT:-110} python3 benchmarks/launch.py --device CUDA --results "$OUT" 2>&1 \
  | grep -v "\[####" | tee "$OUT/bench_launch.log" | tail -40
echo "launch.py exit: $?"
timeout 40 python3 benchmarks/cpu_launch.py --calls 5000 --repeats 5 --results "$OUT" 2>&1 \
  | grep -v "\[####" | tee "$OUT/bench_cpu_launch.log" | tail -9
timeout ${TEST_TIMEOUT:-120} python3 -X dev -m pytest -q -rs -p no:cacheprovider tests/test_dlpack.py tests/test_plan.py \
  tests/test_cuda_device.py tests/test_launch_errors.py tests/test_imports.py tests/test_cpu.py 2>&1 \
  | tee "$OUT/pytest_issue15.log" | tail -25
echo "pytest exit: ${PIPESTATUS[0]}" | tee -a "$OUT/pytest_issue15.log"
ls -la "$OUT"
