"""The dispatcher that measures: time each layer shape's candidate plans on this GPU.

At engine start on a GPU, after the weights are loaded and before vLLM
captures its CUDA graphs, the plugin calls :func:`tune` for every distinct
compressed matrix shape (M, K) and token-count bucket N (powers of two up to
the scheduler's token budget): each candidate of ``dispatch.candidates``
(the fused kernel with each sensible split-K, the decoupled path) and the
same GEMM on a BF16 weight are timed, within a budget of about 10 s in all
(what is not reached keeps the cost model's plan). The fastest plan per
bucket becomes a measured rule (``dispatch.set_measured``), and the whole
result is cached on disk, keyed by GPU name, driver and zipserv-vllm
version, so the next start only reads it.

Policy (``"prefer"`` in ``quantization_config`` or ``ZIPSERV_PREFER``):

* ``memory`` (default): every layer stays compressed, on its fastest plan;
* ``speed``: a layer none of whose compressed plans reaches BF16 speed at the
  token counts that matter (buckets up to the scheduler's batch size) is
  decoded once and kept BF16, so the model is never slower than BF16; one log
  line per layer gives the measured ratio.

The timing function is injected (``time_fn(plan | "bf16", n, m, k) ->
seconds``), so all of this is tested on the CPU with made-up timings; on a
GPU :func:`cuda_time_fn` times real kernels as serving runs them (CUDA-graph replays, weights past the L2).
``ZIPSERV_AUTOTUNE_TIMINGS=FILE`` injects timings from a JSON file (tests),
``ZIPSERV_AUTOTUNE=0`` switches the measuring off. Imports no vLLM.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from . import dispatch
from .dispatch import Plan

from ..settings import PREFER  # one definition
BUDGET_S = 10.0


def prefer_policy(checkpoint_value: str | None = None) -> str:
    """``ZIPSERV_PREFER`` if set, else the checkpoint's ``prefer``, else ``memory``."""
    from ..settings import choice

    return choice("ZIPSERV_PREFER", PREFER, checkpoint_value, "quantization_config.prefer")


def buckets(max_n: int) -> list[int]:
    """Token-count buckets 1, 2, 4, ... up to (and including) ``max_n``."""
    out, n = [], 1
    while n < max_n:
        out.append(n)
        n *= 2
    return out + [max(1, max_n)]


def plan_key(plan: Plan | str) -> str:
    if isinstance(plan, str):  # the CPU dispatcher's candidates are named by strings (kernels/cpu_dispatch.py)
        return plan
    return plan.path if plan.path in dispatch.DECOUPLED_PATHS else f"{plan.path}/split{plan.split}"


def plan_from_key(key: str, n: int) -> Plan:
    if key in dispatch.DECOUPLED_PATHS:
        return Plan(key)
    path, split = key.split("/split", 1)
    return Plan(path, dispatch.tile_n_of(path, n), int(split))


@dataclass
class Tuning:
    """Seconds per (M, K), N and plan key ("bf16": the same GEMM on a BF16 weight)."""

    times: dict[tuple[int, int], dict[int, dict[str, float]]] = field(default_factory=dict)
    complete: bool = True  # False when the budget ran out

    def best(self, m: int, k: int, n: int) -> tuple[str, float] | None:
        t = {p: s for p, s in self.times.get((m, k), {}).get(n, {}).items() if p != "bf16"}
        return min(t.items(), key=lambda kv: kv[1]) if t else None

    def ratio(self, m: int, k: int, n: int) -> float | None:
        """Best compressed time / BF16 time (< 1: compressed is faster)."""
        b = self.best(m, k, n)
        bf = self.times.get((m, k), {}).get(n, {}).get("bf16")
        return None if b is None or not bf else b[1] / bf

    def rules(self) -> dict[tuple[int, int], list[tuple[int, Plan]]]:
        """Measured rules for ``dispatch.set_measured``: each bucket covers N up to itself, and the
        last one every larger N, unless it is the byte-split kernel ("packed"), whose cost grows
        with N (a weight pass per 16 columns): past its largest measured N the cost model decides
        (where a cut budget left the large buckets unmeasured, prefill must not inherit a decode plan)."""
        out = {}
        for (m, k), by_n in self.times.items():
            rows = []
            for n in sorted(by_n):
                b = self.best(m, k, n)
                if b is not None:
                    rows.append((n, plan_from_key(b[0], n)))
            if rows:
                if rows[-1][1].path != "packed":
                    rows[-1] = (1 << 30, rows[-1][1])
                out[(m, k)] = rows
        return out

    def to_json(self) -> dict:
        return {"complete": self.complete,
                "times": {f"{m}x{k}": {str(n): t for n, t in by_n.items()} for (m, k), by_n in self.times.items()}}

    @classmethod
    def from_json(cls, d: dict) -> "Tuning":
        times = {}
        for key, by_n in d.get("times", {}).items():
            m, k = (int(x) for x in key.split("x"))
            times[(m, k)] = {int(n): {p: float(s) for p, s in t.items()} for n, t in by_n.items()}
        return cls(times, bool(d.get("complete", True)))


