"""CUDA implementations of ``zipserv::gemm`` and ``zipserv::decompress`` (csrc/cuda/).

Registered with ``register_kernel("cuda")`` on the ops of ``ops.py`` when this
module is imported (ops.py imports it, guarded). The extension
``zipserv_vllm._cuda`` takes raw pointers, sizes and the current stream, so it
links cudart only; this module does the checks and the bookkeeping.

* ``mode="exact"``: decompress kernel + ``F.linear`` on the rebuilt weight:
  bit-identical to the BF16 path on the same weights.
* ``mode="fast"``: ``dispatch.choose`` picks per call, from N and the layer
  shape, the fused ZipGEMM kernel (with split-K when M alone cannot fill the
  GPU) or the decoupled path (decompress into a per-device workspace, then
  ``torch.matmul`` / cuBLAS).

CUDA-graph capture: nothing here synchronises with the host, kernel
attributes are set once per device (``prepare``), and workspaces are cached
per device and never grown while a stream is capturing: call
``reserve_workspaces(device, max_m, max_k, max_n)`` (the model maximum) before
capturing; a capture that would need more raises instead of allocating.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from . import dispatch, ops
from ..format import spec

try:
    from .. import _cuda  # type: ignore[attr-defined]
except ImportError as exc:  # built only where nvcc was found
    _cuda = None
    _REASON = (f"zipserv_vllm._cuda is not built ({exc}); reinstall with nvcc on PATH or CUDA_HOME set "
               "(and ZIPSERV_NO_CUDA unset)")
else:
    _REASON = ""

_lock = threading.Lock()
_prepared: set[int] = set()
_workspaces: dict[tuple[int, str], torch.Tensor] = {}
_device_info: dict[int, tuple[str, tuple[int, int], int]] = {}


def available() -> bool:
    """True when the extension is built and a CUDA device is visible."""
    return _cuda is not None and torch.cuda.is_available()


def unavailable_reason() -> str:
    if _cuda is None:
        return _REASON
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no GPU or a CPU-only torch)"
    return ""


def _need() -> None:
    if _cuda is None:
        raise RuntimeError(_REASON)


def _index(device) -> int:
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def prepare(device=None) -> None:
    """Set every kernel attribute on ``device`` (once; safe to call again)."""
    _need()
    idx = _index(device if device is not None else "cuda")
    if idx in _prepared:
        return
    with _lock:
        if idx not in _prepared:
            with torch.cuda.device(idx):
                _cuda.prepare()
            _prepared.add(idx)


def device_info(device) -> tuple[str, tuple[int, int], int]:
    """(name, compute capability, SM count) of a device, cached."""
    idx = _index(device)
    if idx not in _device_info:
        p = torch.cuda.get_device_properties(idx)
        _device_info[idx] = (p.name, (p.major, p.minor), p.multi_processor_count)
    return _device_info[idx]


def plan(n: int, m: int, k: int, device) -> dispatch.Plan:
    """The dispatcher's choice for this call on this device."""
    name, cc, sms = device_info(device)
    return dispatch.choose(n, m, k, sms, dispatch.load_table(name, cc))


