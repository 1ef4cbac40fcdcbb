"""Serving throughput: vLLM's own serving benchmark client against a BF16 server and a zipserv server.

Both servers are vLLM's OpenAI-compatible server (``python -m zipserv_vllm.serve``,
CPU backend, the same options, compiled the default way: Inductor, unless
``--eager``), started together on 127.0.0.1 and loaded for the
whole run: one serves the BF16 checkpoint, the other the zipserv checkpoint of the
same model (fast mode unless ``--mode exact``). The client is vLLM's
``vllm.benchmarks.serve`` (random dataset, ``--num-prompts`` prompts of
``--input-len`` tokens, ``--output-len`` new tokens with ``ignore_eos``,
``--concurrency`` requests in flight). Rounds alternate the two servers
(``--rounds``); medians over rounds of output tokens/s, mean TTFT and mean TPOT.

The model is ``bench_memory.py``'s ``--size`` (default ``0.4b``: Llama-shaped,
0.38 B parameters), built offline and compressed once.

    .venv/bin/python benchmarks/bench_serve.py [--size 0.4b] [--rounds 2]

Writes benchmarks/results/bench_serve.json and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from bench_memory import SIZES, _prepare  # noqa: E402  (same models, same cache dir)

METRICS = ("output_throughput", "mean_ttft_ms", "median_ttft_ms", "mean_tpot_ms", "median_tpot_ms")


def run_client(port: int, tokenizer: str, args, seed: int = 0) -> dict:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    cli = parser.parse_args([
        "--backend", "vllm", "--host", "127.0.0.1", "--port", str(port), "--endpoint", "/v1/completions",
        "--model", "m", "--served-model-name", "m", "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--max-concurrency", str(args.concurrency), "--ignore-eos", "--disable-tqdm", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl",
    ])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):  # (the client prints its whole argument namespace and report)
        res = main(cli)
    done = int(res.get("completed", 0))
    if done != args.num_prompts:
        print(out.getvalue(), file=sys.stderr)  # its report says which requests failed and why
        raise SystemExit(f"bench_serve: {args.num_prompts - done} of {args.num_prompts} requests failed on port "
                         f"{port}: the round's numbers would count the others only")
    return {k: float(res[k]) for k in METRICS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="0.4b", choices=sorted(SIZES))
    ap.add_argument("--mode", default="fast", choices=("fast", "exact"))
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--eager", action="store_true",
                    help="start both servers with --enforce-eager (default: vLLM's default compilation, Inductor)")
    ap.add_argument("--workdir", default="/tmp/zipserv-bench-memory")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "bench_serve.json"))
    args = ap.parse_args()

    from zipserv_vllm import serve
    from zipserv_vllm.kernels import cpu_dispatch

    bf16, zs, info = _prepare(args.size, Path(args.workdir))
    server_args = ("--served-model-name", "m", *(("--enforce-eager",) if args.eager else ()),
                   "--no-enable-prefix-caching", "--max-model-len", "256",
                   "--max-num-seqs", str(args.concurrency), "--kv-cache-memory-bytes", str(1 << 30), "--seed", "0")
    logs = Path(args.workdir) / "serve-logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[dict]] = {"bf16": [], "zipserv": []}
    procs, ports = {}, {}
    with contextlib.ExitStack() as stack:
        for name, model in (("bf16", bf16), ("zipserv", zs)):
            ports[name] = serve.free_port()
            f = stack.enter_context(open(logs / f"{name}.log", "w"))
            env = dict(os.environ, ZIPSERV_MODE=args.mode, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
            procs[name] = serve.start_server(model, ports[name], server_args, log=f, env=env)
            stack.callback(serve.stop_server, procs[name])
        t0 = time.perf_counter()
        for name in procs:
            serve.wait_ready(procs[name], ports[name], 600)
        print(f"servers ready in {time.perf_counter() - t0:.0f} s")
        for name in procs:  # warm-up
            run_client(ports[name], str(bf16), argparse.Namespace(**{**vars(args), "num_prompts": args.concurrency}),
                       seed=1000)
        for r in range(args.rounds):
            for name in (("bf16", "zipserv") if r % 2 == 0 else ("zipserv", "bf16")):
                res = run_client(ports[name], str(bf16), args, seed=r)  # other prompts each round (prefix cache)
                results[name].append(res)
                print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in res.items()), flush=True)
    med = {name: {k: statistics.median(r[k] for r in rs) for k in METRICS} for name, rs in results.items()}
    ratio = {
        "output_throughput": med["zipserv"]["output_throughput"] / med["bf16"]["output_throughput"],
        "mean_ttft": med["zipserv"]["mean_ttft_ms"] / med["bf16"]["mean_ttft_ms"],
        "mean_tpot": med["zipserv"]["mean_tpot_ms"] / med["bf16"]["mean_tpot_ms"],
    }
    print(f"{'':10} {'out tok/s':>10} {'TTFT ms':>9} {'TPOT ms':>9}")
    for name in ("bf16", "zipserv"):
        m = med[name]
        print(f"{name:10} {m['output_throughput']:10.1f} {m['mean_ttft_ms']:9.0f} {m['mean_tpot_ms']:9.1f}")
    print(f"zipserv / bf16: output tokens/s {ratio['output_throughput']:.2f}x, TTFT {ratio['mean_ttft']:.2f}x, "
          f"TPOT {ratio['mean_tpot']:.2f}x")
    out = dict(benchmark="bench_serve", host=cpu_dispatch.cpu_identity(), size=args.size, mode=args.mode,
               compilation="eager (--enforce-eager)" if args.eager else "vLLM default (Inductor)",
               settings={k: getattr(args, k) for k in ("num_prompts", "concurrency", "input_len", "output_len", "rounds")},
               server_args=list(server_args), model=info, rounds=results, medians=med, ratios=ratio)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
