"""Public codec API: ``compress_tensor`` and ``decompress_tensor``.

Both run the native C++ codec (``zipserv_vllm._C``, multi-threaded) when it is
built, and the NumPy reference codec otherwise; ``backend=`` forces one. The
two are byte-identical, which the test suite checks.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .format import CompressedTensor, FormatError, reference

try:  # the extension is optional at import time so that a source tree still works
    from . import _C  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - exercised only without a build
    _C = None
    _C_ERROR = exc
else:
    _C_ERROR = None
    if not hasattr(_C, "encode"):  # an extension built before the codec existed
        _C, _C_ERROR = None, ImportError("zipserv_vllm._C has no codec; rebuild it")

_warned = False


def native_available() -> bool:
    return _C is not None


def default_threads() -> int:
    """Threads for the native codec: ZIPSERV_THREADS, else torch's intra-op thread count.

    The codec runs on torch's OpenMP threads (csrc/codec.cpp): inside a vLLM CPU worker those are
    the threads vLLM bound to its cores (the calling thread alone may be pinned to one core, so the
    affinity mask would undercount)."""
    from .settings import threads

    env = threads()  # SettingError (one line) for a value that is not a positive integer
    if env is not None:
        return env
    return max(1, torch.get_num_threads())


def _backend(backend: str) -> str:
    global _warned
    if backend == "auto":
        if _C is not None:
            return "native"
        if not _warned:
            warnings.warn(f"zipserv_vllm._C is not built ({_C_ERROR}); using the slow reference codec")
            _warned = True
        return "reference"
    if backend == "native" and _C is None:
        raise ImportError(f"the native codec zipserv_vllm._C is not built: {_C_ERROR}")
    if backend not in ("native", "reference"):
        raise ValueError(f"backend must be 'auto', 'native' or 'reference', got {backend!r}")
    return backend


def _bits_of(w: torch.Tensor) -> np.ndarray:
    """The BF16 bit patterns of a 2-D CPU bfloat16 tensor as a uint16 array (no copy if contiguous)."""
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(w).__name__}")
    if w.dtype != torch.bfloat16:
        raise TypeError(f"zipserv compresses bfloat16 weights only, got {w.dtype} (converting would not be lossless)")
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {list(w.shape)}")
    if w.shape[0] < 1 or w.shape[1] < 1:
        raise ValueError(f"cannot compress an empty tensor of shape {list(w.shape)}")
    if w.device.type != "cpu":
        w = w.cpu()
    return w.detach().contiguous().view(torch.int16).numpy().view(np.uint16)


def compress_tensor(w: torch.Tensor, *, backend: str = "auto", threads: int | None = None,
                    checksums: bool = False) -> CompressedTensor:
    """Compress a 2-D ``torch.bfloat16`` tensor into TCA-TBE v1 (lossless); with
    ``checksums``, also compute the tile checksums (``tile_crc``, as checkpoints store them)."""
    bits = _bits_of(w)
    if _backend(backend) == "reference":
        e = reference.encode(bits)
        arrays = (e.bitmaps, e.base, e.offsets, e.sm, e.fb)
    else:
        arrays = _C.encode(bits, threads or default_threads())
    bitmaps, base, offsets, sm, fb = arrays
    ct = CompressedTensor(
        (int(bits.shape[0]), int(bits.shape[1])),
        torch.from_numpy(np.ascontiguousarray(bitmaps).view(np.int64)),
        torch.from_numpy(np.ascontiguousarray(base)),
        torch.from_numpy(np.ascontiguousarray(offsets)),
        torch.from_numpy(np.ascontiguousarray(sm)),
        torch.from_numpy(np.ascontiguousarray(fb).view(np.int16)),
    )
    if checksums:
        ct.tile_crc = tile_checksums(ct, backend=backend, threads=threads)
    return ct


def _encoded(ct: CompressedTensor) -> reference.Encoded:
    """The arrays of ``ct`` as NumPy views (on the CPU) in the reference codec's types."""
    ct = ct.to("cpu") if ct.device.type != "cpu" else ct
    return reference.Encoded(ct.shape[0], ct.shape[1], ct.bitmaps.contiguous().numpy().view(np.uint64),
                             ct.base.contiguous().numpy(), ct.offsets.contiguous().numpy(),
                             ct.sm.contiguous().numpy(), ct.fb.contiguous().numpy().view(np.uint16))


def check_tiles(ct: CompressedTensor, name: str = "tensor", threads: int | None = None) -> bool:
    """Compare every tile's stored bytes with ``ct.tile_crc``; FormatError naming the first
    damaged tile. Returns False (checks nothing) when the tensor has no tile checksums.
    (Here, not in format/: the format is the ground floor and imports no codec.)"""
    if ct.tile_crc is None:
        return False
    got = tile_checksums(ct, threads=threads).cpu().numpy()
    want = ct.tile_crc.cpu().numpy()
    bad = np.argwhere(got != want)
    if bad.size:
        tm, tk = (int(x) for x in bad[0])
        exc = FormatError(f"{name}: tile ({tm}, {tk}) does not match its checksum (stored "
                          f"{int(want[tm, tk]) & 0xFFFFFFFF:08x}, computed {int(got[tm, tk]) & 0xFFFFFFFF:08x}): "
                          f"the compressed data is damaged" + (f" ({len(bad)} tiles in all)" if len(bad) > 1 else ""))
        exc.tile = (tm, tk)
        raise exc
    return True


def tile_checksums(ct: CompressedTensor, *, backend: str = "auto", threads: int | None = None) -> torch.Tensor:
    """The tile checksums of ``ct``'s stored bytes (docs/FORMAT.md section 6) as int32 [Mt, Kt]
    (uint32 bit patterns); ValueError when a segment lies outside its stream."""
    e = _encoded(ct)
    if _backend(backend) == "reference":
        crc = reference.tile_crc(e)
    else:
        crc = _C.tile_crc(e.bitmaps, e.base, e.offsets, e.sm, e.fb, threads or default_threads())
    return torch.from_numpy(np.ascontiguousarray(crc).view(np.int32))


def crc32_bytes(t: torch.Tensor | np.ndarray | bytes, *, threads: int | None = None) -> int:
    """zlib CRC-32 of the bytes of a contiguous CPU tensor or buffer (native: on threads)."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous().reshape(-1)
        if t.numel() == 0:
            return 0
        t = t.view(torch.uint8).numpy()
    if _C is None:
        import zlib

        return zlib.crc32(memoryview(t).cast("B") if not isinstance(t, bytes) else t)
    return int(_C.crc32(t, threads or default_threads()))


def decompress_tensor(ct: CompressedTensor, *, backend: str = "auto", threads: int | None = None) -> torch.Tensor:
    """Rebuild the exact ``torch.bfloat16`` matrix of ``ct.shape`` (on the CPU)."""
    ct = ct.to("cpu") if ct.device.type != "cpu" else ct
    m, k = ct.shape
    e = _encoded(ct)
    bitmaps, base, offsets, sm, fb = e.bitmaps, e.base, e.offsets, e.sm, e.fb
    if _backend(backend) == "reference":
        out = reference.decode(e)
        return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
    ct.validate()
    # _C.empty_bits recycles huge-page memory: a fresh torch.empty would take a
    # page fault per 4 KiB on first write, costing more than the decode itself.
    out = _C.empty_bits(m, k)
    _C.decode(bitmaps, base, offsets, sm, fb, out, threads or default_threads())
    return torch.from_numpy(out.view(np.int16)).view(torch.bfloat16)