# ------------------------------------------------------------- workspaces
def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _workspace(device: torch.device, kind: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A cached 1-D buffer of at least ``numel`` elements; grows only outside capture."""
    key = (_index(device), kind)
    buf = _workspaces.get(key)
    if buf is None or buf.numel() < numel:
        if _capturing():
            have = 0 if buf is None else buf.numel()
            raise RuntimeError(
                f"zipserv {kind} workspace on cuda:{key[0]} holds {have} elements, this call needs {numel}: "
                "call zipserv_vllm.cuda_ops.reserve_workspaces(...) with the model maximum before graph capture")
        buf = torch.empty(numel, dtype=dtype, device=device)
        _workspaces[key] = buf
    return buf


def reserve_workspaces(device, max_m: int, max_k: int, max_n: int, max_weight_elems: int | None = None) -> None:
    """Preallocate, for the largest layer (max_m x max_k) and token count max_n,
    the split-K workspace (fp32 partials) and the decoupled path's weight
    workspace (bf16 max_m x max_k), and set the kernel attributes. Call before
    CUDA-graph capture. ``max_weight_elems`` (default max_m * max_k) is the
    largest M * K of any layer, when that is less than the product of maxima."""
    device = torch.device(device)
    prepare(device)
    table = dispatch.load_table(*device_info(device)[:2])
    fused_n = min(max_n, dispatch.max_fused_n(table))
    if fused_n > 0:
        _workspace(device, "splitk", int(table.get("max_split", 16)) * fused_n * max_m, torch.float32)
    decoupled_rules = any(r["path"] == "decoupled" for sh in table.get("shapes", ()) for r in sh["rules"])
    if max_n > int(table.get("fused_max_n", 128)) or decoupled_rules:
        _workspace(device, "weight", max_weight_elems or max_m * max_k, torch.bfloat16)


def release_workspaces() -> None:
    _workspaces.clear()


# ------------------------------------------------------------------ checks
def _ptr16(t: torch.Tensor, name: str) -> int:
    if not t.is_contiguous():
        raise ValueError(f"zipserv CUDA: {name} must be contiguous")
    p = t.data_ptr()
    if p % 16:
        raise ValueError(f"zipserv CUDA: {name} must be 16-byte aligned (data_ptr % 16 = {p % 16}); "
                         "clone() it once at load time")
    return p


def _check(x: torch.Tensor | None, bitmaps, base, offsets, sm, fb, m: int, k: int) -> None:
    mt, kt = -(-m // spec.TILE), -(-k // spec.TILE)
    dev = sm.device
    for name, t, dtype, shape in (("bitmaps", bitmaps, torch.int64, (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE)),
                                  ("base", base, torch.uint8, (mt, kt)),
                                  ("offsets", offsets, torch.int64, (mt, kt, 2))):
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"zipserv CUDA: {name} must be {dtype} {list(shape)} for a {m} x {k} weight, "
                             f"got {t.dtype} {list(t.shape)}")
    if sm.dtype != torch.uint8 or fb.dtype != torch.int16:
        raise ValueError(f"zipserv CUDA: sm must be uint8 and fb int16, got {sm.dtype} and {fb.dtype}")
    for name, t in (("bitmaps", bitmaps), ("base", base), ("offsets", offsets), ("fb", fb)) + (
            (("x", x),) if x is not None else ()):
        if t.device != dev:
            raise ValueError(f"zipserv CUDA: {name} is on {t.device}, sm on {dev}")
    if x is not None and x.dtype != torch.bfloat16:
        raise TypeError(f"zipserv CUDA: x must be bfloat16, got {x.dtype}")


def _stream(device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _decompress_into(out: torch.Tensor, bitmaps, base, offsets, sm, fb, m: int, k: int) -> torch.Tensor:
    _cuda.decompress(_ptr16(bitmaps, "bitmaps"), base.data_ptr(), offsets.data_ptr(),
                     _ptr16(sm, "sm") if sm.numel() else sm.data_ptr(), _ptr16(fb, "fb") if fb.numel() else fb.data_ptr(),
                     out.data_ptr(), m, k, _stream(out.device))
    return out


# -------------------------------------------------------------- op impls
def decompress_cuda(bitmaps, base, offsets, sm, fb, m: int, k: int) -> torch.Tensor:
    """Row-major bf16 [m, k], bit-exact (standalone decompress kernel)."""
    _need()
    _check(None, bitmaps, base, offsets, sm, fb, m, k)
    prepare(sm.device)
    with torch.cuda.device(sm.device):
        out = torch.empty((m, k), dtype=torch.bfloat16, device=sm.device)
        return _decompress_into(out.view(torch.int16), bitmaps, base, offsets, sm, fb, m, k).view(torch.bfloat16)


def fused_gemm(x2: torch.Tensor, bitmaps, base, offsets, sm, fb, m: int, k: int, bias, tile_n: int,
               split: int) -> torch.Tensor:
    """The fused kernel with an explicit configuration: Y[N, m] for x2 [N, k] (bf16, contiguous)."""
    _need()
    _check(x2, bitmaps, base, offsets, sm, fb, m, k)
    with torch.cuda.device(x2.device):
        return _fused_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias, tile_n, split)


def _fused_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias, tile_n, split):
    prepare(x2.device)  # the kernel attributes (a set lookup after the first call)
    if x2.dim() != 2 or x2.shape[1] != k or x2.dtype != torch.bfloat16 or not x2.is_contiguous():
        raise ValueError(f"zipserv CUDA: x must be a contiguous bfloat16 [N, {k}], got {x2.dtype} {list(x2.shape)}")
    n = x2.shape[0]
    kt = -(-k // spec.TILE)
    parts = _cuda.splitk_parts(kt, max(1, min(split, kt)))
    y = torch.empty((n, m), dtype=torch.bfloat16, device=x2.device)
    ws_ptr = 0
    if parts > 1:
        ws_ptr = _workspace(x2.device, "splitk", parts * n * m, torch.float32).data_ptr()
    if bias is not None:
        if bias.dtype != torch.bfloat16 or bias.shape != (m,) or not bias.is_contiguous():
            raise ValueError(f"zipserv CUDA: bias must be a contiguous bfloat16 [{m}], got {bias.dtype} {list(bias.shape)}")
    xp = x2.data_ptr()
    x_vec = int(k % 8 == 0 and xp % 16 == 0)
    _cuda.zipgemm(xp, _ptr16(bitmaps, "bitmaps"), base.data_ptr(), offsets.data_ptr(),
                  _ptr16(sm, "sm") if sm.numel() else sm.data_ptr(), _ptr16(fb, "fb") if fb.numel() else fb.data_ptr(),
                  0 if bias is None else bias.data_ptr(), y.data_ptr(), ws_ptr, m, k, n, tile_n, parts, x_vec,
                  _stream(x2.device))
    return y


def decoupled_gemm(x2: torch.Tensor, bitmaps, base, offsets, sm, fb, m: int, k: int, bias) -> torch.Tensor:
    """Decompress into the per-device weight workspace, then cuBLAS (F.linear)."""
    _need()
    _check(x2, bitmaps, base, offsets, sm, fb, m, k)
    with torch.cuda.device(x2.device):
        return _decoupled_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias)


def _decoupled_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias):
    buf = _workspace(x2.device, "weight", m * k, torch.bfloat16)
    w = buf[: m * k].view(m, k)
    _decompress_into(w.view(torch.int16), bitmaps, base, offsets, sm, fb, m, k)
    return F.linear(x2, w, bias)


def gemm_cuda(x, bitmaps, base, offsets, sm, fb, m: int, k: int, bias, mode: str) -> torch.Tensor:
    _need()
    if mode not in ops.MODES:
        raise ValueError(f"mode must be one of {ops.MODES}, got {mode!r}")
    _check(x, bitmaps, base, offsets, sm, fb, m, k)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    prepare(x.device)
    with torch.cuda.device(x.device):
        if mode == "exact":
            return F.linear(x, decompress_cuda(bitmaps, base, offsets, sm, fb, m, k), bias)
        x2 = x.reshape(-1, k).contiguous()
        n = x2.shape[0]
        if n == 0:
            return x.new_empty((*x.shape[:-1], m))
        p = plan(n, m, k, x.device)
        if p.path == "decoupled":
            y = _decoupled_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias)
        else:
            y = _fused_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias, p.tile_n, p.split)
        return y.view(*x.shape[:-1], m)


# ----------------------------------------------------------- GPU encoder
def canonical_offsets(hcount: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Segment starts [G, 2] of the canonical layout from each tile's H, and the
    stream lengths (sm bytes, fb elements). Works on any device (one sync for the
    lengths); the GPU encoder and its CPU replay both use it."""
    sm_len = (hcount + spec.SM_ALIGN - 1) // spec.SM_ALIGN * spec.SM_ALIGN
    fb_len = (spec.TILE_ELEMS - hcount + spec.FB_ALIGN - 1) // spec.FB_ALIGN * spec.FB_ALIGN
    off = torch.stack([torch.cumsum(sm_len, 0) - sm_len, torch.cumsum(fb_len, 0) - fb_len], dim=1).contiguous()
    s_len, f_len = (int(v) for v in torch.stack([sm_len.sum(), fb_len.sum()]).tolist())
    return off, s_len, f_len


def compress_tensor_cuda(w: torch.Tensor, max_scratch_bytes: int = 512 << 20):
    """Encode a 2-D CUDA bf16 tensor on the GPU; byte-identical to the reference encoder.

    Returns a ``CompressedTensor`` on the same device. Tile rows are encoded in
    chunks so the per-tile scratch (12 KiB per tile) stays below
    ``max_scratch_bytes``. Synchronises once per chunk (stream lengths).
    """
    from ..format import CompressedTensor

    _need()
    if w.dtype != torch.bfloat16 or w.dim() != 2 or not w.is_cuda:
        raise ValueError(f"expected a 2-D CUDA bfloat16 tensor, got {w.dtype} {list(w.shape)} on {w.device}")
    m, k = w.shape
    if m < 1 or k < 1:
        raise ValueError(f"cannot compress an empty tensor of shape {list(w.shape)}")
    dev = w.device
    w = w.contiguous()
    mt, kt = -(-m // spec.TILE), -(-k // spec.TILE)
    rows_per_chunk = max(1, max_scratch_bytes // (kt * 3 * spec.TILE_ELEMS))
    bm_parts, base_parts, off_parts, sm_parts, fb_parts = [], [], [], [], []
    sm_total = fb_total = 0
    with torch.cuda.device(dev):
        st = _stream(dev)
        for tm0 in range(0, mt, rows_per_chunk):
            rows = min(rows_per_chunk, mt - tm0)
            g = rows * kt
            bitmaps = torch.empty((rows, kt, spec.PLANES, spec.FRAGS_PER_TILE), dtype=torch.int64, device=dev)
            base = torch.empty((rows, kt), dtype=torch.uint8, device=dev)
            hcount = torch.empty(g, dtype=torch.int64, device=dev)
            ssm = torch.empty(g * spec.TILE_ELEMS, dtype=torch.uint8, device=dev)
            sfb = torch.empty(g * spec.TILE_ELEMS, dtype=torch.int16, device=dev)
            _cuda.encode_tiles(w.data_ptr(), m, k, tm0, rows, bitmaps.data_ptr(), base.data_ptr(), hcount.data_ptr(),
                               ssm.data_ptr(), sfb.data_ptr(), st)
            off, s_len, f_len = canonical_offsets(hcount)
            sm = torch.zeros(s_len, dtype=torch.uint8, device=dev)
            fb = torch.zeros(f_len, dtype=torch.int16, device=dev)
            _cuda.encode_scatter(hcount.data_ptr(), off.data_ptr(), ssm.data_ptr(), sfb.data_ptr(), sm.data_ptr(),
                                 fb.data_ptr(), g, st)
            bm_parts.append(bitmaps)
            base_parts.append(base)
            off_parts.append((off + torch.tensor([sm_total, fb_total], device=dev)).view(rows, kt, 2))
            sm_parts.append(sm)
            fb_parts.append(fb)
            sm_total += s_len
            fb_total += f_len
    cat = (lambda xs: xs[0] if len(xs) == 1 else torch.cat(xs))
    return CompressedTensor((m, k), cat(bm_parts), cat(base_parts), cat(off_parts), cat(sm_parts), cat(fb_parts))


# ---------------------------------------------------------- registration
ops.gemm.register_kernel("cuda")(gemm_cuda)
ops.decompress.register_kernel("cuda")(decompress_cuda)
