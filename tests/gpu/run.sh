#!/usr/bin/env bash
# The GPU runner: named suites on a machine with an NVIDIA GPU, within a time budget.
#
#   bash tests/gpu/run.sh [--budget SECONDS] [--jobs N] [SUITE ...]        (default: cuda, 540 s, 1 job)
#
# --jobs N runs the cuda suite's pytest passes, and each pair of the onnx suite, in N pytest-xdist processes
# that share the GPU (where xdist is installed: carry its wheels in .whl/).
#
# Suites, run in the order given:
#   cuda       the cuda-marked pytest suite on both CUDA pairs: the `device` fixture runs nvrtc and llvm-nvptx,
#              then the tests that take the default pair run again with llvm-nvptx as the default
#   onnx       every tests/test_onnx_*.py (node cases, models, session, backend, ops, PyTorch exports where
#              torch is installed) on CUDA, the two pairs side by side
#   bench      the GPU benchmarks (kernels, suite, copies, launch, compile, half precision, tensor cores, small
#              shapes (decode), conv, ONNX models), most important first, each skipped once the budget cannot
#              hold it
#   search     MOROK_BEAM searches: the general suite searched on nvrtc, the matmuls on llvm-nvptx, and
#              the search-against-benchmark check of the 4096^3 matmul
#   cpu        the CPU test suite on this host's CPU
#   cpu-bench  the CPU benchmarks on this host's CPU (general suite, launch overhead, register tiles, ONNX
#              models beside onnxruntime, convolutions beside onnxruntime)
#   mlir       the MLIR pair's CUBINs, built beforehand elsewhere (`python tests/mlir_cuda_replay.py build
#              .mlir-replay`, carried), loaded and run here against the CPU
#   all        cuda onnx bench search cpu
#
# Each suite writes tests/results/<machine kind>/<suite>.log; benchmarks write
# benchmarks/results/<machine kind>/<name>.json (+ .png), replacing the last run of the same kind of machine.
# The kind comes from the hardware (benchmarks/machine.py): nvidia-h100, cpu-xeon-avx512-16c, ...
# Where $OUT is set (the device tool), the files go to a scratch tree packed as $OUT/results.tgz, with
# $OUT/summary.log beside it: `tar xzf results.tgz -C <repo>` puts each file in its place. Without $OUT
# they are written into this checkout directly.
#
# Set MOROK_BENCH_GIT=<commit> when the checkout's .git is not the tree's own (a copied working tree):
# the result files record it as the commit measured. Wheels in .whl/ (llvmlite, pyelftools, ...) are
# installed to /tmp/site first when present.
set -u
cd "$(dirname "$0")/../.."
REPO=$PWD

BUDGET=540
JOBS=1
SUITES=()
while (( $# )); do
  case $1 in
    --budget) BUDGET=$2; shift 2 ;;
    --budget=*) BUDGET=${1#*=}; shift ;;
    --jobs) JOBS=$2; shift 2 ;;
    --jobs=*) JOBS=${1#*=}; shift ;;
    -h|--help) sed -n '2,30p' "$0" | cut -c3-; exit 0 ;;
    all) SUITES+=(cuda onnx bench search cpu); shift ;;
    cuda|onnx|bench|search|cpu|cpu-bench|mlir) SUITES+=("$1"); shift ;;
    *) echo "unknown suite or option: $1 (suites: cuda onnx bench search cpu cpu-bench mlir all)" >&2; exit 2 ;;
  esac
