"""CPU fast-mode GEMM against vLLM's own BF16 CPU kernel, at the token counts a server sees.

The baseline is what vLLM's unquantized linear layer really runs on the CPU:
``dispatch_cpu_unquantized_gemm`` (prepacked oneDNN with AVX512-BF16 dot
products on CPUs that have them), prepared once like a BF16 layer's, not
``F.linear``. Side by side in one run, interleaved, for each weight shape and
N in 1, 2, 4, ..., 512, with the same thread count everywhere:

* ``vllm_bf16``: vLLM's kernel on the BF16 weight;
* ``fused``: the fp32 fused kernel from the CPU byte-split layout;
* ``panel``: the AVX512-BF16 panel kernel (CPUs with vdpbf16ps only);
* ``dispatch``: ``zipserv_vllm.linear(x, pt, mode="fast")`` after the
  measuring dispatcher ran for the shape (kernels/cpu_dispatch.py), i.e. what
  the plugin runs.

Weights are cache-cold: a 64 MiB buffer is read between calls (the weights
themselves are 24-90 MB). Medians of ``--reps`` interleaved repetitions, the
variants' order rotated from one repetition to the next; the host's model
name and ISA flags go with every number.

    .venv/bin/python benchmarks/bench_cpu_vs_vllm.py [--shapes 11008x4096] [--ns 1,2,4] [--reps 9]

Writes benchmarks/results/bench_cpu_vs_vllm.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import zipserv_vllm  # noqa: E402
from zipserv_vllm.kernels import autotune, cpu_dispatch  # noqa: E402
from zipserv_vllm.kernels import cpu as cpu_kernels  # noqa: E402

NS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SHAPES = ((11008, 4096), (4096, 4096), (4096, 11008))
_FLUSH = None


def flush() -> None:
    """Evict the weights from L2 / L3 (read 64 MiB)."""
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.ones(16 << 20, dtype=torch.float32)
    _FLUSH.sum()


def make_weight(m: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=",".join(f"{m}x{k}" for m, k in SHAPES))
    ap.add_argument("--ns", default=",".join(map(str, NS)))
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_cpu_vs_vllm.json"))
    args = ap.parse_args()
    if not cpu_kernels.available():
        print(f"error: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    try:
        from zipserv_vllm.vllm_plugin.gemm import bf16_linear_factory

        bf16_linear_factory(torch.zeros(64, 64, dtype=torch.bfloat16))
    except Exception as exc:  # noqa: BLE001
        print(f"error: vLLM's CPU kernel is not available here ({exc})", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    ns = [int(n) for n in args.ns.split(",")]
    ident = cpu_dispatch.cpu_identity()
    print(f"host: {ident}, {args.threads} threads, torch {torch.__version__}")
    rows = []
    for si, (m, k) in enumerate(shapes):
        w = make_weight(m, k, si)
        pt = cpu_kernels.pack(w)
        base = bf16_linear_factory(w)
        # the measuring dispatcher, as at engine start (time_fn of the plugin, same baseline)
        t0 = time.perf_counter()
        tuner = autotune.Tuner(cpu_dispatch.cpu_time_fn(bf16_linear_factory), 512, 256, None,
                               budget_s=60, candidates=cpu_dispatch.candidates, ns=cpu_dispatch.BUCKETS)
        tuner.measure([(m, k)])
        tune_s = time.perf_counter() - t0
        cpu_dispatch.set_measured(tuner.tuning.times)
        print(cpu_dispatch.ratios_line(m, k, tuner.tuning.times[(m, k)]) + f"  (tuning {tune_s:.1f} s)")
        for n in ns:
            x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
            fns = {"vllm_bf16": lambda: base(x), "fused": lambda: cpu_kernels.packed_linear(x, pt, kernel="fused")}
            if cpu_kernels.bf16_supported():
                fns["panel"] = lambda: cpu_kernels.packed_linear(x, pt, kernel="panel")
            fns["dispatch"] = lambda: zipserv_vllm.linear(x, pt, mode="fast")
            for f in fns.values():
                f()
            t = {name: [] for name in fns}
            names = list(fns)
            for rep in range(args.reps):
                # each repetition starts at the next variant, so that none always runs in one slot
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    flush()
                    t0 = time.perf_counter()
                    fns[name]()
                    t[name].append(time.perf_counter() - t0)
            med = {name: statistics.median(v) for name, v in t.items()}
            row = dict(M=m, K=k, N=n, threads=args.threads, chosen=cpu_dispatch.choose(n, m, k),
                       **{f"{name}_ms": v * 1e3 for name, v in med.items()},
                       **{f"speedup_{name}": med["vllm_bf16"] / v for name, v in med.items() if name != "vllm_bf16"},
                       paired_speedup_dispatch=statistics.median(
                           a / b for a, b in zip(t["vllm_bf16"], t["dispatch"])))
            rows.append(row)
            print(f"{m:>6}x{k:<6} N={n:<4} vLLM BF16 {row['vllm_bf16_ms']:8.2f} ms | "
                  + " | ".join(f"{name} {row[name + '_ms']:8.2f} ms {row['speedup_' + name]:.2f}x"
                               for name in fns if name != "vllm_bf16") + f" | chosen {row['chosen']}", flush=True)
    out = dict(benchmark="bench_cpu_vs_vllm", host=ident, platform=platform.platform(), threads=args.threads,
               torch=torch.__version__, reps=args.reps, bits_per_weight_bytesplit=round(pt.bits_per_weight, 3),
               rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
