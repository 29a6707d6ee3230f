#!/usr/bin/env bash
# Session 8's last GPU call, at the final HEAD (the tensor-core dispatch moved to strategies/matrix_units.py,
# rendered code byte-identical): the tensor-core and wgmma device tests and the CUDA device tests (both
# pairs), then issue 13's rows on nvrtc.
# $OUT: env.txt, COMMIT, bench.log, pytest_tc.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-300}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
timeout 170 python3 -m pytest -q -rs -m cuda -p no:cacheprovider tests/test_wgmma.py tests/test_tensor_cores.py \
  tests/test_cuda_device.py tests/test_kernels.py > "$OUT/pytest_tc.log" 2>&1; echo "rc $?" >> "$OUT/pytest_tc.log"
tail -3 "$OUT/pytest_tc.log" | tee -a "$B"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-tc TAILN=10 step tc-nvrtc 100 \
  python3 benchmarks/tensor_cores.py --repeats 10 --results "$R/tc-nvrtc"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
