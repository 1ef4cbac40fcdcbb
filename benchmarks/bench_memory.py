"""Resident weight memory inside vLLM: zipserv (pre-compressed, pack at load) vs BF16.

MEASURED, not computed: every variant is loaded by a real vLLM engine (CPU
backend, in-process, eager) in a fresh subprocess, which then reports

* ``weight_bytes``: the bytes of every distinct parameter/buffer storage of the
  loaded model plus every zipserv arena page (``zipserv_vllm.vllm_plugin.memory.
  weight_memory`` through ``LLM.apply_model``);
* ``rss_after_load`` / ``peak_rss``: the process's VmRSS after the engine is up,
  and VmHWM (peak) over the whole run, from /proc/self/status;
* the greedy tokens of a short batch, so the variants can be checked to agree
  (exact mode).

Models: the tests' tiny Llama, and a Llama-shaped model of about 1.1 B
parameters (hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192,
vocab 32000, untied) with N(0, 0.02^2) weights, built with the shared tiny-model
builder and compressed once with ``zipserv compress`` (the checkpoint module);
``moe1b``, a Mixtral-style mixture of experts of about 1.0 B parameters
(8 layers x 8 experts, hidden 1536, expert intermediate 3072, top-2), whose
routed experts are compressed at load (vllm_plugin/moe.py). Not run by default.

    python benchmarks/bench_memory.py                  # tiny + 1b
    python benchmarks/bench_memory.py --sizes tiny     # quick

Writes benchmarks/results/bench_memory.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

SIZES = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_layers=2, num_heads=4, num_kv_heads=2,
                 vocab_size=2048, std=0.08),
    # Llama-shaped, ~0.38 B parameters (issue 20's serving / decode targets)
    "0.4b": dict(hidden_size=1024, intermediate_size=4096, num_layers=20, num_heads=16, num_kv_heads=8,
                 vocab_size=32000, std=0.02, max_position_embeddings=512),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8,
               vocab_size=32000, std=0.02, max_position_embeddings=512),
    # A Mixtral-style mixture of experts of about 1.0 B parameters (0.91 B in the routed experts: 8 layers x
    # 8 experts x 3 x 1536 x 3072), built by the zoo's MoE builder (its 512-token vocabulary).
    "moe1b": dict(zoo="mixtral", std=0.02, config=dict(hidden_size=1536, intermediate_size=3072, num_hidden_layers=8,
                                                      num_local_experts=8, num_experts_per_tok=2, num_attention_heads=12,
                                                      num_key_value_heads=4, head_dim=128)),
    # Qwen3-MoE-shaped, ~0.39 B parameters (issue 20's MoE target: 16 experts, top-4; 0.35 B in the routed
    # experts: 14 layers x 16 experts x 3 x 1024 x 512), the zoo's MoE builder (its 512-token vocabulary).
    "qwen3moe0.4b": dict(zoo="qwen3-moe", std=0.02, config=dict(hidden_size=1024, moe_intermediate_size=512,
                                                                intermediate_size=2048, num_hidden_layers=14,
                                                                num_experts=16, num_experts_per_tok=4,
                                                                num_attention_heads=16, num_key_value_heads=8,
                                                                head_dim=64)),
}
VARIANTS = ("bf16", "precompressed", "pack_at_load", "precompressed_fast", "pack_at_load_fast")
PROMPTS = ["hello world", "The quick brown fox", "def forward(self, x):", "memory bandwidth is the"]


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return -1


class _AnonPeak:
    """Samples RssAnon every 20 ms: the peak of anonymous (non file-backed) memory.

    VmHWM also counts the checkpoint's memory-mapped file pages, which stay
    mapped (and in RSS) while vLLM holds views of them during loading, although
    they are reclaimable page cache, not allocations."""

    def __init__(self):
        import threading

        self.peak, self._stop = 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _status("RssAnon"))
            self._stop.wait(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        return max(self.peak, _status("RssAnon"))


def child(model: str, quantization: str | None) -> dict:
    """Runs in the subprocess: load, measure, generate, report."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("ZIPSERV_MODE", "exact")
    from vllm import LLM, SamplingParams

    from zipserv_vllm.vllm_plugin.memory import weight_memory

    rss_before, anon_before = _status("VmRSS"), _status("RssAnon")
    sampler = _AnonPeak()
    t0 = time.perf_counter()
    kw = {"quantization": quantization} if quantization else {}
    llm = LLM(model=model, dtype="bfloat16", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=32 << 20,
              seed=0, disable_log_stats=True, **kw)
    load_s = time.perf_counter() - t0
    mem = llm.apply_model(weight_memory)[0]
    rss_after, anon_after, file_after = _status("VmRSS"), _status("RssAnon"), _status("RssFile")
    anon_peak_load = sampler.stop()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    return {
        "weight_bytes": mem["total_bytes"], "param_and_buffer_bytes": mem["param_and_buffer_bytes"],
        "prepacked_bytes": mem["prepacked_bytes"],
        "arena_bytes": mem["arena_bytes"], "arena_pages": mem["arena_pages"],
        "layers_compressed": mem["layers_compressed"], "load_paths": mem["load_paths"], "layouts": mem["layouts"],
        "compressed_bf16_bytes": mem["compressed_bf16_bytes"],
        "rss_before_engine": rss_before, "rss_after_load": rss_after, "peak_rss": _status("VmHWM"),
        "rss_anon_before_engine": anon_before, "rss_anon_after_load": anon_after, "rss_file_after_load": file_after,
        "peak_rss_anon_during_load": anon_peak_load,
        "engine_start_s": round(load_s, 2),
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
    }