def tune(shapes: Iterable[tuple[int, int]], max_n: int, time_fn: Callable[[Plan | str, int, int, int], float],
         budget_s: float = BUDGET_S, clock: Callable[[], float] = time.perf_counter,
         candidates: Callable[[int, int, int], list] | None = None, ns: Iterable[int] | None = None) -> Tuning:
    """Time every candidate of every (shape, bucket), smallest N first, until the budget is spent.

    ``candidates(n, m, k)`` (default: the GPU's ``dispatch.candidates``) and the token counts ``ns``
    (default: ``buckets(max_n)``) let the CPU dispatcher use the same machinery."""
    candidates = candidates or dispatch.candidates
    res = Tuning()
    start = clock()
    for n in (buckets(max_n) if ns is None else sorted(ns)):  # small N first: the decode sizes matter most
        for m, k in sorted(set(shapes)):
            if clock() - start > budget_s:
                res.complete = False
                return res
            row = res.times.setdefault((m, k), {}).setdefault(n, {})
            row["bf16"] = float(time_fn("bf16", n, m, k))
            for plan in candidates(n, m, k):
                row[plan_key(plan)] = float(time_fn(plan, n, m, k))
    return res


def slower_than_bf16(tuning: Tuning, m: int, k: int, n_max: int, tolerance: float = 0.0) -> tuple[float, int] | None:
    """(worst ratio, its N) when no compressed plan reaches BF16 speed at some measured N <= n_max."""
    worst = None
    for n in sorted(tuning.times.get((m, k), {})):
        if n > n_max:
            break
        r = tuning.ratio(m, k, n)
        if r is not None and r > 1.0 + tolerance and (worst is None or r > worst[0]):
            worst = (r, n)
    return worst


# ------------------------------------------------------------------- timings
def injected_time_fn(path: str | os.PathLike) -> Callable[[Plan | str, int, int, int], float]:
    """Timings from a JSON file: {"MxK": {"N": {"bf16": s, "fused/split2": s, "decoupled": s, ...}}},
    where "*" stands for any shape, N or plan; anything the file does not give takes the cost
    model's estimate."""
    data = json.loads(Path(path).read_text())
    gpu = dispatch.gpu_model()

    def fn(plan, n, m, k):
        key = plan if isinstance(plan, str) else plan_key(plan)
        for shape in (f"{m}x{k}", "*"):
            for nk in (str(n), "*"):
                row = data.get(shape, {}).get(nk, {})
                for pk in (key, "*") if key != "bf16" else (key,):
                    if pk in row:
                        return float(row[pk])
        return dispatch.estimate_bf16(n, m, k, gpu) if key == "bf16" else dispatch.estimate(plan, n, m, k, gpu)

    return fn


