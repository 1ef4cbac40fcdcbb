"""Which CPU kernel serves one fast-mode GEMM from the byte-split layout, chosen by measurement.

Candidates (all read the weight compressed, never a decoded copy):

* ``"fused"``: the fp32 fused decode-GEMM (csrc/cpu_gemm/simd_common.inc), every
  ISA, bit-identical across ISAs and thread counts; best at one or two tokens,
  where it is bound by the weight stream;
* ``"panel"``: the AVX512-BF16 panel kernel (csrc/cpu_gemm/kernel_avx512bf16.cpp):
  a tile row decoded once per call into a per-thread BF16 buffer, multiplied
  by ``vdpbf16ps`` register blocks; only on CPUs with AVX512-BF16.

The baseline ``"bf16"`` is the GEMM the user would otherwise run on a BF16
weight. Kernels import no vLLM, so the plugin injects vLLM's own CPU kernel
(``dispatch_cpu_unquantized_gemm``; vllm_plugin/gemm.py); the default is
``F.linear``.

At engine start the plugin times every (shape, N bucket) of its compressed
layers (:data:`BUCKETS`; kernels/autotune.py does the bookkeeping within a
time budget), installs the fastest candidate per bucket with
:func:`set_measured`, logs one line per shape with the measured ratios against
the baseline, and caches the timings on disk keyed by the CPU (model name,
ISA flags), the thread count, the package version, the kernels' build and the baseline's versions
(:func:`cache_file`).
``prefer: speed`` keeps a layer BF16 where no candidate reaches the baseline
(config.speed_reason). Where nothing was measured, :func:`default_kernel`
decides: ``panel`` on CPUs with AVX512-BF16 (faster than ``fused`` at every
N since its 8-tile chunks, measured on Zen 4, docs/CPU.md), else ``fused``.

An N between buckets takes the next bucket up's choice; above the last
bucket, the last one's; above a shape's last measured bucket when the
measurement stopped early, :func:`default_kernel`. No torch import at module level.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger("zipserv_vllm")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
KERNELS = ("fused", "panel")
PANEL_MIN_N = 1  # default_kernel's crossover: panel at every N (docs/CPU.md, measured on Zen 4 at 2 threads)
_ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vbmi2", "avx512_vpopcntdq",
              "avx512_bf16", "amx_bf16", "amx_tile")

_MEASURED: dict[tuple[int, int], list[tuple[int, str]]] = {}  # (m, k) -> [(bucket, kernel)] ascending
_ON_CHANGE: list[Callable[[], None]] = []  # called when the measured choices change (kernels/cpu.py's C++ op)


def on_change(fn: Callable[[], None]) -> None:
    """Call ``fn()`` whenever :func:`set_measured` or :func:`clear_measured` changes the choices."""
    _ON_CHANGE.append(fn)


def _changed() -> None:
    for fn in _ON_CHANGE:
        fn()


_BF16: bool | None = None


def bf16_supported() -> bool:
    global _BF16
    if _BF16 is None:
        from . import cpu

        _BF16 = cpu.bf16_supported()
    return _BF16


def candidates(n: int, m: int, k: int) -> list[str]:
    """The kernels worth timing for one call on this CPU."""
    return ["fused", "panel"] if bf16_supported() else ["fused"]


def bucket(n: int) -> int:
    for b in BUCKETS:
        if n <= b:
            return b
    return BUCKETS[-1]


def default_kernel(n: int) -> str:
    return "panel" if n >= PANEL_MIN_N and bf16_supported() else "fused"


def clear_measured() -> None:
    _MEASURED.clear()
    _changed()


def set_measured(times: dict[tuple[int, int], dict[int, dict[str, float]]]) -> None:
    """Install the fastest kernel per measured (shape, bucket) (``Tuning.times``), replacing what an
    earlier call said of these shapes (other shapes keep theirs: engines in one process share it).
    Only this CPU's candidates count (a cached file of another build may name others)."""
    for (m, k), by_n in times.items():
        rows = []
        for n in sorted(by_n):
            t = {c: s for c, s in by_n[n].items() if c in KERNELS and c in candidates(n, m, k)}
            if t:
                rows.append((n, min(t, key=lambda c: (t[c], c))))
        if rows:
            _MEASURED[(m, k)] = rows
        else:
            _MEASURED.pop((m, k), None)
    _changed()


def measured() -> dict[tuple[int, int], list[tuple[int, str]]]:
    return {k: list(v) for k, v in _MEASURED.items()}


def choose(n: int, m: int, k: int) -> str:
    """The kernel for Y[n, m] = X[n, k] . W[m, k]^T: measured where it was, else :func:`default_kernel`."""
    rows = _MEASURED.get((m, k))
    if rows:
        for b, kern in rows:
            if n <= b:
                return kern
        if rows[-1][0] >= BUCKETS[-1]:  # past the last bucket: its choice; past a partial measurement: the default
            return rows[-1][1]
    return default_kernel(n)


