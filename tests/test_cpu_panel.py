"""The AVX512-BF16 panel kernel (csrc/cpu_gemm/kernel_avx512bf16.cpp) and the CPU dispatcher.

* its decode step is lossless: all 65,536 BF16 bit patterns, awkward shapes,
  real trained weights, exceptions, bit for bit against the reference unpacker;
* its GEMM meets the stated bound (docs/CPU.md, "Numerical bounds") against an
  fp64 reference, for every register-block size, with and without bias, at
  several thread counts (and gives the same bits at each);
* it refuses malformed exception lists like the fused kernels, and a wrong
  high byte changes its output;
* kernels/cpu_dispatch.py: measured choices per shape and bucket (injected
  timings), its defaults, the cache key, the log line; and the autotune
  bookkeeping with CPU candidates, including prefer=speed's verdict.

Tests of the kernel itself skip on CPUs without AVX512-BF16 (stated reason);
the dispatcher's tests run everywhere.
"""

from __future__ import annotations

import os

import pytest
import torch

from zipserv_vllm.format import cpu_layout as L
from zipserv_vllm.kernels import autotune, cpu_dispatch
from zipserv_vllm.kernels import cpu as cpu_kernels

from test_cpu_gemm import _bits, _weight
from test_cpu_layout import SHAPES, _all_patterns, _corrupt, _mixed_weight, trained_matrices

needs_bf16 = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.bf16_supported()),
    reason="the panel kernel needs the _cpu_gemm extension and a CPU with AVX512-BF16 (vdpbf16ps)",
)

U = 2.0 ** -24  # fp32 unit roundoff


def bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """docs/CPU.md's bound on |y - y_exact| for the panel kernel, per output."""
    k = w.shape[1]
    kp = -(-k // 64) * 64
    s = x.double().abs() @ w.double().abs().T
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    depth = kp // 4 + 3  # adds per accumulator lane (2 per column pair), the lane sum, the bias
    flush = kp * 2.0 ** -125 * (1 + x.double().abs().max() + w.double().abs().max())  # DAZ / FTZ
    return ref.abs() * 2.0 ** -8 + depth * U * s + flush  # + the final bf16 rounding


def _ref(x, w, bias):
    return x.double() @ w.double().T + (0 if bias is None else bias.double())


@needs_bf16
@pytest.mark.parametrize("shape", [(256, 256), (512, 128), (1024, 64)])
def test_decode_all_bit_patterns(shape):
    w = _all_patterns(shape, seed=shape[1] + 1)
    pt = cpu_kernels.pack(w, threads=2)
    assert pt.exc.numel() > 0
    for threads in (1, 2):
        assert torch.equal(_bits(cpu_kernels.packed_decode(pt, threads=threads, kernel="panel")), _bits(w))


@needs_bf16
@pytest.mark.parametrize("shape", SHAPES + ((130, 4097),))
def test_decode_awkward_shapes(shape):
    w = _weight(*shape, seed=sum(shape))
    w.view(-1)[::7] = _weight(1, w.numel(), seed=3, scale=30.0).view(-1)[::7]  # exceptions
    pt = cpu_kernels.pack(w)
    assert torch.equal(_bits(cpu_kernels.packed_decode(pt, kernel="panel")), _bits(L.reference_unpack(pt)))
    assert torch.equal(_bits(cpu_kernels.packed_decode(pt, kernel="panel")), _bits(w))


@needs_bf16
def test_decode_real_trained_weights():
    for name, w in trained_matrices().items():
        pt = cpu_kernels.pack(w, threads=2)
        assert torch.equal(_bits(cpu_kernels.packed_decode(pt, threads=2, kernel="panel")), _bits(w)), name


def _one_hot_columns(w: torch.Tensor, n: int, threads: int | None = None) -> torch.Tensor:
    """W read back through the GEMM: x = one-hot rows (n columns per call), y = those columns exactly
    (finite normal weights: w * 1 and the + 0 terms are exact in fp32, and the BF16 rounding of a
    BF16 value is itself)."""
    m, k = w.shape
    pt = cpu_kernels.pack(w)
    cols = torch.empty(k, m, dtype=torch.bfloat16)
    for c0 in range(0, k, n):
        idx = torch.arange(c0, min(c0 + n, k))
        x = torch.zeros(len(idx), k, dtype=torch.bfloat16)
        x[torch.arange(len(idx)), idx] = 1.0
        cols[idx] = cpu_kernels.packed_linear(x, pt, kernel="panel", threads=threads)
    return cols.T.contiguous()


def _finite_normal(seed) -> torch.Tensor:
    """All 65,536 BF16 patterns, shuffled (256 x 256), with the zero / subnormal / inf / NaN ones
    replaced by 1.0."""
    pats = _all_patterns((256, 256), seed=seed).view(torch.int16)
    exp = (pats.int() >> 7) & 0xFF
    return torch.where((exp == 0) | (exp == 255), torch.full_like(pats, 0x3F80), pats).view(torch.bfloat16)


def _normal_patterns(shape, seed) -> torch.Tensor:
    """Every finite normal BF16 pattern (_finite_normal), shuffled, repeated to fill shape."""
    normal = _finite_normal(seed).view(torch.int16).view(-1)
    reps = -(-shape[0] * shape[1] // normal.numel())
    perm = torch.randperm(reps * normal.numel(), generator=torch.Generator().manual_seed(seed))
    return normal.repeat(reps)[perm][: shape[0] * shape[1]].reshape(shape).view(torch.bfloat16)


@needs_bf16
@pytest.mark.parametrize("n", (1, 4, 7, 8, 13, 18, 19, 25))  # streaming (<= 18 tokens; 7, 8: half panels; 5+4+4, 6+6+6), buffered
def test_gemm_reads_every_weight_exactly(n):
    """Both multiply paths' decodes, bit for bit: every finite normal BF16 pattern (exceptions, patched
    medium tiles) and Gaussian tiles (decoded in registers by the streaming path)."""
    normal = _finite_normal(seed=3)
    # the same patterns 64 x 1024: exceptions in both 8-tile chunks of each tile row
    for w in (normal, _weight(130, 300, seed=4), normal.reshape(64, 1024)):
        assert torch.equal(_bits(_one_hot_columns(w, n)), _bits(w))


@needs_bf16
@pytest.mark.parametrize("n", (19, 25, 48, 49))
def test_buffered_path_decodes_the_next_chunk_exactly(n):
    """The buffered path's decode of chunk q + 1 interleaved with the multiply of chunk q, bit for bit:
    6 tile rows of 65 tiles (chunks of 8 tiles below 48 tokens, of 32, 32 and 1 tiles from 48 on;
    exceptions in every one), on one thread (its first work item is 4 rows long, so the chunk
    sequence crosses rows) and on two; and 6 rows of 8 tiles (a chunk per row)."""
    w = _normal_patterns((384, 65 * 64), seed=n)
    assert int(cpu_kernels.pack(w).exc.numel()) > 1000
    for threads in (1, 2):
        assert torch.equal(_bits(_one_hot_columns(w, n, threads=threads)), _bits(w))
    # rows of one 8-tile chunk: below 48 tokens each chunk is a row, the next decoded while it runs
    w = _normal_patterns((384, 8 * 64), seed=n + 1)
    assert torch.equal(_bits(_one_hot_columns(w, n, threads=1)), _bits(w))


@needs_bf16
@pytest.mark.parametrize("n", (1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 13, 18, 19, 20, 33, 50))  # every register block, all paths
def test_gemm_within_bound(n):
    # 520 rows: 9 tile rows, 3 runs of 4 rows (with 2 threads the last rows one per item), so 2
    # and 3 threads really split the work
    w = _weight(520, 4096 + 70, seed=n)
    w[5, :40] = _weight(1, 40, seed=2, scale=30.0)  # exceptions
    pt = cpu_kernels.pack(w)
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, w.shape[1], generator=g).bfloat16()
    bias = torch.randn(w.shape[0], generator=g).bfloat16()
    for b in (None, bias):
        y = cpu_kernels.packed_linear(x, pt, b, kernel="panel", threads=1)
        err = (y.double() - _ref(x, w, b)).abs()
        assert bool((err <= bound(x, w, b)).all()), float((err - bound(x, w, b)).max())
        for threads in (2, 3):
            assert torch.equal(_bits(cpu_kernels.packed_linear(x, pt, b, kernel="panel", threads=threads)), _bits(y))


@needs_bf16
@pytest.mark.parametrize("rows", (64, 512, 520))  # 1 item; 2 runs of 4 tile rows; 3 runs (split tail)
@pytest.mark.parametrize("n", (1, 19, 50))  # the streaming, narrow and wide paths
def test_every_item_runs_at_any_thread_count(rows, n):
    # parallel_claims: the first items dealt out (2t and 2t + 1, or t), the rest claimed ahead;
    # with as many or fewer items than threads, or one thread, every row must still be computed:
    # the output is first filled with NaN, which no computed row keeps
    w = _weight(rows, 640, seed=rows)
    pt = cpu_kernels.pack(w)
    x = torch.randn(n, w.shape[1], generator=torch.Generator().manual_seed(n)).bfloat16()
    y1 = cpu_kernels.packed_linear(x, pt, kernel="panel", threads=1)
    err = (y1.double() - _ref(x, w, None)).abs()
    assert bool((err <= bound(x, w, None)).all())
    from zipserv_vllm import _cpu_gemm

    arrays = [a.numpy() for a in (pt.tiles, pt.luts, pt.exc_start, pt.exc)]
    for threads in (2, 3, 4, 8):
        out = torch.full((n, rows), float("nan"), dtype=torch.bfloat16)
        _cpu_gemm.packed_gemm_bf16(x.view(torch.int16).numpy(), *arrays, rows, w.shape[1], None,
                                   out.view(torch.int16).numpy(), threads)
        assert torch.equal(_bits(out), _bits(y1)), threads


# Four lane values whose documented sum, (l0 + l1) + (l2 + l3) in fp32, rounds to a different BF16
# than any other order of the same four additions (found by search; all BF16 numbers).
_LANES = (9109504.0, 15466496.0, -1.0, -0.0986328125)


def _f32_sum(l0, l1, l2, l3):
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    return (f(l0) + f(l1)) + (f(l2) + f(l3))


@needs_bf16
@pytest.mark.parametrize("n", (1, 7, 19, 25))  # streaming, buffered (blocks of 6 and of 1)
def test_lane_sum_order_bias_and_rounding(n):
    """Step 3 exactly as docs/CPU.md states it: each output row is (l0 + l1) + (l2 + l3) of its four
    accumulator lanes in fp32, + bias, RNE to BF16, any NaN -> 0x7FC0, rows past M not written.
    Lane c of a row sums columns 2c, 2c + 1 of every 8-column group; with x zero outside columns
    0, 2, 4, 6 of the first group each lane holds one exact product, so the expected bits are known."""
    l0, l1, l2, l3 = _LANES
    other = [_f32_sum(l0, l2, l1, l3), _f32_sum(l0, l3, l1, l2), ((torch.tensor(l0) + l1) + l2) + l3]
    assert all(float(o.bfloat16()) != float(_f32_sum(*_LANES).bfloat16()) for o in other)  # the test can fail
    m = 37  # three 16-row panels, the last partial: masked stores
    w = torch.zeros(m, 64, dtype=torch.bfloat16)
    for r in range(m):
        sign = -1.0 if r % 3 == 1 else 1.0
        for c, v in enumerate(_LANES):
            w[r, 2 * c] = sign * v * 2.0 ** (r % 5)
    w[33, 2] = float("nan")
    x = torch.zeros(n, 64, dtype=torch.bfloat16)
    for t in range(n):
        x[t, 0:8:2] = 2.0 ** -(t % 9)
    bias = torch.linspace(-3e6, 3e6, m).bfloat16()
    pt = cpu_kernels.pack(w)
    for b in (None, bias):
        y = cpu_kernels.packed_linear(x, pt, b, kernel="panel")
        lanes = w[:, 0:8:2].float()[None] * x[:, 0:8:2].float()[:, None]  # [n, m, 4], exact products
        exp = (lanes[..., 0] + lanes[..., 1]) + (lanes[..., 2] + lanes[..., 3])
        if b is not None:
            exp = exp + b.float()
        want = torch.where(exp.isnan(), torch.tensor(0x7FC0, dtype=torch.int16), _bits(exp.bfloat16()))
        assert torch.equal(_bits(y), want), n
        assert bool(exp[:, 33].isnan().all())


@needs_bf16
@pytest.mark.parametrize("shape", SHAPES)
def test_gemm_shapes_within_bound(shape):
    w = _weight(*shape, seed=2)
    pt = cpu_kernels.pack(w)
    x = _weight(7, shape[1], seed=4, scale=1.0)
    y = cpu_kernels.packed_linear(x, pt, kernel="panel")
    assert bool(((y.double() - _ref(x, w, None)).abs() <= bound(x, w, None)).all())


@needs_bf16
def test_bound_is_not_vacuous():
    """Negative control: a one-ulp change of a single weight on a wide row breaks exactness
    of the fp64 comparison by more than the bound allows for a wrong element of scale 30."""
    w = _weight(64, 256, seed=9)
    pt = cpu_kernels.pack(w)
    x = torch.ones(1, 256, dtype=torch.bfloat16)
    w2 = w.clone()
    w2[0, 0] = 30.0
    y = cpu_kernels.packed_linear(x, pt, kernel="panel")
    err = (y.double() - _ref(x, w2, None)).abs()
    assert not bool((err <= bound(x, w2, None)).all())


@needs_bf16
def test_inf_nan_and_exceptions_reach_the_output():
    w = _mixed_weight()
    pt = cpu_kernels.pack(w)
    x = torch.ones(4, w.shape[1], dtype=torch.bfloat16)
    y = cpu_kernels.packed_linear(x, pt, kernel="panel")
    ref = cpu_kernels.packed_linear(x, pt, kernel="fused")
    # rows with an inf or NaN weight give inf / NaN in both kernels
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.equal(torch.isinf(y), torch.isinf(ref))


@needs_bf16
def test_wrong_high_byte_changes_the_output():
    w = _weight(64, 64, seed=1)
    w[3, 5] = 0.0
    pt = cpu_kernels.pack(w)
    assert pt.exc.numel() == 1
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    bad = L.PackedTensor(pt.shape, pt.tiles, pt.luts, pt.exc_start, pt.exc ^ 0x40)
    assert not torch.equal(_bits(cpu_kernels.packed_linear(x, bad, kernel="panel")),
                           _bits(cpu_kernels.packed_linear(x, pt, kernel="panel")))
    assert not torch.equal(_bits(cpu_kernels.packed_decode(bad, kernel="panel")), _bits(w))


@needs_bf16
@pytest.mark.parametrize("kind", ["start_past_end", "start_decreasing", "d_out_of_tile", "not_ascending"])
def test_malformed_exception_lists_are_refused(kind):
    w = _weight(128, 128, seed=3)
    w[0, :8] = torch.tensor([0.0, 1e30, -1e30, 1e-30, -1e-30, 3e20, -3e20, 7e25]).bfloat16()
    bad = _corrupt(cpu_kernels.pack(w), kind)
    for n in (1, 19):  # streaming and buffered paths
        x = torch.ones(n, 128, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"tile \([01], [01]\) of the byte-split layout"):
            cpu_kernels.packed_linear(x, bad, kernel="panel")
    with pytest.raises(ValueError, match="byte-split layout"):
        cpu_kernels.packed_decode(bad, kernel="panel")


@needs_bf16
@pytest.mark.parametrize("kind, tile", [("not_ascending", 12), ("not_ascending", 40), ("d_out_of_tile", 12),
                                        ("d_out_of_tile", 40), ("start_past_end", 40)])
def test_malformed_tile_in_a_later_chunk_is_named(kind, tile):
    """Both paths walk a tile row in chunks (8 tiles; the buffered path's from 48 tokens: 32), the
    buffered path decoding the next while it multiplies the current one: a bad exception list in a
    later chunk (the only tile with exceptions; tile 12 is in the first 32-tile chunk, tile 40 in
    the second) is found and named; so is a bad range (the last tile's, 47)."""
    k = 48 * 64
    g = torch.Generator().manual_seed(5)
    # 14 high bytes (both signs, 14 exponents) in every tile: room in its table, so the planted values
    # are the only exceptions
    sign = torch.randint(0, 2, (64, k), generator=g) * 2 - 1
    w = (sign * (torch.rand(64, k, generator=g) + 1) * 2.0 ** -torch.randint(0, 14, (64, k), generator=g)).bfloat16()
    w[0, tile * 64: tile * 64 + 8] = torch.tensor([0.0, 1e30, -1e30, 1e-30, -1e-30, 3e20, -3e20, 7e25]).bfloat16()
    pt = cpu_kernels.pack(w)
    assert int(pt.exc_start[tile]) == 0 and int(pt.exc_start[tile + 1]) >= 2
    bad = _corrupt(pt, kind)
    named = 47 if kind == "start_past_end" else tile  # (that corruption hits the last tile's range)
    for n in (1, 19, 48):
        with pytest.raises(ValueError, match=rf"tile \(0, {named}\) of the byte-split layout"):
            cpu_kernels.packed_linear(torch.ones(n, k, dtype=torch.bfloat16), bad, kernel="panel")


def test_unknown_kernel_is_refused():
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    pt = cpu_kernels.pack(_weight(64, 64))
    with pytest.raises(ValueError, match="kernel must be one of"):
        cpu_kernels.packed_linear(torch.ones(1, 64, dtype=torch.bfloat16), pt, kernel="amx")


# ------------------------------------------------------------------ dispatcher
@pytest.fixture
def clean_dispatch():
    cpu_dispatch.clear_measured()
    yield
    cpu_dispatch.clear_measured()


def test_buckets_and_defaults(clean_dispatch, monkeypatch):
    assert [cpu_dispatch.bucket(n) for n in (1, 2, 3, 5, 9, 100, 512, 4000)] == [1, 2, 4, 8, 16, 128, 512, 512]
    monkeypatch.setattr(cpu_dispatch, "bf16_supported", lambda: True)
    monkeypatch.setattr(cpu_dispatch, "PANEL_MIN_N", 4)
    assert [cpu_dispatch.choose(n, 64, 64) for n in (1, 2, 3, 4, 600)] == ["fused", "fused", "fused", "panel", "panel"]
    monkeypatch.setattr(cpu_dispatch, "PANEL_MIN_N", 1)  # the shipped default: panel at every N
    assert {cpu_dispatch.choose(n, 64, 64) for n in (1, 2, 600)} == {"panel"}
    assert cpu_dispatch.candidates(1, 64, 64) == ["fused", "panel"]
    monkeypatch.setattr(cpu_dispatch, "bf16_supported", lambda: False)
    assert {cpu_dispatch.choose(n, 64, 64) for n in (1, 4, 600)} == {"fused"}
    assert cpu_dispatch.candidates(1, 64, 64) == ["fused"]


def test_measured_choices(clean_dispatch, monkeypatch):
    monkeypatch.setattr(cpu_dispatch, "bf16_supported", lambda: True)
    times = {(128, 256): {1: {"bf16": 2.0, "fused": 1.0, "panel": 1.5},
                          4: {"bf16": 2.0, "fused": 3.0, "panel": 1.8},
                          16: {"bf16": 2.0, "fused": 1.0, "panel": 9.0, "other": 0.1}}}
    cpu_dispatch.set_measured(times)
    assert cpu_dispatch.measured() == {(128, 256): [(1, "fused"), (4, "panel"), (16, "fused")]}
    # N between buckets: the next bucket up; above the last: the last
    assert [cpu_dispatch.choose(n, 128, 256) for n in (1, 2, 4, 5, 16)] == ["fused", "panel", "panel", "fused", "fused"]
    assert cpu_dispatch.choose(4, 64, 64) == "panel"  # another shape: the default
    # a partial measurement (budget cut at 16 tokens): above it, the default, not bucket 16's choice
    assert cpu_dispatch.choose(999, 128, 256) == "panel"
    line = cpu_dispatch.ratios_line(128, 256, times[(128, 256)])
    assert line == "zipserv: CPU GEMM 128x256 vs BF16: N=1 fused 2.00x, N=4 panel 1.11x, N=16 fused 2.00x"
    # a complete measurement: above the last bucket, its choice
    full = {(64, 128): {b: {"fused": 1.0, "panel": 2.0} for b in cpu_dispatch.BUCKETS}}
    cpu_dispatch.set_measured(full)
    assert cpu_dispatch.choose(9999, 64, 128) == "fused"
    assert cpu_dispatch.choose(4, 128, 256) == "panel"  # another shape's rows are kept (engines share them)
    # a CPU without the panel kernel ignores measured panel entries (e.g. a cache of another machine)
    monkeypatch.setattr(cpu_dispatch, "bf16_supported", lambda: False)
    cpu_dispatch.set_measured(times)
    assert cpu_dispatch.choose(4, 128, 256) == "fused"


def test_tuner_with_cpu_candidates(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_dispatch, "bf16_supported", lambda: True)
    calls = []

    def fake(key, n, m, k):  # panel wins from 4 tokens, BF16 is faster at 512
        calls.append((key, n, m, k))
        if key == "bf16":
            return 1.0 if n < 512 else 0.5
        return {"fused": 0.8 if n < 4 else 2.0, "panel": 1.2 if n < 4 else 0.9}[key]

    cache = tmp_path / "cpu.json"
    tuner = autotune.Tuner(fake, 512, 256, cache, candidates=cpu_dispatch.candidates, ns=cpu_dispatch.BUCKETS)
    tuner.measure([(64, 128)])
    assert {c[0] for c in calls} == {"bf16", "fused", "panel"}
    assert sorted({c[1] for c in calls}) == list(cpu_dispatch.BUCKETS)
    cpu_dispatch.set_measured(tuner.tuning.times)
    try:
        assert [cpu_dispatch.choose(n, 64, 128) for n in (1, 2, 4, 512)] == ["fused", "fused", "panel", "panel"]
    finally:
        cpu_dispatch.clear_measured()
    # prefer=speed: slower than BF16 at 512 tokens, which is past decode_n = 256: still compressed
    assert tuner.slower([(64, 128)]) is None
    wide = autotune.Tuner(fake, 512, 512, None, candidates=cpu_dispatch.candidates, ns=cpu_dispatch.BUCKETS)
    assert wide.slower([(64, 128)]) == (pytest.approx(1.8), 512)
    tuner.save()
    again = autotune.Tuner(lambda *a: pytest.fail("cached shapes are not timed again"), 512, 256, cache,
                           candidates=cpu_dispatch.candidates, ns=cpu_dispatch.BUCKETS)
    again.measure([(64, 128)])
    assert again.tuning.times == tuner.tuning.times
    # a shape whose buckets a budget cut short is measured again (and the random weights released)
    released = []
    fake.release = lambda: released.append(1)
    partial = autotune.Tuner(fake, 512, 256, None, candidates=cpu_dispatch.candidates, ns=cpu_dispatch.BUCKETS)
    partial.tuning.times[(64, 128)] = {1: {"fused": 1.0}}
    calls.clear()
    partial.measure([(64, 128)])
    assert sorted({c[1] for c in calls}) == list(cpu_dispatch.BUCKETS) and released == [1]


def test_cache_key(monkeypatch, tmp_path):
    monkeypatch.setenv("ZIPSERV_CACHE", str(tmp_path))
    a = cpu_dispatch.cache_file(2, "1.0")
    assert a.parent == tmp_path / "dispatch" and a.name.startswith("cpu-")
    assert a != cpu_dispatch.cache_file(1, "1.0") and a != cpu_dispatch.cache_file(2, "1.1")
    monkeypatch.setattr(cpu_dispatch, "cpu_identity", lambda: "Other CPU [avx2]")
    assert a != cpu_dispatch.cache_file(2, "1.0")
    monkeypatch.undo()
    monkeypatch.setenv("ZIPSERV_CACHE", str(tmp_path))
    assert cpu_dispatch.cache_file(2, "1.0") == a
    build = cpu_dispatch.kernels_build_id()  # another build of the kernels: another file
    assert build != "none" and len(build) == 16
    monkeypatch.setattr(cpu_dispatch, "_BUILD_ID", ["0123456789abcdef"])
    assert cpu_dispatch.cache_file(2, "1.0") != a


def test_cpu_identity_names_the_isa():
    ident = cpu_dispatch.cpu_identity()
    assert "[" in ident and ident.endswith("]")
    if cpu_kernels.available() and cpu_kernels.bf16_supported():
        assert "avx512_bf16" in ident


@needs_bf16
def test_real_time_fn_times_every_candidate():
    fn = cpu_dispatch.cpu_time_fn(reps=1, threads=1)
    for key in ("bf16", "fused", "panel"):
        assert 0 < fn(key, 4, 64, 128) < 1.0


@needs_bf16
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status and sets RLIMIT_AS (Linux)")
def test_out_of_memory_is_a_memory_error_not_a_crash():
    """The per-thread accumulator buffer (1 KiB per token: 8 MiB here) cannot be allocated under a tight
    address-space limit: the call raises MemoryError, with the AVX512-BF16 panel kernel and the fp32
    fused one, again and again (in a child process, whose limit is set after everything else ran)."""
    import subprocess
    import sys

    probe = """
import resource, torch
from zipserv_vllm.kernels import cpu as ck
w = (torch.randn(64, 64) * 0.02).bfloat16()
pt = ck.pack(w, threads=1)
x = torch.randn(8192, 64).bfloat16()  # 8 MiB of accumulators; the fp32 kernel's x copy is 2 MiB
ck.packed_linear(x[:1], pt, kernel="fused", threads=1)
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
for kernel in ("panel", "fused", "panel"):  # (the fp32 fused kernel crashed on a null buffer before)
    try:
        ck.packed_linear(x, pt, kernel=kernel, threads=1)
        print("RESULT", kernel, "no error")
    except MemoryError:
        print("RESULT", kernel, "MemoryError")
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("MemoryError") == 3, r.stdout


@needs_bf16
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/self/status and sets RLIMIT_AS (Linux)")
def test_out_of_memory_is_reported_to_its_own_call_only():
    """Each call has its own out-of-memory flag: while one thread's calls fail to allocate (and raise
    MemoryError, every time), another thread's calls (the GIL is released inside) succeed with exact
    results. With one process-wide flag a call could take another's failure, or miss its own and
    return an incomplete output."""
    import subprocess
    import sys

    probe = """
