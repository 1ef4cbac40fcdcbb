"""Timing GPU calls the way they run when serving: CUDA-graph replays, weights rotated past the L2.

One definition for the engine-start autotuner (``autotune.cuda_time_fn``) and
the benchmarks (``benchmarks/bench_zipgemm.py``, ``tune_dispatch.py``). An eager
call of one weight measures Python and launch overhead (tens of microseconds,
as long as a decode GEMM) and a weight the L2 already holds; the first GPU run
showed both would have made every compressed plan look better or worse than it
is. Here the calls are captured once in a CUDA graph and replayed, rotating
through copies of the weight that together exceed the L2 (:func:`copies_for`).
"""

from __future__ import annotations

import math
import statistics


def copies_for(weight_bytes: int, l2_bytes: int, factor: int = 2, max_copies: int = 8) -> int:
    """How many copies of a weight to rotate through so that one pass reads ``factor`` x the L2
    from memory (at least 1, at most ``max_copies``)."""
    return max(1, min(max_copies, math.ceil(factor * l2_bytes / max(1, weight_bytes))))


def clone_compressed(ct):
    """A copy of a CompressedTensor with its own device arrays (another weight to rotate through)."""
    from ..format import CompressedTensor

    return CompressedTensor(ct.shape, ct.bitmaps.clone(), ct.base.clone(), ct.offsets.clone(), ct.sm.clone(),
                            ct.fb.clone())


def time_calls(fns, iters: int, reps: int, warmup: int = 3, graph: bool = True) -> float:
    """Median over ``reps`` of the mean seconds per call, rotating through ``fns``.

    Every function runs at least once before capture (a weight's first call validates its offsets
    on the host, which capture refuses). With ``graph`` the ``iters`` calls are captured once in a
    CUDA graph and the graph is replayed, so Python and dispatcher overhead is excluded for every
    method alike."""
    import torch

    for i in range(max(warmup, len(fns))):
        fns[i % len(fns)]()
    torch.cuda.synchronize()
    run = None
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(warmup):
                fns[i % len(fns)]()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(iters):
                fns[i % len(fns)]()
        run = g.replay
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(reps):
        start.record()
        if run is not None:
            run()
        else:
            for i in range(iters):
                fns[i % len(fns)]()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(samples)
