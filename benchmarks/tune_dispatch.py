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

``--from-bench FILE`` builds the table from a ``bench_zipgemm.py`` JSON
instead (no GPU needed): per (shape, N) the faster of its fused timing (at the
split the cost model chose) and its decoupled timing; fewer splits are tried
than here, which the table's "source" says.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

from bench_zipgemm import ROOT, clone_ct, load_shapes, need_cuda, time_calls


def add_rule(rules: list, n: int, best: str) -> None:
    """Append the rule for N (``best``: "decoupled" or "fused_split<s>"), merged with the previous one
    when they agree."""
    if best.startswith("fused"):
        rule = {"n_max": n, "path": "fused", "split": int(best[len("fused_split"):])}
    else:
        rule = {"n_max": n, "path": "decoupled"}
    if rules and {kk: v for kk, v in rules[-1].items() if kk != "n_max"} == \
            {kk: v for kk, v in rule.items() if kk != "n_max"}:
        rules[-1]["n_max"] = n
    else:
        rules.append(rule)


def close_rules(rules: list) -> list:
    """A last decoupled rule covers every larger N (a fused one stops where the measurements stop)."""
    if rules and rules[-1]["path"] == "decoupled":
        rules[-1]["n_max"] = 1 << 30
    return rules


def from_bench(path: Path, out: Path | None) -> int:
    from zipserv_vllm.kernels import dispatch

    d = json.loads(path.read_text())
    by_shape: dict = {}
    measured = []
    for r in sorted(d["rows"], key=lambda r: (r["M"], r["K"], r["N"])):
        times = {"decoupled": r["seconds"]["decoupled"]}
        if "fused" in r["seconds"]:
            times[f"fused_split{r['fused_config']['split']}"] = r["seconds"]["fused"]
        best = min(times, key=times.get)
        entry = by_shape.setdefault((r["M"], r["K"]), {"m": r["M"], "k": r["K"], "label": f"{r['model']}.{r['layer']}",
                                                       "rules": []})
        add_rule(entry["rules"], r["N"], best)
        measured.append({"shape": entry["label"], "m": r["M"], "k": r["K"], "n": r["N"], "seconds": times,
                         "best": best})
    table = dict(dispatch.BUILTIN)
    table.update({
        "gpu": d["gpu"], "compute_capability": d["compute_capability"], "sm_count": d["sm_count"],
        "source": f"benchmarks/tune_dispatch.py --from-bench {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
                  " (bench_zipgemm.py: CUDA-graph replays, weights rotated past the L2, medians; the fused kernel "
                  "timed at the cost model's split only)",
        "shapes": [dict(e, rules=close_rules(e["rules"])) for e in by_shape.values()], "measured": measured,
    })
    dispatch.validate_table(table)
    out = out or ROOT / "configs" / "dispatch" / f"{dispatch.table_key(d['gpu'])}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    for e in table["shapes"]:
        print(f"{e['label']:22s} {e['m']:6d}x{e['k']:<6d} " + ", ".join(
            f"N <= {r['n_max'] if r['n_max'] < 1 << 30 else 'any'}: {r['path']}" for r in e["rules"]))
    print(f"wrote {out}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="llama3-8b,qwen2.5-7b")
    ap.add_argument("--ns", default="1,2,4,8,16,32,64,128,256")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None, help="default: configs/dispatch/<gpu-name>.json")
    ap.add_argument("--from-bench", default=None, help="a bench_zipgemm.py JSON to build the table from (no GPU)")
    args = ap.parse_args(argv)
    if args.from_bench:
        return from_bench(Path(args.from_bench).resolve(), Path(args.out) if args.out else None)
    torch, cuda_ops = need_cuda("tune_dispatch")
    from zipserv_vllm.kernels import dispatch
    from zipserv_vllm.kernels.gpu_timing import copies_for

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
        copies = copies_for(m * k * 2, l2, factor=4)
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
            add_rule(rules, n, best)
        close_rules(rules)
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