# The token counts each bucket's choice serves in the C++ op kernel: (b_prev, b], the last one on to any N.
_BUCKET_SPANS = tuple(zip((1,) + tuple(b + 1 for b in BUCKETS[:-1]), BUCKETS[:-1] + (1 << 62,)))


def bucket_choices(m: int, k: int) -> list[str] | None:
    """:func:`choose` per bucket of :data:`BUCKETS` for an m x k weight, or None where some token
    count would get another kernel than its bucket's: the C++ op kernel (kernels/cpu.py) keeps one
    choice per bucket. ``choose`` steps only at measured N (so every measured N must be a bucket)
    and where :func:`default_kernel` steps (a threshold on N: equal at both ends of each span)."""
    if any(n not in BUCKETS for n, _ in _MEASURED.get((m, k), ())) or \
            any(default_kernel(lo) != default_kernel(hi) for lo, hi in _BUCKET_SPANS):
        return None
    return [choose(b, m, k) for b in BUCKETS]


def ratios_line(m: int, k: int, by_n: dict[int, dict[str, float]]) -> str:
    """One log line: per bucket, the chosen kernel and its speed against the baseline."""
    parts = []
    for n in sorted(by_n):
        t = {c: s for c, s in by_n[n].items() if c in KERNELS}
        if not t:
            continue
        best = min(t, key=lambda c: (t[c], c))
        bf = by_n[n].get("bf16")
        parts.append(f"N={n} {best} {bf / t[best]:.2f}x" if bf else f"N={n} {best}")
    return f"zipserv: CPU GEMM {m}x{k} vs BF16: " + ", ".join(parts)


# ------------------------------------------------------------------ timings
def cpu_time_fn(bf16_factory: Callable | None = None, reps: int = 5, threads: int | None = None):
    """Real timings: random N(0, 0.02^2) weights of each shape, packed; the fastest of ``reps`` calls
    (the minimum: what a candidate can do, least disturbed by other work on a shared host).

    ``bf16_factory(w) -> f(x)`` builds the baseline GEMM for a BF16 weight (default ``F.linear``)."""
    import torch
    import torch.nn.functional as F

    from . import cpu

    weights: dict = {}

    def fn(key, n, m, k):
        if (m, k) not in weights:
            g = torch.Generator().manual_seed(m * 7919 + k)
            w = (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16)
            base = bf16_factory(w) if bf16_factory is not None else (lambda x, w=w: F.linear(x, w))
            weights[(m, k)] = (cpu.pack(w, threads=threads), base)
        pt, base = weights[(m, k)]
        x = torch.randn(n, k, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        if key == "bf16":
            call = lambda: base(x)  # noqa: E731
        else:
            call = lambda: cpu.packed_linear(x, pt, kernel=key, threads=threads)  # noqa: E731
        call()
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
        return min(out)

    fn.release = weights.clear  # the Tuner drops the random weights once it has measured
    return fn


# -------------------------------------------------------------------- cache
def cpu_identity() -> str:
    """Model name, the ISA flags that matter here, and the machine (no flags: \"unknown\")."""
    import platform

    name, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and ":" in line:
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    have = [f for f in _ISA_FLAGS if f in flags]
    return f"{name} [{' '.join(have) or 'unknown'}]"


_BUILD_ID: list[str] = []


def kernels_build_id() -> str:
    """The first 16 hex digits of the SHA-256 of the built CPU kernel extension (``"none"`` where it is
    not built): timings measured with one build of the kernels say nothing of another, and a
    development tree's kernels change without the package version. Computed once per process."""
    if not _BUILD_ID:
        import importlib.util

        spec = importlib.util.find_spec("zipserv_vllm._cpu_gemm")
        try:
            with open(spec.origin, "rb") as fh:  # type: ignore[union-attr, arg-type]
                _BUILD_ID.append(hashlib.sha256(fh.read()).hexdigest()[:16])
        except (AttributeError, TypeError, OSError):
            _BUILD_ID.append("none")
    return _BUILD_ID[0]


def cache_file(threads: int, version: str, baseline: str = "") -> Path:
    """``baseline``: what the BF16 timings depend on besides the CPU (the plugin passes the vLLM and
    torch versions). The key also holds the kernels' build (:func:`kernels_build_id`)."""
    from ..cache import cache_dir

    ident = f"{cpu_identity()} threads={threads} zipserv={version} kernels={kernels_build_id()} {baseline}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return cache_dir() / "dispatch" / f"cpu-{digest}.json"

