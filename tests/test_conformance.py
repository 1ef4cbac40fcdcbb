"""The conformance suite (tests/conformance/) against every vLLM release the plugin is tested with.

Each release runs the suite in its own process: vLLM 0.32 from the venv, and
vLLM 0.33's Python package from ``.vllm033/`` (made by scripts/setup.sh:
``pip install --no-deps --target .vllm033 vllm==0.33.0``), put in front of the
venv's packages with ``PYTHONPATH`` and run on the CPU platform
(``VLLM_TARGET_DEVICE=cpu``) with the venv's torch 2.13. The end-to-end tests
(engine, server) run on 0.32 only: vLLM 0.33 has no CPU wheel, and its GPU
wheel's compiled kernels are not there, which layers, loaders and model
construction do not need.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
VLLM033 = ROOT / ".vllm033"


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1", **env_extra)
    return subprocess.run([sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-o",
                           "python_files=case_*.py", str(ROOT / "tests" / "conformance")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_conformance(release):
    pytest.importorskip("vllm")
    if release == "0.33":
        if not (VLLM033 / "vllm").is_dir():
            pytest.skip(f"{VLLM033} is missing: scripts/setup.sh installs vLLM 0.33's Python package there")
        env = {"PYTHONPATH": str(VLLM033), "VLLM_TARGET_DEVICE": "cpu"}
    else:
        env = {}
    r = _run(env)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"conformance: vLLM {release}." in out, out[:2000]
    assert " passed" in out and "failed" not in out.splitlines()[-1]
