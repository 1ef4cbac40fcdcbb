"""Measure fused ZipGEMM (every split-K) vs decoupled on this GPU and write a dispatch table.

For each layer shape (default: Llama-3-8B and Qwen2.5-7B layers, see
tests/gpu/shapes.py) and each N in --ns, times the fused kernel for every
split in --splits (capped by Kt) and the decoupled path (decompress +
cuBLAS), rotating weight copies as bench_zipgemm.py does. The fastest choice
per (shape, N) becomes a shape rule (shapes not in the table get the cost
model's plan, zipserv_vllm/kernels/dispatch.py). The table is written to
configs/dispatch/<gpu-name>.json (zipserv_vllm.kernels.dispatch looks it up by
name) unless --out says otherwise, with every measurement kept under
"measured". Needs a CUDA device; exits with status 2 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import sys
from pathlib import Path

from bench_zipgemm import ROOT, clone_ct, load_shapes, need_cuda, time_calls


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-8b,qwen2.5-7b")
    ap.add_argument("--ns", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: configs/dispatch/<gpu-name>.json")
    args = ap.parse_args(argv)
    torch, cuda_ops = need_cuda("tune_dispatch")
    from zipserv_vllm.kernels import dispatch

    shapes_mod = load_shapes()
    dev = torch.device("cuda")
    name, cc, sms = cuda_ops.device_info(dev)
    l2 = getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20)
    ns = [int(v) for v in args.ns.split(",")]
    splits = [int(v) for v in args.splits.split(",")]
    shapes = {}
    for model in args.models.split(","):
        for layer, mk in shapes_mod.MODELS[model.strip()].items():
            shapes.setdefault(mk, f"{model.strip()}.{layer}")

    measured, rules_out = [], []
    wins_by_n = {n: 0 for n in ns}
    for (m, k), label in shapes.items():
        w = (torch.randn(m, k, device=dev) * 0.02).to(torch.bfloat16)
        ct = cuda_ops.compress_tensor_cuda(w)
        del w
        copies = max(1, min(8, math.ceil(4 * l2 / (m * k * 2))))
        cts = [ct] + [clone_ct(ct) for _ in range(copies - 1)]
        kt = -(-k // 64)
        cuda_ops.prepare(dev)
        rules = []
        for n in ns:
            x = torch.randn(n, k, device=dev).to(torch.bfloat16)
            tn = dispatch.tile_n_for(n)
            times = {}
            for s in sorted({dispatch.splitk_parts(kt, min(s, kt)) for s in splits}):
                times[f"fused_split{s}"] = time_calls(torch, [
                    (lambda c=c: cuda_ops.fused_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None, tn, s))
                    for c in cts], args.iters, args.reps)
            times["decoupled"] = time_calls(torch, [
                (lambda c=c: cuda_ops.decoupled_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None))
                for c in cts], args.iters, args.reps)
            best = min(times, key=times.get)
            measured.append({"shape": label, "m": m, "k": k, "n": n, "seconds": times, "best": best})
            print(f"{label:22s} {m:6d}x{k:<6d} N={n:<5d} best {best:14s} "
                  + " ".join(f"{key}={t * 1e6:.1f}us" for key, t in times.items()), flush=True)
            if best.startswith("fused"):
                wins_by_n[n] += 1
                rule = {"n_max": n, "path": "fused", "split": int(best[len("fused_split"):])}
            else:
                rule = {"n_max": n, "path": "decoupled"}
            if rules and {kk: v for kk, v in rules[-1].items() if kk != "n_max"} == \
                    {kk: v for kk, v in rule.items() if kk != "n_max"}:
                rules[-1]["n_max"] = n
            else:
                rules.append(rule)
        rules[-1]["n_max"] = 1 << 30 if rules[-1]["path"] == "decoupled" else rules[-1]["n_max"]
        rules_out.append({"m": m, "k": k, "label": label, "rules": rules})
        del cts, ct
        torch.cuda.empty_cache()

    fused_wins = max([n for n in ns if wins_by_n[n] * 2 >= len(shapes)], default=0)
    table = dict(dispatch.BUILTIN)
    table.update({
        "gpu": name, "compute_capability": f"{cc[0]}.{cc[1]}", "sm_count": sms,
        "source": f"benchmarks/tune_dispatch.py on {name}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        "shapes": rules_out, "measured": measured,
    })
    dispatch.validate_table(table)
    out = Path(args.out) if args.out else ROOT / "configs" / "dispatch" / f"{dispatch.table_key(name)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    print(f"the fused kernel won on at least half of the shapes up to N = {fused_wins}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
