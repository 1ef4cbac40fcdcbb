"""zipserv under vLLM's torch.compile path (not enforce_eager) equals the BF16 model.

vLLM compiles the model's forward with dynamo and ``fullgraph=True`` (a graph
break is an error, so a passing run proves zipserv's apply/embedding were
traced). ``VLLM_CPU_CI_ENV=1`` selects dynamo's eager backend
(vllm-plugin-notes section 3): the traced graph runs the same kernels as eager
mode, so exact mode must give the BF16 model's greedy tokens and logprobs bit
for bit under the same compile setting. Inductor on a whole model is not used
here: it takes minutes on this machine, and its fusions of the surrounding ops
differ between the two graphs (the zipserv ops themselves compile under
inductor in test_traceable.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zs_e2e import FAST_LOGPROB_TOL, e2e_environ, max_score_diff

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def compiled_runs(llama_dirs, tmp_path_factory):
    """base (BF16), zipserv exact and zipserv fast (pack at load), all compiled, in one fresh process."""
    bf16, _ = llama_dirs
    out = tmp_path_factory.mktemp("compile") / "runs.json"
    env = dict(e2e_environ(), PYTHONPATH=str(HERE) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(HERE / "compile_worker.py"), str(out), str(bf16)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"compile worker failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def test_exact_mode_compiled_identical_to_bf16_compiled(compiled_runs):
    base, zs = compiled_runs["base"], compiled_runs["exact"]
    assert base["graphs"] >= 1 and zs["graphs"] >= 1  # dynamo really traced both models
    assert zs["memory"]["layers_compressed"] == 10
    assert zs["tokens"] == base["tokens"]
    assert zs["logprobs"] == base["logprobs"]  # exact float equality


def test_fast_mode_compiled_within_bound(compiled_runs):
    """Fast mode traced by vLLM's compile (zipserv::gemm with the fused CPU kernel)."""
    fast = compiled_runs["fast"]
    assert fast["graphs"] >= 1
    assert 0 < max_score_diff(fast, compiled_runs["base"]) <= FAST_LOGPROB_TOL
