"""``CompressedTensor``: one BF16 matrix in TCA-TBE v1, held as torch tensors.

It holds exactly the arrays of docs/FORMAT.md section 6 and offers the
tile-level operations of section 8 (``cat`` along dim 0, ``narrow`` along
either dim), which are index operations: no tile is re-encoded.
This module imports no vLLM and needs no native extension.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from . import spec


class FormatError(ValueError):
    """A compressed tensor is malformed, truncated, or of an unknown version."""


def grid(m: int, k: int) -> tuple[int, int]:
    """Number of tile rows and tile columns of an M x K matrix."""
    return -(-m // spec.TILE), -(-k // spec.TILE)


def high_counts(bitmaps: torch.Tensor) -> np.ndarray:
    """H (high-frequency elements, padding included) of every tile, int64 [Mt, Kt]."""
    planes = bitmaps.detach().cpu().contiguous().numpy().view(np.uint64)
    ind = planes[..., 0, :] | planes[..., 1, :] | planes[..., 2, :]
    return np.bitwise_count(ind).sum(axis=-1, dtype=np.int64)


def segment_lengths(bitmaps: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(sm bytes, fb elements) of every tile's segments, each int64 [Mt, Kt]."""
    h = high_counts(bitmaps)
    sm_len = -(-h // spec.SM_ALIGN) * spec.SM_ALIGN
    fb_len = -(-(spec.TILE_ELEMS - h) // spec.FB_ALIGN) * spec.FB_ALIGN
    return sm_len, fb_len


def _gather_segments(stream: torch.Tensor, starts: np.ndarray, lengths: np.ndarray) -> torch.Tensor:
    """Concatenate stream[starts[i] : starts[i] + lengths[i]] in order, copying runs."""
    starts, lengths = starts.reshape(-1), lengths.reshape(-1)
    if starts.size == 0:
        return stream.new_empty(0)
    # Segments that follow each other in the stream are copied as one run.
    ends = starts + lengths
    breaks = np.flatnonzero(starts[1:] != ends[:-1]) + 1
    run_first = np.concatenate([[0], breaks])
    run_last = np.concatenate([breaks, [starts.size]]) - 1
    run_starts, run_ends = starts[run_first], ends[run_last]
    if run_starts.size == 1:
        return stream[int(run_starts[0]) : int(run_ends[0])].clone()
    out = stream.new_empty(int(lengths.sum()))
    pos = 0
    for a, b in zip(run_starts.tolist(), run_ends.tolist()):
        out[pos : pos + b - a] = stream[a:b]
        pos += b - a
    return out


def meta_values(m: int, k: int, crc32: int, version: int = spec.VERSION) -> list[int]:
    """The ``zs_meta`` a writer stores (minor version 1: with its checksum)."""
    values = [spec.MAGIC, version, m, k, crc32]
    return values + [spec.meta_checksum(values)]


def parse_meta(values, name: str = "tensor") -> tuple[int, int, int, int, int]:
    """(magic, version, M, K, crc32) of a ``zs_meta`` of 6 values (checked against its checksum) or
    of 5 (minor version 0, written before the checksum: read by those rules); FormatError naming
    ``name`` unless the magic is ours, the checksum matches and the version is supported."""
    values = [int(x) for x in values]
    if len(values) not in spec.META_LENS:
        raise FormatError(f"{name}: zs_meta has {len(values)} values, expected {spec.META_LEN} "
                          f"(or {spec.META_LEN_MINOR0} before its checksum)")
    magic, version, m, k, crc = values[:5]
    if magic != spec.MAGIC:
        raise FormatError(f"{name}: bad magic 0x{magic & 0xFFFFFFFFFFFFFFFF:X}, expected 0x{spec.MAGIC:X}: not a zipserv tensor")
    if len(values) == spec.META_LEN and values[5] != spec.meta_checksum(values):
        raise FormatError(f"{name}: zs_meta does not match its checksum (stored {values[5] & 0xFFFFFFFF:08x}, "
                          f"computed {spec.meta_checksum(values):08x}): its shape or CRC-32 is damaged")
    if version not in spec.SUPPORTED_VERSIONS:
        raise FormatError(
            f"{name}: format version {version} is not supported by this zipserv-vllm "
            f"(supported: {', '.join(map(str, spec.SUPPORTED_VERSIONS))})"
        )
    return magic, version, m, k, crc


class MatrixArrays:
    """What every stored form of a BF16 matrix [M, K] offers from ``shape`` and
    ``arrays()`` (CompressedTensor, cpu_layout.PackedTensor)."""

    shape: tuple[int, int]

    def arrays(self) -> dict[str, torch.Tensor]:  # pragma: no cover - overridden
        raise NotImplementedError

    @property
    def grid(self) -> tuple[int, int]:
        return grid(*self.shape)

    @property
    def nbytes(self) -> int:
        """Every byte stored for this matrix."""
        return sum(t.numel() * t.element_size() for t in self.arrays().values())

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.shape[0] * self.shape[1])


@dataclass(eq=False)
class CompressedTensor(MatrixArrays):
    """A BF16 matrix of ``shape`` [M, K] in TCA-TBE v1.

    bitmaps: int64 [Mt, Kt, 3, 64] (uint64 bit patterns); base: uint8 [Mt, Kt];
    offsets: int64 [Mt, Kt, 2] = (sm byte start, fb element start) per tile;
    sm: uint8 [S]; fb: int16 [F] (BF16 bit patterns); crc32: zlib CRC-32 of the
    original bytes, or -1 when not recorded; tile_crc: the optional int32 [Mt, Kt]
    tile checksums (``zs_crc``, section 6), or None.
    """

    shape: tuple[int, int]
    bitmaps: torch.Tensor
    base: torch.Tensor
    offsets: torch.Tensor
    sm: torch.Tensor
    fb: torch.Tensor
    crc32: int = field(default=spec.NO_CRC)
    version: int = field(default=spec.VERSION)
    tile_crc: torch.Tensor | None = field(default=None)

    # ----------------------------------------------------------------- basics
    @property
    def device(self) -> torch.device:
        return self.sm.device

    def arrays(self) -> dict[str, torch.Tensor]:
        """The stored arrays by suffix (FORMAT.md section 6), ``zs_meta`` included."""
        meta = torch.tensor(meta_values(self.shape[0], self.shape[1], self.crc32, self.version), dtype=torch.int64)
        out = {
            "zs_meta": meta,
            "zs_bitmaps": self.bitmaps,
            "zs_base": self.base,
            "zs_offsets": self.offsets,
            "zs_sm": self.sm,
            "zs_fb": self.fb,
        }
        if self.tile_crc is not None:
            out[spec.TILE_CRC] = self.tile_crc
        return out

    def to(self, device) -> "CompressedTensor":
        """The same tensor on another device (arrays copied, shape kept)."""
        return CompressedTensor(
            self.shape,
            self.bitmaps.to(device), self.base.to(device), self.offsets.to(device),
            self.sm.to(device), self.fb.to(device), self.crc32, self.version,
            None if self.tile_crc is None else self.tile_crc.to(device),
        )

    def same_encoding(self, other: "CompressedTensor") -> bool:
        """True when both store byte-identical arrays (the CRC is not compared)."""
        pairs = [
            (self.bitmaps, other.bitmaps), (self.base, other.base),
            (self.offsets, other.offsets), (self.sm, other.sm), (self.fb, other.fb),
        ]
        return tuple(self.shape) == tuple(other.shape) and all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
            for a, b in pairs
        )

    # ------------------------------------------------------------- validation
    @classmethod
    def from_arrays(cls, arrays: dict[str, torch.Tensor], name: str = "tensor") -> "CompressedTensor":
        """Build from the six stored arrays (and ``zs_crc`` when present), refusing anything malformed.

        ``name`` is used in error messages (e.g. the checkpoint tensor name).
        """
        missing = [s for s in spec.SUFFIXES if s not in arrays]
        if missing:
            raise FormatError(f"{name}: missing {', '.join(missing)}")
        meta = arrays["zs_meta"]
        if meta.dtype != torch.int64 or meta.dim() != 1 or meta.shape[0] not in spec.META_LENS:
            raise FormatError(f"{name}: zs_meta must be int64 [{spec.META_LEN}] (or [{spec.META_LEN_MINOR0}] before "
                              f"its checksum), got {meta.dtype} {tuple(meta.shape)}")
        magic, version, m, k, crc = parse_meta(meta.tolist(), name)
        ct = cls((m, k), arrays["zs_bitmaps"], arrays["zs_base"], arrays["zs_offsets"],
                 arrays["zs_sm"], arrays["zs_fb"], crc, version, arrays.get(spec.TILE_CRC))
        ct.validate(name)
        return ct

    def validate(self, name: str = "tensor") -> None:
        """Raise FormatError unless shapes, dtypes and every segment offset are valid."""
        m, k = self.shape
        if m < 1 or k < 1:
            raise FormatError(f"{name}: invalid shape {self.shape}")
        mt, kt = self.grid
        expect = {
            "zs_bitmaps": (self.bitmaps, torch.int64, (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE)),
            "zs_base": (self.base, torch.uint8, (mt, kt)),
            "zs_offsets": (self.offsets, torch.int64, (mt, kt, 2)),
        }
        for key, (t, dtype, shp) in expect.items():
            if t.dtype != dtype or tuple(t.shape) != shp:
                raise FormatError(f"{name}: {key} must be {dtype} {list(shp)} for shape {list(self.shape)}, "
                                  f"got {t.dtype} {list(t.shape)}")
        if self.tile_crc is not None and (self.tile_crc.dtype != torch.int32 or tuple(self.tile_crc.shape) != (mt, kt)):
            raise FormatError(f"{name}: {spec.TILE_CRC} must be {torch.int32} {[mt, kt]} for shape "
                              f"{list(self.shape)}, got {self.tile_crc.dtype} {list(self.tile_crc.shape)}")
        for key, t, dtype in (("zs_sm", self.sm, torch.uint8), ("zs_fb", self.fb, torch.int16)):
            if t.dtype != dtype or t.dim() != 1:
                raise FormatError(f"{name}: {key} must be 1-D {dtype}, got {t.dtype} {list(t.shape)}")
        base = self.base.cpu().numpy()
        if (base > spec.MAX_WINDOW_START - 1).any():
            raise FormatError(f"{name}: base exponent {int(base.max())} out of range")
        sm_len, fb_len = segment_lengths(self.bitmaps)
        off = self.offsets.cpu().numpy()
        off_sm, off_fb = off[..., 0], off[..., 1]
        bad = ((off_sm % spec.SM_ALIGN != 0) | (off_fb % spec.FB_ALIGN != 0) | (off_sm < 0) | (off_fb < 0)
               | (off_sm + sm_len > self.sm.numel()) | (off_fb + fb_len > self.fb.numel()))
        if bad.any():
            tm, tk = (int(x) for x in np.argwhere(bad)[0])
            raise FormatError(
                f"{name}: tile ({tm}, {tk}) segments at ({off_sm[tm, tk]}, {off_fb[tm, tk]}) "
                f"overrun streams of {self.sm.numel()} bytes / {self.fb.numel()} elements "
                f"or are misaligned: truncated or corrupt data"
            )

    # -------------------------------------------------------- tile operations
    def _select(self, tm: slice, tk: slice, shape: tuple[int, int]) -> "CompressedTensor":
        """The tiles grid[tm, tk] with their segments copied into canonical streams."""
        bitmaps = self.bitmaps[tm, tk].contiguous()
        sm_len, fb_len = segment_lengths(bitmaps)
        off = self.offsets[tm, tk].cpu().numpy()
        sm = _gather_segments(self.sm, off[..., 0], sm_len)
        fb = _gather_segments(self.fb, off[..., 1], fb_len)
        new_off = np.stack([np.cumsum(sm_len.reshape(-1)) - sm_len.reshape(-1),
                            np.cumsum(fb_len.reshape(-1)) - fb_len.reshape(-1)], axis=-1)
        offsets = torch.from_numpy(new_off.reshape(off.shape)).to(self.offsets.device)
        crc = None if self.tile_crc is None else self.tile_crc[tm, tk].contiguous()
        return CompressedTensor(shape, bitmaps, self.base[tm, tk].contiguous(), offsets, sm, fb, tile_crc=crc)

    def compact(self) -> "CompressedTensor":
        """The canonical layout of this tensor (segments in tile order, no gaps)."""
        return self._select(slice(None), slice(None), tuple(self.shape))

    def narrow(self, dim: int, start: int, length: int) -> "CompressedTensor":
        """Rows (dim 0) or columns (dim 1) [start, start + length), at tile granularity.

        ``start`` must be a multiple of 64, and ``length`` too unless the slice
        reaches the end. Equal to encoding ``decompress(self).narrow(...)``.
        """
        if dim not in (0, 1, -1, -2):
            raise ValueError(f"dim must be 0 or 1, got {dim}")
        dim = dim % 2
        size = self.shape[dim]
        if not (0 <= start and length >= 1 and start + length <= size):
            raise ValueError(f"narrow({dim}, {start}, {length}) is out of range for size {size}")
        if start % spec.TILE or (length % spec.TILE and start + length != size):
            raise ValueError(
                f"narrow({dim}, {start}, {length}) is not tile-aligned: start must be a multiple of "
                f"{spec.TILE} and length too unless the slice ends at {size}"
            )
        tiles = slice(start // spec.TILE, -(-(start + length) // spec.TILE))
        shape = list(self.shape)
        shape[dim] = length
        if dim == 0:
            return self._select(tiles, slice(None), tuple(shape))
        return self._select(slice(None), tiles, tuple(shape))

    @staticmethod
    def cat(parts: list["CompressedTensor"]) -> "CompressedTensor":
        """Stack matrices along dim 0 (e.g. q, k, v into qkv). Equal to re-encoding.

        All must have the same K, and all but the last must have M % 64 == 0.
        """
        if not parts:
            raise ValueError("cat needs at least one tensor")
        k = parts[0].shape[1]
        for i, p in enumerate(parts):
            if p.shape[1] != k:
                raise ValueError(f"cat: tensor {i} has {p.shape[1]} columns, tensor 0 has {k}")
            if i < len(parts) - 1 and p.shape[0] % spec.TILE:
                raise ValueError(f"cat: tensor {i} has {p.shape[0]} rows, not a multiple of {spec.TILE}")
        parts = [p.compact() for p in parts]
        sm_base = np.cumsum([0] + [p.sm.numel() for p in parts])
        fb_base = np.cumsum([0] + [p.fb.numel() for p in parts])
        offsets = torch.cat([
            p.offsets + torch.tensor([int(sm_base[i]), int(fb_base[i])], dtype=torch.int64, device=p.offsets.device)
            for i, p in enumerate(parts)
        ])
        crcs = [p.tile_crc for p in parts]
        return CompressedTensor(
            (sum(p.shape[0] for p in parts), k),
            torch.cat([p.bitmaps for p in parts]), torch.cat([p.base for p in parts]), offsets,
            torch.cat([p.sm for p in parts]), torch.cat([p.fb for p in parts]),
            tile_crc=None if any(c is None for c in crcs) else torch.cat(crcs),
        )

    # --------------------------------------------------------------- checksums
    def __repr__(self) -> str:
        return (f"CompressedTensor(shape={list(self.shape)}, nbytes={self.nbytes}, "
                f"bits_per_weight={self.bits_per_weight:.3f}, device={self.device})")
