"""Shared helpers of the zipserv end-to-end tests (engine runs, constants)."""

from __future__ import annotations

import gc
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
