"""The CPU byte-split layout (docs/FORMAT.md, appendix A): constants, the
reference packer / unpacker (NumPy), and ``PackedTensor``.

An in-memory layout only, never written to disk: the CPU fast path repacks a
TCA-TBE v1 (or BF16) matrix into it at load time, because its decode is a few
byte shuffles per 32 weights (docs/CPU.md). Per 64 x 64 tile (v1's tile grid
and FT order): the low byte of every BF16 pattern, a 4-bit code per element
that indexes a 16-entry table of high bytes, and a short list of exceptions
for high bytes not in the table. Lossless for every bit pattern.

This module is the single Python definition of the layout; its C++ twin is
``csrc/include/zipserv/cpu_layout.h`` (tests/test_spec_agreement.py compares
them) and the fast packer is ``zipserv_vllm._cpu_gemm.pack``. Imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import spec
from .tensor import FormatError, MatrixArrays, grid

LO_BYTES = spec.FRAG_ELEMS  # 64 low bytes per FT record
CODE_BYTES = spec.FRAG_ELEMS // 2  # 32 code bytes per FT record
FT_BYTES = LO_BYTES + CODE_BYTES  # 96
TILE_BYTES = spec.FRAGS_PER_TILE * FT_BYTES  # 6144 per tile record
LUT_ENTRIES = 16
EXC_SHIFT = 8  # exception entry = d << 8 | high byte, d = 64 f + p
PAD_LO = 0  # a padding element has low byte 0 and code 0


def lo_byte(f: int, p: int) -> int:
    """Byte of FT ``f``'s position ``p`` (= 8 row + col) low byte in a tile record."""
    return f * FT_BYTES + p


def code_byte(f: int, p: int) -> int:
    """Byte of a tile record holding the code of FT ``f``'s position ``p``."""
    return f * FT_BYTES + LO_BYTES + (p >> 5) * 16 + (p & 15)


def code_nibble(p: int) -> int:
    """0: the code is that byte's low nibble; 1: its high nibble."""
    return (p >> 4) & 1


def constants() -> dict:
    """The constants by the names ``_cpu_gemm.layout_constants()`` exports."""
    return {
        "TILE_BYTES": TILE_BYTES, "LO_BYTES": LO_BYTES, "CODE_BYTES": CODE_BYTES,
        "LUT_ENTRIES": LUT_ENTRIES, "EXC_SHIFT": EXC_SHIFT, "PAD_LO": PAD_LO,
        "code_positions": [(code_byte(f, p), code_nibble(p))
                           for f in range(spec.FRAGS_PER_TILE) for p in range(spec.FRAG_ELEMS)],
    }


def _ft_index() -> tuple[np.ndarray, np.ndarray]:
    """Tile-local (row, col) of every (FT f, position p), each int [64, 64]."""
    p = np.arange(spec.FRAG_ELEMS)[None, :]
    rows = np.array([spec.frag_row0(f) for f in range(spec.FRAGS_PER_TILE)])[:, None] + p // spec.FRAG
    cols = np.array([spec.frag_col0(f) for f in range(spec.FRAGS_PER_TILE)])[:, None] + p % spec.FRAG
    return rows, cols


def _tiles_ft_order(a: np.ndarray, m: int, k: int, fill) -> np.ndarray:
    """[M, K] -> [Mt*Kt, 64 FTs, 64 positions], padding set to ``fill``."""
    mt, kt = grid(m, k)
    full = np.full((mt * spec.TILE, kt * spec.TILE), fill, dtype=a.dtype)
    full[:m, :k] = a
    t = full.reshape(mt, spec.TILE, kt, spec.TILE).transpose(0, 2, 1, 3).reshape(mt * kt, spec.TILE, spec.TILE)
    r, c = _ft_index()
    return t[:, r, c]


