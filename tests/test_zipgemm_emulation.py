"""Fragment-level CPU replay of the fused ZipGEMM kernel vs a reference GEMM.

``zipserv_vllm._emul.emulate_zipgemm`` runs the kernel's data path with the
kernel's own index math (csrc/cuda/zipgemm_layout.cuh + decode_lane.h): the
per-warp staging, the lane decode into A registers, the swizzled X tile and
B fragment loads, an mma.m16n8k16 defined independently from the PTX ISA
fragment tables, the split-K partition and reduction, and the epilogue
(bias, bf16 rounding, masking of rows >= M and columns >= N). Results are
compared with float64 X . W^T of the reference-decoded weight.

The tolerance is 1e-5 of sum_k |x||w| per output, far below what a single
wrong weight element contributes, and each deliberate perturbation of a
mapping (lane, A registers, swizzle, fallback offset, split-K range, C map)
must break it. Budget: ~10 s on 2 cores.
"""

import numpy as np
import pytest

from zipserv_vllm.kernels import dispatch
from zipserv_vllm.format import reference

_emul = pytest.importorskip("zipserv_vllm._emul", reason="zipserv_vllm._emul not built (pip install -e .)")


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    u = a.view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # RNE, finite inputs


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _weight(rng, m, k):
    w = rng.standard_normal((m, k)) * 0.02
    w.flat[rng.integers(0, m * k, size=max(1, m * k // 50))] = 0.0  # zeros (fallback)
    w.flat[rng.integers(0, m * k, size=max(1, m * k // 200))] *= 300.0  # outliers (fallback)
    w.flat[rng.integers(0, m * k, size=max(1, m * k // 500))] = 1e-39  # subnormals (fallback)
    return _bf16_bits(w)


_CACHE = {}


def _case(m, k, n, seed=0):
    key = (m, k, n, seed)
    if key not in _CACHE:
        rng = np.random.default_rng([m, k, n, seed])
        w = _weight(rng, m, k)
        e = reference.encode(w)
        x = _bf16_bits(rng.standard_normal((n, k)))
        bias = _bf16_bits(rng.standard_normal(m) * 0.1)
        _CACHE[key] = (e, _f32(reference.decode(e)), x, bias)
    return _CACHE[key]


def _run(e, x, bias, tile_n, split, perturb=0):
    return _emul.emulate_zipgemm(x, e.bitmaps, e.base, e.offsets, e.sm, e.fb, bias, e.m, e.k, tile_n, split, perturb)


def _errors(e, wf, x, bias, yf):
    xf = _f32(x).astype(np.float64)
    ref = xf @ wf.astype(np.float64).T
    scale = np.abs(xf) @ np.abs(wf.astype(np.float64)).T
    if bias is not None:
        ref = ref + _f32(bias)
        scale = scale + np.abs(_f32(bias))
    return np.abs(yf - ref) - (1e-5 * scale + 1e-30), ref


def _assert_close(e, wf, x, bias, y, yf):
    excess, ref = _errors(e, wf, x, bias, yf)
    assert (excess <= 0).all(), f"fp32 result off by {np.nanmax(excess):.3g} beyond tolerance (NaN = unwritten)"
    # epilogue: the bf16 output is the kernels' RNE rounding of the fp32 result
    np.testing.assert_array_equal(y, np.vectorize(_emul.f32_to_bf16, otypes=[np.uint16])(yf))
    # and the bf16 output within bf16 rounding (half an ulp, <= 2^-8 relative) of the reference
    assert (np.abs(_f32(y) - ref) <= 2.0**-8 * np.abs(ref) + 1e-5 * np.abs(ref).max() + 1e-30).all()


SHAPES = [(1, 1), (3, 7), (64, 64), (100, 130), (192, 320), (257, 96), (65, 577)]
NS = [1, 2, 3, 8, 9, 16, 17, 33, 64, 129]


@pytest.mark.parametrize("m,k", SHAPES)
@pytest.mark.parametrize("n", NS)
def test_dispatched_config_matches_reference(m, k, n):
    e, wf, x, bias = _case(m, k, n)
    tn = dispatch.tile_n_for(n)
    for split, b in ((1, None), (3, bias)):
        y, yf = _run(e, x, b, tn, split)
        _assert_close(e, wf, x, b, y, yf)


@pytest.mark.parametrize("tile_n", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("split", [1, 2, 4, 7, 100])
def test_every_instance_and_split(tile_n, split):
    """Every kernel instance, splits that divide Kt, do not, and exceed it."""
    e, wf, x, bias = _case(130, 452, 21)  # Kt = 8, N ragged for every tile_n
    y, yf = _run(e, x, bias, tile_n, split)
    _assert_close(e, wf, x, bias, y, yf)


def test_splitk_partition_covers_k_once():
    for kt in range(1, 70):
        for split in range(1, 20):
            parts = _emul.splitk_parts(kt, split)
            assert parts == dispatch.splitk_parts(kt, split) and 1 <= parts <= min(kt, split)
            per = -(-kt // split)
            ranges = [(p * per, min(kt, p * per + per)) for p in range(parts)]
            assert all(b > a for a, b in ranges) and ranges[-1][1] == kt


def test_k_tail_padding_is_zeroed():
    """K = 65: one real column in the last tile; padding weights must contribute nothing."""
    e, wf, x, bias = _case(64, 65, 5)
    y, yf = _run(e, x, None, 8, 1)
    _assert_close(e, wf, x, None, y, yf)


PERTURBATIONS = ["lane", "a_regs", "x_swizzle", "fb_offset", "splitk_range", "c_map"]


@pytest.mark.parametrize("flag", PERTURBATIONS)
def test_wrong_mapping_fails(flag):
    """Each deliberately wrong layout / offset must break the comparison."""
    e, wf, x, bias = _case(192, 320, 17)
    split = 2 if flag == "splitk_range" else 1
    y, yf = _run(e, x, bias, 32, split)
    _assert_close(e, wf, x, bias, y, yf)  # unperturbed passes
    y, yf = _run(e, x, bias, 32, split, _emul.PERTURBATIONS[flag])
    excess, _ = _errors(e, wf, x, bias, yf)
    assert not (excess <= 0).all(), f"perturbation {flag} went unnoticed"  # NaN (unwritten) counts as wrong


# ------------------------------------------------------------ GPU encoder replay
def _encode_replay(w):
    import torch

    from zipserv_vllm.kernels.cuda import canonical_offsets

    bitmaps, base, hcount, ssm, sfb = _emul.emulate_encode_tiles(w)
    off, s_len, f_len = canonical_offsets(torch.from_numpy(hcount))
    off = off.numpy()
    sm, fb = _emul.emulate_encode_scatter(hcount, off, ssm, sfb, s_len, f_len)
    return reference.Encoded(w.shape[0], w.shape[1], bitmaps, base, off.reshape(*base.shape, 2), sm, fb)


@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (65, 63), (100, 130), (129, 257)])
def test_encoder_replay_equals_reference(shape):
    """encode.cu's per-element rules and index math (encode_layout.cuh), replayed on the CPU."""
    rng = np.random.default_rng(shape)
    w = rng.integers(0, 65536, size=shape, dtype=np.uint32).astype(np.uint16)
    w[: shape[0] // 2] = _weight(rng, shape[0] // 2, shape[1]) if shape[0] > 1 else w[:0]
    e, got = reference.encode(w), _encode_replay(w)
    for name in ("bitmaps", "base", "offsets", "sm", "fb"):
        np.testing.assert_array_equal(getattr(got, name), getattr(e, name), err_msg=name)


def test_encoder_replay_all_patterns_and_ties():
    allp = np.random.default_rng(3).permutation(65536).astype(np.uint16).reshape(256, 256)
    for w in (allp, np.zeros((64, 64), np.uint16), np.full((70, 64), 0x3F80, np.uint16),
              np.tile(np.array([0x0080, 0x3F80], np.uint16), (64, 32))):  # exponents 1 and 127: a cover tie
        e, got = reference.encode(w), _encode_replay(w)
        for name in ("bitmaps", "base", "offsets", "sm", "fb"):
            np.testing.assert_array_equal(getattr(got, name), getattr(e, name), err_msg=name)


# ------------------------------------------------------------ pipeline schedule
def test_pipeline_schedule_has_no_hazard():
    """The fused kernel's buffer rotation (pipe_* in zipgemm_layout.cuh): every read
    sees the tile it wants, no buffer is read and written between two barriers."""
    for nt in range(0, 40):
        assert _emul.pipeline_check(nt) == [], nt


def test_pipeline_check_catches_two_plane_buffers():
    assert _emul.pipeline_check(1, 2) == []  # one tile: nothing to overlap
    bad = _emul.pipeline_check(6, 2)  # planes two tiles ahead need three buffers
    assert bad and any("read while written" in b for b in bad)


# --------------------------------------------------------- embedding gather
def _embedding_case(m, k, seed, patterns=False):
    rng = np.random.default_rng(seed)
    if patterns:  # every BF16 bit pattern: NaN payloads, -0, inf, subnormals
        w = np.arange(65536, dtype=np.uint16)[: m * k].reshape(m, k)
    else:
        w = _weight(rng, m, k)
    e = reference.encode(w)
    return w, e


@pytest.mark.parametrize("m,k", [(1, 1), (64, 64), (130, 452), (200, 70), (256, 1024)])
@pytest.mark.parametrize("ids_dtype", [np.int32, np.int64])
def test_embedding_kernel_body_equals_lookup(m, k, ids_dtype):
    """The embedding kernel's own block body (gather_layout.cuh), run for every thread of every
    block, equals F.embedding on the padded table: ids in the table, in the padding rows
    (zeros) and outside [0, rows) (clamped, as the kernel documents)."""
    w, e = _embedding_case(m, k, seed=m + k)
    rows = m + 37
    rng = np.random.default_rng(1)
    ids = np.concatenate([rng.integers(0, m, 40), [0, m - 1, m, rows - 1, -5, rows + 9]]).astype(ids_dtype)
    out = _emul.emulate_embedding(ids, e.bitmaps, e.base, e.offsets, e.sm, e.fb, m, k, rows)
    padded = np.concatenate([w, np.zeros((rows - m, k), dtype=np.uint16)])
    want = padded[np.clip(ids.astype(np.int64), 0, rows - 1)]
    assert out.shape == (len(ids), k)
    np.testing.assert_array_equal(out, want)


def test_embedding_kernel_body_all_patterns_and_noncanonical_layout():
    """All 65,536 patterns, with the segments stored in reverse tile order and garbage between them."""
    w, e = _embedding_case(256, 256, 0, patterns=True)
    sm_len, fb_len = (x.reshape(-1) for x in _segment_lengths(e.bitmaps))
    g = sm_len.size
    sm, fb, off = [], [], np.zeros((g, 2), dtype=np.int64)
    pos_sm = pos_fb = 0
    for t in reversed(range(g)):
        sm.append(np.full(16, 0xAB, np.uint8)); pos_sm += 16
        fb.append(np.full(8, 0xCDEF, np.uint16)); pos_fb += 8
        a, b = e.offsets.reshape(-1, 2)[t]
        off[t] = (pos_sm, pos_fb)
        sm.append(e.sm[a:a + sm_len[t]]); pos_sm += sm_len[t]
        fb.append(e.fb[b:b + fb_len[t]]); pos_fb += fb_len[t]
    ids = np.arange(256, dtype=np.int64)[::-1].copy()
    out = _emul.emulate_embedding(ids, e.bitmaps, e.base, off.reshape(e.offsets.shape), np.concatenate(sm),
                                  np.concatenate(fb), 256, 256, 256)
    np.testing.assert_array_equal(out, w[ids])


def _segment_lengths(bitmaps):
    h = reference.tile_high_counts(bitmaps)
    return -(-h // 16) * 16, -(-(4096 - h) // 8) * 8
