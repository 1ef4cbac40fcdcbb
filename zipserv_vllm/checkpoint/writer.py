"""A streaming safetensors shard writer: each byte is written once, memory stays near one tensor.

``safetensors.torch.save_file`` needs every tensor of a file in memory at once.
This writer instead writes each tensor's bytes into the shard file as soon as
it is added, behind room reserved for the header, and writes the header (a
JSON object padded with spaces to the reserved size, as the format allows)
when the shard is closed. Every tensor starts at a multiple of its element
size: tensors whose size is a multiple of 8 bytes (almost all of them, and
every zipserv array but the small ``zs_base``) are written in arrival order,
and the others are held back and written at the end of the shard, larger
element sizes first. The files are standard safetensors that ``safe_open``
validates and reads. If the header outgrows its reservation (the caller's
estimate was too small), the data is moved once behind a larger header.
The file writes run on one background thread, so that the caller prepares
the next tensor meanwhile; at most 256 MiB (or one tensor) wait for it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
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
_QUEUED = 256 << 20  # bytes handed to the writer thread and not yet written, at most (plus one tensor)
_HELD_IN_MEMORY = 4 << 20  # held-back (odd-sized) tensors up to this size wait in memory, larger in a spool file
DEFAULT_HEADER_RESERVE = 64 << 10


def header_bound(names_and_shapes, metadata: dict | None = None) -> int:
    """An upper bound of the JSON header bytes of a shard holding these (name, shape) tensors."""
    n = len(json.dumps({"__metadata__": metadata or {}})) + 16
    for name, shape in names_and_shapes:
        # "name":{"dtype":"BF16","shape":[...],"data_offsets":[a,b]}, with 20 digits per offset
        n += len(json.dumps(name)) + 60 + 21 * max(1, len(shape)) + 2 * 20
    return -(-n // 8) * 8


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _raw(t: torch.Tensor) -> memoryview:
    """The row-major bytes of ``t`` (a view when it is already contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def shard_name(i: int, n: int) -> str:
    """The Hugging Face name of shard ``i`` (1-based) of ``n``."""
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def planned_header(tensors, metadata: dict | None = None) -> int:
    """The exact header size ShardWriter writes for a shard of these (name, dtype, shape)
    tensors, added in this order (dtype: a torch dtype), padded to 8 bytes as save_file does."""
    from math import prod

    sized = [(name, DTYPE_NAMES[d], list(shape), prod(shape) * d.itemsize, d.itemsize) for name, d, shape in tensors]
    order = [t for t in sized if t[3] % 8 == 0] + sorted((t for t in sized if t[3] % 8), key=lambda t: -t[4])
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}}
    pos = 0
    for name, code, shape, size, _ in order:
        header[name] = {"dtype": code, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    n = len(json.dumps(header, separators=(",", ":")).encode())
    return n + (-n % 8)


class ShardWriter:
    """Write tensors into safetensors shards of at most ``max_shard_bytes`` of data each.

    ``add(group)`` puts a dict of tensors into one shard (a compressed weight's
    arrays stay together); a group that does not fit in the current, non-empty
    shard starts a new one, and a group larger than the limit gets a shard of
    its own. ``finish()`` names the shards (``model.safetensors`` when there is
    one, else ``model-0000i-of-0000n.safetensors`` plus the index) and returns
    the weight map. ``max_shard_bytes=None`` never splits on its own; call
    ``new_shard()`` to cut. ``header_reserve``: bytes reserved for each shard's
    header, or a function giving them when a shard opens (an upper bound of the
    header of everything still to come avoids moving the data).
    """

    def __init__(self, directory: Path, max_shard_bytes: int | None = None, metadata: dict | None = None,
                 header_reserve: int | Callable[[], int] = DEFAULT_HEADER_RESERVE):
        self.dir = Path(directory)
        self.max = max_shard_bytes
        self.metadata = {str(k): str(v) for k, v in (metadata or {"format": "pt"}).items()}
        self._reserve_of = header_reserve if callable(header_reserve) else (lambda: header_reserve)
        self._done: list[tuple[Path, list[str]]] = []  # (scratch shard file, tensor names)
        self._names: set[str] = set()
        self.total_bytes = 0
        self._file = None
        self.moved_shards = 0  # shards whose header outgrew the reservation (data moved once)
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zipserv-write")
        self._pending: list = []
        self._pending_bytes = 0

    # ------------------------------------------------------------ internals
    def _open_shard(self) -> None:
        self._path = self.dir / f".zs-shard-{len(self._done) + 1:05d}.safetensors"
        self._file = open(self._path, "wb")
        self._reserve = max(8, -(-int(self._reserve_of()) // 8) * 8)
        self._file.seek(8 + self._reserve)
        self._entries: list[tuple[str, str, list[int], int, int]] = []  # name, dtype, shape, start, size
        self._held: list[tuple[int, str, str, list[int], object, int]] = []  # align, name, dtype, shape, data, size
        self._pos = 0  # bytes of data written so far
        self._size = 0  # bytes of data added to this shard (held back included)

    def _write(self, data) -> None:
        """Runs on the writer thread, in submission order."""
        if isinstance(data, (bytes, memoryview)):
            self._file.write(data)
        else:  # a spool file
            data.seek(0)
            shutil.copyfileobj(data, self._file, _CHUNK)
            data.close()

    def _drain(self, keep_bytes: int = 0) -> None:
        """Wait for queued writes until at most ``keep_bytes`` are pending (errors surface here)."""
        while self._pending and (keep_bytes == 0 or self._pending_bytes > keep_bytes):
            fut, n = self._pending.pop(0)
            self._pending_bytes -= n
            fut.result()

    def _put(self, name: str, dtype: str, shape: list[int], data, size: int) -> None:
        # Writes go to one background thread (the GIL is released while the kernel copies), so
        # the caller encodes the next tensor meanwhile; at most _QUEUED bytes wait in memory.
        self._pending.append((self._pool.submit(self._write, data), size))
        self._pending_bytes += size
        self._drain(_QUEUED)
        self._entries.append((name, dtype, shape, self._pos, size))
        self._pos += size

    def _close_shard(self, force: bool = False) -> None:
        if self._file is None:
            if not force:
                return
            self._open_shard()
        elif not self._entries and not self._held and not force:
            return
        for align, name, dtype, shape, data, size in sorted(self._held, key=lambda h: -h[0]):
            self._put(name, dtype, shape, data, size)
        self._held = []
        self._drain()
        header: dict = {"__metadata__": self.metadata}
        for name, dtype, shape, start, size in self._entries:
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [start, start + size]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        if len(raw) <= self._reserve:
            self._file.seek(0)
            self._file.write(struct.pack("<Q", self._reserve) + raw + b" " * (self._reserve - len(raw)))
            self._file.close()
        else:  # the estimate was too small: move the data behind a larger header, once
            self._file.close()
            raw += b" " * (-len(raw) % 8)
            moved = self._path.with_suffix(".moving")
            with open(self._path, "rb") as src, open(moved, "wb") as out:
                out.write(struct.pack("<Q", len(raw)) + raw)
                src.seek(8 + self._reserve)
                shutil.copyfileobj(src, out, _CHUNK)
            os.replace(moved, self._path)
            self.moved_shards += 1
        self._file = None
        self._done.append((self._path, [e[0] for e in self._entries]))

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
        if self._file is not None and self.max is not None and self._size and self._size + size > self.max:
            self._close_shard()
        if self._file is None:
            self._open_shard()
        for name, t in group.items():
            n, raw = tensor_bytes(t), _raw(t)
            dtype, shape = DTYPE_NAMES[t.dtype], list(t.shape)
            if n % 8 == 0:
                self._put(name, dtype, shape, raw, n)
            else:  # would misalign what follows: written at the end of the shard
                if n <= _HELD_IN_MEMORY:
                    data = bytes(raw)
                else:
                    data = tempfile.TemporaryFile(dir=self.dir)
                    data.write(raw)
                self._held.append((t.element_size(), name, dtype, shape, data, n))
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
        self._pool.shutdown()
        return weight_map

    def abort(self) -> None:
        """Close the open shard and spool files (the caller removes the directory)."""
        for fut, _ in self._pending:
            fut.cancel()
        self._pool.shutdown(wait=True)
        self._pending = []
        if self._file is not None:
            self._file.close()
            self._file = None
        for h in getattr(self, "_held", []):
            if not isinstance(h[4], (bytes, memoryview)):
                h[4].close()
