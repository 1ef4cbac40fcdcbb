"""The slow, readable reference codec of TCA-TBE v1 (docs/FORMAT.md).

This is the oracle: every fast encoder and decoder in the project (native C++,
CPU kernels, CUDA kernels) is tested against these functions bit for bit. It
uses NumPy only and favours clarity over speed; it still handles a 4096 x 4096
matrix in a few seconds.

Arrays are the ones of FORMAT.md section 6, as NumPy arrays:
``bitmaps`` uint64 [Mt, Kt, 3, 64], ``base`` uint8 [Mt, Kt],
``offsets`` int64 [Mt, Kt, 2], ``sm`` uint8 [S], ``fb`` uint16 [F].
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from . import spec


@dataclass
class Encoded:
    """The arrays of one compressed matrix (NumPy), plus its shape."""

    m: int
    k: int
    bitmaps: np.ndarray  # uint64 [Mt, Kt, 3, 64]
    base: np.ndarray  # uint8 [Mt, Kt]
    offsets: np.ndarray  # int64 [Mt, Kt, 2]
    sm: np.ndarray  # uint8 [S]
    fb: np.ndarray  # uint16 [F]


def grid(m: int, k: int) -> tuple[int, int]:
    """Number of tile rows and tile columns of an M x K matrix."""
    return -(-m // spec.TILE), -(-k // spec.TILE)


def _linear_order() -> np.ndarray:
    """rows[q], cols[q]: where the element of linear index q sits in its tile."""
    q = np.arange(spec.TILE_ELEMS)
    f, p = q // spec.FRAG_ELEMS, q % spec.FRAG_ELEMS
    rows = np.array([spec.frag_row0(x) for x in range(spec.FRAGS_PER_TILE)])[f] + p // spec.FRAG
    cols = np.array([spec.frag_col0(x) for x in range(spec.FRAGS_PER_TILE)])[f] + p % spec.FRAG
    return rows, cols


_ROWS, _COLS = _linear_order()


def choose_base(exponents: np.ndarray) -> int:
    """base_exp of a tile, from the exponent fields of its non-padding elements."""
    hist = np.bincount(exponents.astype(np.int64), minlength=256)
    best_start, best_cover = spec.MIN_WINDOW_START, -1
    for start in range(spec.MIN_WINDOW_START, spec.MAX_WINDOW_START + 1):
        cover = int(hist[start : start + spec.WINDOW].sum())
        if cover > best_cover:  # strict: the smallest start wins ties
            best_start, best_cover = start, cover
    return best_start - 1


def encode_tile(values: np.ndarray, valid: np.ndarray):
    """Encode one tile.

    values: uint16 [64, 64] BF16 bits (padding positions arbitrary);
    valid: bool [64, 64], False at padding positions.
    Returns (planes uint64 [3, 64], base, sm segment uint8, fb segment uint16).
    """
    v = values[_ROWS, _COLS]  # linear order q
    ok = valid[_ROWS, _COLS]
    exp = (v >> 7) & 0xFF
    base = choose_base(exp[ok])
    rel = exp.astype(np.int64) - base
    code = np.where((rel >= 1) & (rel <= spec.WINDOW), rel, 0)
    code = np.where(ok, code, spec.PAD_CODE)
    sm_byte = (((v >> 8) & 0x80) | (v & 0x7F)).astype(np.uint8)
    sm_byte = np.where(ok, sm_byte, spec.PAD_SM).astype(np.uint8)

    planes = np.zeros((spec.PLANES, spec.FRAGS_PER_TILE), dtype=np.uint64)
    weights = np.left_shift(np.uint64(1), np.arange(64, dtype=np.uint64))
    bits = code.reshape(spec.FRAGS_PER_TILE, spec.FRAG_ELEMS)
    for b in range(spec.PLANES):
        plane_bits = ((bits >> b) & 1).astype(np.uint64)
        planes[b] = (plane_bits * weights).sum(axis=1, dtype=np.uint64)

    hi = code != 0
    h = int(hi.sum())
    sm = np.zeros(spec.sm_segment_len(h), dtype=np.uint8)
    sm[:h] = sm_byte[hi]
    fb = np.zeros(spec.fb_segment_len(h), dtype=np.uint16)
    fb[: spec.TILE_ELEMS - h] = v[~hi]
    return planes, base, sm, fb


def encode(w: np.ndarray) -> Encoded:
    """Encode a 2-D uint16 array of BF16 bit patterns."""
    if w.ndim != 2 or w.dtype != np.uint16:
        raise ValueError(f"expected a 2-D uint16 array, got {w.dtype} {w.shape}")
    m, k = w.shape
    if m < 1 or k < 1:
        raise ValueError(f"cannot encode an empty matrix of shape {w.shape}")
    mt, kt = grid(m, k)
    padded = np.zeros((mt * spec.TILE, kt * spec.TILE), dtype=np.uint16)
    padded[:m, :k] = w
    valid = np.zeros(padded.shape, dtype=bool)
    valid[:m, :k] = True

    bitmaps = np.zeros((mt, kt, spec.PLANES, spec.FRAGS_PER_TILE), dtype=np.uint64)
    base = np.zeros((mt, kt), dtype=np.uint8)
    offsets = np.zeros((mt, kt, 2), dtype=np.int64)
    sm_parts, fb_parts = [], []
    off_sm = off_fb = 0
    for tm in range(mt):
        for tk in range(kt):
            rows = slice(tm * spec.TILE, (tm + 1) * spec.TILE)
            cols = slice(tk * spec.TILE, (tk + 1) * spec.TILE)
            planes, b, sm, fb = encode_tile(padded[rows, cols], valid[rows, cols])
            bitmaps[tm, tk], base[tm, tk] = planes, b
            offsets[tm, tk] = (off_sm, off_fb)
            sm_parts.append(sm)
            fb_parts.append(fb)
            off_sm += sm.size
            off_fb += fb.size
    return Encoded(
        m, k, bitmaps, base, offsets,
        np.concatenate(sm_parts), np.concatenate(fb_parts),
    )


def _popcount64(x: np.ndarray) -> np.ndarray:
    """Population count of each uint64."""
    return np.bitwise_count(x.astype(np.uint64)).astype(np.int64)


def tile_high_counts(bitmaps: np.ndarray) -> np.ndarray:
    """H of every tile: popcount of the indicators, shape [Mt, Kt]."""
    ind = bitmaps[..., 0, :] | bitmaps[..., 1, :] | bitmaps[..., 2, :]
    return _popcount64(ind).sum(axis=-1)


def check_offsets(e: Encoded) -> None:
    """Raise ValueError unless every tile's segments are aligned and in bounds."""
    h = tile_high_counts(e.bitmaps)
    sm_len = -(-h // spec.SM_ALIGN) * spec.SM_ALIGN
    fb_len = -(-(spec.TILE_ELEMS - h) // spec.FB_ALIGN) * spec.FB_ALIGN
    off_sm, off_fb = e.offsets[..., 0], e.offsets[..., 1]
    bad = (
        (off_sm % spec.SM_ALIGN != 0) | (off_fb % spec.FB_ALIGN != 0)
        | (off_sm < 0) | (off_fb < 0)
        | (off_sm + sm_len > e.sm.size) | (off_fb + fb_len > e.fb.size)
    )
    if bad.any():
        tm, tk = np.argwhere(bad)[0]
        raise ValueError(
            f"tile ({tm}, {tk}) has segment offsets ({off_sm[tm, tk]}, {off_fb[tm, tk]}) "
            f"outside streams of {e.sm.size} bytes and {e.fb.size} elements or misaligned"
        )


def _plane_bits(word: np.ndarray) -> np.ndarray:
    """uint64 [64] -> 0/1 int64 [4096]: bit p of word f at linear index f * 64 + p."""
    shifts = np.arange(64, dtype=np.uint64)
    return ((word[:, None] >> shifts[None, :]) & np.uint64(1)).astype(np.int64).reshape(-1)


def decode_tile(planes: np.ndarray, base: int, sm: np.ndarray, fb: np.ndarray,
                off_sm: int, off_fb: int) -> np.ndarray:
    """Decode one tile to uint16 [64, 64] (FORMAT.md section 5).

    For linear index q (FT f, position p), hi(q) counts the high-frequency
    elements before q in the tile: the popcounts of earlier FTs plus
    popcount(ind[f] & ((1 << p) - 1)). Over the whole tile that is simply the
    exclusive prefix sum of the indicator bits in q order.
    """
    code = sum(_plane_bits(planes[b]) << b for b in range(spec.PLANES))
    is_hi = code != 0
    hi = np.cumsum(is_hi) - is_hi  # exclusive prefix count
    q = np.arange(spec.TILE_ELEMS)
    s = sm[off_sm + hi[is_hi]].astype(np.uint16)
    values = np.empty(spec.TILE_ELEMS, dtype=np.uint16)
    values[is_hi] = ((s & 0x80) << 8) | ((base + code[is_hi]).astype(np.uint16) << 7) | (s & 0x7F)
    values[~is_hi] = fb[off_fb + (q - hi)[~is_hi]]
    out = np.empty((spec.TILE, spec.TILE), dtype=np.uint16)
    out[_ROWS, _COLS] = values
    return out


def decode(e: Encoded) -> np.ndarray:
    """Decode to a uint16 [M, K] array of BF16 bit patterns."""
    check_offsets(e)
    mt, kt = grid(e.m, e.k)
    if e.bitmaps.shape != (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE):
        raise ValueError(f"bitmaps of shape {e.bitmaps.shape} do not fit a {e.m} x {e.k} matrix")
    out = np.zeros((mt * spec.TILE, kt * spec.TILE), dtype=np.uint16)
    for tm in range(mt):
        for tk in range(kt):
            out[tm * spec.TILE:(tm + 1) * spec.TILE, tk * spec.TILE:(tk + 1) * spec.TILE] = decode_tile(
                e.bitmaps[tm, tk], int(e.base[tm, tk]), e.sm, e.fb,
                int(e.offsets[tm, tk, 0]), int(e.offsets[tm, tk, 1]),
            )
    return out[: e.m, : e.k]


def tile_crc(e: Encoded) -> np.ndarray:
    """The tile checksums (FORMAT.md section 6, ``zs_crc``) as uint32 [Mt, Kt]: zlib CRC-32 of
    each tile's bit-plane bytes, base byte, sign-mantissa segment and fallback segment."""
    check_offsets(e)
    h = tile_high_counts(e.bitmaps)
    mt, kt = e.bitmaps.shape[:2]
    out = np.empty((mt, kt), dtype=np.uint32)
    sm, fb = np.ascontiguousarray(e.sm), np.ascontiguousarray(e.fb, dtype="<u2")
    for tm in range(mt):
        for tk in range(kt):
            hp, fp = spec.sm_segment_len(int(h[tm, tk])), spec.fb_segment_len(int(h[tm, tk]))
            o_sm, o_fb = int(e.offsets[tm, tk, 0]), int(e.offsets[tm, tk, 1])
            crc = zlib.crc32(np.ascontiguousarray(e.bitmaps[tm, tk], dtype="<u8").tobytes())
            crc = zlib.crc32(bytes([int(e.base[tm, tk])]), crc)
            crc = zlib.crc32(sm[o_sm:o_sm + hp].tobytes(), crc)
            out[tm, tk] = zlib.crc32(fb[o_fb:o_fb + fp].tobytes(), crc)
    return out
