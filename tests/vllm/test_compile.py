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

import os

import pytest

from zs_e2e import FAST_LOGPROB_TOL, max_score_diff, run_engine


@pytest.fixture(scope="module")
def compiled_runs(vllm_env, llama_dirs):
    import torch

    bf16, _ = llama_dirs
    old = os.environ.get("VLLM_CPU_CI_ENV")
    os.environ["VLLM_CPU_CI_ENV"] = "1"
    try:
        runs = {}
        for name, mode, kw in (("base", "exact", {"score": "self"}), ("exact", "exact", {"quantization": "zipserv"}),
                               ("fast", "fast", {"quantization": "zipserv"})):
            if name == "fast":
                kw["score"] = runs["base"]["score_seqs"]
            os.environ["ZIPSERV_MODE"] = mode
            before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            runs[name] = run_engine(bf16, chat=False, enforce_eager=False, **kw)
            runs[name]["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
        return runs
    finally:
        os.environ["ZIPSERV_MODE"] = "exact"
        if old is None:
            os.environ.pop("VLLM_CPU_CI_ENV", None)
        else:
            os.environ["VLLM_CPU_CI_ENV"] = old


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
