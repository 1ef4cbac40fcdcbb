"""Read a Hugging Face safetensors checkpoint directory, plain or zipserv-compressed.

``Checkpoint.open(dir)`` checks the structure up front (config.json, the index
and every shard header, so a truncated or corrupt shard is reported by name
before any work starts) and then reads one tensor at a time: nothing here
loads a whole shard or model into memory.

In a compressed checkpoint (docs/FORMAT.md section 7) the six ``P.zs_*``
arrays of a weight appear as one logical entry named ``P.weight``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..format import CompressedTensor, FormatError, spec
from .names import CONFIG_FILE, INDEX_FILE, QUANT_METHOD, SINGLE_FILE, ALL_SUFFIXES, WEIGHT_SUFFIX, split_array_name

_FORMAT_VERSIONS = spec.SUPPORTED_VERSIONS


class CheckpointError(Exception):
    """A user-facing problem with a checkpoint or a command's arguments (one line, names the culprit)."""


@dataclass(frozen=True)
class Entry:
    """One logical tensor: a plain tensor, or the ``P.zs_*`` group of a compressed ``P.weight``."""

    name: str  # tensor name; ``P.weight`` for a compressed weight
    shard: str  # file name of its shard
    compressed: bool
    dtype: str  # safetensors dtype code ("BF16", ...); "BF16" for a compressed weight
    shape: tuple[int, ...] | None  # None for a compressed weight until its zs_meta is read

    @property
    def prefix(self) -> str:
        return self.name[: -len(WEIGHT_SUFFIX)] if self.compressed else self.name


class _SafetensorsShard:
    """One safetensors shard (safe_open: a lazy memory map)."""

    def __init__(self, path: Path):
        try:
            self._f = safe_open(str(path), framework="pt")
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc}); truncated or corrupt?") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None

    def __enter__(self):
        self._f.__enter__()
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def metadata(self) -> dict | None:
        return self._f.metadata()

    def keys(self) -> list[str]:
        return list(self._f.keys())

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        sl = self._f.get_slice(name)
        return sl.get_dtype(), tuple(sl.get_shape())

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._f.get_tensor(name)


class _BinShard:
    """One PyTorch ``.bin`` shard, read with ``torch.load(weights_only=True)``: tensors
    and plain containers only, never code (a file that needs code to unpickle is
    refused). Zip-format files are memory-mapped, so nothing is read until used."""

    def __init__(self, path: Path):
        import pickle
        import zipfile

        kw = {"mmap": True} if zipfile.is_zipfile(path) else {}
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=True, **kw)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CheckpointError(f"{path}: refused: loading it needs code to be unpickled, and zipserv only "
                                  f"reads plain tensors (torch.load(weights_only=True): {first})") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
        except Exception as exc:  # a truncated or corrupt zip / pickle
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({type(exc).__name__}"
                                  f"{': ' + text if text else ''}); truncated or corrupt?") from None
        if isinstance(obj, dict) and isinstance(obj.get("state_dict"), dict):
            obj = obj["state_dict"]
        if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
            raise CheckpointError(f"{path}: not a state dict of tensors (found {type(obj).__name__})")
        self._t: dict[str, torch.Tensor] = {str(k): v for k, v in obj.items()}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._t = {}
        return False

    def metadata(self) -> dict | None:
        return None

    def keys(self) -> list[str]:
        return list(self._t)

    def info(self, name: str) -> tuple[str, tuple[int, ...]]:
        from .writer import DTYPE_NAMES

        t = self._t[name]
        if t.dtype not in DTYPE_NAMES:
            raise CheckpointError(f"tensor {name}: dtype {t.dtype} cannot be stored in safetensors")
        return DTYPE_NAMES[t.dtype], tuple(t.shape)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._t[name]


def _open_shard(path: Path):
    return _BinShard(path) if path.suffix == ".bin" else _SafetensorsShard(path)


BIN_INDEX_FILE = "pytorch_model.bin.index.json"


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def zipserv_config(config: dict) -> dict | None:
    """The ``quantization_config`` of a zipserv checkpoint's config.json, or None."""
    q = config.get("quantization_config")
    if isinstance(q, dict) and str(q.get("quant_method", "")).lower() == QUANT_METHOD:
        return q
    return None


def is_compressed_checkpoint(path) -> bool:
    """True when ``path/config.json`` declares ``quant_method: zipserv`` (no shard is opened)."""
    cfg = Path(path) / CONFIG_FILE
    try:
        return zipserv_config(json.loads(cfg.read_text())) is not None
    except (OSError, ValueError):
        return False