import resource, threading, time
import numpy as np
from zipserv_vllm import _cpu_gemm
from zipserv_vllm.kernels import cpu as ck
import torch
torch.manual_seed(0)
pt = ck.pack((torch.randn(64, 512) * 0.02).bfloat16(), threads=1)
arrs = [getattr(pt, a).numpy() for a in ("tiles", "luts", "exc_start", "exc")]
bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)
small = bits(torch.randn(24, 512).bfloat16())
big = bits(torch.randn(16384, 512).bfloat16())  # 16 MiB of accumulators in the calling thread's scratch
want = np.zeros((24, 64), np.uint16)
_cpu_gemm.packed_gemm_bf16(small, *arrs, 64, 512, None, want, 1)
out_small, out_big = np.zeros_like(want), np.zeros((16384, 64), np.uint16)  # (no allocation under the limit)
errors, wrong, done, raised = [], 0, 0, 0
go, stop = threading.Event(), threading.Event()
def other():
    global wrong, done
    go.wait()
    while not stop.is_set():
        try:
            out_small[...] = 0
            _cpu_gemm.packed_gemm_bf16(small, *arrs, 64, 512, None, out_small, 1)
            wrong += int(not np.array_equal(out_small, want))
            done += 1
        except Exception as exc:
            errors.append(repr(exc))
