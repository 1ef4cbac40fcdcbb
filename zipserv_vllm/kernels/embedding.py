"""``zipserv::embedding``: rows of a compressed embedding table, as a traceable custom op.

``embedding(ids, bitmaps, base, offsets, sm, fb, m, k, rows) -> Tensor[*ids.shape, k] bf16``
(``packed_embedding(ids, tiles, luts, exc_start, exc, m, k, rows)`` for a table
in the CPU byte-split layout)
returns ``F.embedding(ids, W_padded)`` where ``W`` is the ``[m, k]`` compressed
matrix and ``W_padded`` appends ``rows - m`` zero rows (vLLM pads the vocabulary
of an embedding layer; padding ids read zeros). Ids outside ``[0, rows)`` are
clamped like the plugin did before (vLLM never sends them).

Only what the ids touch is decoded: on the CPU from the byte-split layout one
native call, ``cpu_kernels.packed_embedding``, which decodes each id's row from
the 8 FTs per tile that hold it (a decode step's lookup in microseconds instead
of ~0.9 ms of small torch ops); elsewhere the 64-row tile rows the ids touch.
The set of touched tile rows is data dependent (``torch.unique``), which torch.compile cannot
trace; inside a custom op it is opaque, and the fake implementation gives the
output shape from the ids' shape alone, so graphs with the lookup trace
without breaks (torch.compile fullgraph, CUDA graphs). Imports no vLLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..format import CompressedTensor, spec
from ..format.cpu_layout import PackedTensor
from .ops import _PYTHON_IMPLS, lean_op


def _lookup(ids, decode_rows, device, m, k, rows):
    """F.embedding over the tile rows ``decode_rows(live, sub_m)`` decodes ([sub_m, k])."""
    flat = ids.reshape(-1).clamp(0, rows - 1)
    n_tiles = -(-m // spec.TILE)
    tile_rows = torch.unique(flat // spec.TILE)  # sorted
    live = tile_rows[tile_rows < n_tiles]  # tile rows past the compressed ones are vocabulary padding (zeros)
    if live.numel() == 0:
        return torch.zeros((*ids.shape, k), dtype=torch.bfloat16, device=ids.device)
    idx = live.to(device)
    last_rows = m - (n_tiles - 1) * spec.TILE
    sub_m = (live.numel() - 1) * spec.TILE + (last_rows if int(live[-1]) == n_tiles - 1 else spec.TILE)
    sub = decode_rows(idx, sub_m)
    table = torch.cat([sub.to(ids.device), sub.new_zeros(1, k, device=ids.device)])  # last row: zeros for padding
    pos_of_tile = torch.full((-(-rows // spec.TILE) + 1,), -1, dtype=torch.long, device=flat.device)
    pos_of_tile[live.to(flat.device)] = torch.arange(live.numel(), device=flat.device)
    rank = pos_of_tile[flat // spec.TILE]
    pos = torch.where((rank >= 0) & (flat < m), rank * spec.TILE + flat % spec.TILE, torch.full_like(flat, sub_m))
    return F.embedding(pos, table).reshape(*ids.shape, k)


@torch.library.custom_op("zipserv::embedding", mutates_args=())
def embedding(ids: torch.Tensor, bitmaps: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor,
              sm: torch.Tensor, fb: torch.Tensor, m: int, k: int, rows: int) -> torch.Tensor:
    from ..codec import decompress_tensor

    def decode_rows(idx, sub_m):
        # The selected tiles keep their segment starts: offsets may point anywhere in the streams.
        return decompress_tensor(CompressedTensor((sub_m, k), bitmaps[idx].contiguous(), base[idx].contiguous(),
                                                  offsets[idx].contiguous(), sm, fb))

    _check_ids(ids, m, rows)
    return _lookup(ids, decode_rows, bitmaps.device, m, k, rows)


def _check_ids(ids: torch.Tensor, m: int, rows: int) -> None:
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"zipserv::embedding: ids must be int32 or int64, got {ids.dtype}")
    if rows < m:
        raise ValueError(f"zipserv::embedding: rows ({rows}) must be at least the table's {m} rows")


@embedding.register_fake
def _(ids, bitmaps, base, offsets, sm, fb, m, k, rows):
    return torch.empty((*ids.shape, k), dtype=torch.bfloat16, device=ids.device)


def _packed_embedding_fake(ids, tiles, luts, exc_start, exc, m, k, rows):
    return torch.empty((*ids.shape, k), dtype=torch.bfloat16, device=ids.device)


@lean_op("packed_embedding(Tensor ids, Tensor tiles, Tensor luts, Tensor exc_start, Tensor exc, int m, int k, "
         "int rows) -> Tensor", _packed_embedding_fake)
def packed_embedding(ids: torch.Tensor, tiles: torch.Tensor, luts: torch.Tensor, exc_start: torch.Tensor,
                     exc: torch.Tensor, m: int, k: int, rows: int) -> torch.Tensor:
    from . import cpu as cpu_kernels
    from .ops import packed_decompress

    _check_ids(ids, m, rows)
    if tiles.device.type == "cpu" and cpu_kernels.available():  # one native call (a decode step's lookup: µs)
        y = cpu_kernels.packed_embedding(ids, PackedTensor((m, k), tiles, luts, exc_start, exc), rows)
        cpu_kernels.embedding_op_served(_packed_embedding_python)  # (its C++ kernel serves the next calls)
        return y

    def decode_rows(idx, sub_m):
        sub = PackedTensor((m, k), tiles, luts, exc_start, exc).select_tile_rows(idx, sub_m)
        return packed_decompress(sub.tiles, sub.luts, sub.exc_start, sub.exc, sub_m, k)

    return _lookup(ids, decode_rows, tiles.device, m, k, rows)


_packed_embedding_python = _PYTHON_IMPLS["packed_embedding"]  # (the C++ CPU kernel hands it the rest)


def compressed_embedding(ids: torch.Tensor, ct: CompressedTensor | PackedTensor, rows: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, W)`` for the compressed (or CPU-packed) ``ct`` (``rows - m`` zero padding rows)."""
    m, k = ct.shape
    rows = m if rows is None else rows
    if isinstance(ct, PackedTensor):
        if ct.tiles.device.type == "cpu" and not torch.compiler.is_compiling():
            from . import cpu as cpu_kernels

            if cpu_kernels.available():  # eager: the native lookup directly (the op dispatcher costs 10-20 µs)
                _check_ids(ids, m, rows)
                return cpu_kernels.packed_embedding(ids, ct, rows)
        return packed_embedding(ids, ct.tiles, ct.luts, ct.exc_start, ct.exc, m, k, rows)
    return embedding(ids, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, rows)
