"""The checkpoint operations behind ``zipserv compress / decompress / verify / inspect``.

Every operation streams: one tensor is read, converted, written and dropped
before the next one is read, so peak memory is about the largest tensor plus
its compressed form, whatever the model size. Outputs are staged in a
temporary sibling directory (see ``files.staged_directory``).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import __version__
from ..codec import check_tiles, compress_tensor, crc32_bytes, decompress_tensor, default_threads
from ..format import CompressedTensor, FormatError, high_counts, parse_meta, spec
from .files import SideFiles, copy_side_files, plan_side_files, resolve_source, staged_directory
from .names import (CONFIG_FILE, KINDS, QUANT_METHOD, SINGLE_FILE, compressible, layer_kind, module_name,
                    WeightPlan, plan_weight)
from .reader import Checkpoint, CheckpointError, Entry
from .writer import ShardWriter, header_bound, planned_header

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
MODES = ("fast", "exact")


# --------------------------------------------------------------------------- statistics
@dataclass
class KindStats:
    tensors: int = 0
    elements: int = 0
    before: int = 0  # bytes of the original (BF16 for compressed weights)
    after: int = 0  # bytes stored

    @property
    def ratio(self) -> float:
        return self.before / self.after if self.after else 0.0

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.after / self.elements if self.elements else 0.0

    def add(self, elements: int, before: int, after: int) -> None:
        self.tensors += 1
        self.elements += elements
        self.before += before
        self.after += after

    def as_dict(self) -> dict:
        return {"tensors": self.tensors, "elements": self.elements, "bytes_before": self.before,
                "bytes_after": self.after, "ratio": round(self.ratio, 4), "bits_per_weight": round(self.bits_per_weight, 4)}


@dataclass
class SizeSummary:
    """Bytes before and after, per kind of layer ("uncompressed" holds every copied tensor)."""

    kinds: dict[str, KindStats] = field(default_factory=lambda: {k: KindStats() for k in KINDS})

    def add(self, kind: str, elements: int, before: int, after: int) -> None:
        self.kinds.setdefault(kind, KindStats()).add(elements, before, after)

    def _sum(self, names) -> KindStats:
        out = KindStats()
        for k in names:
            s = self.kinds[k]
            out.tensors += s.tensors
            out.elements += s.elements
            out.before += s.before
            out.after += s.after
        return out

    @property
    def compressed(self) -> KindStats:
        return self._sum([k for k in self.kinds if k != "uncompressed"])

    @property
    def total(self) -> KindStats:
        return self._sum(self.kinds)

    def rows(self) -> list[tuple[str, KindStats]]:
        rows = [(k, s) for k, s in self.kinds.items() if s.tensors]
        return rows + [("compressed", self.compressed), ("total", self.total)]

    def as_dict(self) -> dict:
        return {k: s.as_dict() for k, s in self.rows()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def crc32_of(t: torch.Tensor, threads: int | None = None) -> int:
    """zlib CRC-32 of the row-major bytes of a tensor (the ``zs_meta`` CRC of a BF16 weight)."""
    return crc32_bytes(t, threads=threads)


def _same_bits(a: torch.Tensor, b: torch.Tensor, threads: int | None = None) -> bool:
    """Same dtype, shape and bytes (NaN payloads and -0 included)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    x = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    y = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
    from ..codec import _C

    if _C is not None:
        return bool(_C.bytes_equal(x, y, threads or default_threads()))
    return bool(np.array_equal(x, y))


def _progress(total: int, desc: str, enabled: bool | None):
    from tqdm import tqdm

    # disable=None: shown on a terminal only. Bytes with SI units, so the rate reads in MB/s or GB/s.
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1000, dynamic_ncols=True,
                disable=None if enabled is None else not enabled, leave=False)


def _check_destination(src: Path, dst: Path) -> None:
    """Refuse a destination that is the source or lies inside it (it would be copied into itself)."""
    s, d = src.resolve(), dst.resolve()
    if d == s:
        raise CheckpointError(f"{dst}: the destination is the source checkpoint")
    if s in d.parents:
        raise CheckpointError(f"{dst}: the destination is inside the source checkpoint {src}")


