#!/usr/bin/env bash
# One prepared run for a GPU session (budget: 15 min of device time in all,
# at most 10 min per command). PyTorch + CUDA + pybind11 are present there,
# vLLM is not, and nothing can be downloaded.
#
#   here (with network):  bash benchmarks/gpu_run.sh --prepare   # pure-Python wheels of pytest -> .gpu-wheels/
#   on the GPU machine:   OUT=/some/dir bash benchmarks/gpu_run.sh
#
# Steps, each under its own timeout so one slow step cannot eat the budget (about
# 8 minutes in all; override with the *_TIMEOUT variables; SKIP_SANITIZE=1 /
# SKIP_TESTS=1 / SKIP_BENCH=1; TUNE=1 to run tune_dispatch.py as well):
#   1. build _C and _cuda in place for THIS GPU's arch only
#   2. compute-sanitizer memcheck, racecheck, synccheck on
#      benchmarks/gpu_sanitize.py (small shapes, every kernel) -> $OUT/sanitize-*.txt
#   3. pytest tests/gpu                                    -> $OUT/pytest-gpu.{txt,xml}
#   4. benchmarks/bench_zipgemm.py                          -> $OUT/bench_zipgemm.json
#      and --moe-only (grouped kernel, MoE layers)          -> $OUT/bench_zipgemm_moe.json
#   5. benchmarks/bench_decode_e2e.py (batch 1, 8, 32)      -> $OUT/bench_decode_e2e.json
#   6. the engine-start autotuner on Llama-3-8B shapes      -> $OUT/autotune.json
#   7. (TUNE=1) benchmarks/tune_dispatch.py                 -> $OUT/dispatch-<gpu>.json
# Everything is logged to $OUT/gpu_run.log; the exit status is that of the tests.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "--prepare" ]; then
  "$PY" -m pip download -q --only-binary=:all: --no-deps -d .gpu-wheels pytest pluggy iniconfig packaging pygments exceptiongroup tomli
  ls .gpu-wheels
  exit 0
fi

OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
LOG="$OUT/gpu_run.log"
log() { echo "[gpu_run $(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }
T0=$(date +%s)

log "host $(hostname), python $("$PY" -c 'import sys; print(sys.version.split()[0])')"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || log "nvidia-smi failed"
"$PY" - <<'EOF' 2>&1 | tee -a "$LOG"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
try:
    import numpy
    print("numpy", numpy.__version__, "(zipserv needs >= 2.0)")
except ImportError:
    print("numpy MISSING (zipserv needs numpy >= 2.0)")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "cc", f"{p.major}.{p.minor}", "sms", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30))
EOF
ARCH=$("$PY" -c "import torch; a, b = torch.cuda.get_device_capability(); print(f'{a}{b}')") || { log "no CUDA device"; exit 2; }
export ZIPSERV_CUDA_ARCHS="$ARCH"

if ! "$PY" -m pytest --version >/dev/null 2>&1; then
  if [ -d .gpu-wheels ]; then
    log "installing pytest from .gpu-wheels (offline)"
    "$PY" -m pip install -q --no-index --find-links .gpu-wheels pytest 2>&1 | tee -a "$LOG"
  else
    log "pytest missing and no .gpu-wheels/ (run 'bash benchmarks/gpu_run.sh --prepare' where there is network)"
  fi
fi

log "1. build for sm_$ARCH"
BUILD_START=$(date +%s)
if ! timeout "${BUILD_TIMEOUT:-300}" env ZIPSERV_BUILD_ONLY=_C,_cuda "$PY" setup.py -q build_ext --inplace \
    > "$OUT/build.txt" 2>&1; then
  log "build FAILED (see build.txt)"; tail -30 "$OUT/build.txt" | tee -a "$LOG"; exit 1
fi
log "build ok in $(( $(date +%s) - BUILD_START )) s"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" -c "from zipserv_vllm.kernels import cuda as cuda_ops; print('cuda_ops.available:', cuda_ops.available(), cuda_ops.unavailable_reason())" 2>&1 | tee -a "$LOG"