class Checkpoint:
    """A checkpoint directory: its config, shards and the tensors they hold (read lazily)."""

    def __init__(self, path: Path, config: dict, shards: list[str], tensors: dict[str, str],
                 dtypes: dict[str, str], shapes: dict[str, tuple[int, ...]], metadata: dict | None, indexed: bool,
                 index_file: str | None = None):
        self.path = path
        self.config = config
        self.shards = shards  # file names, in order
        self.tensors = tensors  # raw safetensors name -> shard file name, in file order
        self.dtypes = dtypes
        self.shapes = shapes
        self.metadata = metadata  # __metadata__ of the first shard
        self.indexed = indexed
        self.index_file = index_file  # the index's file name (safetensors or .bin), None without one
        self.entries = self._group()

    # ---------------------------------------------------------------- opening
    @classmethod
    def open(cls, path, *, require_config: bool = True) -> "Checkpoint":
        path = Path(path)
        if not path.exists():
            raise CheckpointError(f"{path}: no such file or directory")
        if not path.is_dir():
            raise CheckpointError(f"{path}: not a directory (expected a Hugging Face checkpoint directory)")
        cfg_path = path / CONFIG_FILE
        if cfg_path.exists():
            config = _read_json(cfg_path)
        elif require_config:
            raise CheckpointError(f"{path}: not a Hugging Face checkpoint (no {CONFIG_FILE})")
        else:
            config = {}
        index_path = path / INDEX_FILE
        if not index_path.exists() and not (path / SINGLE_FILE).is_file() and not any(path.glob("*.safetensors")):
            if (path / BIN_INDEX_FILE).exists():  # a PyTorch .bin checkpoint, sharded
                index_path = path / BIN_INDEX_FILE
        indexed = index_path.exists()
        if indexed:
            index = _read_json(index_path)
            wm = index.get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CheckpointError(f"{index_path}: no weight_map")
            shards = list(dict.fromkeys(str(v) for v in wm.values()))
            missing = [s for s in shards if not (path / s).is_file()]
            if missing:
                raise CheckpointError(f"{path}: shard {missing[0]} listed in {index_path.name} does not exist"
                                      + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        elif (path / SINGLE_FILE).is_file():
            shards, wm = [SINGLE_FILE], None
        else:
            shards, wm = sorted(p.name for p in path.glob("*.safetensors") if p.is_file()), None
            if not shards:
                shards = sorted(p.name for p in path.glob("pytorch_model*.bin") if p.is_file())
            if not shards:
                others = sorted(p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf"))
                hint = (f" (found {others[0]}: zipserv reads safetensors and pytorch_model*.bin checkpoints)"
                        if others else "")
                raise CheckpointError(f"{path}: not a checkpoint: no *.safetensors or pytorch_model*.bin files{hint}")
        tensors: dict[str, str] = {}
        dtypes: dict[str, str] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        metadata = None
        for shard in shards:
            with _open_shard(path / shard) as sf:
                if metadata is None:
                    metadata = sf.metadata()
                for key in sf.keys():
                    if key in tensors:
                        raise CheckpointError(f"{path}: tensor {key} is in both {tensors[key]} and {shard}")
                    if wm is not None and wm.get(key) != shard:
                        where = f"lists it in {wm[key]}" if key in wm else "does not list it"
                        raise CheckpointError(f"{path / shard}: holds tensor {key} but {index_path.name} {where}")
                    tensors[key] = shard
                    dtypes[key], shapes[key] = sf.info(key)
        if wm is not None:
            absent = [k for k in wm if k not in tensors]
            if absent:
                raise CheckpointError(f"{path}: tensor {absent[0]} listed in {index_path.name} is missing from "
                                      f"{wm[absent[0]]}" + (f" (and {len(absent) - 1} more)" if len(absent) > 1 else ""))
        return cls(path, config, shards, tensors, dtypes, shapes, metadata, indexed,
                   index_path.name if indexed else None)

    def _group(self) -> list[Entry]:
        groups: dict[str, dict[str, str]] = {}
        for name, shard in self.tensors.items():
            split = split_array_name(name)
            if split:
                groups.setdefault(split[0], {})[split[1]] = shard
        entries: list[Entry] = []
        seen: set[str] = set()
        for name, shard in self.tensors.items():
            split = split_array_name(name)
            if split is None:
                entries.append(Entry(name, shard, False, self.dtypes[name], self.shapes[name]))
                continue
            prefix = split[0]
            if prefix in seen:
                continue
            seen.add(prefix)
            wname = prefix + WEIGHT_SUFFIX
            if wname in self.tensors:
                raise CheckpointError(f"{self.path}: {wname} is stored both plain and as zipserv arrays")
            where = groups[prefix]
            if len(set(where.values())) > 1:
                detail = ", ".join(f"{s} in {f}" for s, f in sorted(where.items()))
                raise FormatError(f"{wname}: its zipserv arrays are split across shards ({detail})")
            entries.append(Entry(wname, shard, True, "BF16", None))
        return entries

    # ------------------------------------------------------------- properties
    @property
    def quantization_config(self) -> dict | None:
        q = self.config.get("quantization_config")
        return q if isinstance(q, dict) else None

    @property
    def compressed(self) -> bool:
        return zipserv_config(self.config) is not None

    def check_format_version(self) -> int:
        """The declared ``format_version``; FormatError when this zipserv-vllm cannot read it."""
        q = zipserv_config(self.config)
        if q is None:
            raise CheckpointError(f"{self.path}: not a zipserv checkpoint "
                                  f"({CONFIG_FILE} has no quantization_config with quant_method 'zipserv')")
        version = q.get("format_version", spec.VERSION)
        if version not in _FORMAT_VERSIONS:
            raise FormatError(f"{self.path}: format version {version} is not supported by this zipserv-vllm "
                              f"(supported: {', '.join(map(str, _FORMAT_VERSIONS))})")
        return int(version)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name or (e.compressed and e.prefix == name):
                return e
        raise KeyError(f"{self.path}: no tensor {name}")

    # ----------------------------------------------------------------- reading
    def _shard(self, shard: str):
        """An open shard. A .bin shard stays open (unpickled once) until another shard is asked for."""
        if not shard.endswith(".bin"):
            return _open_shard(self.path / shard)
        cached = self.__dict__.get("_bin")
        if cached is None or cached[0] != shard:
            self.__dict__["_bin"] = None  # drop the previous shard's tensors first
            self.__dict__["_bin"] = cached = (shard, _BinShard(self.path / shard))
        return nullcontext(cached[1])

    @property
    def main_files(self) -> list[str]:
        """The shards and their index (file names relative to the checkpoint)."""
        return list(self.shards) + ([self.index_file] if self.index_file else [])

    @property
    def format(self) -> str:
        """``safetensors`` or ``bin`` (PyTorch pickles, read with weights_only)."""
        return "bin" if self.shards and self.shards[0].endswith(".bin") else "safetensors"

    def _arrays(self, sf, prefix: str) -> dict[str, torch.Tensor]:
        return {s: sf.get_tensor(f"{prefix}.{s}") for s in ALL_SUFFIXES if f"{prefix}.{s}" in self.tensors}

    def read_tensor(self, name: str) -> torch.Tensor:
        """One plain tensor as stored (a compressed weight's raw arrays are ``P.zs_*``)."""
        if name not in self.tensors:
            raise KeyError(f"{self.path}: no tensor {name}")
        with self._shard(self.tensors[name]) as sf:
            return sf.get_tensor(name)

    def read_compressed(self, name: str) -> CompressedTensor:
        """The CompressedTensor of ``P.weight`` (or ``P``), validated (FormatError if malformed)."""
        e = self.entry(name)
        if not e.compressed:
            raise KeyError(f"{self.path}: {e.name} is not compressed")
        with self._shard(e.shard) as sf:
            return CompressedTensor.from_arrays(self._arrays(sf, e.prefix), e.name)

    def iter_entries(self) -> Iterator[tuple[Entry, torch.Tensor | CompressedTensor]]:
        """(entry, tensor or CompressedTensor) in file order, one at a time.

        The caller should drop each value before asking for the next, so that
        at most one tensor is alive.
        """
        for shard in self.shards:
            for e in self.shard_entries(shard):
                # A safetensors shard is re-opened for every tensor: safetensors maps the whole
                # file, and pages touched through one long-lived mapping would stay resident (RSS
                # grows to the shard size). The header parse this costs is negligible. A .bin
                # shard is unpickled once (``_shard``).
                with self._shard(shard) as sf:
                    if e.compressed:
                        value = CompressedTensor.from_arrays(self._arrays(sf, e.prefix), e.name)
                    else:
                        value = sf.get_tensor(e.name)
                yield e, value
                del value

    def shard_entries(self, shard: str) -> list[Entry]:
        return [e for e in self.entries if e.shard == shard]

    def nbytes(self, name: str) -> int:
        """Stored bytes of a raw tensor (from the header, nothing is read)."""
        n = 1
        for d in self.shapes[name]:
            n *= d
        return n * _DTYPE_SIZE[self.dtypes[name]]

    def entry_nbytes(self, e: Entry) -> int:
        if e.compressed:
            return sum(self.nbytes(f"{e.prefix}.{s}") for s in ALL_SUFFIXES if f"{e.prefix}.{s}" in self.tensors)
        return self.nbytes(e.name)


_DTYPE_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
