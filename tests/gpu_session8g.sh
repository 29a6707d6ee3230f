#!/usr/bin/env bash
# Session 8's last call, CPU only (the Xeon host): the search with interleaved rounds and a switch margin
# (morok_py/search.py) on issue 12's CPU matmul shapes, 12 threads pinned, twice (separate processes);
# then tests/test_search.py.
# $OUT: env.txt, COMMIT, bench.log, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-150}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
for n in 1 2; do
  MOROK_CACHE_DIR=/tmp/morok-beam$n TAILN=8 step beam-$n 45 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
    --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 10 --results "$R/cpu-beam-$n"
done
timeout 40 python3 -m pytest -q -p no:cacheprovider tests/test_search.py 2>&1 | tail -2 | tee -a "$B"
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
