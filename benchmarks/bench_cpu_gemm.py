"""Benchmark of the fused decode-GEMM CPU kernels against torch's BF16 F.linear.

Side by side in one run, for Llama-like weight shapes [M, K] (out, in):
4096x4096, 14336x4096, 4096x14336, 128256x4096 (N(0, 0.02^2) BF16, compressed
with ``zipserv_vllm.compress_tensor``, then repacked with ``cpu_kernels.pack``)
and N = 1, 4, 16 tokens, with the same thread count on every side (1 and 2):

* ``bf16``: ``F.linear(x, W_bf16)`` (torch, ``torch.set_num_threads(t)``);
* ``v1``: ``cpu_kernels.fused_linear(x, ct, threads=t)``, the fused kernel
  straight from TCA-TBE v1;
* ``bytesplit``: ``cpu_kernels.packed_linear(x, pt, threads=t)``, the fused
  kernel from the CPU byte-split layout (docs/FORMAT.md appendix A);
* ``dispatch``: ``zipserv_vllm.linear(x, pt, mode="fast")``, i.e. what the
  vLLM plugin's CPU fast mode runs (byte-split fused kernel for N <=
  fused_max_n(), else decode + F.linear).

A second table ("threshold") runs larger N on 4096x4096 (both fused kernels vs
bf16 vs decode + F.linear = mode "exact") to justify the dispatch threshold.

Medians of --reps interleaved repetitions (--reps-n1 at N = 1; the calls
alternate, so a noisy neighbour slows all sides alike); wall clock, plus the
caller thread's CPU time for 1-thread runs (meaningful when other jobs share
the cores). The load average before and after is recorded: on a shared machine
read ratios, not absolute times.

Writes benchmarks/results/bench_cpu_gemm.json and prints a table.
Run: .venv/bin/python benchmarks/bench_cpu_gemm.py [--reps 9] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
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

SHAPES = ((4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096))
NS = (1, 4, 16)
THRESHOLD_NS = (16, 64, 256, 512)


def make_weight(m: int, k: int, seed: int) -> torch.Tensor:
    """N(0, 0.02^2) BF16 [m, k], generated in row blocks (no full fp32 copy)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.empty((m, k), dtype=torch.bfloat16)
    step = max(1, (64 << 20) // (4 * k))
    for r in range(0, m, step):
        w[r : r + step] = (torch.randn(min(step, m - r), k, generator=g) * 0.02).bfloat16()
    return w


def timed(fns: dict, reps: int, warmup: int = 2) -> dict:
    """Interleaved medians: {name: (wall_s, thread_cpu_s, [wall_s per repetition])}."""
    for _ in range(warmup):
        for f in fns.values():
            f()
    wall = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            f()
            c1, t1 = time.thread_time(), time.perf_counter()
            wall[k].append(t1 - t0)
            cpu[k].append(c1 - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k]), wall[k]) for k in fns}