@dataclass(eq=False)
class PackedTensor(MatrixArrays):
    """A BF16 matrix of ``shape`` [M, K] in the CPU byte-split layout.

    tiles: uint8 [Mt, Kt, 6144]; luts: uint8 [Mt, Kt, 16]; exc_start: int64
    [Mt*Kt + 1] (tile g's exceptions are exc[exc_start[g]:exc_start[g+1]]);
    exc: int32 [E] entries ``d << 8 | high byte``.
    """

    shape: tuple[int, int]
    tiles: torch.Tensor
    luts: torch.Tensor
    exc_start: torch.Tensor
    exc: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.tiles.device

    def arrays(self) -> dict[str, torch.Tensor]:
        return {"tiles": self.tiles, "luts": self.luts, "exc_start": self.exc_start, "exc": self.exc}

    def to(self, device) -> "PackedTensor":
        """The same matrix on ``device`` (each array made contiguous there; shape kept)."""
        return PackedTensor(self.shape, *(t.contiguous().to(device) for t in self.arrays().values()))

    def validate(self, name: str = "tensor") -> None:
        """Raise FormatError unless shapes, dtypes and the exception lists are valid."""
        m, k = self.shape
        if m < 1 or k < 1:
            raise FormatError(f"{name}: invalid shape {self.shape}")
        mt, kt = self.grid
        expect = {"tiles": (torch.uint8, (mt, kt, TILE_BYTES)), "luts": (torch.uint8, (mt, kt, LUT_ENTRIES)),
                  "exc_start": (torch.int64, (mt * kt + 1,))}
        for key, (dtype, shp) in expect.items():
            t = getattr(self, key)
            if t.dtype != dtype or tuple(t.shape) != shp:
                raise FormatError(f"{name}: {key} must be {dtype} {list(shp)}, got {t.dtype} {list(t.shape)}")
        if self.exc.dtype != torch.int32 or self.exc.dim() != 1:
            raise FormatError(f"{name}: exc must be 1-D int32, got {self.exc.dtype} {list(self.exc.shape)}")
        start = self.exc_start.cpu().numpy()
        if start[0] != 0 or start[-1] != self.exc.numel() or (np.diff(start) < 0).any():
            raise FormatError(f"{name}: exc_start is not a prefix count of the {self.exc.numel()} exceptions")
        e = self.exc.cpu().numpy().astype(np.int64)
        d = e >> EXC_SHIFT
        tile = np.repeat(np.arange(mt * kt), np.diff(start))
        prev_same = np.concatenate([[False], tile[1:] == tile[:-1]])
        bad = (e < 0) | (d >= spec.TILE_ELEMS) | (prev_same & (d <= np.concatenate([[-1], d[:-1]])))
        if bad.any():
            g = int(tile[np.flatnonzero(bad)[0]])
            raise FormatError(f"{name}: tile ({g // kt}, {g % kt}) has a malformed exception list")

    def select_tile_rows(self, idx: torch.Tensor, rows: int) -> "PackedTensor":
        """The tile rows ``idx`` (ascending, int64) stacked as a ``[rows, K]`` matrix
        (``rows``: the real rows they hold; exception lists gathered and rebased)."""
        mt, kt = self.grid
        start = self.exc_start.cpu()
        g = (idx.cpu()[:, None] * kt + torch.arange(kt)[None, :]).reshape(-1)
        counts = start[g + 1] - start[g]
        new_start = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
        if int(new_start[-1]):
            pos = torch.repeat_interleave(start[g] - new_start[:-1], counts) + torch.arange(int(new_start[-1]))
            exc = self.exc[pos.to(self.exc.device)]
        else:
            exc = self.exc[:0]
        return PackedTensor((rows, self.shape[1]), self.tiles[idx].contiguous(), self.luts[idx].contiguous(),
                            new_start.to(self.exc_start.device), exc.contiguous())


