"""vLLM CPU decode speed: zipserv fast mode, zipserv exact mode and BF16, side by side.

Each variant runs in a fresh subprocess (one real vLLM engine, CPU backend,
in-process engine core, compiled the default way: Inductor; ``--eager`` for
``enforce_eager``). The model is the Llama-shaped ~1.1 B model of
``bench_memory.py`` (hidden 2048, 16 layers, intermediate 8192, vocab 32000,
N(0, 0.02^2) weights), built with the shared tiny-model builder and compressed
once with the checkpoint module; the compressed variants load the
pre-compressed checkpoint (``ZIPSERV_MODE`` selects fast / exact).

Decode is measured separately from prefill: for each batch size the same
prompts are generated greedily (``ignore_eos``) with ``--short`` and ``--long``
new tokens; decode tokens/s = batch * (long - short) / (t_long - t_short),
so the prefill and the first token cancel out. Each (batch, length) is timed
``--reps`` times after one warm-up generation; medians are reported. With
``--rounds R`` every variant's engine is started R times, the variants
alternating, and the medians are taken over all R x reps repetitions (a slow
period of a shared host then hits every variant). With ``--interleave`` all
variants' engines stay loaded at once (one process each) and every repetition
runs each of them in turn, the closest pairing this benchmark offers.

    python benchmarks/bench_vllm_e2e.py                    # 1b, batch 1 and 8
    python benchmarks/bench_vllm_e2e.py --size tiny --reps 2   # quick check

Writes benchmarks/results/bench_vllm_e2e.json and prints a table.
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

sys.path.insert(0, str(Path(__file__).parent))
from bench_memory import SIZES, _prepare  # noqa: E402  (same models, same cache dir)

VARIANTS = {  # name -> (checkpoint, ZIPSERV_MODE)
    "bf16": ("bf16", None),
    "zipserv_fast": ("zs", "fast"),
    "zipserv_exact": ("zs", "exact"),
}
PROMPT_WORDS = "the quick brown fox jumps over the lazy dog while memory bandwidth limits decode".split()


def _summary(b: int, short: int, long: int, ts: list, tl: list, toks) -> dict:
    """Medians and decode tokens/s of one batch size from paired short / long generation times."""
    t_s, t_l = statistics.median(ts), statistics.median(tl)
    return {
        "t_short_s": [round(x, 4) for x in ts], "t_long_s": [round(x, 4) for x in tl],
        "median_short_s": round(t_s, 4), "median_long_s": round(t_l, 4),
        "decode_tok_s": round(b * (long - short) / (t_l - t_s), 3),
        "decode_ms_per_step": round(1000 * (t_l - t_s) / (long - short), 2),
        # the same from each repetition's own (long, short) pair: shows the run-to-run noise
        "decode_tok_s_per_rep": [round(b * (long - short) / (a - c), 3) if a > c else None for a, c in zip(tl, ts)],
        "tokens": toks,
    }


def _engine(model: str, max_seqs: int):
    """One real vLLM engine (in-process engine core) on ``model``, and its start time: compiled the
    default way (Inductor), or eager where the parent was given ``--eager`` (``BENCH_EAGER=1``)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=os.environ.get("BENCH_EAGER") == "1", max_model_len=256, kv_cache_memory_bytes=256 << 20,
              seed=0, disable_log_stats=True, max_num_seqs=max_seqs)
    return llm, round(time.perf_counter() - t0, 2)


def _ran_eager(llm) -> bool:
    """Whether the engine really runs eager (its own configuration, not what was asked)."""
    return bool(llm.llm_engine.vllm_config.model_config.enforce_eager)


def _generate(llm, batch: int, tokens: int) -> tuple[float, list]:
    """Greedy generation of exactly ``tokens`` new tokens for ``batch`` prompts: (seconds, token ids)."""
    from vllm import SamplingParams

    prompts = [" ".join(PROMPT_WORDS[i % 5 : i % 5 + 8]) for i in range(batch)]
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return dt, [list(o.outputs[0].token_ids) for o in outs]