def paired(r: dict, a: str, b: str) -> float:
    """Median over repetitions of time(a) / time(b), each pair measured back to back: less
    sensitive than the ratio of medians to the host slowing down part of the run."""
    return statistics.median(x / y for x, y in zip(r[a][2], r[b][2]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--reps-n1", type=int, default=31,
                    help="repetitions at N = 1 (fast calls; the ratio there is the noisiest on a shared host)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--quick", action="store_true", help="4096x4096 only, fewer reps (smoke run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_cpu_gemm.json"))
    args = ap.parse_args()
    if not cpu_kernels.available():
        print(f"error: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    shapes = SHAPES[:1] if args.quick else SHAPES
    reps = 3 if args.quick else args.reps
    reps_n1 = reps if args.quick else max(reps, args.reps_n1)
    threads = [int(t) for t in args.threads.split(",")]
    load_before = os.getloadavg()
    rows, thr_rows = [], []
    for si, (m, k) in enumerate(shapes):
        w = make_weight(m, k, seed=si)
        t0 = time.perf_counter()
        ct = compress_tensor(w)
        comp_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        pt = cpu_kernels.pack(ct)
        pack_s = time.perf_counter() - t0
        bits, bits_pk = ct.bits_per_weight, pt.bits_per_weight
        for t in threads:
            torch.set_num_threads(t)
            for n in NS:
                x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).bfloat16()
                path = cpu_kernels.dispatch(x, None, m)[1]
                r = timed({
                    "bf16": lambda: F.linear(x, w),
                    "v1": lambda: cpu_kernels.fused_linear(x, ct, threads=t),
                    "bytesplit": lambda: cpu_kernels.packed_linear(x, pt, threads=t),
                    "dispatch": lambda: zipserv_vllm.linear(x, pt, mode="fast"),
                }, reps_n1 if n == 1 else reps)
                row = dict(M=m, K=k, N=n, threads=t, bits_per_weight_v1=round(bits, 3),
                           bits_per_weight_bytesplit=round(bits_pk, 3), dispatch_path=path,
                           **{f"{name}_ms": r[name][0] * 1e3 for name in r})
                for name in ("v1", "bytesplit", "dispatch"):
                    row[f"speedup_{name}"] = r["bf16"][0] / r[name][0]
                    row[f"paired_speedup_{name}"] = paired(r, "bf16", name)
                if t == 1:
                    for name in r:
                        row[f"{name}_cpu_ms"] = r[name][1] * 1e3
                    row["speedup_dispatch_cpu"] = r["bf16"][1] / r["dispatch"][1]
                rows.append(row)
                print(f"{m:>6}x{k:<6} N={n:<3} t={t}  bf16 {row['bf16_ms']:8.2f} ms  v1 {row['v1_ms']:8.2f} ms"
                      f" x{row['speedup_v1']:.2f}  bytesplit {row['bytesplit_ms']:8.2f} ms x{row['speedup_bytesplit']:.2f}"
                      f"  dispatch {row['dispatch_ms']:8.2f} ms x{row['speedup_dispatch']:.2f}"
                      f"  paired x{row['paired_speedup_v1']:.2f} / x{row['paired_speedup_bytesplit']:.2f}"
                      f" / x{row['paired_speedup_dispatch']:.2f}", flush=True)
        if (m, k) == (4096, 4096):
            torch.set_num_threads(threads[-1])
            for n in THRESHOLD_NS[: 2 if args.quick else None]:
                x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).bfloat16()
                r = timed({
                    "bf16": lambda: F.linear(x, w),
                    "v1": lambda: cpu_kernels.fused_linear(x, ct, threads=threads[-1]),
                    "bytesplit": lambda: cpu_kernels.packed_linear(x, pt, threads=threads[-1]),
                    "decode_linear": lambda: zipserv_vllm.linear(x, pt, mode="exact"),
                }, max(3, reps // 3), warmup=1)
                tr = dict(M=m, K=k, N=n, threads=threads[-1], **{f"{name}_ms": r[name][0] * 1e3 for name in r})
                for name in ("v1", "bytesplit", "decode_linear"):
                    tr[f"speedup_{name}"] = r["bf16"][0] / r[name][0]
                thr_rows.append(tr)
                print(f"threshold {m}x{k} N={n:<4} t={threads[-1]}  bf16 {tr['bf16_ms']:9.2f}  v1 {tr['v1_ms']:9.2f}"
                      f" (x{tr['speedup_v1']:.2f})  bytesplit {tr['bytesplit_ms']:9.2f} (x{tr['speedup_bytesplit']:.2f})"
                      f"  decode+F.linear {tr['decode_linear_ms']:9.2f} (x{tr['speedup_decode_linear']:.2f})", flush=True)
        print(f"# {m}x{k}: {bits:.3f} bits/weight in v1 (compressed in {comp_s:.2f} s), {bits_pk:.3f} in the "
              f"byte-split layout (repacked from v1 in {pack_s:.2f} s)", flush=True)
        del w, ct, pt
        gc.collect()
    result = dict(
        benchmark="bench_cpu_gemm",
        machine=dict(platform=platform.platform(), cpu=platform.processor() or "unknown",
                     cores=os.cpu_count(), isas=cpu_kernels.isas(), torch=torch.__version__),
        fused_max_n=cpu_kernels.fused_max_n(), reps=reps, reps_n1=reps_n1,
        loadavg_before=load_before, loadavg_after=os.getloadavg(),
        rows=rows, threshold=thr_rows,
        notes="medians of interleaved reps; v1 = fused kernel from TCA-TBE v1, bytesplit = fused kernel from "
              "the CPU byte-split layout, dispatch = zipserv_vllm.linear(x, packed, mode='fast'); "
              "*_cpu_ms = caller-thread CPU time (1-thread runs only); "
              "paired_* = median of per-repetition ratios (bf16 and the other call back to back)",
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print()
    print(f"{'shape':>14} {'N':>3} {'thr':>3} {'bf16 ms':>9} {'v1 ms':>9} {'x':>5} {'bsplit ms':>9} {'x':>5}"
          f" {'disp ms':>9} {'x':>5} {'paired':>6}  path")
    for r in rows:
        print(f"{r['M']:>6}x{r['K']:<7} {r['N']:>3} {r['threads']:>3} {r['bf16_ms']:9.2f} {r['v1_ms']:9.2f}"
              f" {r['speedup_v1']:5.2f} {r['bytesplit_ms']:9.2f} {r['speedup_bytesplit']:5.2f} {r['dispatch_ms']:9.2f}"
              f" {r['speedup_dispatch']:5.2f} {r['paired_speedup_dispatch']:6.2f}  {r['dispatch_path']}")
    print(f"load average before {load_before}, after {result['loadavg_after']}; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
