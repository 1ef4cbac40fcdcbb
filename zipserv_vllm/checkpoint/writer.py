"""A streaming safetensors shard writer: memory stays at one tensor, not one shard.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once.
This writer instead appends each tensor's bytes to a per-alignment scratch file
as soon as it is added, and builds the shard (8-byte header length, JSON
header, data) when the shard is full, copying the scratch files in chunks.
Data is laid out like ``save_file`` does (larger element sizes first), so
every tensor starts at a multiple of its element size, and the files are
standard safetensors that ``safe_open`` validates and reads.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import torch

from .names import INDEX_FILE, SINGLE_FILE

DTYPE_NAMES = {
    torch.bool: "BOOL", torch.uint8: "U8", torch.int8: "I8", torch.int16: "I16", torch.uint16: "U16",
    torch.int32: "I32", torch.uint32: "U32", torch.int64: "I64", torch.uint64: "U64",
    torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32", torch.float64: "F64",
}
for _attr, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _attr):
        DTYPE_NAMES[getattr(torch, _attr)] = _code

_CHUNK = 16 << 20


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` (a view when it is already contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def shard_name(i: int, n: int) -> str:
    """The Hugging Face name of shard ``i`` (1-based) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


class ShardWriter:
    """Write tensors into safetensors shards of at most ``max_shard_bytes`` of data each.

    ``add(group)`` puts a dict of tensors into one shard (a compressed weight's
    six arrays stay together); a group that does not fit in the current,
    non-empty shard starts a new one, and a group larger than the limit gets a
    shard of its own. ``finish()`` names the shards (``model.safetensors`` when
    there is one, else ``model-0000i-of-0000n.safetensors`` plus the index) and
    returns the weight map. ``max_shard_bytes=None`` never splits on its own;
    call ``new_shard()`` to cut.
    """

    def __init__(self, directory: Path, max_shard_bytes: int | None = None, metadata: dict | None = None):
        self.dir = Path(directory)
        self.max = max_shard_bytes
        self.metadata = {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}
        self._done: list[tuple[Path, list[str]]] = []  # (scratch shard file, tensor names)
        self._names: set[str] = set()
        self.total_bytes = 0
        self._open_shard()

    # ------------------------------------------------------------ internals
    def _open_shard(self) -> None:
        self._entries: list[tuple[str, str, list[int], int, int]] = []  # name, dtype, shape, align, size
        self._files: dict[int, object] = {}
        self._size = 0

    def _scratch(self, align: int):
        f = self._files.get(align)
        if f is None:
            f = open(self.dir / f".zs-shard-{len(self._done) + 1:05d}.data{align}", "wb")
            self._files[align] = f
        return f

    def _close_shard(self, force: bool = False) -> None:
        if not self._entries and not force:
            return
        header: dict = {"__metadata__": self.metadata}
        pos = 0
        order = sorted(self._files)[::-1]  # 8-byte elements first: every tensor stays aligned
        for align in order:
            for name, dtype, shape, a, size in self._entries:
                if a == align:
                    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
                    pos += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        path = self.dir / f".zs-shard-{len(self._done) + 1:05d}.safetensors"
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(raw)))
            out.write(raw)
            for align in order:
                f = self._files[align]
                f.close()
                with open(f.name, "rb") as src:
                    shutil.copyfileobj(src, out, _CHUNK)
                os.unlink(f.name)
        self._done.append((path, [e[0] for e in self._entries]))
        self._open_shard()

    # -------------------------------------------------------------- public
    def new_shard(self, force: bool = False) -> None:
        """Close the current shard (``force``: even when it is empty)."""
        self._close_shard(force)

    def add(self, group: dict[str, torch.Tensor]) -> None:
        size = 0
        for name, t in group.items():
            if name in self._names:
                raise ValueError(f"tensor {name!r} written twice")
            if t.dtype not in DTYPE_NAMES:
                raise TypeError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
            size += tensor_bytes(t)
        if self.max is not None and self._entries and self._size + size > self.max:
            self._close_shard()
        for name, t in group.items():
            align = t.element_size()
            self._scratch(align).write(_raw(t))
            self._entries.append((name, DTYPE_NAMES[t.dtype], list(t.shape), align, tensor_bytes(t)))
            self._names.add(name)
        self._size += size
        self.total_bytes += size

    def finish(self, names: list[str] | None = None) -> dict[str, str]:
        """Close the last shard, give every shard its final name, write the index; return the weight map.

        ``names``: explicit shard file names (one per shard, e.g. the source's);
        an index is written whenever there is more than one shard or a name is
        not ``model.safetensors``.
        """
        self._close_shard()
        if not self._done:  # a checkpoint with no tensor still gets a (valid, empty) file
            self._close_shard(force=True)
        n = len(self._done)
        if names is None:
            names = [SINGLE_FILE] if n == 1 else [shard_name(i, n) for i in range(1, n + 1)]
        if len(names) != n:
            raise ValueError(f"{len(names)} shard names for {n} shards")
        weight_map: dict[str, str] = {}
        for (path, tensors), final in zip(self._done, names):
            os.replace(path, self.dir / final)
            weight_map.update({t: final for t in tensors})
        if n > 1 or names != [SINGLE_FILE]:
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return weight_map

    def abort(self) -> None:
        """Close scratch files (the caller removes the directory)."""
        for f in self._files.values():
            f.close()
