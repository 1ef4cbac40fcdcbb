"""A decode step's linears on the CPU: fused compressed kernel vs torch BF16, with torch ops in between.

The kernel benchmark (bench_cpu_gemm.py) times one GEMM at a time. In a model,
every linear is preceded by other torch ops (norms, attention, activations)
that run on torch's OpenMP threads, whose workers keep spinning for a while
after each op. This benchmark reproduces that pattern without vLLM: per layer
of a Llama-3.2-1B-shaped model (hidden 2048, 8 KV heads, intermediate 8192)
the four linears (qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down
2048x8192) at N tokens, each preceded by a parallel elementwise torch op
("--no-between" drops it), once with BF16 ``F.linear`` and once with
``zipserv_vllm.linear(mode="fast")`` on the compressed weights. All cores
(torch.get_num_threads()) unless --threads is given.

Medians of --reps interleaved repetitions; writes
benchmarks/results/bench_cpu_step.json and prints the ratio.
Run: .venv/bin/python benchmarks/bench_cpu_step.py [--layers 4] [--reps 31]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import zipserv_vllm  # noqa: E402
from zipserv_vllm import compress_tensor  # noqa: E402
from zipserv_vllm.kernels import cpu as cpu_kernels  # noqa: E402

SHAPES = ((3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192))  # qkv, o, gate_up, down


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4, help="distinct layers (weights are not shared between them)")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--reps", type=int, default=31)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-between", action="store_true", help="no torch op between the linears")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_cpu_step.json"))
    args = ap.parse_args(argv)
    if args.layers < 1 or args.tokens < 1 or args.reps < 1:
        print("error: --layers, --tokens and --reps must be >= 1", file=sys.stderr)
        return 2
    if not cpu_kernels.available():
        print(f"error: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    ws = [[(torch.randn(s, generator=g) * 0.02).bfloat16() for s in SHAPES] for _ in range(args.layers)]
    cts = [[compress_tensor(w) for w in layer] for layer in ws]
    x = torch.randn(args.tokens, max(k for _, k in SHAPES), generator=g).bfloat16()
    act = torch.randn(1 << 20, generator=g)  # 4 MiB: large enough for torch to run it in parallel

    def between():
        if not args.no_between:
            torch.mul(act, 1.0, out=act)

    def step_bf16():
        for layer in ws:
            for w in layer:
                between()
                F.linear(x[:, : w.shape[1]], w)

    def step_zipserv():
        for layer in cts:
            for ct in layer:
                between()
                zipserv_vllm.linear(x[:, : ct.shape[1]], ct, mode="fast")

    fns = {"bf16": step_bf16, "zipserv_fast": step_zipserv}
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(args.reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    weights = args.layers * sum(m * k for m, k in SHAPES)
    result = dict(benchmark="bench_cpu_step", threads=torch.get_num_threads(), tokens=args.tokens,
                  layers=args.layers, weights=weights, torch_op_between=not args.no_between, reps=args.reps,
                  isas=cpu_kernels.isas(), loadavg=os.getloadavg(),
                  median_ms={k: round(v * 1e3, 3) for k, v in med.items()},
                  times_ms={k: [round(t * 1e3, 3) for t in v] for k, v in times.items()},
                  speedup=round(med["bf16"] / med["zipserv_fast"], 3))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{args.layers} layers x 4 linears, N = {args.tokens}, {result['threads']} threads, torch op between: "
          f"{not args.no_between}")
    print(f"  bf16 {med['bf16'] * 1e3:.2f} ms   zipserv fast {med['zipserv_fast'] * 1e3:.2f} ms   "
          f"speedup {result['speedup']:.2f}x   (wrote {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
