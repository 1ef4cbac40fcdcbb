"""The CUDA kernels' own sources, run on the CPU by the SIMT harness, against the reference codec.

``zipserv_vllm._simt`` is csrc/cuda/*.cu compiled by g++ (csrc/cuda/target.cuh,
csrc/simt/): the launches, the host wrappers (zipgemm(), decompress(), the
encoder's two passes, embedding_gather(), prepare_current_device()) and the
bindings are the ones the GPU build runs; every block's threads execute the
kernel body with real barriers, warp exchanges, mma.sync from the PTX tables
and cp.async that lands only at its wait (tests/simt/test_harness.py checks
the harness). Here: every fused instance (tile_n 8..128) with split-K off and
on, ragged M/N/K, bias, the dispatcher's choices; all 65,536 BF16 patterns
through the decompress, fused (one-hot X) and embedding kernels and the GPU
encoder; non-canonical stream layouts with garbage between segments; three
thread schedules. Budget: ~1 min on 2 cores.
"""

import numpy as np
import pytest

from zipserv_vllm.format import reference
from zipserv_vllm.kernels import dispatch

from . import cases, harness, kernels
from .corpus import ALL, decompress_case, encode_case, expert_weights, gemm_case, grouped_case, weight

simt = harness.module()
pytestmark = pytest.mark.skipif(simt is None, reason=harness.MISSING)


@pytest.fixture(autouse=True)
def _prepared():
    simt.configure("forward", 1)
    simt.prepare()
    yield
    simt.configure("forward", 1)


def _check(case):
    msg = cases.run(simt, case)
    assert msg is None, msg


# ------------------------------------------------------------------ fused ZipGEMM
SHAPES = [(1, 1), (3, 7), (64, 64), (100, 130), (192, 320), (257, 96), (65, 577)]
NS = [1, 2, 3, 8, 9, 16, 17, 33, 64, 129]


@pytest.mark.parametrize("m,k", SHAPES)
def test_dispatched_config(m, k):
    """The tile_n the dispatcher picks for each N, split-K off (no bias) and on (bias)."""
    for n in NS:
        tn = dispatch.tile_n_for(n)
        _check(gemm_case(m, k, n, tn, 1, bias=False))
        _check(gemm_case(m, k, n, tn, 3, bias=True))