t = threading.Thread(target=other)
t.start()
vm = int([l for l in open("/proc/self/status") if l.startswith("VmSize")][0].split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (4 << 20), resource.RLIM_INFINITY))
go.set()
calls, t0 = 0, time.monotonic()
try:
    while (calls < 100 or done < 50) and time.monotonic() - t0 < 120:  # (until both threads ran enough)
        calls += 1
        try:
            _cpu_gemm.packed_gemm_bf16(big, *arrs, 64, 512, None, out_big, 1)
        except MemoryError:
            raised += 1
finally:
    stop.set()
    t.join()
print("RESULT", calls - raised, wrong, len(errors), errors[:1], done >= 50)
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT 0 0 0 [] True" in r.stdout, r.stdout  # (no call of the first thread returned, none of the other failed)


# ------------------------------------------------------------------ MoE experts in one call
def _experts(n_exp, hidden, inter, seed):
    w13 = [_weight(2 * inter, hidden, seed=seed + e) for e in range(n_exp)]
    w2 = [_weight(hidden, inter, seed=seed + 100 + e) for e in range(n_exp)]
    w13[1][3, :8] = torch.tensor([0.0, 1e30, -1e30, 1e-30, -1e-30, 3e20, -3e20, 7e25]).bfloat16()  # exceptions
    return [cpu_kernels.pack(w) for w in w13], [cpu_kernels.pack(w) for w in w2]


