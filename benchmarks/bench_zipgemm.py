"""ZipGEMM vs decoupled (decompress + cuBLAS) vs cuBLAS BF16, side by side, on one GPU.

For every layer shape (Llama-3-8B/70B, Qwen2.5; tests/gpu/shapes.py) and N it
times, in the same run and process:

* ``fused``     : the fused ZipGEMM kernel with the dispatcher's config
                  (tile_n from N, split-K heuristic of the GPU's table);
* ``decoupled`` : decompress kernel into a workspace + F.linear (cuBLAS);
* ``cublas``    : F.linear on the BF16 weight;
* ``dispatch``  : zipserv_vllm.linear(mode="fast"), i.e. what serving gets;
* ``packed``    : at N <= 16, the byte-split-layout kernel (docs/FORMAT.md
                  appendix A, ~12.05 bits per weight), at the fused kernel's split;
* ``packed_decoupled``: that layout's decompress kernel + F.linear (cuBLAS);
* ``packed_dispatch``: zipserv_vllm.linear on the byte-split weight, what a
                  GPU engine holding that layout serves (ZIPSERV_GPU_LAYOUT=bytesplit
                  or prefer: speed; the dispatcher's plan for the layout).

Several copies of every weight are rotated (enough to exceed 4x the L2 cache,
at most --max-copies) so no method is flattered by a warm L2. Each number is
the median of --reps CUDA-event timings of --iters calls (captured in a CUDA
graph for N <= --graph-max-n, so launch overhead is excluded alike). Reports time,
effective weight bandwidth (bytes of the weight as stored / time) and speedups
over cuBLAS; writes JSON (benchmarks/results/bench_zipgemm.json) and prints a
table. Without a CUDA device it exits with status 2 and a message: there are no
CPU numbers to fake.

With ``--moe`` (or ``--moe-only``) it also times mixture-of-experts layers:
the grouped fused kernel (one launch over the routed experts) against a BF16
per-expert cuBLAS loop, the decoupled path and one fused launch per expert
(``moe_rows`` in the JSON; see run_moe).

    python benchmarks/bench_zipgemm.py [--models llama3-8b,qwen2.5-7b] [--ns 1,8,32] [--quick] [--moe]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_shapes():
    spec = importlib.util.spec_from_file_location("zipserv_gpu_shapes", ROOT / "tests" / "gpu" / "shapes.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def need_cuda(tool: str):
    try:
        import torch
    except ImportError:
        sys.exit(f"{tool}: PyTorch is not installed")
    if not torch.cuda.is_available():
        print(f"{tool}: no CUDA device (torch.cuda.is_available() is False); this benchmark only runs on a GPU "
              "and reports nothing otherwise", file=sys.stderr)
        sys.exit(2)
    from zipserv_vllm.kernels import cuda as cuda_ops

    if not cuda_ops.available():
        print(f"{tool}: {cuda_ops.unavailable_reason()}", file=sys.stderr)
        sys.exit(2)
    return torch, cuda_ops


def time_calls(torch, fns, iters: int, reps: int, warmup: int = 3, graph: bool = True) -> float:
    """zipserv_vllm.kernels.gpu_timing.time_calls (CUDA-graph replays; ``torch`` is unused, kept for
    the callers)."""
    from zipserv_vllm.kernels.gpu_timing import time_calls as timed

    return timed(fns, iters, reps, warmup=warmup, graph=graph)


def clone_ct(ct):
    from zipserv_vllm.kernels.gpu_timing import clone_compressed

    return clone_compressed(ct)


def packed_copies(w, copies: int, dev) -> list:
    """``copies`` PackedTensors of the BF16 weight w on dev (docs/FORMAT.md appendix A), packed on the CPU by
    the native packer; none where it is not built."""
    try:
        from zipserv_vllm.kernels.cpu import pack
        pt = pack(w.cpu())
    except (ImportError, RuntimeError) as exc:  # no _cpu_gemm: the reference packer would take minutes per layer
        print(f"bench_zipgemm: the byte-split kernel is not timed ({exc})", flush=True)
        return []
    return [pt.to(dev) for _ in range(copies)]


def packed_bytes(pt) -> int:
    return sum(getattr(pt, a).numel() * getattr(pt, a).element_size() for a in ("tiles", "luts", "exc_start", "exc"))


# Mixture-of-experts layers for --moe: (experts, top-k, {matrix: (M, K)}) per model.
MOE_MODELS = {
    "qwen3-30b-a3b": (128, 8, {"w13": (1536, 2048), "w2": (2048, 768)}),
    "mixtral-8x7b": (8, 2, {"w13": (28672, 4096), "w2": (4096, 14336)}),
}
MOE_TOKENS = (1, 8, 32, 128, 512)


def run_moe(args, torch, cuda_ops, iters: int, reps: int, on_row=None) -> list:
    """Grouped ZipGEMM over one MoE layer's experts vs a BF16 per-expert cuBLAS loop, side by side.

    T tokens each routed to top-k distinct experts (seeded uniform routing), rows grouped per expert:

    * ``bf16_loop``       : F.linear on each routed expert's BF16 weight over its rows;
    * ``grouped_fused``   : one launch of the grouped fused kernel (cuda.grouped_gemm, path fused);
    * ``zs_decoupled``    : per routed expert, decompress + cuBLAS;
    * ``zs_fused_loop``   : one fused launch per routed expert (what grouping saves).

    Counts are fixed per row, so every method is captured in a CUDA graph alike (no launch overhead)."""
    import torch.nn.functional as F

    from zipserv_vllm.kernels import dispatch

    dev = torch.device("cuda")
    rows_out = []
    for model, (n_exp, top_k, mats) in MOE_MODELS.items():
        for mat, (m, k) in mats.items():
            w_bf16, cts = [], []
            for e in range(n_exp):
                w = (torch.randn(m, k, device=dev) * 0.02).to(torch.bfloat16)
                w_bf16.append(w)
                cts.append(cuda_ops.compress_tensor_cuda(w))
            table = cuda_ops.expert_table(cts)
            for t in MOE_TOKENS:
                gen = torch.Generator().manual_seed(t)
                ids = torch.stack([torch.randperm(n_exp, generator=gen)[:top_k] for _ in range(t)]).reshape(-1)
                counts = torch.bincount(ids, minlength=n_exp).tolist()
                starts = [0]
                for c in counts:
                    starts.append(starts[-1] + c)
                rows = starts[-1]
                x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
                er = torch.tensor(starts, dtype=torch.int32, device=dev)
                active = [e for e in range(n_exp) if counts[e]]
                tn = dispatch.tile_n_for(max(1, -(-rows // min(n_exp, rows))))

                def loop(fn):
                    def call():
                        for e in active:
                            fn(e, x[starts[e]:starts[e + 1]])
                    return call

                methods = {
                    "bf16_loop": [loop(lambda e, xe: F.linear(xe, w_bf16[e]))],
                    "grouped_fused": [lambda: cuda_ops.grouped_gemm(x, cts, er, table=table, path="fused", tile_n=tn)],
                    "zs_decoupled": [loop(lambda e, xe: cuda_ops.decoupled_gemm(
                        xe, cts[e].bitmaps, cts[e].base, cts[e].offsets, cts[e].sm, cts[e].fb, m, k, None))],
                    "zs_fused_loop": [loop(lambda e, xe: cuda_ops.fused_gemm(
                        xe, cts[e].bitmaps, cts[e].base, cts[e].offsets, cts[e].sm, cts[e].fb, m, k, None,
                        dispatch.tile_n_for(xe.shape[0]), 1))],
                }
                secs = {key: time_calls(torch, fns, iters, reps, graph=True) for key, fns in methods.items()}
                bf16_bytes = sum(m * k * 2 for _ in active)
                zs_bytes = sum(cts[e].nbytes for e in active)
                row = {"model": model, "matrix": mat, "M": m, "K": k, "experts": n_exp, "top_k": top_k, "tokens": t,
                       "rows": rows, "active_experts": len(active), "tile_n": tn, "timing": "cuda_graph",
                       "routed_bf16_bytes": bf16_bytes, "routed_compressed_bytes": zs_bytes, "seconds": secs,
                       "speedup_vs_bf16_loop": {key: secs["bf16_loop"] / v for key, v in secs.items()
                                                if key != "bf16_loop"}}
                rows_out.append(row)
                sp = row["speedup_vs_bf16_loop"]
                print(f"{model:14s} {mat:4s} {m:6d}x{k:<6d} T={t:<4d} active {len(active):3d}  "
                      f"bf16 loop {secs['bf16_loop'] * 1e6:9.1f} us  grouped fused {sp['grouped_fused']:5.2f}x  "
                      f"decoupled {sp['zs_decoupled']:5.2f}x  fused loop {sp['zs_fused_loop']:5.2f}x", flush=True)
                if on_row is not None:
                    on_row(rows_out)
            del w_bf16, cts, table
            torch.cuda.empty_cache()
    return rows_out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-8b,llama3-70b,qwen2.5-7b")
    ap.add_argument("--ns", default=None, help="comma-separated N (default: tests/gpu/shapes.NS)")
    ap.add_argument("--fused-max-n", type=int, default=1024, help="skip the fused kernel above this N (slow by design)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--max-copies", type=int, default=8)
    ap.add_argument("--graph-max-n", type=int, default=256,
                    help="time N up to this inside CUDA graphs (no launch overhead); larger N eagerly")
    ap.add_argument("--quick", action="store_true",
                    help="first contact: Llama-3-8B only, N in 1,8,32, fewer iterations (the JSON is rewritten "
                         "after every row, so a run cut short still leaves its rows)")
    ap.add_argument("--moe", action="store_true",
                    help="also time the grouped kernel over MoE layers (Qwen3-30B-A3B, Mixtral-8x7B experts)")
    ap.add_argument("--moe-only", action="store_true", help="only the MoE entries")
    ap.add_argument("--no-packed", action="store_true", help="skip the byte-split-layout kernel (N <= 16)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_zipgemm.json"))
    args = ap.parse_args(argv)
    torch, cuda_ops = need_cuda("bench_zipgemm")
    import torch.nn.functional as F

    import zipserv_vllm
    from zipserv_vllm.kernels import dispatch
    from zipserv_vllm.kernels.gpu_timing import copies_for

    shapes_mod = load_shapes()
    models = ["llama3-8b"] if args.quick else [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in shapes_mod.MODELS]
    if unknown:
        print(f"bench_zipgemm: unknown model(s) {unknown}; known: {sorted(shapes_mod.MODELS)}", file=sys.stderr)
        return 1
    ns = [1, 8, 32] if args.quick else (
        [int(v) for v in args.ns.split(",")] if args.ns else list(shapes_mod.NS))
    iters, reps = (10, 3) if args.quick else (args.iters, args.reps)

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    name, cc, sms = cuda_ops.device_info(dev)
    table = dispatch.load_table(name, cc)
    rows = []
    t_start = time.time()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def write(moe_rows, complete: bool) -> None:
        """The JSON so far (rewritten after every row: a run cut short keeps what it measured)."""
        result = {
            "benchmark": "bench_zipgemm", "complete": complete,
            "gpu": name, "compute_capability": f"{cc[0]}.{cc[1]}", "sm_count": sms, "l2_bytes": l2,
            "torch": torch.__version__, "cuda": torch.version.cuda,
            "dispatch_table": table.get("_file", "built-in"),
            "iters": iters, "reps": reps, "statistic": "median of reps, mean per call within a rep",
            "wall_seconds": round(time.time() - t_start, 1),
            "rows": rows,
            "moe_rows": moe_rows,
        }
        tmp = out.with_suffix(out.suffix + ".tmp")
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)

    for model in ([] if args.moe_only else models):
        layers = shapes_mod.MODELS[model]
        cuda_ops.prepare(dev)
        for layer, (m, k) in layers.items():
            w = (torch.randn(m, k, device=dev) * 0.02).to(torch.bfloat16)
            ct = cuda_ops.compress_tensor_cuda(w)
            copies = copies_for(m * k * 2, l2, factor=4, max_copies=args.max_copies)
            ws = [w] + [w.clone() for _ in range(copies - 1)]
            cts = [ct] + [clone_ct(ct) for _ in range(copies - 1)]
            pts = [] if args.no_packed else packed_copies(w, copies, dev)
            for n in ns:
                x = torch.randn(n, k, device=dev).to(torch.bfloat16)
                gpu = dispatch.gpu_model(name, cc, sms)
                plan = dispatch.choose(n, m, k, sms, table, gpu)
                tn = dispatch.tile_n_for(n)
                fused = [p for p in dispatch.candidates(n, m, k, table) if p.path == "fused"]
                fused_split = min(fused, key=lambda p: dispatch.estimate(p, n, m, k, gpu, table)).split
                methods = {
                    "cublas": [lambda w=w_: F.linear(x, w) for w_ in ws],
                    "decoupled": [lambda c=c_: cuda_ops.decoupled_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None)
                                  for c_ in cts],
                    "dispatch": [lambda c=c_: zipserv_vllm.linear(x, c) for c_ in cts],
                }
                if pts and n <= 16:  # the byte-split-layout kernel (tile_n 8 / 16), at the fused kernel's split
                    methods["packed"] = [lambda p=p_: cuda_ops.packed_gemm(x, p, None, 8 if n <= 8 else 16, fused_split)
                                         for p_ in pts]
                if pts:
                    methods["packed_decoupled"] = [lambda p=p_: cuda_ops.packed_decoupled_gemm(x, p, None) for p_ in pts]
                    methods["packed_dispatch"] = [lambda p=p_: zipserv_vllm.linear(x, p) for p_ in pts]
                if n <= args.fused_max_n:
                    methods["fused"] = [lambda c=c_: cuda_ops.fused_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k,
                                                                          None, tn, fused_split) for c_ in cts]
                graph = n <= args.graph_max_n
                t = {key: time_calls(torch, fns, iters, reps, graph=graph) for key, fns in methods.items()}
                row = {
                    "model": model, "layer": layer, "M": m, "K": k, "N": n, "copies": copies,
                    "timing": "cuda_graph" if graph else "eager",
                    "bf16_weight_bytes": m * k * 2, "compressed_weight_bytes": ct.nbytes,
                    "bits_per_weight": round(ct.bits_per_weight, 3),
                    "plan": {"path": plan.path, "tile_n": plan.tile_n, "split": plan.split},
                    "fused_config": {"tile_n": tn, "split": fused_split},
                    "seconds": t,
                    "packed_weight_bytes": packed_bytes(pts[0]) if pts else None,
                    "weight_GBps": {"cublas": m * k * 2 / t["cublas"] / 1e9,
                                    **{key: (packed_bytes(pts[0]) if key.startswith("packed") else ct.nbytes) / t[key] / 1e9
                                       for key in t if key != "cublas"}},
                    "speedup_vs_cublas": {key: t["cublas"] / t[key] for key in t if key != "cublas"},
                }
                rows.append(row)
                sp = row["speedup_vs_cublas"]
                print(f"{model:12s} {layer:8s} {m:6d}x{k:<6d} N={n:<5d} cublas {t['cublas'] * 1e6:9.1f} us  "
                      f"fused {t.get('fused', float('nan')) * 1e6:9.1f} us ({sp.get('fused', float('nan')):5.2f}x)  "
                      f"decoupled {t['decoupled'] * 1e6:9.1f} us ({sp['decoupled']:5.2f}x)  "
                      f"dispatch[{plan.path}] {sp['dispatch']:5.2f}x"
                      + (f"  packed {t['packed'] * 1e6:9.1f} us ({sp['packed']:5.2f}x)" if "packed" in t else "")
                      + (f"  packed_dispatch {sp['packed_dispatch']:5.2f}x" if "packed_dispatch" in t else ""),
                      flush=True)
                write([], complete=False)
            del ws, cts, w, ct, pts
            torch.cuda.empty_cache()
    moe_rows = run_moe(args, torch, cuda_ops, iters, reps, lambda mr: write(mr, complete=False)) \
        if (args.moe or args.moe_only) else []
    write(moe_rows, complete=True)
    fused_sp = [r["speedup_vs_cublas"]["fused"] for r in rows if "fused" in r["speedup_vs_cublas"]]
    if fused_sp:
        print(f"fused vs cuBLAS: geometric mean {math.exp(statistics.fmean(math.log(s) for s in fused_sp)):.3f}x "
              f"over {len(fused_sp)} (shape, N), min {min(fused_sp):.2f}x, max {max(fused_sp):.2f}x")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
