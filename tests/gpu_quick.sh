#!/usr/bin/env bash
# A short GPU check in one device call: the cuda-marked suite on both pairs, then the kernel benchmark
# without the size sweep (KERNELS picks the subset). Logs and JSON are packed into $OUT/quick.tgz.
set -u
FINAL_OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$FINAL_OUT"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader
timeout ${TEST_TIMEOUT:-300} python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/ ${PYTEST_ARGS:-} 2>&1 \
  | tee "$WORK/pytest_cuda.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"
timeout ${BENCH_TIMEOUT:-240} python3 benchmarks/kernels.py --device CUDA --no-sweep --results "$WORK" \
  --only "${KERNELS:-add,sum,row_max,softmax,matmul}" 2>&1 | tee "$WORK/bench_kernels.log" | tail -30
echo "kernels.py exit: ${PIPESTATUS[0]}"
tar czf "$FINAL_OUT/quick.tgz" -C "$WORK" .