@needs_bf16
def test_moe_experts_one_call_matches_per_expert_panel_gemms():
    """cpu_kernels.moe_experts (one native call: every expert's w13, SiLU x up, w2) gives each row what
    the per-expert path gives (panel GEMMs per expert, torch's SiLU): the GEMMs are the same kernel on
    the same rows, so only SiLU's last-ulp rounding may differ; an empty expert is skipped; the thread
    count does not change the bits."""
    hidden, inter, counts = 128, 192, [3, 0, 1, 6]
    p13, p2 = _experts(4, hidden, inter, seed=20)
    t13, t2 = cpu_kernels.expert_table(p13, (2 * inter, hidden)), cpu_kernels.expert_table(p2, (hidden, inter))
    xs = torch.randn(sum(counts), hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
    y = cpu_kernels.moe_experts(xs, counts, t13, t2, inter, threads=1)
    assert torch.equal(_bits(cpu_kernels.moe_experts(xs, counts, t13, t2, inter, threads=2)), _bits(y))
    ref, r0 = [], 0
    for e, c in enumerate(counts):
        if c:
            h = cpu_kernels.packed_linear(xs[r0:r0 + c], p13[e], kernel="panel")
            act = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).bfloat16()
            ref.append(cpu_kernels.packed_linear(act, p2[e], kernel="panel"))
        r0 += c
    ref = torch.cat(ref)
    assert bool(torch.isfinite(ref).all()) and float(ref.float().abs().max()) > 0
    assert torch.allclose(y.float(), ref.float(), rtol=2e-2, atol=1e-3)
    assert float((_bits(y) == _bits(ref)).float().mean()) > 0.95
    # a wrong expert order would not be close: swapping two experts' tables moves the rows
    swapped = cpu_kernels.moe_experts(xs, counts, t13[[3, 1, 2, 0]], t2[[3, 1, 2, 0]], inter)
    assert not torch.allclose(swapped.float(), ref.float(), rtol=2e-2, atol=1e-3)