@pytest.mark.parametrize("tile_n", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("split", [1, 2, 4, 7, 100])
def test_every_instance_and_split(tile_n, split):
    """Every instance; splits that divide Kt = 8, do not, and exceed it; N ragged for every tile_n."""
    _check(gemm_case(130, 452, 21, tile_n, split))


def test_k_tail_padding_and_unaligned_x():
    _check(gemm_case(64, 65, 5, 8, 1, bias=False))  # one real column in the last K tile
    _check(gemm_case(70, 100, 9, 16, 2))  # K % 8 != 0: X staged element-wise, not by cp.async


@pytest.mark.parametrize("tile_n,split,n", [(128, 1, 256), (8, 4, 64), (32, 3, 100)])
def test_fused_all_patterns_one_hot(tile_n, split, n):
    """All 65,536 patterns as W; X one-hot, so each output is one decoded weight times 1.0: exact,
    NaN in the rows that hold an inf or NaN."""
    w = ALL.reshape(256, 256)
    cols = (np.arange(n) * 97) % 256
    _check(cases.weight(reference.encode(w), kind="onehot", name=f"all patterns tile_n={tile_n} split={split}",
                        w=w, cols=cols, tile_n=tile_n, split=split))


def test_fused_noncanonical_layout():
    c = gemm_case(130, 200, 17, 32, 2)
    e = kernels.noncanonical(cases._enc(c))
    c.update(sm=e.sm, fb=e.fb, offsets=e.offsets, name="non-canonical layout")
    _check(c)


# ------------------------------------------------------------------ grouped ZipGEMM (mixtures of experts)
@pytest.mark.parametrize("tile_n", [8, 16, 32, 64, 128])
def test_grouped_every_instance(tile_n):
    """One launch over 5 experts with ragged row counts: empty experts, one row (decode, top-k of one
    token), rows not a multiple of tile_n, one expert holding most rows; M and K ragged."""
    _check(grouped_case(expert_weights(5, 130, 452), [0, 1, 21, 0, 2 * tile_n + 3], tile_n))


def test_grouped_decode_sized_and_unaligned_x():
    _check(grouped_case(expert_weights(8, 192, 128), [1, 0, 0, 1, 0, 0, 0, 0], 8, name="top-2 of one token"))
    _check(grouped_case(expert_weights(3, 70, 100), [5, 1, 9], 16, name="K % 8 != 0"))  # X staged element-wise
    simt.reset_stats()
    _check(grouped_case(expert_weights(2, 64, 64), [0, 0], 8, name="no rows"))
    assert simt.stats()["launches"] == 0  # nothing launched, nothing written


def test_grouped_all_patterns_one_hot():
    """Three experts, each holding all 65,536 patterns (rolled differently); X one-hot: exact per expert."""
    ws = np.stack([np.roll(ALL, 4099 * i).reshape(256, 256) for i in range(3)])
    _check(grouped_case(ws, [9, 0, 130], 32, onehot=True, name="all patterns"))
    _check(grouped_case(ws, [1, 70, 3], 128, onehot=True, name="all patterns"))


def test_grouped_noncanonical_expert_and_equal_to_one_launch_per_expert():
    """An expert stored with reordered segments and garbage between them; and the grouped result
    equals the per-expert fused launches bit for bit (the same block body on the same rows)."""
    ws = expert_weights(3, 130, 200, seed=2)
    enc = [reference.encode(w) for w in ws]
    enc[1] = kernels.noncanonical(enc[1])
    c = grouped_case(ws, [4, 11, 7], 16, encoded=enc, name="non-canonical expert")
    _check(c)
    experts = [cases.SimpleNamespace(m=130, k=200, **{n: c[f"{n}{i}"] for n in cases.ENC}) for i in range(3)]
    y = kernels.zipgemm_grouped(simt, experts, c["x"], c["counts"], 16)
    start = 0
    for i, n in enumerate(c["counts"].tolist()):
        one = kernels.zipgemm(simt, experts[i], c["x"][start:start + n], None, 16, 1)
        assert np.array_equal(y[start:start + n], one), i
        start += n


def test_grouped_launch_counters_and_bad_arguments():
    """Grid (ceil(rows / tile_n), Mt, E): blocks past their expert's rows leave before any barrier."""
    simt.reset_stats()
    _check(grouped_case(expert_weights(4, 130, 200), [3, 0, 9, 1], 8))  # rows 13 -> 2 column blocks, Mt 3, Kt 4
    s = simt.stats()
    assert s["launches"] == 1 and s["blocks"] == 2 * 3 * 4
    working = 3 * (1 + 0 + 2 + 1)  # blocks holding rows: expert rows 3, 0, 9, 1 -> 1, 0, 2, 1 column blocks
    assert s["barriers"] == working * (1 + 4)
    with pytest.raises(RuntimeError, match="zipgemm_grouped failed"):
        simt.zipgemm_grouped(0, 0, 0, 0, 64, 64, 0, 1, 8, 1, 0)  # E = 0
    with pytest.raises(RuntimeError, match="zipgemm_grouped failed"):
        simt.zipgemm_grouped(0, 0, 0, 0, 64, 64, 2, 1, 12, 1, 0)  # tile_n 12


# ------------------------------------------------------------------ decompress
def test_decompress_all_patterns_ordered_and_shuffled():
    rng = np.random.default_rng(1)
    _check(decompress_case(ALL.reshape(256, 256), "ordered"))  # runs of consecutive patterns: many fallbacks
    _check(decompress_case(rng.permutation(ALL).reshape(256, 256), "shuffled"))
    _check(decompress_case(rng.permutation(ALL).reshape(128, 512), "shuffled 128x512"))


@pytest.mark.parametrize("shape", [(1, 1), (1, 65), (65, 1), (63, 64), (64, 63), (100, 130), (129, 257), (200, 72)])
def test_decompress_awkward_shapes(shape):
    rng = np.random.default_rng(list(shape))
    _check(decompress_case(weight(rng, *shape)))
    _check(decompress_case(rng.integers(0, 65536, size=shape, dtype=np.uint32).astype(np.uint16), "random bits"))


def test_decompress_degenerate_tiles():
    z = np.zeros((64, 64), np.uint16)  # H = 0: an empty sm stream
    assert reference.encode(z).sm.size == 0
    _check(decompress_case(z, "all zero"))
    _check(decompress_case(np.full((64, 64), 0x3F80, np.uint16), "H = 4096"))
    _check(decompress_case(np.full((70, 70), 0x7FC1, np.uint16), "NaN payloads"))
    w = np.zeros((64, 128), np.uint16)
    w[:, :16] = 0x3C00  # 16 k high-frequency elements per tile: the over-read sits at the segment end
    _check(decompress_case(w, "segment end"))


def test_decompress_noncanonical_layout():
    w = weight(np.random.default_rng(5), 130, 190)
    moved = kernels.noncanonical(reference.encode(w))
    assert np.array_equal(reference.decode(reference.Encoded(moved.m, moved.k, moved.bitmaps, moved.base,
                                                              moved.offsets, moved.sm, moved.fb)), w)
    _check(decompress_case(w, "non-canonical", e=moved))


def test_one_lane_by_hand():
    """decode_lane_pair itself (the function every decode above runs), on values worked out by hand."""
    p0, p1, p2 = 0b1, 0b0, 0b1  # code at position 0: 1 | 0 << 1 | 1 << 2 = 5; position 1 a fallback
    v = simt.lane_decode_one(p0, p1, p2, 120, [0x85, 0, 0], [0x1234, 0x5678, 0], 0, 0, 0)
    assert v & 0xFFFF == (0x8000 | (125 << 7) | 5)  # sign 1, exponent base + code, mantissa 5
    assert v >> 16 == 0x1234  # the FT's first fallback
    v = simt.lane_decode_one(p0, p1, p2, 120, [0x85, 0, 0], list(range(0x100, 0x108)), 0, 0, 1)
    assert (v & 0xFFFF, v >> 16) == (0x101, 0x102)  # lane 1: positions 2, 3 = fallbacks 2 and 3 - 1 before


# ------------------------------------------------------------------ embedding gather
@pytest.mark.parametrize("m,k", [(1, 1), (64, 64), (130, 452), (200, 70), (256, 1024)])
@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_embedding_equals_lookup(m, k, ids_dtype):
    """Ids in the table, in vLLM's padding rows (zeros) and outside [0, rows) (clamped)."""
    w = weight(np.random.default_rng(m + k), m, k)
    rows = m + 37
    rng = np.random.default_rng(1)
    ids = np.concatenate([rng.integers(0, m, 40), [0, m - 1, m, rows - 1, -5, rows + 9]]).astype(ids_dtype)
    padded = np.concatenate([w, np.zeros((rows - m, k), np.uint16)])
    want = padded[np.clip(ids.astype(np.int64), 0, rows - 1)]
    _check(cases.weight(reference.encode(w), kind="embedding", ids=ids, rows=rows, want=want))


def test_embedding_all_patterns_noncanonical():
    w = ALL.reshape(256, 256)
    ids = np.arange(256, dtype=np.int64)[::-1].copy()
    moved = kernels.noncanonical(reference.encode(w))
    _check(cases.weight(moved, kind="embedding", ids=ids, rows=256, want=w[ids]))


# ------------------------------------------------------------------ GPU encoder
@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (65, 63), (100, 130), (129, 257)])
def test_encoder_equals_reference(shape):
    rng = np.random.default_rng(list(shape))
    w = rng.integers(0, 65536, size=shape, dtype=np.uint32).astype(np.uint16)
    if shape[0] > 1:
        w[: shape[0] // 2] = weight(rng, shape[0] // 2, shape[1])
    _check(encode_case(w))


def test_encoder_all_patterns_and_ties():
    for name, w in (("all patterns", np.random.default_rng(3).permutation(ALL).reshape(256, 256)),
                    ("zeros", np.zeros((64, 64), np.uint16)), ("ones", np.full((70, 64), 0x3F80, np.uint16)),
                    ("cover tie", np.tile(np.array([0x0080, 0x3F80], np.uint16), (64, 32)))):
        _check(encode_case(w, name))


def test_encoder_with_the_packages_host_step():
    """encode_tiles -> kernels.cuda.canonical_offsets (torch, the GPU path's own host step) -> encode_scatter."""
    import torch

    from zipserv_vllm.kernels.cuda import canonical_offsets

    w = weight(np.random.default_rng(9), 150, 200)
    got = kernels.encode(simt, w, offsets_fn=lambda h: (lambda o, s, f: (o.numpy(), s, f))(
        *canonical_offsets(torch.from_numpy(h))))
    e = reference.encode(w)
    for n in cases.ENC:
        np.testing.assert_array_equal(getattr(got, n), getattr(e, n), err_msg=n)


# ------------------------------------------------------------------ schedules, host wrappers
@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_other_thread_schedules(schedule):
    """The same kernels with the block's threads resumed in another order: no result depends on one."""
    simt.configure(schedule, 11)
    rng = np.random.default_rng(4)
    w = weight(rng, 130, 200)
    for c in (gemm_case(130, 452, 21, 32, 3), gemm_case(100, 130, 9, 128, 1), decompress_case(w),
              encode_case(w), cases.weight(reference.encode(w), kind="embedding", ids=np.arange(130, dtype=np.int32),
                                            rows=130, want=w)):
        _check(c)


def test_launch_needs_prepare_for_large_tiles():
    """tile_n 128 uses 61 KiB of dynamic shared memory: prepare() (cudaFuncSetAttribute for every
    instance, csrc/cuda/zipgemm.cu) must run first, as kernels/cuda.py does before any launch."""
    simt.reset_device()
    c = gemm_case(64, 64, 3, 128, 1)
    msg = cases.run(simt, c)
    assert msg and "zipgemm failed" in msg and "cudaFuncSetAttribute" in msg and "over the kernel's limit" in msg
    assert cases.run(simt, gemm_case(64, 64, 3, 64, 1)) is None  # 33 KiB: under the default 48 KiB
    simt.prepare()
    _check(c)


def test_every_instance_fits_an_sm86_class_device():
    """99 KiB of shared memory per block (sm_86 / sm_89): prepare() succeeds and every instance runs."""
    assert max(simt.fused_smem_bytes(t) for t in simt.tile_ns()) <= 99 * 1024
    simt.configure("forward", 1, device_max_dynamic_shared=99 * 1024)
    try:
        simt.reset_device()
        simt.prepare()
        for t in simt.tile_ns():
            _check(gemm_case(70, 130, 5, t, 1))
        simt.configure("forward", 1, device_max_dynamic_shared=48 * 1024)
        simt.reset_device()
        with pytest.raises(RuntimeError, match="prepare"):
            simt.prepare()  # a device that cannot hold tile_n 64/128: refused up front
    finally:
        simt.configure("forward", 1, device_max_dynamic_shared=227 * 1024)
        simt.reset_device()
        simt.prepare()


def test_host_wrappers_refuse_bad_arguments():
    c = gemm_case(64, 64, 3, 8, 1)
    for tile_n, split, msg in ((12, 1, "invalid argument"), (8, 0, "invalid argument")):
        e = cases._enc(c)
        y = np.zeros((3, 64), np.uint16)
        with pytest.raises(RuntimeError, match="zipserv CUDA zipgemm failed"):
            simt.zipgemm(kernels.ptr(c["x"]), kernels.ptr(e.bitmaps), kernels.ptr(e.base), kernels.ptr(e.offsets),
                         kernels.ptr(e.sm), kernels.ptr(e.fb), 0, kernels.ptr(y), 0, 64, 64, 3, tile_n, split, 1, 0)
    with pytest.raises(RuntimeError, match="decompress failed"):
        simt.decompress(0, 0, 0, 0, 0, 0, 0, 64, 0)  # M = 0


def test_splitk_partition_covers_k_once():
    for kt in range(1, 70):
        for split in range(1, 20):
            parts = simt.splitk_parts(kt, split)
            assert parts == dispatch.splitk_parts(kt, split) and 1 <= parts <= min(kt, split)
            per = -(-kt // split)
            ranges = [(p * per, min(kt, p * per + per)) for p in range(parts)]
            assert all(b > a for a, b in ranges) and ranges[-1][1] == kt


def test_the_harness_ran_the_kernels():
    """Counters of one split-K launch equal what the kernels' structure implies: blocks, barriers,
    warp collectives (two __reduce_add_sync per warp and tile, one mma.sync per n8 group that holds a
    real column) and cp.async copies executed."""
    simt.reset_stats()
    _check(gemm_case(130, 452, 21, 32, 3))  # Mt = 3, Kt = 8 -> parts of 3, 3, 2 tiles; tile_n 32, N = 21
    s = simt.stats()
    mt, kt, parts = 3, 8, 3
    assert s["launches"] == 2  # fused + split-K reduction
    assert s["blocks"] == mt * parts + -(-130 * 21 // 256)
    assert s["barriers"] == mt * (parts + kt)  # one in the prologue and one per tile, per part
    mma = mt * 4 * kt * 4 * 3  # rows x warps x tiles x K slices x n8 groups holding columns 0..20
    assert s["mma"] == mma
    assert s["collectives"] == mma + mt * kt * 4 * 2
    assert s["cp_async"] > mt * kt * 96  # at least the bit-planes: 96 chunks per tile
