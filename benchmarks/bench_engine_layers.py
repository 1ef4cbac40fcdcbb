"""Each linear layer's time inside a real vLLM engine: BF16 (vLLM's own layers) vs zipserv fast mode.

Kernel benchmarks (bench_cpu_vs_vllm.py) time one GEMM at a time with the
caches flushed by a 64 MiB read between calls. Inside an engine the same
GEMMs run between the model's other ops, and vLLM's BF16 kernel turned out
to run there up to 2x faster than in that benchmark, ours less so: at 8
tokens the kernel benchmark's ratios overstate what a decode step gains.
This benchmark measures where it matters: every linear layer's
``quant_method.apply`` (vLLM's ``UnquantizedLinearMethod`` /
``UnquantizedEmbeddingMethod`` for the lm_head, or zipserv's methods) is
wrapped with a timer, and so is each MoE layer's (vLLM's
``UnquantizedFusedMoEMethod`` or zipserv's), inside one real engine per variant (CPU backend,
in-process engine core, eager), while greedy generations of ``--tokens`` new
tokens run at each batch size. Calls are grouped by (output width, input
width, tokens), MoE layers as "moe HxH"; decode calls are those with as many
tokens as the batch.

Variants run in turn in fresh subprocesses, ``--rounds`` times alternating;
per (shape, tokens) the median call time over all rounds is reported with
the ratio BF16 / zipserv (> 1: zipserv faster), and per batch size the sum
over one decode step's timed calls and the whole step's time. Same model
and cache directory as bench_vllm_e2e.py.

    .venv/bin/python benchmarks/bench_engine_layers.py [--size 0.4b] [--batches 1,8] [--rounds 2]

Writes benchmarks/results/bench_engine_layers.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_memory import SIZES, _prepare  # noqa: E402
from bench_vllm_e2e import PROMPT_WORDS, _child_env  # noqa: E402

VARIANTS = {"bf16": ("bf16", None), "zipserv_fast": ("zs", "fast")}


def child(model: str, batches: list[int], tokens: int, reps: int) -> dict:
    """In the subprocess: one engine, every linear apply timed, generations at each batch size."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from zipserv_vllm.vllm_plugin import methods, moe

    calls: dict[tuple, list[float]] = {}
    depth = [0]  # (zipserv's methods hand layers they keep BF16 to vLLM's: count such a call once)

    def wrap(cls, label: str = "") -> None:
        orig = cls.apply

        def apply(self, layer, x, *rest, **kw):
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                y = orig(self, layer, x, *rest, **kw)
            finally:
                depth[0] -= 1
            if depth[0] == 0:
                calls.setdefault((f"{label}{y.shape[-1]}x{x.shape[-1]}", x.numel() // x.shape[-1]), []).append(
                    time.perf_counter() - t0)
            return y

        cls.apply = apply

    for cls in (UnquantizedLinearMethod, UnquantizedEmbeddingMethod, methods.ZipServLinearMethod,
                methods.ZipServEmbeddingMethod):
        wrap(cls)
    wrap(UnquantizedFusedMoEMethod, "moe ")  # a MoE layer's routed experts (models with experts)
    wrap(moe.ZipServMoEMethod, "moe ")
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=256, kv_cache_memory_bytes=256 << 20,
              seed=0, disable_log_stats=True, max_num_seqs=max(batches))
    out = {"torch_threads": torch.get_num_threads(), "batches": {}}
    for b in batches:
        prompts = [" ".join(PROMPT_WORDS[i % 5: i % 5 + 8]) for i in range(b)]
        sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        llm.generate(prompts, sp, use_tqdm=False)  # warm-up
        calls.clear()
        walls = []
        for _ in range(reps):
            t0 = time.perf_counter()
            llm.generate(prompts, sp, use_tqdm=False)
            walls.append(time.perf_counter() - t0)
        decode = {k: v for k, v in calls.items() if k[1] == b}
        steps = reps * (tokens - 1)  # the first token comes from the prefill
        out["batches"][str(b)] = {
            "median_us": {s: round(statistics.median(v) * 1e6, 1) for (s, n), v in decode.items()},
            "calls_per_step": {s: len(v) / steps for (s, n), v in decode.items()},
            "layers_ms_per_step": round(sum(sum(v) for v in decode.values()) / steps * 1e3, 3),
            "generate_s": [round(w, 4) for w in walls],
        }
    return out