@needs_bf16
def test_moe_experts_refuses_bad_input():
    hidden, inter = 64, 64
    p13, p2 = _experts(3, hidden, inter, seed=40)
    t13, t2 = cpu_kernels.expert_table(p13, (2 * inter, hidden)), cpu_kernels.expert_table(p2, (hidden, inter))
    assert cpu_kernels.expert_table(p13, (hidden, inter)) is None  # wrong shape
    assert cpu_kernels.expert_table([p13[0], None], (2 * inter, hidden)) is None  # an expert not byte-split
    odd = L.PackedTensor(p13[0].shape, p13[0].tiles, p13[0].luts, p13[0].exc_start, p13[0].exc.to(torch.int64))
    assert cpu_kernels.expert_table([odd], (2 * inter, hidden)) is None  # exception entries of the wrong width
    xs = torch.ones(4, hidden, dtype=torch.bfloat16)
    start = p2[2].exc_start.clone()
    start[-1] += 1  # expert 2's w2: its only tile's range runs past the exception list
    bad2 = list(p2)
    bad2[2] = L.PackedTensor(p2[2].shape, p2[2].tiles, p2[2].luts, start, p2[2].exc)
    tb = cpu_kernels.expert_table(bad2, (hidden, inter))
    with pytest.raises(ValueError, match=r"expert 2 \(w2\): tile \(0, 0\) of the byte-split layout"):
        cpu_kernels.moe_experts(xs, [1, 1, 2], t13, tb, inter)
    cpu_kernels.moe_experts(xs, [2, 2, 0], t13, tb, inter)  # expert 2 has no rows: its tiles are not read
    with pytest.raises(ValueError, match="multiples of 64"):
        cpu_kernels.moe_experts(xs, [4, 0, 0], t13, t2, 32)
    # sizes that do not match the experts' are refused before any weight is read
    with pytest.raises(ValueError, match=r"w13: expert 0 is 128 x 64, the call needs 256 x 64"):
        cpu_kernels.moe_experts(xs, [4, 0, 0], t13, t2, 128)
    with pytest.raises(ValueError, match=r"w13: expert 0 is 128 x 64, the call needs 128 x 128"):
        cpu_kernels.moe_forward(torch.ones(2, 128, dtype=torch.bfloat16), torch.zeros(2, 1, dtype=torch.int64),
                                torch.ones(2, 1), t13, t2, inter)
    with pytest.raises(ValueError, match="2-D bfloat16 CPU tensor"):
        cpu_kernels.moe_forward(xs.float(), torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1), t13, t2, inter)
    with pytest.raises(ValueError):
        cpu_kernels.moe_experts(xs, [1, 1, 1], t13, t2, inter)  # 3 rows counted, 4 given


