"""Per-layer loading state, tensor-parallel tile selection and completeness checks.

Pre-compressed checkpoints follow "record first, execute later"
(vllm-loading-notes section 6.2):

1. ``create_weights`` registers 0-size placeholder parameters named after the
   checkpoint suffixes (``zs_meta`` ... ``zs_fb``, and ``weight`` for a layer the
   checkpoint stores uncompressed). Their ``weight_loader`` only *records* the
   (lazily memory-mapped) tensor with its ``shard_id``; nothing is read.
2. The first ``process_weights_after_loading`` call (all weights have arrived
   by then) runs :func:`execute_precompressed` for every recorded layer:
   completeness and format checks, then each rank's tiles as a
   :class:`~.tiles.TilePlan` (tile-aligned narrow of the metadata grid and of
   the stream segments, q/k/v or gate/up joined by ``cat``), then one
   :class:`~.arena.PagedArena` with exact-size pages is allocated and filled
   with one copy per byte range. Only the rank's own bytes are read.
3. A split that does not fall on a 64-element tile boundary is handled for that
   layer by decoding the shards, letting vLLM's own weight loader place and
   narrow them, and re-encoding the rank's matrix (one log line).

Next door: :mod:`.weight_loaders` (the loaders of the placeholders: recording
during the load, weight updates after it) and :mod:`.layouts` (which in-memory
layout a device holds; pack at load and the repack into the byte-split layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .. import settings
from ..codec import check_tiles, compress_tensor, decompress_tensor
from ..format import CompressedTensor, FormatError, parse_meta, spec
from ..format.cpu_layout import PackedTensor
from .arena import PageTable, PagedArena
from .log import logger
from .tiles import TilePlan, compressed_from_table

WEIGHT = "weight"
SUFFIXES = tuple(spec.SUFFIXES)  # zs_meta, zs_bitmaps, zs_base, zs_offsets, zs_sm, zs_fb: all required
ALL_SUFFIXES = tuple(spec.ALL_SUFFIXES)  # plus zs_crc (tile checksums), optional
VERIFY_MODES = settings.VERIFY_MODES  # ZIPSERV_VERIFY / quantization_config "verify"; the first is the default
# The dtype of each checkpoint array: placeholders are created with it, so vLLM's loader
# never warns about a dtype change (it would for every array of a uint8 placeholder).
ARRAY_DTYPES = {"zs_meta": torch.int64, "zs_bitmaps": torch.int64, "zs_base": torch.uint8, "zs_offsets": torch.int64,
                "zs_sm": torch.uint8, "zs_fb": torch.int16, "zs_crc": torch.int32, WEIGHT: torch.bfloat16}


NO_CHECKSUMS = "no checksums"    # LayerState.checked: a shard has no zs_crc (tiles mode)
NO_CRC_STORED = "no CRC stored"  # LayerState.checked: a shard's zs_meta has no CRC-32 (full mode)


class ZipServLoadError(ValueError):
    """A checkpoint is incomplete, inconsistent or corrupt (message names the tensor)."""


_PARTS_EPOCH = [0]
_PARTS_HOOKS: list[Callable[[], None]] = []


def on_parts_change(fn: Callable[[], None]) -> None:
    """Call ``fn()`` after every assignment of any layer's ``parts`` (what caches addresses into
    them drops its copies)."""
    _PARTS_HOOKS.append(fn)


def parts_epoch() -> int:
    """A number that changes whenever any layer's ``parts`` are assigned (load, rebind, re-encode,
    repack): what is cached from parts' tensors (a MoE layer's expert address tables) stays valid
    while it is unchanged, checked in O(1) per call instead of walking every part."""
    return _PARTS_EPOCH[0]


@dataclass
class LayerState:
    """What zipserv knows about one compressed layer (kept in ``layer._zs_state``)."""

    def __setattr__(self, name, value):
        object.__setattr__(self, name, value)
        if name == "parts":  # (after the assignment: a reader that sees the new number sees the new parts)
            _PARTS_EPOCH[0] += 1
            for fn in _PARTS_HOOKS:
                fn()

    prefix: str
    kind: str                       # "linear" or "embedding"
    rows: int                       # rows of the rank's weight (vocab padding included)
    cols: int
    device: torch.device
    expected_shards: list[Any]
    orig_loader: Callable | None = None
    layer_ref: Any = None           # weakref to the module
    records: dict[tuple[Any, str], torch.Tensor] = field(default_factory=dict)
    parts: list[CompressedTensor] = field(default_factory=list)   # stacked along rows
    tables: list[PageTable] = field(default_factory=list)
    part_shapes: list[tuple[int, int]] = field(default_factory=list)
    arena: PagedArena | None = None
    checked: str = ""               # how its data was checked at load: tiles / full / no checksums /
    #                                 no CRC stored / "" (nothing checked)
    bf16: bool = False              # kept uncompressed (reason logged)
    bf16_reason: str = ""
    tied_to: "LayerState | None" = None
    done: bool = False
    path: str = ""                  # how it was loaded: tiles / re-encoded / packed / bf16
    ckpt_prefixes: dict | None = None  # shard -> checkpoint module name, where the prefix does not give it

    @property
    def layer(self):
        return self.layer_ref() if self.layer_ref is not None else None

    @property
    def compressed_rows(self) -> int:
        return sum(s[0] for s in self.part_shapes)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tables)

    def bind(self) -> None:
        """(Re)build the part tensors as views of the arena (after a trim, too). On a GPU each
        part's offsets are validated once here, on the host, so that the kernels may read
        through them inside CUDA-graph capture (kernels/cuda.py)."""
        self.parts = [_part_from_table(self.arena, t, s) for t, s in zip(self.tables, self.part_shapes)]
        for p in self.parts:
            if p.device.type == "cuda":
                from ..kernels import cuda

                if not cuda.REGISTERED:
                    continue
                if isinstance(p, CompressedTensor):
                    cuda.validate_weight(p.bitmaps, p.base, p.offsets, p.sm, p.fb, *p.shape)
                else:
                    cuda.validate_packed(p)

    def source(self) -> "LayerState":
        return self.tied_to.source() if self.tied_to is not None else self


def _part_from_table(arena: PagedArena, table: PageTable, shape) -> CompressedTensor | PackedTensor:
    if "tiles" in table.entries:
        v = arena.views(table)
        return PackedTensor(tuple(shape), v["tiles"], v["luts"], v["exc_start"], v["exc"])
    return compressed_from_table(arena, table, shape)




# --------------------------------------------------------------------- naming
_PACKED: dict[str, list[str]] = {}


def set_packed_mapping(mapping: dict[str, list[str]]) -> None:
    _PACKED.update(mapping or {})


def ckpt_name(state: LayerState, shard_id, suffix: str) -> str:
    """The checkpoint tensor name of (layer, shard, suffix), e.g. ``...k_proj.zs_sm``."""
    prefix = state.prefix or "<layer>"
    if state.ckpt_prefixes and shard_id in state.ckpt_prefixes:
        return f"{state.ckpt_prefixes[shard_id]}.{suffix}"
    if shard_id is not None:
        head, _, last = prefix.rpartition(".")
        names = _PACKED.get(last)
        idx = {"q": 0, "k": 1, "v": 2}.get(shard_id, shard_id)
        if names and isinstance(idx, int) and 0 <= idx < len(names):
            prefix = f"{head}.{names[idx]}" if head else names[idx]
        else:
            prefix = f"{prefix}[shard {shard_id!r}]"
    return f"{prefix}.{suffix}"


# ------------------------------------------------------- tensor-parallel split
def _layer_split(layer, state: LayerState, shard_id) -> tuple[tuple[int, int] | None, tuple[int | None, int, int] | None]:
    """(expected full shape of the shard, (dim, start, length) of this rank's part).

    ``None`` for the split means the whole shard; ``None`` for the shape means
    the layer type is not known here (the generic path is used)."""
    from . import compat

    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear, RowParallelLinear = (
        compat.find(n) for n in ("ColumnParallelLinear", "MergedColumnParallelLinear", "QKVParallelLinear",
                                 "ReplicatedLinear", "RowParallelLinear"))
    VocabParallelEmbedding = compat.find("VocabParallelEmbedding")

    t = type(layer)
    if isinstance(layer, VocabParallelEmbedding):
        if layer.num_added_embeddings:
            return None, None
        full = (layer.org_vocab_size, layer.embedding_dim)
        si = layer.shard_indices
        if layer.tp_size == 1:
            return full, None
        return full, (0, si.org_vocab_start_index, si.org_vocab_end_index - si.org_vocab_start_index)
    k_full = layer.input_size
    if t is QKVParallelLinear and shard_id is None:  # stored fused, e.g. GPT-2's c_attn: q, k, v rows
        q_full, q_local = layer.total_num_heads * layer.head_size, layer.num_heads * layer.head_size
        k_sz, v_sz = layer.total_num_kv_heads * layer.head_size, layer.total_num_kv_heads * layer.v_head_size
        full = (q_full + k_sz + v_sz, k_full)
        if layer.tp_size == 1:
            return full, None
        kv_rank = layer.tp_rank // layer.num_kv_head_replicas
        k_local, v_local = layer.num_kv_heads * layer.head_size, layer.num_kv_heads * layer.v_head_size
        return full, [(0, layer.tp_rank * q_local, q_local), (0, q_full + kv_rank * k_local, k_local),
                      (0, q_full + k_sz + kv_rank * v_local, v_local)]
    if t is MergedColumnParallelLinear and shard_id is None:  # stored fused, e.g. Phi-3's gate_up_proj
        full = (sum(layer.output_sizes), k_full)
        if layer.tp_size == 1:
            return full, None
        out, start = [], 0
        for size in layer.output_sizes:
            local = size // layer.tp_size
            out.append((0, start + layer.tp_rank * local, local))
            start += size
        return full, out
    if t is QKVParallelLinear:
        if shard_id not in ("q", "k", "v"):
            return None, None
        if shard_id == "q":
            full_m, local, rank = layer.total_num_heads * layer.head_size, layer.num_heads * layer.head_size, layer.tp_rank
        else:
            hs = layer.head_size if shard_id == "k" else layer.v_head_size
            full_m, local = layer.total_num_kv_heads * hs, layer.num_kv_heads * hs
            rank = layer.tp_rank // layer.num_kv_head_replicas
        return (full_m, k_full), (None if layer.tp_size == 1 else (0, rank * local, local))
    if t is MergedColumnParallelLinear:
        if not isinstance(shard_id, int):
            return None, None
        full_m = layer.output_sizes[shard_id]
        local = full_m // layer.tp_size
        return (full_m, k_full), (None if layer.tp_size == 1 else (0, layer.tp_rank * local, local))
    if shard_id is not None:
        return None, None
    if t is ColumnParallelLinear:
        local = layer.output_size_per_partition
        return (layer.output_size, k_full), (None if layer.tp_size == 1 else (0, layer.tp_rank * local, local))
    if t is RowParallelLinear:
        local = layer.input_size_per_partition
        return (layer.output_size, k_full), (None if layer.tp_size == 1 else (1, layer.tp_rank * local, local))
    if isinstance(layer, ReplicatedLinear):  # incl. subclasses such as MoE routers (GateLinear): never split
        return (layer.output_size, k_full), None
    return None, None


def _aligned(split, full) -> bool:
    if split is None:
        return True
    if isinstance(split, list):
        return all(_aligned(s, full) for s in split)
    dim, start, length = split
    return (length >= 1 and start % spec.TILE == 0
            and (length % spec.TILE == 0 or start + length == full[dim]))


def shard_noting_loader(state: LayerState, orig):
    """vLLM's weight loader of a pack-at-load layer, noting which shards (q/k/v, gate/up...) it was given,
    so a merged layer that received only some of them is refused (:func:`check_shards_arrived`) rather
    than compressed with rows nothing was loaded into."""

    def zipserv_shard_noting_loader(param, loaded_weight, *args, **kwargs):
        shard = args[0] if args else kwargs.get("loaded_shard_id")
        arrived = state.__dict__.setdefault("_arrived", set())
        arrived.update(shard if isinstance(shard, tuple) else (shard,))
        return orig(param, loaded_weight, *args, **kwargs)

    return zipserv_shard_noting_loader


def check_shards_arrived(state: LayerState) -> None:
    """One line naming the first shard of a pack-at-load layer that was never loaded (a shard id of
    None is the whole stacked weight at once)."""
    arrived = state.__dict__.pop("_arrived", None)
    if arrived is None or None in arrived:
        return
    missing = [s for s in state.expected_shards if s not in arrived]
    if missing:
        raise ZipServLoadError(
            f"zipserv: checkpoint tensor {ckpt_name(state, missing[0], WEIGHT)} was never loaded, so layer "
            f"{state.prefix} is only partly filled (it takes shards {list(state.expected_shards)}, got "
            f"{sorted(arrived, key=str)}); refusing to compress rows nothing was loaded into")


# --------------------------------------------------------------- execution
def _collect(state: LayerState) -> dict[Any, dict[str, torch.Tensor]]:
    """Recorded tensors by shard, checked for completeness (one clear error)."""
    by_shard: dict[Any, dict[str, torch.Tensor]] = {}
    for (shard, name), t in state.records.items():
        by_shard.setdefault(shard, {})[name] = t
    expected = list(state.expected_shards)
    # A checkpoint may store a fused layer already fused (shard None, e.g. Phi-3's qkv_proj).
    if None in by_shard and expected != [None]:
        expected = [None]
    for shard in by_shard:
        if shard not in expected:
            name = next(iter(by_shard[shard]))
            raise ZipServLoadError(
                f"zipserv: unexpected tensor {ckpt_name(state, shard, name)} for layer {state.prefix} "
                f"(expected shards {expected})")
    for shard in expected:
        got = by_shard.get(shard, {})
        zs = [s for s in SUFFIXES if s in got]
        if WEIGHT in got and zs:
            raise ZipServLoadError(
                f"zipserv: {ckpt_name(state, shard, WEIGHT)} is stored both uncompressed and compressed "
                f"({', '.join(ckpt_name(state, shard, s) for s in zs)})")
        if WEIGHT in got:
            continue
        missing = [s for s in SUFFIXES if s not in got]
        if missing:
            raise ZipServLoadError(
                f"zipserv: checkpoint tensor {ckpt_name(state, shard, missing[0])} is missing "
                f"(layer {state.prefix} needs {', '.join(ckpt_name(state, shard, s) for s in missing)})")
    return {s: by_shard[s] for s in expected}


def shard_ct(state: LayerState, shard, arrays: dict[str, torch.Tensor]) -> CompressedTensor:
    """The shard's CompressedTensor over the checkpoint views, with light checks.

    Magic, version, dtypes and grid shapes are checked here; segment offsets are
    checked when the rank's tiles are selected and again on the rank's arrays,
    so a rank never reads other ranks' metadata just to validate it."""
    meta_name = ckpt_name(state, shard, "zs_meta")
    meta = arrays["zs_meta"]
    if meta.dtype != torch.int64 or meta.dim() != 1 or meta.shape[0] not in spec.META_LENS:
        raise ZipServLoadError(f"zipserv: corrupt checkpoint tensor {meta_name}: must be int64 [{spec.META_LEN}] "
                               f"(or [{spec.META_LEN_MINOR0}]), got {meta.dtype} {list(meta.shape)}")
    try:
        _, version, m, k, crc = parse_meta(meta.tolist(), f"zipserv: {meta_name}")
    except FormatError as exc:
        raise ZipServLoadError(str(exc)) from None
    if m < 1 or k < 1:
        raise ZipServLoadError(f"zipserv: corrupt checkpoint tensor {meta_name}: shape [{m}, {k}]")
    ct = CompressedTensor((m, k), arrays["zs_bitmaps"], arrays["zs_base"], arrays["zs_offsets"],
                          arrays["zs_sm"], arrays["zs_fb"], crc, version, arrays.get(spec.TILE_CRC))
    mt, kt = ct.grid
    expect = {"zs_bitmaps": (torch.int64, (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE)),
              "zs_base": (torch.uint8, (mt, kt)), "zs_offsets": (torch.int64, (mt, kt, 2))}
    if ct.tile_crc is not None:
        expect[spec.TILE_CRC] = (torch.int32, (mt, kt))
    for suffix, (dtype, shape) in expect.items():
        t = arrays[suffix]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ZipServLoadError(
                f"zipserv: corrupt checkpoint tensor {ckpt_name(state, shard, suffix)}: must be {dtype} {list(shape)} "
                f"for a [{m}, {k}] matrix, got {t.dtype} {list(t.shape)}")
    for suffix, dtype in (("zs_sm", torch.uint8), ("zs_fb", torch.int16)):
        t = arrays[suffix]
        if t.dtype != dtype or t.dim() != 1:
            raise ZipServLoadError(f"zipserv: corrupt checkpoint tensor {ckpt_name(state, shard, suffix)}: "
                                   f"must be 1-D {dtype}, got {t.dtype} {list(t.shape)}")
    return ct


def damaged(state: LayerState, shard, exc: Exception, name: str | None = None) -> ZipServLoadError:
    name = name or ckpt_name(state, shard, "zs_*")
    return ZipServLoadError(
        f"zipserv: checkpoint tensor {name} is damaged: {str(exc).split(': ', 1)[-1]}; "
        "re-download or re-compress the checkpoint (`zipserv verify DIR` lists every damaged tensor)")


def _check_full(state: LayerState, shard, ct: CompressedTensor, w: torch.Tensor | None = None) -> None:
    """The ``full`` check: decode the whole matrix and compare its CRC-32 with ``zs_meta``'s."""
    if ct.crc32 == spec.NO_CRC:  # nothing to compare the decoded matrix with: say so, never "full"
        state.checked = NO_CRC_STORED
        return
    if w is None:
        w = decompress_tensor(ct)
    from ..codec import crc32_bytes

    got = crc32_bytes(w)
    if got != (ct.crc32 & 0xFFFFFFFF):
        raise damaged(state, shard, FormatError(f"x: the decoded matrix's CRC-32 is {got:08x}, "
                                                 f"zs_meta says {ct.crc32 & 0xFFFFFFFF:08x}"))
    if state.checked != NO_CRC_STORED:  # a layer of several shards is "full" only if every shard was
        state.checked = "full"


def _note_unchecked(state: LayerState, ct: CompressedTensor, verify: str) -> None:
    """A shard without tile checksums makes its layer "no checksums" in tiles mode (whatever its
    other shards had): the summary must not count it as checked."""
    if verify == "tiles" and ct.tile_crc is None:
        state.checked = NO_CHECKSUMS


def _mark_tiles_checked(state: LayerState) -> None:
    if state.checked in ("", "tiles"):  # never over "full" nor over a shard that could not be checked
        state.checked = "tiles"


def _generic_local_weight(state: LayerState, layer, shards: dict[Any, dict[str, torch.Tensor]],
                          verify: str = "tiles") -> torch.Tensor:
    """Decode every shard and let vLLM's own loader place and narrow it."""
    w = torch.nn.Parameter(torch.empty(state.rows, state.cols, dtype=torch.bfloat16, device=state.device),
                           requires_grad=False)
    w.output_dim, w.input_dim = 0, 1
    for shard, arrays in shards.items():
        if WEIGHT in arrays:
            full = arrays[WEIGHT]
        else:
            ct = shard_ct(state, shard, arrays)
            try:
                ct.validate(ckpt_name(state, shard, "weight"))
            except FormatError as exc:
                raise ZipServLoadError(f"zipserv: corrupt checkpoint tensor: {exc}") from None
            if verify != "none":
                try:
                    if check_tiles(ct, ckpt_name(state, shard, "weight")):
                        _mark_tiles_checked(state)
                except FormatError as exc:
                    raise damaged(state, shard, exc) from None
                _note_unchecked(state, ct, verify)
            full = decompress_tensor(ct)
            if verify == "full":
                _check_full(state, shard, ct, full)
        if shard is None:
            state.orig_loader(w, full)
        else:
            state.orig_loader(w, full, shard)
    return w.data


def join_rows(plans: list[TilePlan]) -> list[TilePlan]:
    """Stack row blocks (q/k/v, gate/up) into one matrix where the tiles allow it: a block whose
    rows are not a multiple of the tile ends a part."""
    groups: list[list[TilePlan]] = [[]]
    for p in plans:
        groups[-1].append(p)
        if p.shape[0] % spec.TILE:
            groups.append([])
    return [TilePlan.cat(g) for g in groups if g]


def plan_layer(state: LayerState, verify: str = "tiles") -> TilePlan | list[TilePlan] | torch.Tensor | None:
    """Decide how one recorded layer is loaded (``verify``: one of VERIFY_MODES).

    Returns a list of tile plans (rows stacked), or a BF16 tensor when the layer
    stays uncompressed, and sets ``state.path``.
    """
    layer = state.layer
    shards = _collect(state)
    if all(WEIGHT in a for a in shards.values()):
        w = _generic_local_weight(state, layer, shards)
        state.path = "bf16"
        state.bf16_reason = "stored uncompressed in the checkpoint"
        return w
    cts: dict[Any, CompressedTensor] = {}
    plans: list[TilePlan] = []
    fast = all(WEIGHT not in a for a in shards.values())
    reason = ""
    for shard, arrays in shards.items():
        if WEIGHT in arrays:
            continue
        ct = cts[shard] = shard_ct(state, shard, arrays)
        full, split = _layer_split(layer, state, shard)
        if full is None:
            fast, reason = False, f"{type(layer).__name__} shard {shard!r} has no tile-level split rule"
            continue
        if tuple(ct.shape) != tuple(full):
            raise ZipServLoadError(
                f"zipserv: checkpoint tensor {ckpt_name(state, shard, 'zs_meta')} says shape {list(ct.shape)}, "
                f"but layer {state.prefix} expects {list(full)}")
        if not _aligned(split, full):
            fast = False
            where = "; ".join(f"dim {d}, start {a}, length {n}" for d, a, n in (split if isinstance(split, list)
                                                                                  else [split]))
            reason = (f"rank {layer.tp_rank}'s split of {ckpt_name(state, shard, 'weight')} "
                      f"({where}) is not on {spec.TILE}-element tile boundaries")
            continue
        if verify == "full":
            _check_full(state, shard, ct)
        elif verify == "tiles":
            _note_unchecked(state, ct, verify)
        if fast:
            try:
                label = ckpt_name(state, shard, "zs_*")
                for sp in (split if isinstance(split, list) else [split]):
                    plans.append(TilePlan.select(ct, *sp, label=label) if sp else TilePlan.select(ct, label=label))
            except FormatError as exc:
                raise ZipServLoadError(f"zipserv: corrupt checkpoint tensor {ckpt_name(state, shard, 'weight')}: {exc}") from None
    if fast:
        plans = join_rows(plans)
        if sum(p.shape[0] for p in plans) > state.rows or any(p.shape[1] != state.cols for p in plans):
            raise ZipServLoadError(f"zipserv: layer {state.prefix}: the rank's tiles are "
                                   f"{[list(p.shape) for p in plans]}, the layer holds [{state.rows}, {state.cols}]")
        state.path = "tiles"
        return plans
    logger.debug("zipserv: %s: %s; decoding, splitting with vLLM's loader and re-encoding this layer",
                state.prefix, reason or "part of the layer is stored uncompressed")
    w = _generic_local_weight(state, layer, shards, "none" if verify == "none" else
                              ("tiles" if verify == "tiles" else "full"))
    state.path = "re-encoded"
    return [TilePlan.select(compress_tensor(w))]


def execute_precompressed(states: list[LayerState], arenas: Callable[[torch.device], PagedArena],
                          verify: str = "tiles", keep_bf16_reason: Callable | None = None) -> None:
    """Plan every recorded layer, then allocate exact arena pages and copy the ranges; with
    ``verify`` "tiles" (or "full") every tile a rank loads is checked against its checksum."""
    planned: list[tuple[LayerState, list[TilePlan]]] = []
    for st in states:
        if st.done or st.tied_to is not None:
            continue
        result = plan_layer(st, verify)
        if isinstance(result, torch.Tensor):
            finish_bf16(st, result)
            continue
        reason = keep_bf16_reason([p.shape for p in result]) if keep_bf16_reason is not None else None
        if reason:  # the measuring dispatcher's prefer=speed: decode now, never allocate it in the arena
            logger.info("zipserv: %s kept BF16 (%s)", st.prefix, reason)
            st.bf16_reason = reason
            finish_bf16(st, _generic_local_weight(st, st.layer, _collect(st), "none"))
            st.path = "bf16"
            continue
        planned.append((st, result))
    load_plans(planned, arenas, verify)


def load_plans(planned: list[tuple[LayerState, list[TilePlan]]], arenas: Callable[[torch.device], PagedArena],
               verify: str = "tiles") -> None:
    """Reserve every planned layer's arrays, allocate each page once with exactly its bytes,
    copy (checking each tile's checksum unless ``verify`` is "none"), bind and validate."""
    for st, plans in planned:
        st.arena = arenas(st.device)
        st.tables = [p.reserve(st.arena) for p in plans]
        st.part_shapes = [p.shape for p in plans]
    for arena in {id(st.arena): st.arena for st, _ in planned}.values():
        arena.commit()
    for st, plans in planned:
        for p, table in zip(plans, st.tables):
            try:
                if p.copy_into(st.arena, table, check=None if verify == "none" else st.prefix):
                    _mark_tiles_checked(st)
            except FormatError as exc:
                tile = getattr(exc, "tile", None)
                raise damaged(st, None, exc, p.source_of(tile[0]) if tile else None) from None
        st.bind()
        for part in st.parts:
            try:
                part.validate(st.prefix)
            except FormatError as exc:
                raise ZipServLoadError(f"zipserv: corrupt checkpoint data for layer {st.prefix}: {exc}") from None
        st.records.clear()  # drop the checkpoint views (unmaps the files)
        st.done = True


def finish_bf16(state: LayerState, w: torch.Tensor) -> None:
    """Keep ``w`` as the layer's plain BF16 weight (vLLM's unquantized path runs it)."""
    layer = state.layer
    layer.weight = torch.nn.Parameter(w, requires_grad=False)
    state.bf16 = True
    state.bf16_reason = state.bf16_reason or "stored uncompressed in the checkpoint"
    state.records.clear()
    state.done = True
