"""Run the compiled-engine comparison of test_compile.py in a fresh process (one JSON file).

vLLM's compile path must not share the test process's state: after other
in-process engines (e.g. the failing loads of test_bad_checkpoints.py) the
compiled BF16 model's greedy output for one prompt was observed to change in
the same process, so the three engines run here, in a new interpreter.
Usage: python compile_worker.py OUT.json BF16_DIR
"""

from __future__ import annotations

import json
import os
import sys

from zs_e2e import ENV

os.environ.update(ENV)
os.environ["VLLM_CPU_CI_ENV"] = "1"  # dynamo with the eager backend (vllm-plugin-notes section 3)


def main() -> None:
    import torch

    from zs_e2e import run_engine

    out, bf16 = sys.argv[1], sys.argv[2]
    runs: dict = {}
    for name, mode, kw in (("base", "exact", {"score": "self"}), ("exact", "exact", {"quantization": "zipserv"}),
                           ("fast", "fast", {"quantization": "zipserv"})):
        if name == "fast":
            kw["score"] = runs["base"]["score_seqs"]
        os.environ["ZIPSERV_MODE"] = mode
        before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        runs[name] = run_engine(bf16, chat=False, enforce_eager=False, **kw)
        runs[name]["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
    with open(out, "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