@needs_bf16
@pytest.mark.parametrize("on_input", [False, True])
def test_moe_forward_routes_and_sums_like_the_grouped_path(on_input):
    """cpu_kernels.moe_forward (routing, both GEMMs, SiLU x up and the weighted sum in one call) equals
    grouping the rows by expert in Python, moe_experts, and an fp32 weighted sum: bit for bit where the
    sums are taken in the same order (top-1), within fp32 reassociation otherwise; a token routed twice
    to one expert, unrouted experts, no tokens at all, and ids outside the experts refused."""
    hidden, inter, n_exp = 128, 64, 5
    p13, p2 = _experts(n_exp, hidden, inter, seed=60)
    t13, t2 = cpu_kernels.expert_table(p13, (2 * inter, hidden)), cpu_kernels.expert_table(p2, (hidden, inter))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(7, hidden, generator=g).bfloat16()
    ids = torch.tensor([[0, 3], [3, 3], [1, 0], [4, 0], [0, 1], [3, 4], [1, 1]], dtype=torch.int64)
    w = torch.rand(7, 2, generator=g)

    def reference(ids, w):
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_exp).tolist()
        tok, wt = order // k, w.reshape(-1)[order, None]
        xs = x.index_select(0, tok)
        if on_input:
            xs = (xs * wt).bfloat16()
        y = cpu_kernels.moe_experts(xs, counts, t13, t2, inter).float()
        out = torch.zeros(x.shape[0], hidden)
        out.index_add_(0, tok, y if on_input else y * wt)
        return out.bfloat16()

    got = cpu_kernels.moe_forward(x, ids, w, t13, t2, inter, on_input=on_input)
    want = reference(ids, w)
    assert got.shape == (7, hidden) and got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-3)
    top1 = ids[:, :1].contiguous()
    assert torch.equal(_bits(cpu_kernels.moe_forward(x, top1, w[:, :1], t13, t2, inter, on_input=on_input)),
                       _bits(reference(top1, w[:, :1])))
    assert not torch.allclose(got.float(), reference(ids.flip(1), w).float(), rtol=1e-2, atol=1e-3)
    empty = cpu_kernels.moe_forward(x[:0], ids[:0], w[:0], t13, t2, inter, on_input=on_input)
    assert empty.shape == (0, hidden)
    with pytest.raises(ValueError, match=r"topk_ids holds expert 5, outside \[0, 5\)"):
        cpu_kernels.moe_forward(x, ids + 1, w, t13, t2, inter)