done
(( ${#SUITES[@]} )) || SUITES=(cuda)

# -- environment: the carried wheels, PYTHONPATH, the machine's description ----------------------------
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if ls .whl/*.whl >/dev/null 2>&1; then
  # once per machine: a second runner started beside the first (two suites at once) finds them installed
  if [ "$(ls .whl)" != "$(cat /tmp/site/.morok-wheels 2>/dev/null)" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "installing the wheels in .whl/ failed" >&2; exit 1; }
    ls .whl > /tmp/site/.morok-wheels
  fi
  export PYTHONPATH=/tmp/site:$REPO
else
  export PYTHONPATH=$REPO
fi
if [ -z "${MOROK_BENCH_GIT:-}" ]; then
  MOROK_BENCH_GIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  echo "note: MOROK_BENCH_GIT unset; recording $MOROK_BENCH_GIT (the checkout's HEAD) as the commit measured"
fi
export MOROK_BENCH_GIT

if [ -n "${OUT:-}" ]; then ROOT=$(mktemp -d /tmp/gpu-results.XXXX); else ROOT=$REPO; fi
export MOROK_RESULTS_DIR=$ROOT/benchmarks/results
GPU=$(python3 benchmarks/machine.py CUDA 2>/dev/null || echo nvidia-unknown)
CPU=$(python3 benchmarks/machine.py)
mkdir -p "$ROOT/tests/results/$GPU"
SUMMARY=$ROOT/tests/results/$GPU/summary.log
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

{
  date -u; echo "commit $MOROK_BENCH_GIT; GPU kind $GPU; CPU kind $CPU"
  nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"
  python3 -c "import sys, llvmlite, numpy; print(sys.version); print('llvmlite', llvmlite.__version__, 'numpy', numpy.__version__)"
  python3 -c "import onnx, onnxruntime as o; print('onnx', onnx.__version__, 'onnxruntime', o.__version__, o.get_available_providers())"
  python3 -c "import torch; print('torch', torch.__version__)"
  python3 -c "from morok_py import Device; d = Device['CUDA']; print(d, d.info())"
} > "$ROOT/tests/results/$GPU/env.txt" 2>&1
cat "$ROOT/tests/results/$GPU/env.txt"

# -- steps -------------------------------------------------------------------------------------------
left() { echo $(( BUDGET - SECONDS )); }

# step LOG MIN_S COMMAND...: append COMMAND's output to LOG within the time left, unless less than MIN_S is
# left; the log's last lines go to the summary
step() {
  local log=$1 min=$2 lim; shift 2
  lim=$(( $(left) - 5 ))
  if (( lim < min )); then say "-- skipped (${lim}s left): $*"; return; fi
  say "-- $* (at ${SECONDS}s, up to ${lim}s)"
  echo "\$ $*" >> "$log"
  timeout "$lim" "$@" >> "$log" 2>&1
  local rc=$?
  echo "exit $rc after ${SECONDS}s" >> "$log"
  grep -v -E "^\[bench\]|\[#|^kernels \[" "$log" | tail -"${TAILN:-6}" | tee -a "$SUMMARY"
}

pytest_args=(-q -rs -p no:cacheprovider)
python3 -c "import xdist" 2>/dev/null && XDIST=(-n 8) || XDIST=()

# fills the GPU's memory on purpose: it runs alone, last, so that nothing else on the GPU (the onnx suite
# started beside this one) sees its out-of-memory window
OOM_TEST=out_of_memory_under_load

suite_cuda() {
  local log=$ROOT/tests/results/$GPU/cuda.log jobs=(-n 0); : > "$log"     # -n 0: one process (pyproject's -n auto off)
  # --jobs N: N pytest-xdist processes share the GPU (the out-of-memory test still runs alone, last)
  if (( JOBS > 1 )) && (( ${#XDIST[@]} )); then jobs=(-n "$JOBS"); fi
  TAILN=3 step "$log" 120 python3 -m pytest "${pytest_args[@]}" "${jobs[@]}" -m cuda -k "not $OOM_TEST" tests/
  # the tests that take the default pair instead of the `device` fixture, again with llvm-nvptx as the default
  MOROK_CUDA_COMPILER=llvm-nvptx TAILN=3 step "$log" 60 python3 -m pytest "${pytest_args[@]}" "${jobs[@]}" -m cuda \
    -k "not CUDA-nvrtc and not CUDA-llvm-nvptx and not $OOM_TEST" tests/
  TAILN=3 step "$log" 20 python3 -m pytest "${pytest_args[@]}" -n 0 -m cuda -k "$OOM_TEST" tests/test_cuda_faults.py
}

suite_onnx() {
  local log=$ROOT/tests/results/$GPU/onnx.log pair lim jobs=(-n 0); : > "$log"
  # --jobs N: each pair's pytest in N xdist processes (2N on the GPU at once)
  if (( JOBS > 1 )) && (( ${#XDIST[@]} )); then jobs=(-n "$JOBS"); fi
  lim=$(( $(left) - 10 ))
  if (( lim < 150 )); then say "-- onnx skipped (${lim}s left)"; return; fi
  say "-- onnx: node cases and models on CUDA, nvrtc and llvm-nvptx side by side (at ${SECONDS}s, up to ${lim}s)"
  for pair in nvrtc llvm-nvptx; do
    ( MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair timeout "$lim" python3 -m pytest "${pytest_args[@]}" "${jobs[@]}" \
        tests/test_onnx_*.py > "/tmp/onnx-$pair.log" 2>&1; echo "exit $?" >> "/tmp/onnx-$pair.log" ) &
  done
  wait
  for pair in nvrtc llvm-nvptx; do
    { echo "== ONNX on CUDA, $pair"; cat "/tmp/onnx-$pair.log"; } >> "$log"
    { echo "ONNX on CUDA, $pair:"; grep -E "FAILED|ERROR" "/tmp/onnx-$pair.log" | head -10; tail -2 "/tmp/onnx-$pair.log"; } | tee -a "$SUMMARY"
  done
}

suite_bench() {
  local log=$ROOT/tests/results/$GPU/bench.log; : > "$log"
  local B=benchmarks pair
  for pair in nvrtc llvm-nvptx; do
    MOROK_CUDA_COMPILER=$pair TAILN=18 step "$log" 90 python3 $B/kernels.py --device CUDA --no-sweep --rounds 3
  done
  for pair in nvrtc llvm-nvptx; do
    MOROK_CUDA_COMPILER=$pair TAILN=22 step "$log" 120 python3 $B/kernels.py --device CUDA --suite --no-sweep --rounds 3
  done
  TAILN=12 step "$log" 90 python3 $B/launch.py --device CUDA
  TAILN=24 step "$log" 60 python3 $B/half_bandwidth.py --device CUDA
  for pair in nvrtc llvm-nvptx; do
    MOROK_CUDA_COMPILER=$pair TAILN=8 step "$log" 120 python3 $B/tensor_cores.py
  done
  for pair in nvrtc llvm-nvptx; do
    TAILN=14 step "$log" 90 python3 $B/decode.py --device CUDA --compiler $pair
  done
  TAILN=12 step "$log" 60 python3 $B/conv.py --device CUDA
  TAILN=12 step "$log" 90 python3 $B/copies.py --device CUDA
  TAILN=12 step "$log" 90 python3 $B/compile.py --device CUDA
  TAILN=8 step "$log" 150 python3 $B/onnx_models.py --device CUDA --compiler nvrtc --compiler llvm-nvptx
}

suite_search() {
  local log=$ROOT/tests/results/$GPU/search.log B=benchmarks; : > "$log"
  TAILN=3 step "$log" 60 python3 -m pytest "${pytest_args[@]}" -m cuda tests/test_search.py
  MOROK_CUDA_COMPILER=nvrtc TAILN=30 step "$log" 150 python3 $B/kernels.py --device CUDA --suite --no-sweep \
    --rounds 3 --beam 4 --beam-seconds 8
  MOROK_CUDA_COMPILER=llvm-nvptx TAILN=14 step "$log" 90 python3 $B/kernels.py --device CUDA \
    --only matmul,matmul_sym,matmul_odd --no-sweep --rounds 3 --beam 4 --beam-seconds 8
  MOROK_CUDA_COMPILER=nvrtc TAILN=8 step "$log" 60 python3 $B/search_context.py --case matmul
}

suite_cpu() {
  mkdir -p "$ROOT/tests/results/$CPU"
  local log=$ROOT/tests/results/$CPU/cpu.log; : > "$log"
  TAILN=3 step "$log" 120 python3 -m pytest "${pytest_args[@]}" "${XDIST[@]}" -m "not cuda and not rocm" tests/
}

suite_cpu_bench() {
  mkdir -p "$ROOT/tests/results/$CPU"
  local log=$ROOT/tests/results/$CPU/bench.log B=benchmarks; : > "$log"
  TAILN=18 step "$log" 90 python3 $B/kernels.py --device CPU --suite --no-sweep --rounds 3
  TAILN=8 step "$log" 60 python3 $B/cpu_launch.py
  TAILN=12 step "$log" 90 python3 $B/cpu_tiles.py --rounds 3
  TAILN=12 step "$log" 150 python3 $B/onnx_models.py --device CPU --runs 20
  [ -f $B/cpu_conv.py ] && TAILN=12 step "$log" 90 python3 $B/cpu_conv.py
}

suite_mlir() {
  local log=$ROOT/tests/results/$GPU/mlir-replay.log
  if [ ! -d .mlir-replay ]; then say "-- mlir skipped: no .mlir-replay folder (build it with tests/mlir_cuda_replay.py)"; return; fi
  : > "$log"
  TAILN=3 step "$log" 60 python3 tests/mlir_cuda_replay.py run .mlir-replay
}

for s in "${SUITES[@]}"; do
  say "== $s (at ${SECONDS}s of ${BUDGET}s)"
  "suite_${s//-/_}"
done
say "== done in ${SECONDS}s; GPU kind $GPU, CPU kind $CPU"
find "$ROOT/tests/results" -name '*.log' -empty -delete     # a suite that ran nothing leaves the last log alone

if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  cp "$SUMMARY" "$OUT/summary.log"
  rm -f "$SUMMARY"          # the summary is the call's own record, not a result
  tar -czf "$OUT/results.tgz" -C "$ROOT" $(cd "$ROOT" && ls -d tests benchmarks 2>/dev/null)
  echo "results: \$OUT/results.tgz ($(tar -tzf "$OUT/results.tgz" | grep -c -v '/$') files); unpack with tar xzf results.tgz -C <repo>"
else
  rm -f "$SUMMARY"
fi
