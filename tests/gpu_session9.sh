#!/usr/bin/env bash
# Session 9's first call: issue 12's targets measured with interleaved rounds (benchmarks/kernels.py
# --rounds: ours, the searched schedule and the peers alternate in every round; symbolic against static
# sizes is its own interleaved pair).
#   phase A, the GPU idle: the CPU suite on the Xeon host (12 threads on cores 4-15, as in session 8), the
#     CPU matmul shapes searched, and the same shapes on one thread per physical core (if the host has SMT);
#   phase B: the GPU suite on nvrtc (searched too) and llvm-nvptx, the five tuned kernels, and the SASS of
#     the float32 4096^3 matmul with symbolic and with static sizes (nvdisasm, where the image has it).
# $OUT: env.txt, topology.txt, COMMIT, bench.log, sass-*.txt.gz, results.tgz.
set -u
source tests/gpu_env.sh
DEADLINE=${DEADLINE:-540}
R=/tmp/res; mkdir -p "$R"
B="$OUT/bench.log"
cat COMMIT > "$OUT/COMMIT" 2>/dev/null || git rev-parse --short HEAD > "$OUT/COMMIT"
{ lscpu; echo; lscpu -e; echo; nproc; uptime; } > "$OUT/topology.txt" 2>&1
# one logical CPU per physical core, from cores 4 up (the GPU benchmarks' Python runs on the low ones)
PHYS=$(lscpu -p=CPU,CORE | grep -v '^#' | sort -t, -k2,2n -k1,1n | awk -F, '!seen[$2]++ {print $1}' | awk '$1 >= 4' | paste -sd,)
NPHYS=$(echo "$PHYS" | tr ',' '\n' | grep -c .)
echo "one CPU per core from 4: $PHYS ($NPHYS)" | tee -a "$OUT/topology.txt"
ROUNDS=${ROUNDS:-7}
export OPENBLAS_NUM_THREADS=12 OMP_NUM_THREADS=12 NUMBA_NUM_THREADS=12 MOROK_CPU_THREADS=12
MOROK_CACHE_DIR=/tmp/morok-cpu TAILN=22 step cpu-suite 120 taskset -c 4-15 python3 benchmarks/kernels.py \
  --device CPU --suite --no-sweep --rounds $ROUNDS --results "$R/cpu-suite"
MOROK_CACHE_DIR=/tmp/morok-cpu-beam TAILN=10 step cpu-beam 100 taskset -c 4-15 python3 benchmarks/kernels.py --device CPU \
  --only matmul,mlp1,mlp2 --no-sweep --beam 6 --beam-seconds 8 --rounds $ROUNDS --results "$R/cpu-beam"
if (( NPHYS >= 4 && NPHYS < 12 )); then
  export OPENBLAS_NUM_THREADS=$NPHYS OMP_NUM_THREADS=$NPHYS NUMBA_NUM_THREADS=$NPHYS MOROK_CPU_THREADS=$NPHYS
  MOROK_CACHE_DIR=/tmp/morok-cpu-phys TAILN=10 step cpu-phys 60 taskset -c $PHYS python3 benchmarks/kernels.py --device CPU \
    --only matmul,matmul_sym,mlp1,mlp2 --no-sweep --rounds $ROUNDS --results "$R/cpu-phys"
fi
unset OPENBLAS_NUM_THREADS OMP_NUM_THREADS NUMBA_NUM_THREADS MOROK_CPU_THREADS
echo "== phase A done at ${SECONDS}s" | tee -a "$B"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-gsuite TAILN=22 step suite-nvrtc 170 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --rounds 5 --beam 6 --beam-seconds 10 --results "$R/suite-nvrtc"
MOROK_CUDA_COMPILER=llvm-nvptx MOROK_CACHE_DIR=/tmp/morok-gsuite-ll TAILN=16 step suite-llvm-nvptx 70 \
  python3 benchmarks/kernels.py --device CUDA --suite --no-sweep --rounds 5 --results "$R/suite-llvm-nvptx"
MOROK_CUDA_COMPILER=nvrtc MOROK_CACHE_DIR=/tmp/morok-five TAILN=12 step five-nvrtc 70 \
  python3 benchmarks/kernels.py --device CUDA --no-sweep --rounds 3 --results "$R/five-nvrtc"
step sass 40 python3 - <<'PY'
import glob, gzip, os, shutil, subprocess
from morok_py import Device, kernels as K
try:
    import triton
    tri = glob.glob(os.path.join(os.path.dirname(triton.__file__), "**", "nvdisasm"), recursive=True)
except ImportError:
    tri = []
nv = shutil.which("nvdisasm") or next(iter(tri + glob.glob("/usr/local/cuda*/bin/nvdisasm")), None)
print("nvdisasm:", nv)
d = Device["CUDA"]
for lab, ast in (("static", K.matmul(4096, 4096, 4096)), ("symbolic", K.matmul())):
    cub = d.compiler.compile(d.renderer.render(ast, "mm_" + lab)).bytes
    open(f"/tmp/mm_{lab}.cubin", "wb").write(cub)
    if nv:
        sass = subprocess.run([nv, "-c", f"/tmp/mm_{lab}.cubin"], capture_output=True, text=True).stdout
        with gzip.open(os.path.join(os.environ["OUT"], f"sass-{lab}.txt.gz"), "wt") as f:
            f.write(sass)
        print(lab, len(sass.splitlines()), "lines")
PY
tar -C /tmp -czf "$OUT/results.tgz" res
echo "total ${SECONDS}s" | tee -a "$B"
