"""The per-lane decode (csrc/include/zipserv/decode_lane.h), host build, vs the reference decoder.

``zipserv_vllm._emul`` compiles the same ``ZS_HD decode_lane_pair`` the CUDA
kernels use. Every lane (0..31) of every FT of every tile goes through it and
the rebuilt matrix must equal ``reference.decode`` bit for bit: all 65,536
BF16 patterns, awkward shapes with padding, degenerate tiles, non-canonical
segment layouts. ``emulate_decompress`` replays the decompress kernel
(per-warp counts, staging ranges and the over-read bound included).
Budget: a few seconds on 2 cores.
"""

import numpy as np
import pytest

from zipserv_vllm.format import reference, spec

_emul = pytest.importorskip("zipserv_vllm._emul", reason="zipserv_vllm._emul not built (pip install -e .)")


def _gauss_bits(rng, m, k, scale=0.02):
    w = (rng.standard_normal((m, k)) * scale).astype(np.float32)
    return (w.view(np.uint32) >> 16).astype(np.uint16)


def _args(e):
    return e.bitmaps, e.base, e.offsets, e.sm, e.fb, e.m, e.k


def _check(w):
    e = reference.encode(w)
    ref = reference.decode(e)
    assert np.array_equal(ref, w)  # the oracle itself round-trips
    got = _emul.lane_decode_matrix(*_args(e))
    assert got.dtype == np.uint16 and got.shape == w.shape
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(_emul.emulate_decompress(*_args(e)), ref)
    return e


def test_all_65536_patterns_ordered_and_shuffled():
    allp = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    _check(allp.reshape(256, 256))  # runs of consecutive patterns: many fallbacks
    rng = np.random.default_rng(1)
    _check(rng.permutation(allp).reshape(256, 256))  # every tile mixed
    _check(rng.permutation(allp).reshape(128, 512))


@pytest.mark.parametrize("shape", [(1, 1), (1, 65), (65, 1), (63, 64), (64, 63), (100, 130), (129, 257), (200, 72)])
def test_awkward_shapes_with_padding(shape):
    rng = np.random.default_rng(hash(shape) % 2**32)
    _check(_gauss_bits(rng, *shape))
    _check(rng.integers(0, 65536, size=shape, dtype=np.uint32).astype(np.uint16))


def test_degenerate_tiles():
    z = np.zeros((64, 64), np.uint16)  # H = 0: an empty sm stream
    e = _check(z)
    assert e.sm.size == 0
    _check(np.full((64, 64), 0x3F80, np.uint16))  # all high-frequency: H = 4096, no fallback
    _check(np.full((70, 70), 0x7FC1, np.uint16))  # NaN payload tiles, padding
    # exactly 16*k high-frequency elements per tile: the over-read sits at the segment end
    w = np.zeros((64, 128), np.uint16)
    w[:, :16] = 0x3C00
    _check(w)


def test_non_canonical_layout():
    """Segments in reverse tile order with gaps: the decoder uses only the per-tile starts."""
    rng = np.random.default_rng(5)
    w = _gauss_bits(rng, 130, 190)
    e = reference.encode(w)
    h = reference.tile_high_counts(e.bitmaps).reshape(-1)
    sm_len = -(-h // 16) * 16
    fb_len = -(-(4096 - h) // 8) * 8
    old = e.offsets.reshape(-1, 2)
    sm_parts, fb_parts, new = [], [], np.zeros_like(old)
    pos_sm = pos_fb = 0
    for g in reversed(range(h.size)):
        sm_parts += [np.full(32, 0xEE, np.uint8), e.sm[old[g, 0]:old[g, 0] + sm_len[g]]]
        fb_parts += [np.full(24, 0xBEEF, np.uint16), e.fb[old[g, 1]:old[g, 1] + fb_len[g]]]
        pos_sm += 32
        pos_fb += 24
        new[g] = (pos_sm, pos_fb)
        pos_sm += sm_len[g]
        pos_fb += fb_len[g]
    moved = reference.Encoded(e.m, e.k, e.bitmaps, e.base, new.reshape(e.offsets.shape),
                              np.concatenate(sm_parts), np.concatenate(fb_parts))
    np.testing.assert_array_equal(reference.decode(moved), w)
    np.testing.assert_array_equal(_emul.lane_decode_matrix(*_args(moved)), w)
    np.testing.assert_array_equal(_emul.emulate_decompress(*_args(moved)), w)


def test_one_lane_by_hand():
    # FT with position 0 high-frequency (code 5), position 1 fallback.
    p0, p1, p2 = 0b1, 0b0, 0b1  # code at p=0: 1 | 0 << 1 | 1 << 2 = 5
    sm = np.array([0x85, 0, 0], np.uint8)  # sign 1, mantissa 5
    fb = np.array([0x1234, 0x5678, 0], np.uint16)
    v = _emul.lane_decode_one(p0, p1, p2, 120, sm, fb, 0, 0, 0)
    assert v & 0xFFFF == (0x8000 | (125 << 7) | 5)
    assert v >> 16 == 0x1234  # first fallback of the FT (fb index 0 = p - hi_before)
    # lane 1: positions 2, 3 are fallbacks 2 and 3 of the FT, after one sm byte
    fb = np.arange(0, 8, dtype=np.uint16) + 0x100
    v = _emul.lane_decode_one(p0, p1, p2, 120, sm, fb, 0, 0, 1)
    assert (v & 0xFFFF, v >> 16) == (0x101, 0x102)


@pytest.mark.parametrize("flag", ["lane", "fb_offset"])
def test_perturbed_decode_is_caught(flag):
    """A wrong lane mapping or fallback offset must not pass: the test above can fail."""
    rng = np.random.default_rng(2)
    w = _gauss_bits(rng, 64, 128)
    e = reference.encode(w)
    got = _emul.lane_decode_matrix(*_args(e), perturb=_emul.PERTURBATIONS[flag])
    assert not np.array_equal(got, w)


def test_staging_fits_the_format_bound():
    # a medium tile holds 1024 elements; the staging is sized for any split of them
    assert spec.TILE_ELEMS // 4 == 1024
    for t in (8, 16, 32, 64, 128):
        assert _emul.fused_smem_bytes(t) <= 99 * 1024  # sm_86 / sm_89 per-block limit