def _run(model: Path, mode: str | None, args) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), "--batches", args.batches, "--tokens", str(args.tokens),
           "--reps", str(args.reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_child_env(mode))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"child for {model.name} (mode {mode}) failed with exit code {proc.returncode}")
    return json.loads(lines[-1][len("BENCH_JSON "):])


def _isa() -> str:
    from zipserv_vllm.kernels.cpu_dispatch import cpu_identity

    return cpu_identity()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="0.4b", choices=sorted(SIZES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=24, help="new tokens per generation")
    ap.add_argument("--reps", type=int, default=3, help="generations per batch size and engine")
    ap.add_argument("--rounds", type=int, default=2, help="engines started per variant, alternating")
    ap.add_argument("--workdir", default="/tmp/zipserv-bench-memory")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_engine_layers.json"))
    ap.add_argument("--timeout", type=int, default=1200)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        print("BENCH_JSON " + json.dumps(child(args.child, batches, args.tokens, args.reps)), flush=True)
        return 0
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bf16, zs, info = _prepare(args.size, workdir)
    models = {"bf16": bf16, "zs": zs}
    runs: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for _ in range(args.rounds):
        for name, (ckpt, mode) in VARIANTS.items():
            runs[name].append(_run(models[ckpt], mode, args))
    result = {"benchmark": "bench_engine_layers", "cpu": _isa(), "host": platform.node(), "cpus": os.cpu_count(),
              "model": {"size": args.size, "config": SIZES[args.size], **info},
              "settings": {"batches": batches, "tokens": args.tokens, "reps": args.reps, "rounds": args.rounds,
                           "enforce_eager": True, "torch_threads": runs["bf16"][0]["torch_threads"]},
              "batches": {}}
    print(f"host: {result['cpu']}, {result['settings']['torch_threads']} torch threads")
    for b in batches:
        per = {}
        for name in VARIANTS:
            shapes = runs[name][0]["batches"][str(b)]["median_us"]
            per[name] = {
                "median_us": {s: statistics.median(r["batches"][str(b)]["median_us"][s] for r in runs[name])
                              for s in shapes},
                "calls_per_step": runs[name][0]["batches"][str(b)]["calls_per_step"],
                "layers_ms_per_step": statistics.median(r["batches"][str(b)]["layers_ms_per_step"]
                                                        for r in runs[name]),
                "step_ms": statistics.median(1e3 * g / (args.tokens - 1) for r in runs[name]
                                             for g in r["batches"][str(b)]["generate_s"]),
            }
        bf, zp = per["bf16"], per["zipserv_fast"]
        ratios = {s: round(bf["median_us"][s] / zp["median_us"][s], 3) for s in bf["median_us"] if s in zp["median_us"]}
        result["batches"][str(b)] = {**per, "ratio_bf16_over_zipserv": ratios,
                                     "layers_ratio": round(bf["layers_ms_per_step"] / zp["layers_ms_per_step"], 3),
                                     "step_ratio": round(bf["step_ms"] / zp["step_ms"], 3)}
        print(f"batch {b}:")
        for s, r in sorted(ratios.items(), key=lambda kv: -bf["median_us"][kv[0]]):
            print(f"  {s:>14}  x{bf['calls_per_step'][s]:4.0f}/step  BF16 {bf['median_us'][s]:8.1f} us  "
                  f"zipserv {zp['median_us'][s]:8.1f} us  {r:.2f}x")
        print(f"  timed layers (linear, MoE) per decode step: BF16 {bf['layers_ms_per_step']:.2f} ms, zipserv "
              f"{zp['layers_ms_per_step']:.2f} ms ({result['batches'][str(b)]['layers_ratio']:.2f}x); "
              f"whole generation per token: BF16 {bf['step_ms']:.2f} ms, zipserv {zp['step_ms']:.2f} ms "
              f"({result['batches'][str(b)]['step_ratio']:.2f}x)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