def cuda_time_fn(device, iters: int = 10, reps: int = 3, max_copies: int = 4, layout: str = "v1"
                 ) -> Callable[[Plan | str, int, int, int], float]:  # pragma: no cover - GPU
    """Real timings on ``device`` as serving runs them: random weights of each shape in enough copies
    to exceed twice the L2, every plan captured in a CUDA graph and replayed (gpu_timing.time_calls),
    the median of ``reps``. ``release()`` frees the weights (the Tuner calls it after measuring, so
    the scratch does not stay out of the KV cache for the engine's life). ``layout`` "bytesplit":
    the weights are also held in the byte-split layout, for the "packed" plans."""
    import torch
    import torch.nn.functional as F

    from . import cuda
    from .gpu_timing import clone_compressed, copies_for, time_calls

    weights: dict = {}
    l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 << 20)

    def fn(plan, n, m, k):
        if (m, k) not in weights:
            w = (torch.randn(m, k, device=device) * 0.02).to(torch.bfloat16)
            copies = copies_for(m * k * 2, l2, max_copies=max_copies)
            if layout == "bytesplit":
                ct = cuda.pack_cuda(w)
                cts = [ct] + [cuda.clone_packed(ct) for _ in range(copies - 1)]
            else:
                ct = cuda.compress_tensor_cuda(w)
                cts = [ct] + [clone_compressed(ct) for _ in range(copies - 1)]
            weights[(m, k)] = ([w] + [w.clone() for _ in range(copies - 1)], cts)
        ws, cts = weights[(m, k)]
        x = torch.randn(n, k, device=device).to(torch.bfloat16)
        if plan == "bf16":
            fns = [lambda w=w: F.linear(x, w) for w in ws]
        elif plan.path == "packed":
            fns = [lambda c=c: cuda.packed_gemm(x, c, None, plan.tile_n, plan.split) for c in cts]
        elif plan.path == "packed_decoupled":
            fns = [lambda c=c: cuda.packed_decoupled_gemm(x, c, None) for c in cts]
        elif plan.path == "decoupled":
            fns = [lambda c=c: cuda.decoupled_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None)
                   for c in cts]
        else:
            fns = [lambda c=c: cuda.fused_gemm(x, c.bitmaps, c.base, c.offsets, c.sm, c.fb, m, k, None,
                                               plan.tile_n, plan.split) for c in cts]
        return time_calls(fns, iters, reps)

    def release() -> None:
        weights.clear()
        torch.cuda.empty_cache()

    fn.release = release
    return fn


class Tuner:
    """One engine's measurements: shapes are timed when first asked about (a shared budget),
    cached on disk when ``cache`` is given."""

    def __init__(self, time_fn, max_n: int, decode_n: int, cache: Path | None = None, budget_s: float = BUDGET_S,
                 candidates=None, ns=None):
        self.time_fn, self.max_n, self.decode_n, self.cache = time_fn, max_n, decode_n, cache
        self.candidates, self.ns = candidates, ns
        self.budget_left = budget_s
        self.tuning = (load_cached(cache) if cache is not None else None) or Tuning()
        self._dirty = False

    def measure(self, shapes) -> None:
        """Time the shapes not measured yet, and those whose buckets a budget cut short before."""
        want = set(buckets(self.max_n) if self.ns is None else self.ns)
        new = sorted(s for s in {tuple(s) for s in shapes} if not want <= set(self.tuning.times.get(s, {})))
        if not new or self.budget_left <= 0:
            return
        t0 = time.perf_counter()
        try:
            got = tune(new, self.max_n, self.time_fn, budget_s=self.budget_left, candidates=self.candidates,
                       ns=self.ns)
        finally:
            self.release()
        self.budget_left -= time.perf_counter() - t0
        for shape, by_n in got.times.items():
            self.tuning.times.setdefault(shape, {}).update(by_n)
        self.tuning.complete = self.tuning.complete and got.complete
        self._dirty = True

    def release(self) -> None:
        """Free what the timing function holds (e.g. its random weight copies), if it holds anything."""
        release = getattr(self.time_fn, "release", None)
        if release is not None:
            release()

    def slower(self, shapes) -> tuple[float, int] | None:
        """The worst (ratio, N) at which these shapes' best compressed plans are slower than BF16."""
        self.measure(shapes)
        return max((w for w in (slower_than_bf16(self.tuning, *s, self.decode_n) for s in shapes) if w),
                   default=None)

    def save(self) -> None:
        if self.cache is not None and self._dirty:
            save_cached(self.cache, self.tuning)
            self._dirty = False


# --------------------------------------------------------------------- cache
def cache_file(gpu_name: str, driver: str, version: str, layout: str = "v1") -> Path:
    from ..cache import cache_dir

    suffix = "" if layout == "v1" else f"-{layout}"  # (a layout's plans time that layout's kernels)
    key = dispatch.table_key(f"{gpu_name}-driver-{driver}-zipserv-{version}{suffix}")
    return cache_dir() / "dispatch" / f"{key}.json"


def load_cached(path: Path) -> Tuning | None:
    try:
        return Tuning.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError):
        return None


def save_cached(path: Path, tuning: Tuning) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # A name of this process's own: two engines starting at once on one machine each write a whole
    # file and the last rename wins (a shared ".tmp" let one rename the other's half-written file).
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(tuning.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
