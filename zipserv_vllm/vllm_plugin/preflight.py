"""Checkpoint preflight: header-only checks of a pre-compressed directory.

vLLM's default loader does not check completeness for quantized models, and a
truncated safetensors shard or an unknown tensor under a fused layer produce
errors that name no tensor (vllm-plugin-notes, pitfall 9). So before vLLM
builds the model, :func:`check_checkpoint` reads every shard's header (and the
48-byte ``zs_meta`` of each compressed matrix) and raises one clear
:class:`CheckpointError` naming the first offending tensor:

* a shard shorter than its header says (truncated download or copy);
* a compressed matrix with some but not all six ``.zs_*`` tensors, or with an
  unknown ``.zs_*`` suffix, or stored both compressed and as ``.weight``;
* an array with the wrong dtype or rank;
* a ``zs_meta`` with a bad magic or an unsupported format version.

It reads headers and 48 bytes per matrix only. This module imports no vLLM.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np

from ..format import FormatError, parse_meta, spec

_DTYPES = {"zs_meta": "I64", "zs_bitmaps": "I64", "zs_base": "U8", "zs_offsets": "I64", "zs_sm": "U8", "zs_fb": "I16",
           "zs_crc": "I32"}
_RANKS = {"zs_meta": 1, "zs_bitmaps": 4, "zs_base": 2, "zs_offsets": 3, "zs_sm": 1, "zs_fb": 1, "zs_crc": 2}


class CheckpointError(ValueError):
    """A pre-compressed checkpoint is incomplete, truncated or of an unknown version."""


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data section) of one safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"zipserv: checkpoint shard {path.name} is truncated: {size} bytes, no header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise CheckpointError(f"zipserv: checkpoint shard {path.name} is truncated: its header needs {n} bytes, "
                                  f"the file has {size - 8} after the length")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise CheckpointError(f"zipserv: checkpoint shard {path.name} has a corrupt header: {exc}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / n for n in names]
    return sorted(model_dir.glob("*.safetensors"))


def _unservable(model_dir: Path):
    """prefix -> why vLLM cannot load it compressed ("" when it can), from the compressor's rules."""
    from ..checkpoint.names import plan_weight

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        config = {}

    def why(prefix: str) -> str:
        plan = plan_weight(prefix + ".weight", (0, 0), config)
        if plan.action == "plain" and "smaller" not in plan.reason:
            return f"it is {plan.reason}" if plan.reason.startswith("a") else plan.reason
        return ""

    return why


def check_checkpoint(model_dir: str | os.PathLike) -> dict[str, int]:
    """Raise :class:`CheckpointError` on the first problem; return counts when sound."""
    model_dir = Path(model_dir)
    files = shard_files(model_dir)
    groups: dict[str, dict[str, tuple[Path, dict, int]]] = {}
    weights: set[str] = set()
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"zipserv: checkpoint shard {path.name} listed in the index is missing")
        header, data_start = read_header(path)
        data_len = path.stat().st_size - data_start
        for name, info in header.items():
            lo, hi = info["data_offsets"]
            if hi > data_len:
                raise CheckpointError(
                    f"zipserv: checkpoint shard {path.name} is truncated: tensor {name} needs bytes "
                    f"[{lo}, {hi}) of the data section, only {data_len} are present")
            prefix, _, suffix = name.rpartition(".")
            if suffix.startswith("zs_"):
                if suffix not in _DTYPES:
                    raise CheckpointError(f"zipserv: unexpected tensor {name} in {path.name} "
                                          f"(known compressed suffixes: {', '.join(spec.ALL_SUFFIXES)})")
                if info["dtype"] != _DTYPES[suffix] or len(info["shape"]) != _RANKS[suffix]:
                    raise CheckpointError(
                        f"zipserv: corrupt checkpoint tensor {name}: dtype {info['dtype']} rank {len(info['shape'])}, "
                        f"expected {_DTYPES[suffix]} rank {_RANKS[suffix]}")
                groups.setdefault(prefix, {})[suffix] = (path, info, data_start)
            elif suffix == "weight":
                weights.add(prefix)
    with_crc = [p for p, a in groups.items() if spec.TILE_CRC in a]
    if with_crc and len(with_crc) < len(groups):
        from ..checkpoint.convert import mixed_tile_crc_problem

        first = next(p for p, a in groups.items() if spec.TILE_CRC not in a)
        raise CheckpointError(f"zipserv: checkpoint tensor {mixed_tile_crc_problem(first, len(with_crc))}")
    unservable = _unservable(model_dir)
    meta_lens: dict[int, str] = {}  # zs_meta length -> the first matrix with it
    for prefix, arrays in groups.items():
        why = unservable(prefix)
        if why:
            raise CheckpointError(f"zipserv: {prefix}.weight is stored compressed, but {why}, so vLLM cannot load "
                                  "it; compress the BF16 checkpoint again with this zipserv-vllm (it keeps such "
                                  "weights BF16)")
        missing = [s for s in spec.SUFFIXES if s not in arrays]
        if missing:
            raise CheckpointError(f"zipserv: checkpoint tensor {prefix}.{missing[0]} is missing "
                                  f"(a compressed matrix needs {', '.join(prefix + '.' + s for s in spec.SUFFIXES)})")
        if prefix in weights:
            raise CheckpointError(f"zipserv: {prefix}.weight is stored both uncompressed and compressed")
        path, info, data_start = arrays["zs_meta"]
        if len(info["shape"]) != 1 or info["shape"][0] not in spec.META_LENS:
            raise CheckpointError(f"zipserv: corrupt checkpoint tensor {prefix}.zs_meta: shape {info['shape']}, "
                                  f"expected [{spec.META_LEN}] (or [{spec.META_LEN_MINOR0}] before its checksum)")
        meta_lens.setdefault(info["shape"][0], prefix)
        with open(path, "rb") as f:
            f.seek(data_start + info["data_offsets"][0])
            meta = np.frombuffer(f.read(8 * info["shape"][0]), dtype="<i8")
        try:
            parse_meta(meta.tolist(), f"zipserv: {prefix}.zs_meta")
        except FormatError as exc:
            raise CheckpointError(str(exc)) from None
    if len(meta_lens) > 1:  # one writer writes one minor version: a matrix without the checksum was swapped in
        raise CheckpointError(f"zipserv: checkpoint tensor {meta_lens[spec.META_LEN_MINOR0]}.zs_meta has no checksum, "
                              f"while {meta_lens[spec.META_LEN]}.zs_meta and others do: the checkpoint was damaged or "
                              "edited; re-download or re-compress it")
    return {"shards": len(files), "compressed": len(groups), "uncompressed_weights": len(weights)}
