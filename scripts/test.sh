#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite. CI runs exactly this.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest -q -rs --durations=30 tests "$@"
