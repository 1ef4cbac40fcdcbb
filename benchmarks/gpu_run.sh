#!/usr/bin/env bash
# First contact with a GPU, in one command that fits a short lease (default budget 8 minutes,
# BUDGET=seconds to change it). Staged so the decisive numbers come first; every stage has its
# own time limit, cut to what is left of the budget, and a stage that no longer fits is skipped
# with a line saying so. PyTorch, CUDA, nvcc and pybind11 must be there; vLLM is not needed.
#
#   OUT=/some/dir bash benchmarks/gpu_run.sh
#
#   0. probe: GPU, driver, nvcc, Python headers, zlib, pybind11, the profilers      -> probe.txt
#   1. build _cuda (nvcc, this GPU's arch only) and _C + _cpu_gemm (g++; the byte-split packer)
#      side by side                                                                  -> build_*.txt
#      + the machine code: SASS and resource use of every kernel                     -> sass_*.txt, resources.txt
#   2. first contact: every kernel instance once, exactly (kernels/selfcheck.py)    -> first_contact.txt
#   3. bench_zipgemm.py --quick: fused / decoupled / byte-split / cuBLAS, Llama-3-8B,
#      N 1, 8, 32                                                                    -> bench_quick.json
#   4. pytest tests/gpu, without the long layer-shape sweep                         -> pytest-gpu.{txt,xml}
#   5. compute-sanitizer memcheck on gpu_sanitize.py (exact checks), no caching allocator
#   6. ncu: two fused launches and cuBLAS's at N = 1 and 8 (28672 x 4096)             -> ncu.txt
#   7. what time is left: racecheck, the MoE benchmark, the full benchmark
# Logs go to a work folder; after every stage it is packed into $OUT/gpu_run.tar.gz (so a run cut
# short still returns what it did), and the decisive JSON lies beside it: $OUT/bench_quick.json.
# The exit status is 0 when the first contact, the tests and memcheck passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-$PWD/gpu-out}
BUDGET=${BUDGET:-480}
WORK=$(mktemp -d /tmp/zipserv-gpu-run.XXXXXX)
LOG="$WORK/gpu_run.log"
T0=$(date +%s)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

