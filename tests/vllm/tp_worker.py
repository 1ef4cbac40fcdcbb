"""Run the greedy batch at tensor- (or, with ZS_PARALLEL=pp, pipeline-) parallel size 2 for several checkpoints.

Started in a subprocess by test_tensor_parallel.py and test_moe.py: TP=2 on CPU needs the
multi-process executor (two worker processes) and ``VLLM_CPU_OMP_THREADS_BIND="0|1"``, and it must
not share the test process's in-process engine state.
Usage: python tp_worker.py OUT.json NAME=DIR[,quantization][,tp1] ...
(``tp1``: that engine at tensor-parallel size 1, the reference of per-rank sizes)
"""

from __future__ import annotations

import json
import os
import sys

# The engine core in this process (the workers are still two processes of vLLM's multiprocess
# executor): each engine then starts one process generation fewer, ~11 s less on 2 cores.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")
# LLM.apply_model ships a function to the workers: local test processes only.
os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def main() -> None:
    from vllm import LLM, SamplingParams

    from zipserv_vllm.vllm_plugin.memory import weight_memory
    from zs_e2e import ENGINE_KW, MAX_TOKENS, PROMPTS

    out, results = sys.argv[1], {}
    for spec in sys.argv[2:]:
        name, _, rest = spec.partition("=")
        model, *opts = rest.split(",")
        quant = [o for o in opts if o != "tp1"]
        kw = {"quantization": quant[0]} if quant else {}
        size = {"pipeline_parallel_size": 2} if os.environ.get("ZS_PARALLEL") == "pp" else {"tensor_parallel_size": 2}
        if "tp1" in opts:
            size = {}
        llm = LLM(model=model, **size, **{**ENGINE_KW, **kw})
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=1, ignore_eos=True)
        outs = llm.generate(PROMPTS, sp, use_tqdm=False)
        results[name] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs],
            "memory": llm.apply_model(weight_memory),
        }
        llm.llm_engine.engine_core.shutdown()
        del llm
    with open(out, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