def child(model: str, batches: list[int], short: int, long: int, reps: int, exact_reps: int) -> dict:
    """In the subprocess: start the engine, time generations, report."""
    import torch

    llm, start_s = _engine(model, max(batches))
    if os.environ.get("ZIPSERV_MODE") == "exact":
        reps = exact_reps
    out = {"engine_start_s": start_s, "torch_threads": torch.get_num_threads(),
           "enforce_eager": _ran_eager(llm), "batches": {}}
    for b in batches:
        _generate(llm, b, short)  # warm-up
        ts, tl, toks = [], [], None
        for _ in range(reps):
            ts.append(_generate(llm, b, short)[0])
            dt, toks = _generate(llm, b, long)
            tl.append(dt)
        out["batches"][str(b)] = _summary(b, short, long, ts, tl, toks)
    return out


def serve_child(model: str, max_seqs: int) -> int:
    """--interleave subprocess: start the engine, then answer "gen BATCH TOKENS" lines from stdin."""
    import torch

    llm, start_s = _engine(model, max_seqs)
    print("BENCH_READY " + json.dumps({"engine_start_s": start_s, "torch_threads": torch.get_num_threads(),
                                       "enforce_eager": _ran_eager(llm)}),
          flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] != "gen":
            break
        dt, toks = _generate(llm, int(cmd[1]), int(cmd[2]))
        print("BENCH_GEN " + json.dumps({"dt": dt, "tokens": toks}), flush=True)
    return 0


class _Engine:
    """One --interleave subprocess (its engine stays loaded between requests)."""

    def __init__(self, model: Path, mode: str | None, max_seqs: int, log_path: Path):
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve-child", str(model), "--batches", str(max_seqs)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=_child_env(mode))
        self.info = self._read("BENCH_READY ")

    def _read(self, tag: str) -> dict:
        for line in self.proc.stdout:
            if line.startswith(tag):
                return json.loads(line[len(tag):])
        raise RuntimeError(f"benchmark engine exited (rc {self.proc.wait()}); see {self.log.name}")

    def gen(self, batch: int, tokens: int) -> dict:
        self.proc.stdin.write(f"gen {batch} {tokens}\n")
        self.proc.stdin.flush()
        return self._read("BENCH_GEN ")

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()


def _interleaved(dirs: dict, names: list, batches: list, args) -> dict:
    """All variants' engines loaded at once; every repetition runs each of them in turn."""
    engines = {}
    try:
        for name in names:
            ckpt, mode = VARIANTS[name]
            print(f"starting {name} ...", flush=True)
            engines[name] = _Engine(dirs[ckpt], mode, max(batches), Path(args.workdir) / f"interleave-{name}.log")
        runs = {name: {"engine_start_s": e.info["engine_start_s"], "torch_threads": e.info["torch_threads"],
                       "enforce_eager": e.info["enforce_eager"], "batches": {}} for name, e in engines.items()}
        for b in batches:
            ts = {n: [] for n in names}
            tl = {n: [] for n in names}
            toks = {}
            for e in engines.values():
                e.gen(b, args.short)  # warm-up
            for rep in range(args.reps):
                print(f"  batch {b}: repetition {rep + 1} of {args.reps}", flush=True)
                for name, e in engines.items():
                    if VARIANTS[name][1] == "exact" and rep >= args.exact_reps:
                        continue
                    ts[name].append(e.gen(b, args.short)["dt"])
                    r = e.gen(b, args.long)
                    tl[name].append(r["dt"])
                    toks[name] = r["tokens"]
            for name in names:
                runs[name]["batches"][str(b)] = _summary(b, args.short, args.long, ts[name], tl[name], toks[name])
        return runs
    finally:
        for e in engines.values():
            e.close()


def _child_env(mode: str | None) -> dict:
    """This process's environment with ZIPSERV_MODE set to ``mode`` (removed for None)."""
    env = dict(os.environ)
    env.pop("ZIPSERV_MODE", None)
    if mode:
        env["ZIPSERV_MODE"] = mode
    return env


