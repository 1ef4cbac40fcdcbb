"""Tile-granular slicing plans: which byte ranges of a compressed matrix a rank needs.

A tensor-parallel rank needs a block of whole tiles of each checkpoint matrix
(its rows for column-parallel layers, its columns for row-parallel ones) and,
for merged layers (q/k/v, gate/up), several such blocks stacked. A
:class:`TilePlan` describes the resulting local matrix without reading it: for
each array (bitmaps, base, sm, fb) the list of byte ranges of the source
arrays whose concatenation *is* the local array, plus the recomputed segment
offsets (small, computed from the bit-planes). Executing a plan copies exactly
those ranges into a :class:`~.arena.PagedArena`, so a rank reads only its own
tiles' bytes from the (lazily mapped) checkpoint and nothing is re-encoded.

The result is byte-identical to ``CompressedTensor.narrow(...)`` and
``CompressedTensor.cat([...])`` (docs/FORMAT.md section 8); the unit tests
check that. This module imports no vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..codec import check_tiles
from ..format import CompressedTensor, FormatError, spec
from ..format.tensor import segment_lengths
from .arena import PageTable, PagedArena

ARRAYS = ("bitmaps", "base", "offsets", "sm", "fb")
_DTYPES = {"bitmaps": torch.int64, "base": torch.uint8, "offsets": torch.int64, "sm": torch.uint8, "fb": torch.int16}
_TILE_BYTES = {"bitmaps": spec.PLANES * spec.FRAGS_PER_TILE * 8, "base": 1}


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a 1-D uint8 view (no copy)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


def _runs(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    """Merge [start, start + length) intervals that follow each other into runs."""
    starts, lengths = starts.reshape(-1), lengths.reshape(-1)
    keep = lengths > 0
    starts, lengths = starts[keep], lengths[keep]
    if starts.size == 0:
        return []
    ends = starts + lengths
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    first = np.concatenate([[0], breaks])
    last = np.concatenate([breaks, [starts.size]]) - 1
    return list(zip(starts[first].tolist(), ends[last].tolist()))


@dataclass
class TilePlan:
    """A local compressed matrix described as byte ranges of source arrays.

    ``pieces[name]`` lists ``(source_bytes, start, end)``: the local array
    ``name`` is the concatenation of ``source_bytes[start:end]`` in order.
    ``offsets`` is computed (canonical layout) and held as a tensor.
    """

    shape: tuple[int, int]
    grid: tuple[int, int]
    pieces: dict[str, list[tuple[torch.Tensor, int, int]]] = field(default_factory=dict)
    offsets: torch.Tensor | None = None
    tile_crc: torch.Tensor | None = None  # the local tiles' checksums (zs_crc), when the source has them
    # (first local tile row, source name) of each stacked part, to name a damaged tile's source
    labels: list[tuple[int, str]] = field(default_factory=list)

    def source_of(self, tile_row: int) -> str:
        """The source name of the part holding local tile row ``tile_row``."""
        name = ""
        for first, label in self.labels:
            if first <= tile_row:
                name = label
        return name

    @property
    def sizes(self) -> dict[str, int]:
        """Bytes of each local array."""
        out = {name: sum(e - s for _, s, e in p) for name, p in self.pieces.items()}
        out["offsets"] = self.offsets.numel() * 8
        return out

    @property
    def nbytes(self) -> int:
        return sum(self.sizes.values())

    # ---------------------------------------------------------------- build
    @classmethod
    def select(cls, ct: CompressedTensor, dim: int | None = None, start: int = 0,
               length: int | None = None, label: str = "") -> "TilePlan":
        """The rows (``dim=0``) or columns (``dim=1``) ``[start, start + length)``
        of ``ct``, tile-aligned as in ``CompressedTensor.narrow``; ``dim=None``
        takes the whole matrix."""
        m, k = ct.shape
        mt, kt = ct.grid
        tm, tk = slice(0, mt), slice(0, kt)
        shape = [m, k]
        if dim is not None:
            size = ct.shape[dim]
            if length is None:
                length = size - start
            if not (0 <= start and length >= 1 and start + length <= size):
                raise ValueError(f"select({dim}, {start}, {length}) is out of range for size {size}")
            if start % spec.TILE or (length % spec.TILE and start + length != size):
                raise ValueError(f"select({dim}, {start}, {length}) is not on {spec.TILE}-element tile boundaries")
            tiles = slice(start // spec.TILE, -(-(start + length) // spec.TILE))
            if dim == 0:
                tm = tiles
            else:
                tk = tiles
            shape[dim] = length
        rows = np.arange(tm.start, tm.stop)
        cols_lo, cols_hi = tk.start, tk.stop
        plan = cls((shape[0], shape[1]), (tm.stop - tm.start, tk.stop - tk.start))
        # Fixed-size per-tile arrays: one run per tile row (one in all when whole rows are taken).
        for name, src in (("bitmaps", ct.bitmaps), ("base", ct.base)):
            tb = _TILE_BYTES[name]
            starts = (rows * kt + cols_lo) * tb
            lengths = np.full(rows.shape, (cols_hi - cols_lo) * tb, dtype=np.int64)
            flat = _flat_bytes(src)
            plan.pieces[name] = [(flat, a, b) for a, b in _runs(starts, lengths)]
        # Streams: the selected tiles' segments in increasing tile order.
        bitmaps = ct.bitmaps[tm, tk]
        sm_len, fb_len = segment_lengths(bitmaps)
        off = ct.offsets[tm, tk].cpu().numpy()
        for j, (lens, n, what) in enumerate(((sm_len, ct.sm.numel(), "sign-mantissa"), (fb_len, ct.fb.numel(), "fallback"))):
            o = off[..., j]
            bad = (o < 0) | (o + lens > n)
            if bad.any():
                a, b = (int(x) for x in np.argwhere(bad)[0])
                raise FormatError(f"tile ({a + tm.start}, {b + tk.start}) segment [{o[a, b]}, {o[a, b] + lens[a, b]}) "
                                  f"overruns the {what} stream of {n} elements: truncated or corrupt data")
        plan.pieces["sm"] = [(_flat_bytes(ct.sm), a, b) for a, b in _runs(off[..., 0], sm_len)]
        plan.pieces["fb"] = [(_flat_bytes(ct.fb), 2 * a, 2 * b) for a, b in _runs(off[..., 1], fb_len)]
        sm_flat, fb_flat = sm_len.reshape(-1), fb_len.reshape(-1)
        new_off = np.stack([np.cumsum(sm_flat) - sm_flat, np.cumsum(fb_flat) - fb_flat], axis=-1)
        plan.offsets = torch.from_numpy(np.ascontiguousarray(new_off.reshape(*sm_len.shape, 2)))
        if ct.tile_crc is not None:
            plan.tile_crc = ct.tile_crc[tm, tk].contiguous().cpu()
        plan.labels = [(0, label)]
        return plan

    @staticmethod
    def cat(plans: list["TilePlan"]) -> "TilePlan":
        """Stack local matrices along dim 0 (like ``CompressedTensor.cat``)."""
        if not plans:
            raise ValueError("cat needs at least one plan")
        k = plans[0].shape[1]
        for i, p in enumerate(plans):
            if p.shape[1] != k:
                raise ValueError(f"cat: plan {i} has {p.shape[1]} columns, plan 0 has {k}")
            if i < len(plans) - 1 and p.shape[0] % spec.TILE:
                raise ValueError(f"cat: plan {i} has {p.shape[0]} rows, not a multiple of {spec.TILE}")
        out = TilePlan((sum(p.shape[0] for p in plans), k), (sum(p.grid[0] for p in plans), plans[0].grid[1]))
        for name in ("bitmaps", "base", "sm", "fb"):
            out.pieces[name] = [piece for p in plans for piece in p.pieces[name]]
        offs, sm_base, fb_base, row = [], 0, 0, 0
        for p in plans:
            out.labels += [(first + row, label) for first, label in p.labels]
            row += p.grid[0]
            offs.append(p.offsets + torch.tensor([sm_base, fb_base], dtype=torch.int64))
            sizes = p.sizes
            sm_base += sizes["sm"]
            fb_base += sizes["fb"] // 2
        out.offsets = torch.cat(offs)
        if all(p.tile_crc is not None for p in plans):
            out.tile_crc = torch.cat([p.tile_crc for p in plans])
        return out

    # -------------------------------------------------------------- execute
    def reserve(self, arena: PagedArena) -> PageTable:
        """Reserve this plan's arrays in ``arena`` (no copy yet)."""
        sizes = self.sizes
        mt, kt = self.grid
        shapes = {"bitmaps": (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE), "base": (mt, kt),
                  "offsets": (mt, kt, 2), "sm": (sizes["sm"],), "fb": (sizes["fb"] // 2,)}
        from .arena import Entry

        return PageTable({name: Entry(arena.reserve(sizes[name]), _DTYPES[name], shapes[name]) for name in ARRAYS})

    def copy_into(self, arena: PagedArena, table: PageTable, check: str | None = None) -> bool:
        """Copy every byte range into the reserved (committed) slots of ``table``.

        With ``check`` (a name for messages) and tile checksums, the local tiles are
        compared with them (FormatError naming the first damaged one); on a CPU arena
        in place, otherwise on the host before the copy to the device. Returns whether
        the tiles were checked."""
        on_host = arena.device.type == "cpu"
        checked = False
        if not on_host and check and self.tile_crc is not None:
            host = self.host_arrays()
            check_tiles(CompressedTensor(self.shape, host["bitmaps"], host["base"], host["offsets"], host["sm"],
                                         host["fb"], tile_crc=self.tile_crc), check)
            checked = True
            for name in ARRAYS:
                arena.raw(table.entries[name].slot).copy_(_flat_bytes(host[name]))
            return checked
        for name in ARRAYS:
            dst = arena.raw(table.entries[name].slot)
            if name == "offsets":
                dst.copy_(_flat_bytes(self.offsets))
                continue
            pos = 0
            for src, a, b in self.pieces[name]:
                dst[pos : pos + b - a].copy_(src[a:b])
                pos += b - a
        if check and self.tile_crc is not None:
            ct = compressed_from_table(arena, table, self.shape)
            ct.tile_crc = self.tile_crc
            check_tiles(ct, check)
            checked = True
        return checked

    def host_arrays(self) -> dict[str, torch.Tensor]:
        """The local arrays assembled on the host (canonical layout, typed views)."""
        out = {}
        mt, kt = self.grid
        shapes = {"bitmaps": (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE), "base": (mt, kt)}
        for name in ("bitmaps", "base", "sm", "fb"):
            buf = torch.empty(sum(b - a for _, a, b in self.pieces[name]), dtype=torch.uint8)
            pos = 0
            for src, a, b in self.pieces[name]:
                buf[pos : pos + b - a].copy_(src[a:b])
                pos += b - a
            t = buf.view(_DTYPES[name])
            out[name] = t.view(shapes[name]) if name in shapes else t
        out["offsets"] = self.offsets
        return out


def compressed_from_table(arena: PagedArena, table: PageTable, shape: tuple[int, int]) -> CompressedTensor:
    """The CompressedTensor whose arrays are the arena views of ``table``."""
    v = arena.views(table)
    return CompressedTensor(tuple(shape), v["bitmaps"], v["base"], v["offsets"], v["sm"], v["fb"])


def store_compressed(arena: PagedArena, ct: CompressedTensor) -> PageTable:
    """Copy an in-memory CompressedTensor into the arena (incremental fill)."""
    return arena.store({"bitmaps": ct.bitmaps, "base": ct.base, "offsets": ct.offsets, "sm": ct.sm, "fb": ct.fb})
