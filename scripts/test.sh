#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
# Two workers (pytest-xdist), each taking whole files, the longest first (tests/conftest.py,
# LONG_FIRST): most tests wait on one process at a time (vLLM start-up is mostly single-threaded
# imports), so two at once use both cores. ZIPSERV_TEST_WORKERS=0 runs everything in this process.
WORKERS=${ZIPSERV_TEST_WORKERS:-2}
if [ "$WORKERS" = 0 ]; then
  exec .venv/bin/python -m pytest -q -rs --durations=30 tests "$@"
fi
# One OpenMP thread per worker: two workers with two threads each put four spinning OpenMP threads
# on two cores (measured: test_offline + test_features on two workers 152 s -> 121 s). The kernels'
# own tests pass their thread counts explicitly; test_compile's engines run with two.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec .venv/bin/python -m pytest -q -rs --durations=30 -n "$WORKERS" --dist loadfile --no-loadscope-reorder tests "$@"
