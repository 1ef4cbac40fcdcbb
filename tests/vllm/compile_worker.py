"""Run engines under vLLM's default compilation (torch.compile with Inductor) in a fresh process.

vLLM's compile path must not share the test process's state (after other
in-process engines a compiled model's output was once seen to change in the
same process), so test_compile.py runs its engines here, one list per process.
Each engine gets the fast CPU settings of zs_e2e.ENV, but not
``VLLM_CPU_CI_ENV`` (which would pick dynamo's eager backend): the model is
compiled as ``vllm serve`` compiles it. The compile cache lives under
``VLLM_CACHE_ROOT`` (the caller's choice), so a second process can find it warm.

Usage: python compile_worker.py SPEC.json OUT.json
SPEC: {"runs": [{"name", "model", "mode", "quantization": bool,
                 "score": "self" | NAME of an earlier run (score its sequences) | [[token ids]...]}],
       "aot_root": DIR}
"""

from __future__ import annotations

import json
import os
import sys

from zs_e2e import ENV

os.environ.update(ENV)
os.environ.pop("VLLM_CPU_CI_ENV", None)


def _aot_dirs(root: str) -> list[str]:
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def main() -> None:
    from zs_e2e import run_engine

    spec = json.load(open(sys.argv[1]))
    runs: dict = {}
    for r in spec["runs"]:
        os.environ["ZIPSERV_MODE"] = r["mode"]
        kw = {"quantization": "zipserv"} if r.get("quantization") else {}
        score = r.get("score")
        if score is not None:
            kw["score"] = runs[score]["score_seqs"] if isinstance(score, str) and score != "self" else score
        before = _aot_dirs(spec["aot_root"])
        runs[r["name"]] = run_engine(r["model"], chat=False, enforce_eager=False, **kw)
        runs[r["name"]]["new_aot_dirs"] = sorted(set(_aot_dirs(spec["aot_root"])) - set(before))
    with open(sys.argv[2], "w") as f:
        json.dump(runs, f)


if __name__ == "__main__":
    main()