def _write_config(dst: Path, config: dict) -> None:
    (dst / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def _shard_metadata(ck: Checkpoint) -> dict:
    meta = dict(ck.metadata or {})
    meta.setdefault("format", "pt")
    return meta


# ----------------------------------------------------------------------------- compress
@dataclass
class CompressReport:
    src: Path
    dst: Path
    summary: SizeSummary
    seconds: float
    shards: int
    compressed_modules: list[str]
    side: SideFiles  # every other file: copied, or left out as a duplicate of the main weights
    kept_bf16: list[tuple[str, str]] = field(default_factory=list)  # (weight, why) of 2-D BF16 weights left plain
    transposed: list[str] = field(default_factory=list)  # Conv1D modules stored as [out, in]

    @property
    def gb_per_s(self) -> float:
        return self.summary.total.before / self.seconds / 1e9 if self.seconds > 0 else 0.0


CAST_DTYPES = {"bfloat16": torch.bfloat16}  # compress --dtype: what vLLM's --dtype would load the weights as
_SOURCE_DTYPES = {"F32": "float32", "F16": "float16", "F64": "float64", "BF16": "bfloat16"}


def _check_source(ck: Checkpoint, cast: str | None = None) -> None:
    q = ck.quantization_config
    if q is not None:
        method = q.get("quant_method", "?")
        raise CheckpointError(f"{ck.path}: already quantized ({CONFIG_FILE} has a quantization_config with "
                              f"quant_method {method!r}); zipserv compresses plain BF16 checkpoints")
    for e in ck.entries:
        if e.compressed:
            raise CheckpointError(f"{ck.path}: holds zipserv arrays ({e.prefix}.zs_*) but {CONFIG_FILE} does not "
                                  "declare quant_method 'zipserv'")
        if compressible(e.name, e.shape) and e.dtype != "BF16" and \
                plan_weight(e.name, e.shape, ck.config).action != "plain":
            if cast is not None and e.dtype in ("F32", "F16"):
                continue
            if cast is not None:
                raise CheckpointError(f"{ck.path}: tensor {e.name} is {e.dtype}: --dtype {cast} casts F32 and F16 "
                                      "weights only")
            raise CheckpointError(f"{ck.path}: tensor {e.name} is {e.dtype}, not BF16: zipserv is lossless for "
                                  "bfloat16 weights only and will not convert it; `--dtype bfloat16` stores what "
                                  "vLLM serves with --dtype bfloat16 (the weights cast as its loader casts them)")


def _source_dtype(ck: Checkpoint) -> str:
    """The floating dtype of the source's compressible weights (its config's torch_dtype if none)."""
    seen = {e.dtype for e in ck.entries if e.shape is not None and compressible(e.name, e.shape)}
    seen &= set(_SOURCE_DTYPES)
    if len(seen) == 1:
        return _SOURCE_DTYPES[seen.pop()]
    return str(ck.config.get("dtype") or ck.config.get("torch_dtype") or "mixed")


def _header_names(ck: Checkpoint, e: Entry) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of the tensors ``e`` can become in an output (for the header reservation)."""
    if e.shape is not None and compressible(e.name, e.shape):
        p = module_name(e.name)
        return [(e.name, e.shape)] + [(f"{p}.{s}", (0, 0, 0, 0)) for s in spec.ALL_SUFFIXES]
    return [(e.name, e.shape or (0,))]


def compress_checkpoint(src, dst, *, overwrite: bool = False, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
                        threads: int | None = None, mode: str = "fast", progress: bool | None = None,
                        backend: str = "auto", check: bool = True, dtype: str | None = None,
                        _on_tensor: Callable[[str, torch.Tensor], None] | None = None) -> CompressReport:
    """Write a zipserv checkpoint of the BF16 checkpoint ``src`` (a directory or a Hub id) into ``dst``.

    Every weight vLLM runs through a layer zipserv serves (``names.plan_weight``)
    becomes its ``zs_*`` arrays, with the CRC-32 of the original bytes in
    ``zs_meta`` and the tile checksums in ``zs_crc``; a Conv1D weight is
    compressed transposed (recorded in ``transposed_modules``); a weight whose
    compressed form would not be smaller, and every other tensor, is copied
    unchanged, and so is every other file of the source, except copies of the
    main weights in other formats (``files.DUPLICATE_PATTERNS``, named in the
    report). With ``check`` each weight is decoded again and compared bit for
    bit before it is written. ``_on_tensor`` is a test hook called with each
    source tensor.

    ``dtype="bfloat16"`` takes an FP32 or FP16 checkpoint: each weight that is
    compressed is first cast to BF16 exactly as vLLM's loader casts it when it
    serves the source with ``--dtype bfloat16`` (``Tensor.to``: round to nearest
    even); other tensors are copied unchanged (vLLM casts them at load as it
    would the source's). ``config.json`` then says ``torch_dtype`` bfloat16 and
    ``quantization_config.source_dtype`` the source's dtype: the contract is
    vLLM serving the source with ``dtype=bfloat16``, bit for bit.
    """
    if mode not in MODES:
        raise CheckpointError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if max_shard_bytes < 1:
        raise CheckpointError(f"max shard size must be positive, got {max_shard_bytes}")
    if dtype is not None and dtype not in CAST_DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(CAST_DTYPES)}, got {dtype!r}")
    src_path = resolve_source(src)
    dst = Path(dst)
    ck = Checkpoint.open(src_path)
    _check_source(ck, dtype)
    source_dtype = _source_dtype(ck) if dtype is not None else None
    _check_destination(src_path, dst)
    threads = threads or default_threads()
    total = sum(ck.entry_nbytes(e) for e in ck.entries)
    summary = SizeSummary()
    modules: list[str] = []
    kept: list[tuple[str, str]] = []
    transposed: list[str] = []
    meta = _shard_metadata(ck)
    # The header of a shard holds at most every tensor not yet written: reserve that much room.
    bounds = [header_bound(_header_names(ck, e)) for e in ck.entries]
    left = [sum(bounds)]
    start = time.perf_counter()
    with staged_directory(dst, overwrite) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes, meta, header_reserve=lambda: left[0] + header_bound([], meta))
        bar = _progress(total, "compress", progress)
        try:
            for i, (e, t) in enumerate(ck.iter_entries()):
                if _on_tensor is not None:
                    _on_tensor(e.name, t)
                nbytes = t.numel() * t.element_size()
                plan = plan_weight(e.name, t.shape, ck.config) if compressible(e.name, t) else None
                if plan is not None and t.numel() == 0:
                    plan = WeightPlan("plain", f"an empty weight (shape {list(t.shape)}): nothing to compress")
                if plan is not None and plan.action == "plain":
                    kept.append((e.name, plan.reason))
                    plan = None
                ct = None
                if plan is not None:
                    w = t.t().contiguous() if plan.action == "transpose" else t
                    if dtype is not None and w.dtype != CAST_DTYPES[dtype]:
                        w = w.to(CAST_DTYPES[dtype])  # as vLLM's param.data.copy_(loaded_weight) rounds it
                    ct = compress_tensor(w, backend=backend, threads=threads, checksums=True)
                    if ct.nbytes >= w.numel() * 2:  # BF16's bytes (an FP32 source's are twice that)
                        kept.append((e.name, "its compressed form would not be smaller than BF16"))
                        ct = None
                    else:
                        ct.crc32 = crc32_of(w, threads)
                        if check and not _same_bits(decompress_tensor(ct, backend=backend, threads=threads), w,
                                                    threads):
                            raise RuntimeError(f"{e.name}: the codec did not round-trip this tensor bit for bit; "
                                               "refusing to write a lossy checkpoint (this is a zipserv-vllm bug)")
                    del w
                if ct is not None:
                    prefix = module_name(e.name)
                    writer.add({f"{prefix}.{s}": a for s, a in ct.arrays().items()})
                    summary.add(layer_kind(e.name), t.numel(), nbytes, ct.nbytes)
                    modules.append(prefix)
                    if plan.action == "transpose":
                        transposed.append(prefix)
                    del ct
                else:
                    writer.add({e.name: t})
                    summary.add("uncompressed", t.numel(), nbytes, nbytes)
                left[0] -= bounds[i]
                del t
                bar.update(nbytes)
            weight_map = writer.finish()
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        config = dict(ck.config)
        config["quantization_config"] = {
            "quant_method": QUANT_METHOD,
            "format_version": spec.VERSION,
            "mode": mode,
            "compressed_modules": modules,
            # vLLM reads quantization_config["producer"]["name"]: it must be a dict.
            "producer": {"name": "zipserv-vllm", "version": __version__},
        }
        if transposed:
            config["quantization_config"]["transposed_modules"] = transposed
        if source_dtype is not None:
            config["quantization_config"]["source_dtype"] = source_dtype
            # what vLLM serves (and what --dtype auto then picks): newer transformers write "dtype",
            # older ones "torch_dtype"; both are set so that every reader sees the same
            config["torch_dtype"] = config["dtype"] = dtype
        _write_config(tmp, config)
        side = plan_side_files(src_path, main=set(ck.main_files), skip={CONFIG_FILE})
        copy_side_files(src_path, tmp, side)
    return CompressReport(src_path, dst, summary, time.perf_counter() - start, len(set(weight_map.values())),
                          modules, side, kept, transposed)


# --------------------------------------------------------------------------- decompress
@dataclass
class DecompressReport:
    src: Path
    dst: Path
    summary: SizeSummary
    seconds: float
    shards: int


def _open_compressed(path) -> Checkpoint:
    ck = Checkpoint.open(path)
    ck.check_format_version()
    return ck


def transposed_modules(ck: Checkpoint) -> set[str]:
    """Modules stored transposed (Conv1D) in a compressed checkpoint (FORMAT.md section 7)."""
    q = ck.quantization_config or {}
    t = q.get("transposed_modules") or []
    if not isinstance(t, list) or not all(isinstance(x, str) for x in t):
        raise FormatError(f"{ck.path}: quantization_config.transposed_modules must be a list of module names")
    return set(t)


def _crc_problem(e: Entry, ct: CompressedTensor, w: torch.Tensor, threads: int | None) -> str | None:
    """None when the decoded ``w`` matches the stored CRC-32; else what is wrong (the damaged tile, if known)."""
    if ct.crc32 == spec.NO_CRC:
        return None
    got = crc32_of(w, threads)
    if got == (ct.crc32 & 0xFFFFFFFF):
        return None
    where = ""
    try:
        check_tiles(ct, e.name)
    except FormatError as exc:
        where = f"; {str(exc).split(': ', 1)[1]}"
    return f"CRC mismatch (stored {ct.crc32 & 0xFFFFFFFF:08x}, decoded {got:08x}){where}"


def _decode_checked(e: Entry, ct: CompressedTensor, threads: int | None, transpose: bool = False) -> torch.Tensor:
    """The original tensor of a compressed entry: decoded, CRC-checked, transposed back if it was."""
    w = decompress_tensor(ct, threads=threads)
    problem = _crc_problem(e, ct, w, threads)
    if problem:
        raise CheckpointError(f"{e.name}: {problem}" + ("" if "damaged" in problem else ": the compressed data is corrupt"))
    return w.t().contiguous() if transpose else w


def _output_tensor(ck: Checkpoint, e: Entry, flipped: set[str]) -> tuple[str, torch.dtype, list[int]]:
    """(name, dtype, shape) of what decompress writes for ``e`` (reads only a zs_meta)."""
    if not e.compressed:
        from .writer import DTYPE_NAMES

        return e.name, {v: k for k, v in DTYPE_NAMES.items()}[ck.dtypes[e.name]], list(e.shape)
    _, _, m, k, _ = parse_meta(ck.read_tensor(f"{e.prefix}.zs_meta").tolist(), e.name)
    return e.name, torch.bfloat16, [k, m] if e.prefix in flipped else [m, k]


def decompress_checkpoint(src, dst, *, overwrite: bool = False, threads: int | None = None,
                          progress: bool | None = None) -> DecompressReport:
    """Rebuild the plain BF16 checkpoint (same tensor names, orientations and shards, no
    quantization_config; every other file copied)."""
    ck = _open_compressed(src)
    dst = Path(dst)
    _check_destination(ck.path, dst)
    flipped = transposed_modules(ck)
    summary = SizeSummary()
    start = time.perf_counter()
    total = sum(ck.entry_nbytes(e) for e in ck.entries)
    meta = _shard_metadata(ck)
    reserve = [0]
    with staged_directory(dst, overwrite) as tmp:
        writer = ShardWriter(tmp, None, meta, header_reserve=lambda: reserve[0])
        bar = _progress(total, "decompress", progress)
        names = []
        try:
            for shard in ck.shards:
                entries = ck.shard_entries(shard)
                reserve[0] = planned_header([_output_tensor(ck, e, flipped) for e in entries], meta)
                for e in entries:
                    stored = ck.entry_nbytes(e)
                    if e.compressed:
                        w = _decode_checked(e, ck.read_compressed(e.name), threads, e.prefix in flipped)
                        summary.add(layer_kind(e.name), w.numel(), w.numel() * 2, stored)
                    else:
                        w = ck.read_tensor(e.name)
                        summary.add("uncompressed", w.numel(), stored, stored)
                    writer.add({e.name: w})
                    del w
                    bar.update(stored)
                writer.new_shard(force=True)
                names.append(shard)
            writer.finish(names if (ck.indexed or names != [SINGLE_FILE]) else None)
        except BaseException:
            writer.abort()
            raise
        finally:
            bar.close()
        config = {k: v for k, v in ck.config.items() if k != "quantization_config"}
        _write_config(tmp, config)
        copy_side_files(ck.path, tmp, plan_side_files(ck.path, main=set(ck.main_files), skip={CONFIG_FILE},
                                                      duplicates=False))
    return DecompressReport(ck.path, dst, summary, time.perf_counter() - start, len(ck.shards))


# ------------------------------------------------------------------------------- verify
@dataclass
class VerifyReport:
    path: Path
    against: Path | None
    compressed: int = 0
    copied: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    files_checked: int = 0  # other files of the source found byte-identical (with ``against``)
    duplicates: list[tuple[str, str]] = field(default_factory=list)  # source files left out, and why
    no_crc: list[str] = field(default_factory=list)  # compressed tensors whose zs_meta stores no CRC-32
    no_crc_tiles: int = 0  # of those, how many had their tiles checked against zs_crc instead
    source_dtype: str | None = None  # compress --dtype: the source's dtype (compared after the cast)

    @property
    def ok(self) -> bool:
        return not self.problems


def _same_file(a: Path, b: Path) -> bool:
    import filecmp

    return filecmp.cmp(a, b, shallow=False)


def verify_checkpoint(path, against=None, *, threads: int | None = None,
                      progress: bool | None = None) -> VerifyReport:
    """Decode every compressed tensor and check its CRC; with ``against``, compare every tensor
    bit for bit and check that every other file of the source is in the output, byte for byte
    (or is a known copy of the main weights, which compress leaves out).

    Structural problems (unreadable shards, incomplete index, missing ``zs_*``
    arrays, unknown format version) raise; data mismatches are collected in
    ``report.problems`` (each naming the tensor or file).
    """
    ck = _open_compressed(path)
    ref = Checkpoint.open(resolve_source(against)) if against is not None else None
    report = VerifyReport(ck.path, ref.path if ref else None)
    threads = threads or default_threads()
    start = time.perf_counter()
    flipped = transposed_modules(ck)
    report.source_dtype = ck.config["quantization_config"].get("source_dtype")
    cast = CAST_DTYPES.get(str(ck.config.get("dtype") or ck.config.get("torch_dtype"))) if report.source_dtype else None
    declared = ck.config["quantization_config"].get("compressed_modules")
    found = [e.prefix for e in ck.entries if e.compressed]
    if isinstance(declared, list) and set(declared) != set(found):
        missing = sorted(set(declared) - set(found))
        extra = sorted(set(found) - set(declared))
        what = f"{missing[0]}.weight is declared compressed in {CONFIG_FILE} but has no zs_* arrays" if missing \
            else f"{extra[0]}.weight is compressed but not declared in {CONFIG_FILE}"
        raise FormatError(f"{ck.path}: {what}")
    if ref is not None:
        mine = {e.name for e in ck.entries}
        for e in ref.entries:
            if e.name not in mine:
                report.problems.append(f"{e.name}: in {ref.path} but missing from {ck.path}")
        theirs = {e.name for e in ref.entries}
        for e in ck.entries:
            if e.name not in theirs:
                report.problems.append(f"{e.name}: in {ck.path} but not in {ref.path}")
        side = plan_side_files(ref.path, main=set(ref.main_files), skip={CONFIG_FILE})
        report.duplicates = side.duplicates
        for rel in side.copied:
            out = ck.path / rel
            if not out.is_file():
                report.problems.append(f"{rel}: in {ref.path} but missing from {ck.path}")
            elif not _same_file(ref.path / rel, out):
                report.problems.append(f"{rel}: differs from {ref.path / rel}")
            else:
                report.files_checked += 1
    bar = _progress(sum(ck.entry_nbytes(e) for e in ck.entries), "verify", progress)
    with_tile_crc: list[str] = []
    without_tile_crc: list[str] = []
    try:
        for e, value in ck.iter_entries():
            if e.compressed:
                w = decompress_tensor(value, threads=threads)
                problem = _crc_problem(e, value, w, threads)
                if problem:
                    report.problems.append(f"{e.name}: {problem}")
                (with_tile_crc if value.tile_crc is not None else without_tile_crc).append(e.name)
                if value.crc32 == spec.NO_CRC:  # nothing to compare the decoded matrix with: say so
                    report.no_crc.append(e.name)
                    try:
                        if check_tiles(value, e.name):
                            report.no_crc_tiles += 1
                    except FormatError as exc:
                        report.problems.append(f"{e.name}: {str(exc).split(': ', 1)[-1]}")
                if e.prefix in flipped:
                    w = w.t()
                report.compressed += 1
            else:
                w = value
                report.copied += 1
            if ref is not None and e.name in ref.tensors:
                other = ref.read_tensor(e.name)
                if e.compressed and cast is not None and other.dtype != cast:
                    other = other.to(cast)  # compress --dtype: the contract is the cast source
                if not _same_bits(w, other, threads):
                    detail = (f"{other.dtype} {list(other.shape)} there, {w.dtype} {list(w.shape)} here"
                              if (other.dtype, tuple(other.shape)) != (w.dtype, tuple(w.shape))
                              else "the bits differ")
                    report.problems.append(f"{e.name}: differs from {ref.path} ({detail})")
                del other
            report.bytes_checked += ck.entry_nbytes(e)
            bar.update(ck.entry_nbytes(e))
            del w, value
    finally:
        bar.close()
    if with_tile_crc and without_tile_crc:  # compress writes zs_crc for every matrix: damage or tampering
        report.problems.append(mixed_tile_crc_problem(without_tile_crc[0], len(with_tile_crc)))
    report.seconds = time.perf_counter() - start
    return report


def mixed_tile_crc_problem(first_without: str, n_with: int) -> str:
    """A checkpoint where some compressed matrices have tile checksums and others do not."""
    name = first_without[: -len(".weight")] if first_without.endswith(".weight") else first_without
    return (f"{name}.zs_crc is missing, while {n_with} other compressed "
            f"matri{'ces have' if n_with != 1 else 'x has'} tile checksums (zipserv compress writes them for "
            "every matrix): the checkpoint was damaged or edited; re-download or re-compress it")


# ------------------------------------------------------------------------------ inspect
def coverage(ct: CompressedTensor) -> float:
    """Fraction of the real (non-padding) elements that are high-frequency (inside their tile's window)."""
    m, k = ct.shape
    mt, kt = ct.grid
    padding = mt * kt * spec.TILE_ELEMS - m * k
    return float(int(high_counts(ct.bitmaps).sum()) - padding) / (m * k)


def _natural_key(name: str) -> list:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


def inspect_checkpoint(path) -> dict:
    """Per-tensor sizes (and, for compressed weights, bits per weight and window coverage) plus totals.

    Reads the arrays, decodes nothing. Works on plain checkpoints too (all
    tensors are then "uncompressed").
    """
    ck = Checkpoint.open(path)
    version = ck.check_format_version() if ck.compressed else None
    flipped = transposed_modules(ck) if ck.compressed else set()
    summary = SizeSummary()
    rows = []
    for e, value in ck.iter_entries():
        stored = ck.entry_nbytes(e)
        if e.compressed:
            m, k = value.shape
            kind = layer_kind(e.name)
            flip = e.prefix in flipped
            row = {"name": e.name, "kind": kind, "compressed": True, "dtype": "BF16",
                   "shape": [k, m] if flip else [m, k], "transposed": flip,
                   "tile_checksums": value.tile_crc is not None,
                   "bytes": stored, "original_bytes": m * k * 2, "ratio": round(m * k * 2 / stored, 4),
                   "bits_per_weight": round(8.0 * stored / (m * k), 4), "coverage": round(coverage(value), 6),
                   "tiles": value.grid[0] * value.grid[1], "crc32": None if value.crc32 == spec.NO_CRC
                   else f"{value.crc32 & 0xFFFFFFFF:08x}", "shard": e.shard}
            summary.add(kind, m * k, m * k * 2, stored)
        else:
            n = value.numel()
            row = {"name": e.name, "kind": "uncompressed", "compressed": False, "dtype": e.dtype,
                   "shape": list(e.shape), "bytes": stored, "original_bytes": stored, "ratio": 1.0,
                   "bits_per_weight": round(8.0 * stored / n, 4) if n else 0.0, "coverage": None,
                   "tiles": None, "crc32": None, "shard": e.shard}
            summary.add("uncompressed", n, stored, stored)
        rows.append(row)
        del value
    rows.sort(key=lambda r: _natural_key(r["name"]))
    comp = summary.compressed
    cov = sum(r["coverage"] * _numel(r["shape"]) for r in rows if r["compressed"])
    return {
        "path": str(ck.path),
        "compressed": ck.compressed,
        "format_version": version,
        "mode": ck.config["quantization_config"].get("mode") if ck.compressed else None,
        "shards": ck.shards,
        "tensors": rows,
        "by_kind": summary.as_dict(),
        "totals": {**summary.total.as_dict(),
                   "compressed_bits_per_weight": round(comp.bits_per_weight, 4),
                   "compressed_ratio": round(comp.ratio, 4),
                   "coverage": round(cov / comp.elements, 6) if comp.elements else None},
    }


def iter_tensors(path, *, decode: bool = False):
    """(name, tensor) of a checkpoint, one at a time; compressed weights as CompressedTensor or, with
    ``decode``, as the rebuilt BF16 tensor (CRC-checked)."""
    ck = Checkpoint.open(path)
    flipped = set()
    if ck.compressed:
        ck.check_format_version()
        flipped = transposed_modules(ck)
    for e, value in ck.iter_entries():
        if e.compressed and decode:
            value = _decode_checked(e, value, None, e.prefix in flipped)
        yield e.name, value
