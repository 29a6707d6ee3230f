# Sourced by the GPU scripts: install the carried wheels (.whl: llvmlite >= 0.50, pyelftools) that the
# GPU image lacks, set PYTHONPATH, and write the machine's description to $OUT/env.txt.
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD || { echo "wheel install failed"; exit 1; }
else
  export PYTHONPATH=$PWD
fi
{
  date -u; nvidia-smi --query-gpu=index,name,compute_cap,memory.total,driver_version --format=csv
  lscpu | grep -E "Model name|^CPU\(s\)"; grep -o -m1 -w 'avx512f' /proc/cpuinfo || echo "no avx512f"
  python3 -c "import sys, llvmlite, numpy; print(sys.version); print('llvmlite', llvmlite.__version__, 'numpy', numpy.__version__)"
  python3 -c "import onnx, onnxruntime as o; print('onnx', onnx.__version__, 'onnxruntime', o.__version__, o.get_available_providers())"
  python3 -c "from morok_py import Device; d = Device['CUDA']; print(d, d.info())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# step NAME LIMIT_S COMMAND...: run one step into $R/NAME.log, its tail into $B, unless fewer than LIMIT_S
# seconds remain before $DEADLINE (the callers set R, B and DEADLINE)
step() {   # step NAME LIMIT_S COMMAND...: run unless fewer than LIMIT_S seconds remain before DEADLINE
  local name=$1 lim=$2; shift 2
  if (( SECONDS + lim > DEADLINE )); then echo "== $name: skipped, ${SECONDS}s used" | tee -a "$B"; return; fi
  echo "== $name (t=${SECONDS}s)" | tee -a "$B"
  timeout "$lim" "$@" > "$R/$name.log" 2>&1; echo "rc $? after ${SECONDS}s" >> "$R/$name.log"
  grep -v "\[#\|^kernels \[" "$R/$name.log" | tail -${TAILN:-24} | tee -a "$B"
}

# onnx_cuda LIMIT_S: ONNX's node tests and light models on CUDA, both pairs at once, each within LIMIT_S
# seconds; their failures and tails into $OUT/onnx_cuda.log, the counts into $B
onnx_cuda() {
  local lim=$1 pair
  for pair in nvrtc llvm-nvptx; do
    ( MOROK_ONNX_DEVICE=CUDA MOROK_CUDA_COMPILER=$pair MOROK_CACHE_DIR=/tmp/morok-onnx-$pair timeout "$lim" python3 -m pytest \
        -q -rs -p no:cacheprovider tests/test_onnx_nodes.py tests/test_onnx_models.py > /tmp/onnx_cuda_$pair.log 2>&1 ) &
  done
  wait
  for pair in nvrtc llvm-nvptx; do
    { echo "== ONNX on CUDA, $pair"; grep -E "FAILED|ERROR" /tmp/onnx_cuda_$pair.log | head -20; tail -3 /tmp/onnx_cuda_$pair.log; } >> "$OUT/onnx_cuda.log"
  done
  grep -E "==|passed|failed" "$OUT/onnx_cuda.log" | tee -a "$B"
}
