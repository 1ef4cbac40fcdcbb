"""Run the engine-start autotuner (zipserv_vllm/kernels/autotune.py) on Llama-3-8B shapes; write JSON.

For every shape and token bucket: the fastest measured plan and its time
relative to the BF16 GEMM (cuBLAS on a BF16 weight), in one run on this GPU.
Usage: python benchmarks/gpu_autotune.py OUT.json (needs a CUDA device).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.gpu.shapes import LLAMA3_8B  # noqa: E402
from zipserv_vllm.kernels import autotune  # noqa: E402


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_autotune: no CUDA device", file=sys.stderr)
        return 2
    t = autotune.tune(LLAMA3_8B.values(), 8192, autotune.cuda_time_fn(torch.device("cuda")), budget_s=40)
    rows = {f"{m}x{k}": {n: {"best": t.best(m, k, n), "ratio_vs_bf16": t.ratio(m, k, n)} for n in sorted(by_n)}
            for (m, k), by_n in t.times.items()}
    Path(sys.argv[1]).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "complete": t.complete,
                                             "best": rows, "times": t.to_json()["times"]}, indent=1))
    for key, by_n in rows.items():
        print(key, " ".join(f"N={n}:{r['ratio_vs_bf16']:.2f}x" for n, r in by_n.items() if r["ratio_vs_bf16"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
