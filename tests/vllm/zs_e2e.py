"""Shared helpers of the zipserv end-to-end tests (engine runs, constants)."""

from __future__ import annotations

import contextlib
import gc
import os
from pathlib import Path

ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "HF_HUB_OFFLINE": "1",
    "ZIPSERV_MODE": "exact",
    "TOKENIZERS_PARALLELISM": "false",
}
ENGINE_KW = dict(dtype="bfloat16", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=32 << 20,
                 seed=0, disable_log_stats=True)
PROMPTS = [
    "hello world", "The quick brown fox", "def forward(self, x):", "lossless compression of",
    "0 1 2 3", "User: What is the capital", "model weight tensor tile", "a", "memory bandwidth is the",
]
MAX_TOKENS = 12

# Fast mode's GEMM sums in another order than torch's BF16 GEMM and rounds each
# output to BF16 once: each layer output may differ by about one BF16 ulp
# (2^-8 relative), and the differences grow through the layers. On the tiny test
# model (2 layers, weights N(0, 0.08^2)) the teacher-forced logprobs differed by
# at most 0.032 nats (measured; docs/VLLM.md). FAST_LOGPROB_TOL = 0.1 leaves a 3x
# margin above that; the negative control (one 64x64 tile = 4096 of the model's
# 2.5 M weights altered) moved them by 1.88 nats, and must exceed 5x the bound.
FAST_LOGPROB_TOL = 0.1

# Fast mode computes each routed expert with the fused CPU kernel: its GEMM outputs are rounded to
# BF16 before the activation and the weighted sum (vLLM's expert kernel keeps them in fp32) and SiLU
# uses the exact exp, so expert outputs differ by about one BF16 ulp (measured: 0.0024 at a magnitude
# of 0.48). Routing amplifies that: a token near a tie between two experts may switch experts. On the
# tiny Mixtral the teacher-forced logprobs differ little on average but a single switched token can
# move far, and how far depends on the host's BF16 GEMM (the BF16 baseline's own rounding): measured
# on an Intel Xeon (AVX-512, no AVX512_BF16), 185 scored tokens, mean |d| 0.0097 and max 0.212 eager,
# mean 0.0113 and max 0.404 compiled (one routing switch; an AMD EPYC host had max 0.216). So two
# bounds: the mean over the scored tokens (MOE_FAST_MEAN_TOL, ~2.7x the measured mean) and every
# token (MOE_FAST_MAX_TOL, 1.5x the largest switch seen). The negative control (one 64x64 tile of one
# expert's gate weights replaced) moved them by mean 0.164 and max 0.848: it must exceed 4x the mean
# bound and the max bound.
MOE_FAST_MEAN_TOL = 0.03
MOE_FAST_MAX_TOL = 0.6


def score_diffs(run, base) -> list[float]:
    """|teacher-forced logprob difference| of every token two runs scored (the same sequences)."""
    assert run["score_seqs"] == base["score_seqs"]
    diffs = [abs(a - b) for ra, rb in zip(run["scores"], base["scores"]) for a, b in zip(ra, rb)]
    assert len(diffs) >= len(PROMPTS) * 10
    return diffs


def max_score_diff(run, base) -> float:
    """Largest |teacher-forced logprob difference| of two runs that scored the same sequences."""
    return max(score_diffs(run, base))


def mean_score_diff(run, base) -> float:
    d = score_diffs(run, base)
    return sum(d) / len(d)


def _release(llm) -> None:
    """Shut an in-process engine down so the next one can start in this process."""
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()
    try:
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        cleanup_dist_env_and_memory()
    except Exception:
        pass


def _score(llm, seqs: list[list[int]]) -> list[list[float]]:
    """Teacher-forced log-probabilities: for each token sequence, the logprob of
    every token after the first given its prefix (one prefill, ``prompt_logprobs``)."""
    from vllm import SamplingParams, TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=s) for s in seqs],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], s[1:])] for o, s in zip(outs, seqs)]


def _compilation(llm) -> dict:
    """How the engine's model was compiled: vLLM's compilation mode and torch.compile backend."""
    cc = llm.llm_engine.vllm_config.compilation_config
    return {"mode": getattr(cc.mode, "name", str(cc.mode)), "backend": str(cc.backend)}


def cpp_op_report(model) -> dict:
    """Which calls the C++ CPU kernels of the zipserv ops serve in this engine (``llm.apply_model``):
    the install status, the MoE layers served by name, and the model's compressed MoE layers' names
    (in fast mode with the one-call kernel, after a generation, the two lists should agree)."""
    from zipserv_vllm.kernels import cpu
    from zipserv_vllm.vllm_plugin import moe

    mine = sorted(moe._op_name(m.quant_method.zs_prefix) for m in model.modules()
                  if isinstance(getattr(m, "quant_method", None), moe.ZipServMoEMethod) and moe.moe_states(m))
    served = sorted(cpu._op.remembered_moe()) if cpu._op is not None else []
    return {"status": cpu.op_status(), "moe_served": served, "moe_layers": mine}


def run_engine(model: Path, chat: bool = True, score=None, **kw) -> dict:
    """Start one engine, run the greedy batch (+ one chat), measure its weights, stop it.

    ``score="self"`` also scores (teacher-forced) each prompt followed by this
    engine's own greedy tokens; a list of token sequences scores those."""
    from vllm import LLM, SamplingParams

    from zipserv_vllm.vllm_plugin.memory import weight_memory

    llm = LLM(model=str(model), **{**ENGINE_KW, **kw})
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        result = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
            "text": [o.outputs[0].text for o in outs],
            "memory": llm.apply_model(weight_memory)[0],
            "compilation": _compilation(llm),
            "cpp_op": llm.apply_model(cpp_op_report)[0],
        }
        if score is not None:
            seqs = ([list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
                    if score == "self" else score)
            result["score_seqs"], result["scores"] = seqs, _score(llm, seqs)
        if chat:
            c = llm.chat([{"role": "user", "content": "What is a tile?"}],
                         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            result["chat"] = list(c[0].outputs[0].token_ids)
        return result
    finally:
        _release(llm)


def load_check(model) -> tuple[str, dict]:
    """(the summary line's words on how the checkpoint was checked, weight_memory's "checked" counts)
    of a loaded model: ``llm.apply_model(load_check)[0]``."""
    from zipserv_vllm.vllm_plugin.config import ZipServConfig
    from zipserv_vllm.vllm_plugin.memory import weight_memory

    methods = [getattr(m, "quant_method", None) for m in model.modules()]
    cfgs = [c for q in methods for c in (getattr(q, "zs_config", None), getattr(q, "config", None))
            if isinstance(c, ZipServConfig)]
    return (cfgs[0].load_check() if cfgs else ""), weight_memory(model)["checked"]


@contextlib.contextmanager
def e2e_env():
    """The fast CPU settings (zs_e2e.ENV) for the duration of the block, then the environment as it was."""
    old = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)
    try:
        yield dict(os.environ)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def e2e_environ() -> dict:
    """A child process's environment with the fast CPU settings (this process's stays as it is)."""
    return {**os.environ, **ENV}