SAN_RC=0
if [ -z "${SKIP_SANITIZE:-}" ]; then
  SAN=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$SAN" ]; then
    for tool in memcheck racecheck synccheck; do
      log "2. compute-sanitizer --tool $tool"
      timeout "${SANITIZE_TIMEOUT:-90}" "$SAN" --tool "$tool" --error-exitcode 3 "$PY" benchmarks/gpu_sanitize.py \
          > "$OUT/sanitize-$tool.txt" 2>&1
      rc=$?; [ "$rc" -ne 0 ] && SAN_RC=$rc
      log "$tool exit status $rc"; tail -4 "$OUT/sanitize-$tool.txt" | tee -a "$LOG"
    done
  else
    log "2. compute-sanitizer not found: sanitizer runs skipped"
  fi
fi

TEST_RC=0
if [ -z "${SKIP_TESTS:-}" ]; then
  log "3. tests"
  timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -rs --maxfail=20 -p no:cacheprovider tests/gpu \
      --junitxml="$OUT/pytest-gpu.xml" > "$OUT/pytest-gpu.txt" 2>&1
  TEST_RC=$?
  tail -25 "$OUT/pytest-gpu.txt" | tee -a "$LOG"
  log "tests exit status $TEST_RC"
fi

if [ -z "${SKIP_BENCH:-}" ]; then
  log "4. bench_zipgemm"
  timeout "${BENCH_TIMEOUT:-200}" "$PY" benchmarks/bench_zipgemm.py ${BENCH_ARGS:-} --out "$OUT/bench_zipgemm.json" \
      > "$OUT/bench_zipgemm.txt" 2>&1
  log "bench_zipgemm exit status $?"; tail -5 "$OUT/bench_zipgemm.txt" | tee -a "$LOG"
  log "4b. bench_zipgemm --moe-only (grouped kernel over MoE layers)"
  timeout "${MOE_BENCH_TIMEOUT:-120}" "$PY" benchmarks/bench_zipgemm.py --moe-only --iters 10 --reps 3 \
      --out "$OUT/bench_zipgemm_moe.json" > "$OUT/bench_zipgemm_moe.txt" 2>&1
  log "bench_zipgemm --moe-only exit status $?"; tail -12 "$OUT/bench_zipgemm_moe.txt" | tee -a "$LOG"
  log "5. bench_decode_e2e"
  timeout "${E2E_TIMEOUT:-150}" "$PY" benchmarks/bench_decode_e2e.py ${E2E_ARGS:-} --out "$OUT/bench_decode_e2e.json" \
      > "$OUT/bench_decode_e2e.txt" 2>&1
  log "bench_decode_e2e exit status $?"; tail -6 "$OUT/bench_decode_e2e.txt" | tee -a "$LOG"
fi

log "6. autotune (the engine-start dispatcher) on Llama-3-8B shapes"
timeout "${AUTOTUNE_TIMEOUT:-60}" "$PY" benchmarks/gpu_autotune.py "$OUT/autotune.json" > "$OUT/autotune.txt" 2>&1
log "autotune exit status $?"; tail -6 "$OUT/autotune.txt" | tee -a "$LOG"

if [ -n "${TUNE:-}" ]; then
  log "7. tune_dispatch"
  GPU_KEY=$("$PY" -c "import torch; from zipserv_vllm.kernels.dispatch import table_key; print(table_key(torch.cuda.get_device_name()))")
  timeout "${TUNE_TIMEOUT:-150}" "$PY" benchmarks/tune_dispatch.py --out "$OUT/dispatch-$GPU_KEY.json" \
      > "$OUT/tune_dispatch.txt" 2>&1
  log "tune_dispatch exit status $?"; tail -3 "$OUT/tune_dispatch.txt" | tee -a "$LOG"
fi
log "done in $(( $(date +%s) - T0 )) s"
[ "$TEST_RC" -ne 0 ] && exit "$TEST_RC"
exit "$SAN_RC"