log() { echo "[gpu_run +$(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }
left() { echo $(( T0 + BUDGET - $(date +%s) )); }
# (a name per process: the two build stages run side by side)
pack() { tar -czf "$OUT/gpu_run.tar.gz.$BASHPID" -C "$WORK" . 2>/dev/null && mv "$OUT/gpu_run.tar.gz.$BASHPID" "$OUT/gpu_run.tar.gz"; }
# stage NAME LIMIT CMD...: run CMD under min(LIMIT, time left - 15 s); skip it when under 20 s are left
stage() {
  local name=$1 limit=$2; shift 2
  local l; l=$(( $(left) - 15 )); [ "$l" -lt "$limit" ] && limit=$l
  if [ "$limit" -lt 20 ]; then log "$name: SKIPPED (budget spent)"; return 124; fi
  log "$name (limit ${limit} s)"
  timeout --kill-after=5 "$limit" "$@"
  local rc=$?
  log "$name: exit status $rc$([ $rc = 124 ] && echo ' (time limit)')"
  pack
  return $rc
}

# ------------------------------------------------------------------ 0. probe
{
  echo "date $(date -u +%FT%TZ)  host $(hostname)  cores $(nproc)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv 2>&1
  command -v nvcc && nvcc --version | tail -2
  for tool in ncu compute-sanitizer cuobjdump nvdisasm; do echo "$tool: $(command -v $tool || echo MISSING)"; done
  "$PY" - <<'EOF'
import os, sys, sysconfig
print("python", sys.version.split()[0], sys.executable)
inc = sysconfig.get_paths()["include"]
print("Python.h", os.path.exists(os.path.join(inc, "Python.h")), inc)
print("zlib.h", any(os.path.exists(os.path.join(d, "zlib.h")) for d in ("/usr/include", inc)))
for mod in ("torch", "numpy", "pybind11", "safetensors", "pytest", "hypothesis", "tqdm", "huggingface_hub"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as exc:
        print(mod, "MISSING", type(exc).__name__, exc)
import torch
print("torch cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "cc", f"{p.major}.{p.minor}", "SMs", p.multi_processor_count,
          "memory GiB", round(p.total_memory / 2**30, 1), "L2 MiB", getattr(p, "L2_cache_size", 0) >> 20)
EOF
} > "$WORK/probe.txt" 2>&1
cat "$WORK/probe.txt" >> "$LOG"
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')" 2>/dev/null) \
  || { log "no CUDA device: nothing to do"; pack; exit 2; }
log "probe done: sm_$ARCH"
pack

# ------------------------------------------------------------------ 1. build
export ZIPSERV_CUDA_ARCHS="$ARCH"
log "1. build _cuda (nvcc sm_$ARCH) and _C, _cpu_gemm (g++) side by side"
( stage "1a. build _cuda" 300 env ZIPSERV_BUILD_ONLY=_cuda "$PY" setup.py -q build_ext --inplace > "$WORK/build_cuda.txt" 2>&1 ) &
B1=$!
( stage "1b. build _C and _cpu_gemm" 300 env ZIPSERV_BUILD_ONLY=_C,_cpu_gemm "$PY" setup.py -q build_ext --inplace \
    > "$WORK/build_C.txt" 2>&1 ) &
B2=$!
wait $B1; RC_CUDA=$?
wait $B2; RC_C=$?
[ "$RC_CUDA" = 0 ] || { log "build _cuda FAILED:"; tail -40 "$WORK/build_cuda.txt" | tee -a "$LOG"; }
[ "$RC_C" = 0 ] || { log "build _C/_cpu_gemm FAILED (slow reference codec and packer):"; tail -20 "$WORK/build_C.txt" | tee -a "$LOG"; }
"$PY" -c "from zipserv_vllm.kernels import cuda; print('kernels.cuda available:', cuda.available(), cuda.unavailable_reason()); \
from zipserv_vllm import codec; print('native codec:', codec.native_available())" 2>&1 | tee -a "$LOG"
SO=$(ls zipserv_vllm/_cuda*.so 2>/dev/null | head -1)
if [ -n "$SO" ] && command -v cuobjdump >/dev/null; then
  cuobjdump --dump-resource-usage "$SO" > "$WORK/resources.txt" 2>&1
  cuobjdump --dump-sass "$SO" | gzip > "$WORK/sass_sm$ARCH.txt.gz"
  log "machine code dumped ($(grep -c 'Function' "$WORK/resources.txt") kernels)"
fi
pack
[ "$RC_CUDA" = 0 ] || { log "no CUDA extension: stopping"; exit 1; }

# ------------------------------------------------------------------ 2. first contact
FC_RC=0
stage "2. first contact (every kernel instance once, exact)" 60 "$PY" - > "$WORK/first_contact.txt" 2>&1 <<'EOF' || FC_RC=$?
import time, torch
from zipserv_vllm.kernels import selfcheck
t = time.time()
fails = selfcheck.first_contact(torch.device("cuda", 0))
print(f"first contact on {torch.cuda.get_device_name(0)}: {len(fails)} failing instance(s) in {time.time() - t:.2f} s")
for f in fails:
    print("  FAIL", f)
raise SystemExit(1 if fails else 0)
EOF
cat "$WORK/first_contact.txt" | tee -a "$LOG"

# ------------------------------------------------------------------ 3. the decisive numbers
stage "3. bench_zipgemm --quick" 120 "$PY" benchmarks/bench_zipgemm.py --quick --out "$WORK/bench_quick.json" \
  > "$WORK/bench_quick.txt" 2>&1
cat "$WORK/bench_quick.txt" | tee -a "$LOG"
[ -f "$WORK/bench_quick.json" ] && cp "$WORK/bench_quick.json" "$OUT/bench_quick.json"

# ------------------------------------------------------------------ 4. tests
TEST_RC=0
stage "4. pytest tests/gpu (without the long sweep)" 150 "$PY" -m pytest -q -rs --maxfail=10 -p no:cacheprovider tests/gpu \
  -k "not layer_shapes_all_n" --junitxml="$WORK/pytest-gpu.xml" > "$WORK/pytest-gpu.txt" 2>&1 || TEST_RC=$?
tail -30 "$WORK/pytest-gpu.txt" | tee -a "$LOG"

# ------------------------------------------------------------------ 5. memcheck
SAN_RC=0
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
if [ -n "$SAN" ]; then
  stage "5. compute-sanitizer memcheck" 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool memcheck \
    --error-exitcode 3 "$PY" benchmarks/gpu_sanitize.py > "$WORK/sanitize-memcheck.txt" 2>&1 || SAN_RC=$?
  tail -6 "$WORK/sanitize-memcheck.txt" | tee -a "$LOG"
else
  log "5. compute-sanitizer not found: memcheck skipped"
fi

# ------------------------------------------------------------------ 6. ncu
if command -v ncu >/dev/null; then
  cat > "$WORK/ncu_target.py" <<'EOF'
import torch, torch.nn.functional as F
from zipserv_vllm.kernels import cuda
m, k = 28672, 4096
w = (torch.randn(m, k, device="cuda") * 0.02).to(torch.bfloat16)
ct = cuda.compress_tensor_cuda(w)
args = (ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, None)
xs = {n: torch.randn(n, k, device="cuda").to(torch.bfloat16) for n in (1, 8)}
for n, x in xs.items():  # warm: validation, kernel attributes, cuBLAS handles
    cuda.fused_gemm(x, *args, 8, 1); F.linear(x, w)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for n, x in xs.items():
    cuda.fused_gemm(x, *args, 8, 1)
    F.linear(x, w)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
print("weights per launch", m * k, "compressed bytes", ct.nbytes, "bf16 bytes", m * k * 2)
EOF
  stage "6. ncu (fused and cuBLAS, N = 1 and 8)" 120 ncu --clock-control none --profile-from-start off \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section ComputeWorkloadAnalysis \
    --section InstructionStats --metrics smsp__inst_executed.sum,dram__bytes_read.sum,gpu__time_duration.sum \
    "$PY" "$WORK/ncu_target.py" > "$WORK/ncu.txt" 2>&1
  grep -E "fused_kernel|gemm|gemv|nvjet|Duration|DRAM Throughput|dram__bytes_read|smsp__inst_executed.sum|Issue Slots|Executed Ipc|Registers|Achieved Occupancy" \
    "$WORK/ncu.txt" | head -60 | tee -a "$LOG"
else
  log "6. ncu not found: skipped"
fi

# ------------------------------------------------------------------ 7. with what is left
if [ -n "$SAN" ]; then
  stage "7a. compute-sanitizer racecheck" 90 "$SAN" --tool racecheck --error-exitcode 3 \
    "$PY" benchmarks/gpu_sanitize.py > "$WORK/sanitize-racecheck.txt" 2>&1
  tail -4 "$WORK/sanitize-racecheck.txt" | tee -a "$LOG"
fi
stage "7b. bench_zipgemm --moe-only" 90 "$PY" benchmarks/bench_zipgemm.py --moe-only --iters 10 --reps 3 \
  --out "$WORK/bench_moe.json" > "$WORK/bench_moe.txt" 2>&1
tail -12 "$WORK/bench_moe.txt" | tee -a "$LOG"
stage "7c. bench_zipgemm (Llama-3-8B, every N)" 200 "$PY" benchmarks/bench_zipgemm.py --models llama3-8b \
  --out "$WORK/bench_full.json" > "$WORK/bench_full.txt" 2>&1
tail -8 "$WORK/bench_full.txt" | tee -a "$LOG"

log "done in $(( $(date +%s) - T0 )) s: first contact $FC_RC, tests $TEST_RC, memcheck $SAN_RC"
pack
[ "$FC_RC" = 0 ] && [ "$TEST_RC" = 0 ] && [ "$SAN_RC" = 0 ]