def _prepare(size: str, workdir: Path) -> tuple[Path, Path, dict]:
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.tiny_model import build_tiny_model

    bf16, zs = workdir / f"{size}-bf16", workdir / f"{size}-zs"
    info = {}
    if not (bf16 / "config.json").exists():
        t = time.perf_counter()
        spec = dict(SIZES[size])
        if "zoo" in spec:
            from zipserv_vllm.testing.zoo import build_zoo_model

            build_zoo_model(bf16, spec.pop("zoo"), **spec)
        else:
            build_tiny_model(bf16, "llama", **spec)
        info["build_s"] = round(time.perf_counter() - t, 1)
    # compressed again on every run: a cached copy may come from an older compressor (whose rules,
    # e.g. which MoE experts are stored compressed, have changed since)
    t = time.perf_counter()
    compress_checkpoint(bf16, zs, progress=False, overwrite=True)
    info["compress_s"] = round(time.perf_counter() - t, 1)
    info["checkpoint_bytes"] = {"bf16": sum(f.stat().st_size for f in bf16.glob("*.safetensors")),
                                "zipserv": sum(f.stat().st_size for f in zs.glob("*.safetensors"))}
    return bf16, zs, info


def _run_child(model: Path, quantization: str | None, timeout: int, mode: str = "exact") -> dict:
    cmd = [sys.executable, __file__, "--child", str(model)] + (["--quantization", quantization] if quantization else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, "ZIPSERV_MODE": mode})
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_JSON ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child for {model} failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("BENCH_JSON "):])


def _mib(n: int) -> str:
    return f"{n / 2**20:,.1f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,1b")
    ap.add_argument("--workdir", default="/tmp/zipserv-bench-memory")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "bench_memory.json"))
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--quantization", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("BENCH_JSON " + json.dumps(child(args.child, args.quantization)), flush=True)
        return 0

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {"benchmark": "bench_memory", "host": os.uname().nodename, "cpus": os.cpu_count(),
               "mode": "exact (the *_fast variants: fast, i.e. the CPU byte-split layout)", "models": {}}
    try:
        import vllm.version as vv

        results["vllm"] = vv.__version__
    except Exception:
        pass
    for size in [s.strip() for s in args.sizes.split(",") if s.strip()]:
        bf16, zs, info = _prepare(size, workdir)
        runs = {
            "bf16": _run_child(bf16, None, args.timeout),
            "precompressed": _run_child(zs, None, args.timeout),
            "pack_at_load": _run_child(bf16, "zipserv", args.timeout),
            # CPU fast mode: the layers are held in the byte-split layout (docs/FORMAT.md appendix A)
            "precompressed_fast": _run_child(zs, None, args.timeout, mode="fast"),
            "pack_at_load_fast": _run_child(bf16, "zipserv", args.timeout, mode="fast"),
        }
        base = runs["bf16"]
        for name in VARIANTS[1:]:
            r = runs[name]
            r["weight_ratio_vs_bf16"] = round(base["weight_bytes"] / r["weight_bytes"], 4)
            r["weight_bytes_saved"] = base["weight_bytes"] - r["weight_bytes"]
            r["rss_after_load_saved"] = base["rss_after_load"] - r["rss_after_load"]
            r["rss_anon_after_load_saved"] = base["rss_anon_after_load"] - r["rss_anon_after_load"]
            r["tokens_equal_bf16"] = r["tokens"] == base["tokens"]
        # BF16 storage / 2 bytes (buffers and weights prepacked by vLLM's CPU GEMM included)
        n_params = (base["param_and_buffer_bytes"] + base["prepacked_bytes"]) // 2
        results["models"][size] = {"config": SIZES[size], "approx_params": n_params, **info, "runs": runs}

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # sizes measured by an earlier run and not by this one stay in the file, each with its own date
    for m in results["models"].values():
        m["measured"] = time.strftime("%Y-%m-%d")
    if out.exists():
        try:
            earlier = json.loads(out.read_text()).get("models", {})
        except ValueError:
            earlier = {}
        results["models"] = {**{k: v for k, v in earlier.items() if k not in results["models"]}, **results["models"]}
    out.write_text(json.dumps(results, indent=2))

    print(f"{'model':6} {'variant':18} {'weights MiB':>12} {'ratio':>7} {'arena MiB':>10} {'anon RSS MiB':>13} "
          f"{'peak anon MiB':>14} {'peak RSS MiB':>13} {'start s':>8} {'tokens=':>7}")
    for size, m in results["models"].items():
        for name in VARIANTS:
            r = m["runs"][name]
            print(f"{size:6} {name:18} {_mib(r['weight_bytes']):>12} {r.get('weight_ratio_vs_bf16', 1.0):>7.3f} "
                  f"{_mib(r['arena_bytes']):>10} {_mib(r['rss_anon_after_load']):>13} "
                  f"{_mib(r['peak_rss_anon_during_load']):>14} {_mib(r['peak_rss']):>13} "
                  f"{r['engine_start_s']:>8} {str(r.get('tokens_equal_bf16', '-')):>7}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
