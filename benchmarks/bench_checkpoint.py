"""End-to-end speed of ``zipserv compress / verify / decompress`` against the disk's own speed.

Builds (once, with the tiny-model builder) a Llama-shaped BF16 checkpoint of
about 0.8 GB (hidden 2048, 6 layers, vocab 32000, N(0, 0.02^2)) and, in one
process with its imports done (start-up excluded), times repetition by
repetition:

* ``disk``: a plain safetensors round trip of the same checkpoint:
  ``safetensors.torch.load_file`` + ``save_file`` (every tensor read, every byte
  written once) — what a copy through Python costs on this disk;
* ``compress``: ``compress_checkpoint`` (encode, tile checksums, CRC-32, decode
  and compare bit for bit, write);
* ``verify``: ``verify_checkpoint(..., against=SRC)`` (decode, CRC-32, compare
  every tensor and file with the source);
* ``decompress``: ``decompress_checkpoint`` (decode, CRC-32, write);

and the public codec API on an 8192 x 4096 matrix: ``compress_tensor`` /
``decompress_tensor`` with 1 and 2 threads, medians over calls on distinct
matrices after one warm-up call. Speeds are GB/s of BF16 (the checkpoint's
tensor bytes) per second; medians of --reps; the page cache is warm for every
variant alike. Writes benchmarks/results/bench_checkpoint.json.

Run: .venv/bin/python benchmarks/bench_checkpoint.py [--reps 5] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zipserv_vllm import compress_tensor, decompress_tensor  # noqa: E402
from zipserv_vllm.checkpoint import compress_checkpoint, decompress_checkpoint, verify_checkpoint  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "bench_checkpoint.json"
SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_layers=6, num_heads=16, num_kv_heads=4,
             vocab_size=32000, std=0.02)


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def checkpoint_speeds(src: Path, work: Path, reps: int) -> dict:
    from safetensors.torch import load_file, save_file

    nbytes = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    rows = {k: [] for k in ("disk", "compress", "verify", "decompress")}
    zs, back, copy = work / "zs", work / "back", work / "copy.safetensors"
    for r in range(reps):
        for d in (zs, back):
            shutil.rmtree(d, ignore_errors=True)
        copy.unlink(missing_ok=True)

        def disk():
            for f in sorted(src.glob("*.safetensors")):
                save_file(load_file(str(f)), str(copy), metadata={"format": "pt"})

        rows["disk"].append(_timed(disk))
        rows["compress"].append(_timed(lambda: compress_checkpoint(src, zs, progress=False)))
        rep = None

        def ver():
            nonlocal rep
            rep = verify_checkpoint(zs, src, progress=False)

        rows["verify"].append(_timed(ver))
        assert rep.ok, rep.problems[:3]
        rows["decompress"].append(_timed(lambda: decompress_checkpoint(zs, back, progress=False)))
        print(f"  rep {r + 1}: " + ", ".join(f"{k} {nbytes / v[-1] / 1e9:.2f} GB/s" for k, v in rows.items()),
              flush=True)
    out = {"bf16_bytes": nbytes, "seconds": rows}
    for k, v in rows.items():
        out[f"{k}_gb_per_s_median"] = round(nbytes / statistics.median(v) / 1e9, 3)
    out["compressed_bytes"] = sum(f.stat().st_size for f in zs.glob("*.safetensors"))
    return out


def codec_speeds(reps: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ws = [(torch.randn(8192, 4096, generator=gen) * 0.02).to(torch.bfloat16) for _ in range(3)]
    nbytes = ws[0].numel() * 2
    out = {"shape": [8192, 4096]}
    for threads in (1, 2):
        compress_tensor(ws[0], threads=threads)  # warm-up: the codec's memory pool
        enc, dec = [], []
        for i in range(max(reps, 3) * 2):
            w = ws[i % len(ws)]
            t = time.perf_counter()
            ct = compress_tensor(w, threads=threads)
            enc.append(time.perf_counter() - t)
            t = time.perf_counter()
            decompress_tensor(ct, threads=threads)
            dec.append(time.perf_counter() - t)
            del ct
        e, d = nbytes / statistics.median(enc) / 1e9, nbytes / statistics.median(dec) / 1e9
        out[f"threads_{threads}"] = {"encode_gb_per_s": round(e, 3), "decode_gb_per_s": round(d, 3),
                                     "encode_gb_per_s_per_core": round(e / threads, 3),
                                     "decode_gb_per_s_per_core": round(d / threads, 3)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--workdir", default=None, help="where to build the checkpoint (default: a temporary directory)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    from zipserv_vllm.testing import build_tiny_model

    with tempfile.TemporaryDirectory(prefix="zs-bench-ckpt-") as tmp:
        work = Path(a.workdir or tmp)
        src = work / "bf16"
        if not (src / "model.safetensors").exists():
            print(f"building the {SHAPE} checkpoint in {src}", flush=True)
            build_tiny_model(src, "llama", **SHAPE)
        print("checkpoint commands (GB/s of BF16, warm page cache):", flush=True)
        ck = checkpoint_speeds(src, work, a.reps)
        print("codec API (8192 x 4096):", flush=True)
        co = codec_speeds(a.reps)
    result = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")},
              "checkpoint": ck, "codec": co}
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{'':12}{'GB/s':>8}{'vs disk':>9}")
    disk = ck["disk_gb_per_s_median"]
    for k in ("disk", "compress", "verify", "decompress"):
        v = ck[f"{k}_gb_per_s_median"]
        print(f"{k:12}{v:>8.2f}{v / disk:>8.2f}x")
    for t in (1, 2):
        r = co[f"threads_{t}"]
        print(f"compress_tensor / decompress_tensor, {t} thread(s): {r['encode_gb_per_s_per_core']:.2f} / "
              f"{r['decode_gb_per_s_per_core']:.2f} GB/s per core")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
