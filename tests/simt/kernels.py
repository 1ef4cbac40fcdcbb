"""Launching the CUDA kernels' sources through the SIMT harness (``zipserv_vllm._simt``), numpy only.

The functions take the module (the plain build in-process, or a sanitizer or
planted-fault build loaded by ``child.py``) and call it exactly as
``zipserv_vllm.kernels.cuda`` calls ``_cuda``: raw pointers, sizes, the
split-K part count from ``splitk_parts``, the ``x_vec`` flag. Outputs start
as sentinels (0xFFFF, NaN) so an element a kernel never writes shows.

Imported by file path in the sanitizer child process, so it must not import
torch or the package.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

TILE = 64


def ptr(a: np.ndarray) -> int:
    return a.ctypes.data if a.size else 0


def f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)


def weight_arrays(e) -> SimpleNamespace:
    """The five arrays of an encoded weight (reference.Encoded or any object with them), contiguous."""
    return SimpleNamespace(m=int(e.m), k=int(e.k), **{n: np.ascontiguousarray(getattr(e, n))
                                                      for n in ("bitmaps", "base", "offsets", "sm", "fb")})


def decompress(mod, e) -> np.ndarray:
    e = weight_arrays(e)
    out = np.full((e.m, e.k), 0xFFFF, np.uint16)
    mod.decompress(ptr(e.bitmaps), ptr(e.base), ptr(e.offsets), ptr(e.sm), ptr(e.fb), ptr(out), e.m, e.k, 0)
    return out


def _gemm_buffers(mod, m: int, k: int, x: np.ndarray, split: int):
    """(N, split-K parts, Y and the workspace filled with sentinels, x_vec) of a GEMM launch, as
    kernels/cuda.py computes them."""
    n = x.shape[0]
    kt = -(-k // TILE)
    parts = mod.splitk_parts(kt, max(1, min(split, kt)))
    y = np.full((n, m), 0x7FC1, np.uint16)
    ws = np.full(parts * n * m, np.nan, np.float32) if parts > 1 else None
    return n, parts, y, ws, int(k % 8 == 0 and ptr(x) % 16 == 0)


def zipgemm(mod, e, x: np.ndarray, bias: np.ndarray | None, tile_n: int, split: int) -> np.ndarray:
    """Y [N, M] (bf16 bits) = X [N, K] . W^T (+ bias) by the fused kernel (+ split-K reduction)."""
    e = weight_arrays(e)
    x = np.ascontiguousarray(x, dtype=np.uint16)
    n, parts, y, ws, x_vec = _gemm_buffers(mod, e.m, e.k, x, split)
    mod.zipgemm(ptr(x), ptr(e.bitmaps), ptr(e.base), ptr(e.offsets), ptr(e.sm), ptr(e.fb),
                0 if bias is None else ptr(bias), ptr(y), 0 if ws is None else ptr(ws), e.m, e.k, n, tile_n, parts,
                x_vec, 0)
    return y


PACKED = ("tiles", "luts", "exc_start", "exc")


def zipgemm_packed(mod, pk, x: np.ndarray, bias: np.ndarray | None, tile_n: int, split: int) -> np.ndarray:
    """Y [N, M] (bf16 bits) by the byte-split-layout kernel; pk has m, k and the four arrays of a
    PackedTensor (docs/FORMAT.md appendix A). x may be an unaligned view (the general instance)."""
    n, parts, y, ws, x_vec = _gemm_buffers(mod, pk.m, pk.k, x, split)
    mod.zipgemm_packed(ptr(x), *(ptr(getattr(pk, a)) for a in PACKED), 0 if bias is None else ptr(bias), ptr(y),
                       0 if ws is None else ptr(ws), pk.m, pk.k, n, tile_n, parts, x_vec, 0)
    return y


def decompress_packed(mod, pk) -> np.ndarray:
    """W [M, K] (bf16 bits) rebuilt from the byte-split layout by its decompress kernel; elements the
    kernel never writes stay 0xFFFF."""
    out = np.full((pk.m, pk.k), 0xFFFF, np.uint16)
    mod.decompress_packed(*(ptr(getattr(pk, a)) for a in PACKED), ptr(out), pk.m, pk.k, 0)
    return out


def zipgemm_grouped(mod, experts: list, x: np.ndarray, counts, tile_n: int) -> np.ndarray:
    """Y [rows, M] (bf16 bits) by one grouped launch: X's rows grouped by expert, counts[e] rows
    for expert e (the launch sequence kernels/cuda.py's grouped_gemm uses: an int64 [E, 5] table of
    each expert's array addresses, int32 [E + 1] row starts)."""
    ws = [weight_arrays(e) for e in experts]
    m, k = ws[0].m, ws[0].k
    table = np.ascontiguousarray([[ptr(w.bitmaps), ptr(w.base), ptr(w.offsets), ptr(w.sm), ptr(w.fb)] for w in ws],
                                 dtype=np.uint64)
    starts = np.ascontiguousarray(np.concatenate([[0], np.cumsum(counts)]), dtype=np.int32)
    x = np.ascontiguousarray(x, dtype=np.uint16)
    rows = int(starts[-1])
    assert x.shape == (rows, k)
    y = np.full((rows, m), 0x7FC1, np.uint16)
    x_vec = int(k % 8 == 0 and ptr(x) % 16 == 0)
    mod.zipgemm_grouped(ptr(table), ptr(starts), ptr(x), ptr(y), m, k, len(ws), rows, tile_n, x_vec, 0)
    return y


def embedding(mod, e, ids: np.ndarray, rows: int) -> np.ndarray:
    e = weight_arrays(e)
    ids = np.ascontiguousarray(ids)
    out = np.full((ids.size, e.k), 0xFFFF, np.uint16)
    mod.embedding_gather(ptr(ids), int(ids.dtype == np.int64), ids.size, ptr(e.bitmaps), ptr(e.base),
                         ptr(e.offsets), ptr(e.sm), ptr(e.fb), ptr(out), e.m, e.k, rows, 0)
    return out


def canonical_offsets(hcount: np.ndarray) -> tuple[np.ndarray, int, int]:
    """numpy twin of kernels.cuda.canonical_offsets (for the child process, which has no torch)."""
    sm_len = -(-hcount // 16) * 16
    fb_len = -(-(TILE * TILE - hcount) // 8) * 8
    off = np.stack([np.cumsum(sm_len) - sm_len, np.cumsum(fb_len) - fb_len], axis=1).astype(np.int64)
    return np.ascontiguousarray(off), int(sm_len.sum()), int(fb_len.sum())


def encode(mod, w: np.ndarray, offsets_fn=canonical_offsets) -> SimpleNamespace:
    """The GPU encoder (encode_tiles, host offsets, encode_scatter) -> the five arrays."""
    w = np.ascontiguousarray(w, dtype=np.uint16)
    m, k = w.shape
    mt, kt = -(-m // TILE), -(-k // TILE)
    g = mt * kt
    bitmaps = np.zeros((mt, kt, 3, 64), np.uint64)
    base = np.zeros((mt, kt), np.uint8)
    hcount = np.full(g, -1, np.int64)
    ssm = np.empty(g * TILE * TILE, np.uint8)
    sfb = np.empty(g * TILE * TILE, np.uint16)
    mod.encode_tiles(ptr(w), m, k, 0, mt, ptr(bitmaps), ptr(base), ptr(hcount), ptr(ssm), ptr(sfb), 0)
    off, s_len, f_len = offsets_fn(hcount)
    off = np.ascontiguousarray(np.asarray(off, dtype=np.int64))
    sm = np.zeros(s_len, np.uint8)
    fb = np.zeros(f_len, np.uint16)
    mod.encode_scatter(ptr(hcount), ptr(off), ptr(ssm), ptr(sfb), ptr(sm), ptr(fb), g, 0)
    return SimpleNamespace(m=m, k=k, bitmaps=bitmaps, base=base, offsets=off.reshape(mt, kt, 2), sm=sm, fb=fb)


def segment_lengths(bitmaps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sm, fb) segment lengths of every tile, from its bit-planes."""
    ind = bitmaps[..., 0, :] | bitmaps[..., 1, :] | bitmaps[..., 2, :]
    h = np.unpackbits(ind.view(np.uint8), axis=-1).reshape(*ind.shape[:-1], -1).sum(axis=-1).astype(np.int64)
    return -(-h // 16) * 16, -(-(TILE * TILE - h) // 8) * 8


def noncanonical(e, gap_sm: int = 32, gap_fb: int = 24) -> SimpleNamespace:
    """The same weight with its segments stored in reverse tile order and garbage between them."""
    e = weight_arrays(e)
    sm_len, fb_len = (a.reshape(-1) for a in segment_lengths(e.bitmaps))
    old = e.offsets.reshape(-1, 2)
    sm_parts, fb_parts, new = [], [], np.zeros_like(old)
    pos_sm = pos_fb = 0
    for g in reversed(range(sm_len.size)):
        sm_parts += [np.full(gap_sm, 0xEE, np.uint8), e.sm[old[g, 0]:old[g, 0] + sm_len[g]]]
        fb_parts += [np.full(gap_fb, 0xBEEF, np.uint16), e.fb[old[g, 1]:old[g, 1] + fb_len[g]]]
        pos_sm += gap_sm
        pos_fb += gap_fb
        new[g] = (pos_sm, pos_fb)
        pos_sm += sm_len[g]
        pos_fb += fb_len[g]
    return SimpleNamespace(m=e.m, k=e.k, bitmaps=e.bitmaps, base=e.base, offsets=new.reshape(e.offsets.shape),
                           sm=np.concatenate(sm_parts), fb=np.concatenate(fb_parts))


def one_hot_x(n: int, k: int, cols: np.ndarray) -> np.ndarray:
    """X [n, k] whose row i is 1.0 at column cols[i], 0 elsewhere: Y[i, m] = W[m, cols[i]]."""
    x = np.zeros((n, k), np.uint16)
    x[np.arange(n), cols] = 0x3F80
    return x


def one_hot_expected(w: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the fused kernel must give for one_hot_x: (bits, rows_with_nonfinite). Rows of W holding an
    inf or NaN give NaN everywhere (0 * inf); elsewhere Y[i, m] = W[m, cols[i]] exactly, with -0 read as +0."""
    want = w[:, cols].T.copy()
    nonfinite = ((w & 0x7F80) == 0x7F80).any(axis=1)
    want[(want & 0x7FFF) == 0] = 0  # -0 + 0 = +0
    return want, nonfinite


def check_one_hot(y: np.ndarray, w: np.ndarray, cols: np.ndarray) -> str | None:
    want, nonfinite = one_hot_expected(w, cols)
    fin = ~nonfinite
    bad = (y[:, fin] != want[:, fin]).sum()
    if bad:
        return f"{bad} outputs of finite rows differ from the decoded weight"
    if nonfinite.any() and not np.isnan(f32(y[:, nonfinite])).all():
        return "rows with inf/NaN weights did not give NaN"
    return None


def gemm_error(y: np.ndarray, w: np.ndarray, x: np.ndarray, bias: np.ndarray | None) -> float:
    """How far the bf16 output is from float64 X . W^T (+ bias), in units of the bound
    half a bf16 ulp of the result + 1e-5 sum |x||w|; > 1 fails."""
    xf, wf = f32(x).astype(np.float64), f32(w).astype(np.float64)
    ref = xf @ wf.T
    scale = np.abs(xf) @ np.abs(wf).T
    if bias is not None:
        ref = ref + f32(bias)
        scale = scale + np.abs(f32(bias))
    got = f32(y).astype(np.float64)
    bound = 2.0 ** -8 * np.abs(ref) + 1e-5 * scale + 1e-30
    r = np.abs(got - ref) / bound
    return float(np.nanmax(np.where(np.isnan(got), np.inf, r)))
