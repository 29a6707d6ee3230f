#!/usr/bin/env bash
# One device call: the transpose and decode probes (SKIP_RAW, SKIP_MOROK, SKIP_DECODE=1 leave them out), then the
# cuda-marked tests in $TESTS, then benchmarks/permute.py ($BENCH: its options) and benchmarks/decode.py
# ($DECODE_BENCH) on both CUDA pairs. Logs and JSON under $OUT (at most 8 files).
set -u
O=${OUT:-/tmp/out}; mkdir -p "$O"
export PYTHONUNBUFFERED=1 MOROK_CACHE=0
LOG=$O/log.txt
run() { echo "=== $* ($(date +%T))" >>"$LOG"; timeout "$1" "${@:2}" >>"$LOG" 2>&1; echo "rc=$?" >>"$LOG"; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv >>"$LOG" 2>&1
[[ ${SKIP_RAW:-0} == 1 ]] || run 120 python3 benchmarks/probes/transpose_layouts.py --json "$O/raw.json"
for pair in nvrtc llvm-nvptx; do
  export MOROK_CUDA_COMPILER=$pair
  [[ ${SKIP_MOROK:-0} == 1 ]] || run 150 python3 benchmarks/probes/transpose_layouts.py --morok-only --json "$O/morok-$pair.json"
  [[ ${SKIP_DECODE:-0} == 1 ]] || run 150 python3 benchmarks/probes/decode_tiles.py --json "$O/decode-$pair.json"
done
unset MOROK_CUDA_COMPILER MOROK_CACHE
[[ -n ${TESTS:-} ]] && run 300 python3 -m pytest -m cuda -n 0 -q -p no:cacheprovider $TESTS
[[ -n ${BENCH:-} ]] && for pair in nvrtc llvm-nvptx; do
  run 240 env MOROK_CUDA_COMPILER=$pair python3 benchmarks/permute.py --device CUDA $BENCH --results "$O/res"
done
[[ -n ${DECODE_BENCH:-} ]] && for pair in nvrtc llvm-nvptx; do
  run 240 env MOROK_CUDA_COMPILER=$pair python3 benchmarks/decode.py --device CUDA $DECODE_BENCH --results "$O/res"
done
grep -E "^===|^rc=|x |WRONG|passed|failed|error|Error|met|MISSED" "$LOG" | tail -150
