#!/usr/bin/env bash
# The whole GPU proof in one device call: tests/gpu_run.sh (cuda-marked suite on both pairs,
# compile-only tests, launch benchmark), then the kernel, copy and compile benchmarks. Everything is
# written to a scratch folder and packed into $OUT/gpu.tgz (the device tool returns at most 8 files).
# The copy on a GPU machine sits over an older .git: pass the commit, MOROK_BENCH_GIT=<hash> bash tests/gpu_full.sh,
# so the JSON records what was measured.
set -u
FINAL_OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$FINAL_OUT"
export OUT=$(mktemp -d)
bash tests/gpu_run.sh
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD}
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site:$PWD
for b in kernels copies compile; do
  timeout ${BENCH_TIMEOUT:-200} python3 benchmarks/$b.py --device CUDA --results "$OUT" 2>&1 \
    | tee "$OUT/bench_$b.log" | tail -25
  echo "$b.py exit: ${PIPESTATUS[0]}"
done
timeout 200 python3 benchmarks/profile_fresh_hit.py --device CUDA --kernels add,softmax,matmul \
  > "$OUT/profile_fresh_hit.log" 2>&1; grep "== .*: \(plain\|pieces\)" "$OUT/profile_fresh_hit.log" | cut -c1-300
tar czf "$FINAL_OUT/gpu.tgz" -C "$OUT" .
cp "$OUT"/pytest_cuda.log "$FINAL_OUT/" 2>/dev/null
ls -la "$OUT" "$FINAL_OUT"