@needs_bf16
def test_moe_layer_run_takes_addresses_after_its_checks():
    """cpu_kernels.moe_layer / moe_run (the plugin's per-call entry: tables checked once and copied,
    only buffer addresses cross per call) give moe_forward's bits for int32 and int64 ids, strided
    inputs and fp64 weights; the tables can change after the layer is made (it holds a copy); wrong
    sizes and ids outside the experts are refused before any weight is read; no tokens, no call."""
    hidden, inter, n_exp = 128, 64, 5
    p13, p2 = _experts(n_exp, hidden, inter, seed=70)
    t13, t2 = cpu_kernels.expert_table(p13, (2 * inter, hidden)), cpu_kernels.expert_table(p2, (hidden, inter))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, hidden, generator=g).bfloat16()
    ids = torch.tensor([[0, 3], [3, 3], [1, 0], [4, 2], [2, 1], [3, 4]], dtype=torch.int64)
    w = torch.rand(6, 2, generator=g)
    want = _bits(cpu_kernels.moe_forward(x, ids, w, t13, t2, inter))
    layer = cpu_kernels.moe_layer(t13, t2, inter, hidden)
    assert (layer.hidden, layer.inter, layer.experts) == (hidden, inter, n_exp)
    t13[:] = 0  # the layer checked and copied the tables at construction
    assert torch.equal(_bits(cpu_kernels.moe_run(layer, x, ids, w)), want)
    assert torch.equal(_bits(cpu_kernels.moe_run(layer, x, ids.to(torch.int32), w.double())), want)
    xs = torch.cat([x, x], 1)[:, :hidden]  # strided rows
    ids_t, w_t = ids.t().contiguous().t(), w.t().contiguous().t()  # column-major
    assert not (xs.is_contiguous() or ids_t.is_contiguous() or w_t.is_contiguous())
    assert torch.equal(_bits(cpu_kernels.moe_run(layer, xs, ids_t, w_t)), want)
    assert cpu_kernels.moe_run(layer, x[:0], ids[:0], w[:0]).shape == (0, hidden)
    with pytest.raises(ValueError, match="128 columns"):
        cpu_kernels.moe_run(layer, x[:, :64], ids, w)
    with pytest.raises(ValueError, match=r"\[6, k\]"):
        cpu_kernels.moe_run(layer, x, ids[:5], w[:5])
    with pytest.raises(ValueError, match=r"\[6, k\]"):
        cpu_kernels.moe_run(layer, x, ids, w[:, :1])
    with pytest.raises(ValueError, match=r"topk_ids holds expert -1, outside \[0, 5\)"):
        cpu_kernels.moe_run(layer, x, ids - 1, w)
    with pytest.raises(ValueError, match="w13: expert 0 is 128 x 128"):
        cpu_kernels.moe_layer(cpu_kernels.expert_table(p13, (2 * inter, hidden)), t2, inter, 2 * hidden)
