"""What checking the data at load costs: vLLM engine start-up with ZIPSERV_VERIFY none / tiles / full.

The Llama-shaped 1.1 B model of bench_memory.py (N(0, 0.02^2), built once with
the tiny-model builder and compressed with ``zipserv compress``), loaded by a
real vLLM CPU engine in a fresh subprocess per run (in-process engine, eager,
exact mode, so the byte-split repack of fast mode is not part of it), the
variants interleaved run by run:

* ``bf16``: the BF16 checkpoint (reference);
* ``none``: the pre-compressed checkpoint, no checks (``ZIPSERV_VERIFY=none``);
* ``tiles``: the default, every tile a rank loads checked against its ``zs_crc``;
* ``full``: also every matrix decoded and its CRC-32 compared.

Reported: seconds from ``LLM(...)`` to a ready engine, medians of --reps, and
the checks' cost as the difference to ``none``. Writes
benchmarks/results/bench_load.json.

Run: .venv/bin/python benchmarks/bench_load.py [--reps 3] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "bench_load.json"

CHILD = r"""
import json, os, sys, time
from vllm import LLM
t = time.perf_counter()
llm = LLM(model=sys.argv[1], dtype="bfloat16", enforce_eager=True, max_model_len=128,
          kv_cache_memory_bytes=32 << 20, seed=0, disable_log_stats=True)
print("ZS_LOAD", json.dumps({"seconds": time.perf_counter() - t}))
"""


def run(model: Path, verify: str | None) -> float:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1", ZIPSERV_MODE="exact")
    if verify:
        env["ZIPSERV_VERIFY"] = verify
    r = subprocess.run([sys.executable, "-c", CHILD, str(model)], capture_output=True, text=True, env=env,
                       timeout=1800)
    for line in r.stdout.splitlines():
        if line.startswith("ZS_LOAD "):
            return json.loads(line[8:])["seconds"]
    raise RuntimeError(f"load failed ({r.returncode}):\n{r.stderr[-3000:]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/zipserv-bench-load")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    from benchmarks.bench_memory import SIZES
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.tiny_model import build_tiny_model

    work = Path(a.workdir)
    bf16, zs = work / "bf16", work / "zs"
    if not (bf16 / "config.json").exists():
        print(f"building the 1.1 B model in {bf16}", flush=True)
        build_tiny_model(bf16, "llama", **SIZES["1b"])
    if not (zs / "config.json").exists():
        compress_checkpoint(bf16, zs, progress=False)
    nbytes = sum(f.stat().st_size for f in zs.glob("*.safetensors"))
    variants = {"bf16": (bf16, None), "none": (zs, "none"), "tiles": (zs, "tiles"), "full": (zs, "full")}
    times: dict[str, list[float]] = {k: [] for k in variants}
    for r in range(a.reps):
        for k, (model, verify) in variants.items():
            times[k].append(run(model, verify))
        print(f"  rep {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": SIZES["1b"], "compressed_bytes": nbytes, "seconds": times,
              "median_seconds": {k: round(v, 3) for k, v in med.items()},
              "tiles_cost_seconds": round(med["tiles"] - med["none"], 3),
              "full_cost_seconds": round(med["full"] - med["none"], 3),
              "date": time.strftime("%Y-%m-%d")}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nengine start-up, median of {a.reps}:")
    for k, v in med.items():
        print(f"  {k:6} {v:6.2f} s" + (f"  (+{v - med['none']:.2f} s vs none)" if k in ("tiles", "full") else ""))
    print(f"tile checks: {nbytes / 1e9:.2f} GB of compressed data in "
          f"{max(1e-9, med['tiles'] - med['none']):.2f} s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