def _run_child(model: Path, mode: str | None, args) -> dict:
    cmd = [sys.executable, __file__, "--child", str(model), "--batches", args.batches, "--short", str(args.short),
           "--long", str(args.long), "--reps", str(args.reps), "--exact-reps", str(args.exact_reps)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=_child_env(mode))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child for {model} (mode {mode}) failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH_JSON "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1b", choices=sorted(SIZES))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--short", type=int, default=4, help="new tokens of the short generation")
    ap.add_argument("--long", type=int, default=36, help="new tokens of the long generation")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1,
                    help="run the variants' engines this many times each, alternating; medians over all repetitions "
                         "(not used with --interleave)")
    ap.add_argument("--exact-reps", type=int, default=1, help="repetitions for exact mode (it decodes every weight each step)")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--workdir", default="/tmp/zipserv-bench-memory")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_vllm_e2e.json"))
    ap.add_argument("--timeout", type=int, default=2400)
    ap.add_argument("--interleave", action="store_true",
                    help="keep every variant's engine loaded (one process each) and alternate them repetition by "
                         "repetition: the fairest comparison on a noisy host (needs memory for all models at once)")
    ap.add_argument("--eager", action="store_true",
                    help="engines with enforce_eager (default: vLLM's default compilation, Inductor)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--serve-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not (args.child or args.serve_child):  # the child processes read it (their own argv has no --eager)
        os.environ["BENCH_EAGER"] = "1" if args.eager else "0"
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if args.rounds < 1 or args.reps < 1:
        print("error: --rounds and --reps must be >= 1", file=sys.stderr)
        return 2
    if args.long <= args.short:
        print(f"error: --long ({args.long}) must be larger than --short ({args.short})", file=sys.stderr)
        return 2
    if args.serve_child:
        return serve_child(args.serve_child, max(batches))
    if args.child:
        print("BENCH_JSON " + json.dumps(child(args.child, batches, args.short, args.long, args.reps, args.exact_reps)),
              flush=True)
        return 0

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    bf16, zs, info = _prepare(args.size, workdir)
    dirs = {"bf16": bf16, "zs": zs}
    results = {"benchmark": "bench_vllm_e2e", "host": os.uname().nodename, "cpus": os.cpu_count(),
               "model": {"size": args.size, "config": SIZES[args.size], **info},
               "settings": {"batches": batches, "short": args.short, "long": args.long, "reps": args.reps,
                            "exact_reps": args.exact_reps, "rounds": args.rounds, "interleave": args.interleave,
                            "enforce_eager": bool(args.eager), "greedy": True, "ignore_eos": True},
               "runs": {}}
    try:
        import vllm.version as vv

        results["vllm"] = vv.__version__
    except Exception:
        pass
    try:
        load = os.getloadavg()
        results["loadavg_at_start"] = [round(x, 2) for x in load]
    except OSError:
        pass
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    per_round = {name: [] for name in names}
    if args.interleave:
        for name, run in _interleaved(dirs, names, batches, args).items():
            per_round[name].append(run)
    else:
        for rnd in range(args.rounds):  # variants alternate, so slow periods of a shared host hit all of them
            for name in names:
                ckpt, mode = VARIANTS[name]
                print(f"running {name} (round {rnd + 1} of {args.rounds}) ...", flush=True)
                per_round[name].append(_run_child(dirs[ckpt], mode, args))
    for name, runs in per_round.items():
        merged = {"engine_start_s": [r["engine_start_s"] for r in runs], "torch_threads": runs[0]["torch_threads"],
                  "enforce_eager": runs[0]["enforce_eager"], "batches": {}}
        if any(r["enforce_eager"] != bool(args.eager) for r in runs):  # what the engines really ran
            raise SystemExit(f"{name}: an engine ran with enforce_eager != {bool(args.eager)}")
        for b in runs[0]["batches"]:
            ts = [t for r in runs for t in r["batches"][b]["t_short_s"]]
            tl = [t for r in runs for t in r["batches"][b]["t_long_s"]]
            merged["batches"][b] = _summary(int(b), args.short, args.long, ts, tl, runs[-1]["batches"][b]["tokens"])
        results["runs"][name] = merged
    base = results["runs"].get("bf16")
    for name, r in results["runs"].items():
        for b, m in r["batches"].items():
            if base and name != "bf16":
                m["speedup_vs_bf16"] = round(m["decode_tok_s"] / base["batches"][b]["decode_tok_s"], 3)
                m["tokens_equal_bf16"] = m["tokens"] == base["batches"][b]["tokens"]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))

    print(f"{'variant':14} {'batch':>5} {'decode tok/s':>13} {'ms/step':>9} {'vs bf16':>8} {'t_short s':>10} "
          f"{'t_long s':>9} {'tokens=bf16':>11}")
    for name, r in results["runs"].items():
        for b, m in r["batches"].items():
            print(f"{name:14} {b:>5} {m['decode_tok_s']:>13.2f} {m['decode_ms_per_step']:>9.1f} "
                  f"{m.get('speedup_vs_bf16', 1.0):>8.2f} {m['median_short_s']:>10.3f} {m['median_long_s']:>9.3f} "
                  f"{str(m.get('tokens_equal_bf16', '-')):>11}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
