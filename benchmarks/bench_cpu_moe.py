"""MoE layer on the CPU: zipserv's one-call kernel against vLLM's own BF16 MoE kernel, side by side.

One MoE layer's routed experts (routing, w13, SiLU x up, w2, weighted sum) for N tokens, top-k of E
experts, on the experts' shapes of a model (default: Qwen3-MoE-shaped, hidden 1024, expert
intermediate 512, 16 experts, top-4, as ``bench_vllm_e2e.py --size qwen3moe0.4b``):

* ``vllm_bf16``: ``vllm._custom_ops.cpu_fused_moe`` on weights prepacked by
  ``cpu_prepack_moe_weight`` (what vLLM's unquantized CPU MoE layer runs);
* ``zipserv``: ``cpu_kernels.moe_run`` on a ``cpu_kernels.moe_layer`` of byte-split experts (what
  fast mode runs on AVX512-BF16 CPUs), held in a ``PagedArena`` as the plugin holds them.

``--layers`` layers of different weights are called in turn (14 x 16 experts: ~700 MB in BF16), so
the routed experts come from memory, as in a decode step; routing is random per layer and token.
Each repetition times all layers with both kernels, alternating, and the ratio is the median of
the per-repetition ratios. Needs a CPU with AVX512-BF16 and vLLM's CPU build.

    .venv/bin/python benchmarks/bench_cpu_moe.py [--ns 1,2,8,32] [--reps 15]

Writes benchmarks/results/bench_cpu_moe.json and prints a table.
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

from zipserv_vllm.kernels import cpu as cpu_kernels  # noqa: E402
from zipserv_vllm.kernels import cpu_dispatch  # noqa: E402
from zipserv_vllm.format.cpu_layout import PackedTensor  # noqa: E402
from zipserv_vllm.vllm_plugin.arena import PagedArena  # noqa: E402


def _in_arena(arena, pt):
    """``pt`` copied into ``arena`` (64 MiB pages, huge pages advised), as the plugin stores a layer."""
    v = arena.views(arena.store(pt.arrays()))
    return PackedTensor(tuple(pt.shape), v["tiles"], v["luts"], v["exc_start"], v["exc"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--inter", type=int, default=512, help="expert intermediate size")
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--topk", type=int, default=4)
    ap.add_argument("--layers", type=int, default=14)
    ap.add_argument("--ns", default="1,2,8,32")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "bench_cpu_moe.json"))
    args = ap.parse_args()
    if not (cpu_kernels.available() and cpu_kernels.bf16_supported()):
        print("error: this benchmark needs zipserv's CPU kernels on a CPU with AVX512-BF16", file=sys.stderr)
        return 2
    try:
        from vllm import _custom_ops as vops
    except ImportError as e:
        print(f"error: vLLM's CPU build is needed for its BF16 MoE kernel ({e})", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    h, i, e, k = args.hidden, args.inter, args.experts, args.topk
    g = torch.Generator().manual_seed(0)
    layers = []
    arena = PagedArena("cpu")  # (the experts held as the plugin holds them: views into the arena's pages)
    print(f"building {args.layers} layers x {e} experts ({h} x {i}) ...", flush=True)
    for _ in range(args.layers):
        w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.02).bfloat16()
        w2 = (torch.randn(e, h, i, generator=g) * 0.02).bfloat16()
        p13 = [_in_arena(arena, cpu_kernels.pack(w13[x])) for x in range(e)]
        p2 = [_in_arena(arena, cpu_kernels.pack(w2[x])) for x in range(e)]
        native = cpu_kernels.moe_layer(cpu_kernels.expert_table(p13, (2 * i, h)),
                                       cpu_kernels.expert_table(p2, (h, i)), i, h)
        layers.append(dict(parts=(p13, p2), native=native, b13=vops.cpu_prepack_moe_weight(w13, "vec"),
                           b2=vops.cpu_prepack_moe_weight(w2, "vec")))
        del w13, w2

    def zipserv(lay, x, ids, w):
        return cpu_kernels.moe_run(lay["native"], x, ids, w)

    def vllm_bf16(lay, x, ids, w):
        out = torch.empty_like(x)
        vops.cpu_fused_moe(out, x, lay["b13"], lay["b2"], None, None, w, ids, "silu", "vec")
        return out

    ident = cpu_dispatch.cpu_identity()
    print(f"host: {ident}, {args.threads} threads, torch {torch.__version__}")
    rows = []
    for n in [int(v) for v in args.ns.split(",") if v.strip()]:
        inputs = []
        for _ in range(args.layers):
            x = (torch.randn(n, h, generator=g)).bfloat16()
            ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(torch.int32)
            inputs.append((x, ids, torch.rand(n, k, generator=g)))
        a, b = zipserv(layers[0], *inputs[0]).float(), vllm_bf16(layers[0], *inputs[0]).float()
        max_diff = (a - b).abs().max().item()
        t = {"zipserv": [], "vllm_bf16": []}
        for _ in range(args.reps):
            for name, fn in (("vllm_bf16", vllm_bf16), ("zipserv", zipserv)):
                t0 = time.perf_counter()
                for lay, inp in zip(layers, inputs):
                    fn(lay, *inp)
                t[name].append((time.perf_counter() - t0) / args.layers)
        ratio = statistics.median(bf / zs for bf, zs in zip(t["vllm_bf16"], t["zipserv"]))
        row = dict(n=n, zipserv_us=round(statistics.median(t["zipserv"]) * 1e6, 1),
                   vllm_bf16_us=round(statistics.median(t["vllm_bf16"]) * 1e6, 1), speedup=round(ratio, 3),
                   max_abs_diff=max_diff)
        rows.append(row)
        print(f"N={n:<4} vLLM BF16 {row['vllm_bf16_us']:8.1f} us | zipserv {row['zipserv_us']:8.1f} us | "
              f"{ratio:.2f}x | max |diff| {max_diff:.2e}", flush=True)
    out = dict(benchmark="bench_cpu_moe", host=ident, platform=platform.platform(), threads=args.threads,
               shape=dict(hidden=h, inter=i, experts=e, topk=k, layers=args.layers), reps=args.reps, rows=rows)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