# ------------------------------------------------------------- reference codec
def reference_pack(w: torch.Tensor) -> PackedTensor:
    """The reference packer (NumPy): BF16 ``w`` [M, K] -> PackedTensor.

    The table of a tile holds its (up to) 16 most frequent high bytes (ties: the
    smaller byte first), in ascending order, the last repeated to 16 entries;
    an element's code is the index of its high byte's first occurrence; every
    other element is an exception (code 0).
    """
    if w.dtype != torch.bfloat16 or w.dim() != 2 or w.numel() == 0:
        raise TypeError(f"reference_pack takes a non-empty 2-D bfloat16 matrix, got {w.dtype} {list(w.shape)}")
    m, k = w.shape
    mt, kt = grid(m, k)
    bits = w.detach().cpu().contiguous().view(torch.int16).numpy().view(np.uint16)
    e = _tiles_ft_order(bits, m, k, 0).astype(np.int64)  # [G, 64, 64]
    real = _tiles_ft_order(np.ones((m, k), dtype=bool), m, k, False)
    g = e.shape[0]
    hi, lo = e >> 8, e & 0xFF
    flat_hi = hi.reshape(g, -1)
    counts = np.zeros((g, 256), dtype=np.int64)
    np.add.at(counts, (np.repeat(np.arange(g), spec.TILE_ELEMS), flat_hi.reshape(-1)), real.reshape(-1))
    key = counts * 256 + (255 - np.arange(256))[None, :]
    top = np.argsort(-key, axis=1, kind="stable")[:, :LUT_ENTRIES]
    valid = np.take_along_axis(counts, top, axis=1) > 0
    n = np.maximum(valid.sum(axis=1), 1)
    chosen = np.sort(np.where(valid, top, 1 << 16), axis=1)
    lut = np.take_along_axis(chosen, np.minimum(np.arange(LUT_ENTRIES)[None, :], n[:, None] - 1), axis=1)
    code_of = np.full((g, 256), -1, dtype=np.int64)
    for i in reversed(range(LUT_ENTRIES)):
        code_of[np.arange(g), lut[:, i]] = i
    code = np.take_along_axis(code_of, flat_hi, axis=1).reshape(g, 64, 64)
    exc_mask = real & (code < 0)
    code = np.where(real & (code >= 0), code, 0)
    lo = np.where(real, lo, PAD_LO)
    tg, d = np.nonzero(exc_mask.reshape(g, -1))
    exc = (d << EXC_SHIFT) | flat_hi[tg, d]
    exc_start = np.concatenate([[0], np.cumsum(np.bincount(tg, minlength=g))])
    c = code.reshape(g, 64, 2, 2, 16)  # [tile, f, h, nibble, j]
    cbytes = (c[:, :, :, 0, :] | (c[:, :, :, 1, :] << 4)).reshape(g, 64, CODE_BYTES)
    rec = np.concatenate([lo, cbytes], axis=2).astype(np.uint8).reshape(mt, kt, TILE_BYTES)
    return PackedTensor((m, k), torch.from_numpy(rec), torch.from_numpy(lut.astype(np.uint8).reshape(mt, kt, LUT_ENTRIES)),
                        torch.from_numpy(exc_start.astype(np.int64)), torch.from_numpy(exc.astype(np.int32)))


def reference_unpack(pt: PackedTensor) -> torch.Tensor:
    """The reference unpacker (NumPy): PackedTensor -> BF16 [M, K], bit for bit."""
    pt.validate()
    m, k = pt.shape
    mt, kt = pt.grid
    g = mt * kt
    rec = pt.tiles.cpu().numpy().reshape(g, 64, FT_BYTES).astype(np.int64)
    lo = rec[:, :, :LO_BYTES]
    cb = rec[:, :, LO_BYTES:].reshape(g, 64, 2, 16)
    code = np.stack([cb & 15, cb >> 4], axis=3).reshape(g, 64 * 64)
    lut = pt.luts.cpu().numpy().reshape(g, LUT_ENTRIES).astype(np.int64)
    hi = np.take_along_axis(lut, code, axis=1)
    start = pt.exc_start.cpu().numpy()
    e = pt.exc.cpu().numpy().astype(np.int64)
    tile = np.repeat(np.arange(g), np.diff(start))
    hi[tile, e >> EXC_SHIFT] = e & 0xFF
    vals = ((hi.reshape(g, 64, 64) << 8) | lo).astype(np.uint16)
    r, c = _ft_index()
    t = np.zeros((g, spec.TILE, spec.TILE), dtype=np.uint16)
    t[:, r, c] = vals
    full = t.reshape(mt, kt, spec.TILE, spec.TILE).transpose(0, 2, 1, 3).reshape(mt * spec.TILE, kt * spec.TILE)
    return torch.from_numpy(np.ascontiguousarray(full[:m, :k]).view(np.int16)).view(torch.bfloat16)
