"""CUDA implementations of ``zipserv::gemm``, ``::decompress`` and ``::embedding`` (csrc/cuda/).

Registered with ``register_kernel("cuda")`` on the ops of :mod:`.ops` and
:mod:`.embedding` when this module is imported (by ``zipserv_vllm.kernels``),
and only when the extension ``zipserv_vllm._cuda`` is built: without it one
warning says so and CUDA tensors take the ops' composite implementation
(decoded on the CPU: correct, slow). The extension takes raw pointers, sizes
and the current stream, so it links cudart only; this module does the checks
and the bookkeeping.

* ``mode="exact"``: decompress kernel + ``F.linear`` on the rebuilt weight:
  bit-identical to the BF16 path on the same weights.
* ``mode="fast"``: ``dispatch.choose`` picks per call, from N and the layer
  shape, the fused ZipGEMM kernel (with split-K when M alone cannot fill the
  GPU) or the decoupled path (decompress into a per-device workspace, then
  ``torch.matmul`` / cuBLAS).
* a weight in the byte-split layout (``PackedTensor``, docs/FORMAT.md
  appendix A; a GPU engine holds it with ``ZIPSERV_GPU_LAYOUT=bytesplit`` or
  ``prefer: speed``): ``zipserv::packed_gemm`` / ``::packed_decompress``, the
  byte-split kernel at N <= 16 or its decompress kernel + cuBLAS
  (``dispatch.choose(..., layout="bytesplit")``).
* mixtures of experts: :func:`grouped_gemm`, one launch of the grouped fused
  kernel over the experts a batch routes to (rows grouped per expert), or the
  decoupled path per expert for large token counts. Not yet called by the vLLM
  plugin (whose compressed experts run on the CPU backend; on a GPU they stay
  BF16) until it has run on a GPU.

CUDA-graph capture: nothing here synchronises with the host during a call.
Kernel attributes are set once per device (``prepare``). Scratch memory (the
split-K fp32 partials, the decoupled path's BF16 weight) comes from torch's
allocator on every call, never from a cache this module could free or grow:
a call captured in a graph gets its scratch from the graph's memory pool,
which lives as long as the graph, so a later eager call can never free memory
that a replay writes into. Each weight's segment offsets are validated against
its streams once, on the host (``validate_weight``; the vLLM plugin does it
while loading), before a kernel may read through them; a weight not yet
validated is validated at its first call, which is refused during capture.
"""

from __future__ import annotations

import threading
import warnings

import torch
import torch.nn.functional as F

from . import dispatch, embedding, ops
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
_device_info: dict[int, tuple[str, tuple[int, int], int]] = {}
# on a validated offsets tensor: (its version, the arrays and shape it was validated with)
_VALIDATED_ATTR = "_zipserv_validated"  # set on the offsets tensor: lives and dies with it


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


def driver_from_proc(text: str) -> str | None:
    """The version in /proc/driver/nvidia/version's text (proprietary and open kernel modules)."""
    import re

    m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9]+\.[0-9.]+)", text)
    return m.group(1) if m else None


def driver_version() -> str:
    """The NVIDIA driver's version ("580.159.04", from /proc/driver/nvidia/version on Linux), else
    the CUDA driver API version torch reports ("cuda-driver-13000"): what dispatch timings depend on,
    beside the GPU and this package (torch.version.cuda is the toolkit torch was built with)."""
    try:
        with open("/proc/driver/nvidia/version") as fh:
            found = driver_from_proc(fh.read())
        if found:
            return found
    except OSError:
        pass
    try:
        return f"cuda-driver-{torch._C._cuda_getDriverVersion()}"
    except Exception:  # no driver API entry in this torch build
        return f"cuda-{torch.version.cuda}"


def plan(n: int, m: int, k: int, device, layout: str = "v1") -> dispatch.Plan:
    """The dispatcher's choice for this call on this device, for a weight held in ``layout``."""
    name, cc, sms = device_info(device)
    return dispatch.choose(n, m, k, sms, dispatch.load_table(name, cc), dispatch.gpu_model(name, cc, sms), layout)


# ------------------------------------------------------------- workspaces
def _capturing() -> bool:
    return torch.cuda.is_current_stream_capturing()


def _scratch(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Per-call scratch from torch's allocator (a captured call's comes from its graph's pool)."""
    return torch.empty(numel, dtype=dtype, device=device)


# ------------------------------------------------------------------ checks
def _ptr16(t: torch.Tensor, name: str) -> int:
    if not t.is_contiguous():
        raise ValueError(f"zipserv CUDA: {name} must be contiguous")
    p = t.data_ptr()
    if p % 16:
        raise ValueError(f"zipserv CUDA: {name} must be 16-byte aligned (data_ptr % 16 = {p % 16}); "
                         "clone() it once at load time")
    return p


def _check(x: torch.Tensor | None, bitmaps, base, offsets, sm, fb, m: int, k: int, bias=None) -> None:
    mt, kt = -(-m // spec.TILE), -(-k // spec.TILE)
    dev = sm.device
    for name, t, dtype, shape in (("bitmaps", bitmaps, torch.int64, (mt, kt, spec.PLANES, spec.FRAGS_PER_TILE)),
                                  ("base", base, torch.uint8, (mt, kt)),
                                  ("offsets", offsets, torch.int64, (mt, kt, 2))):
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"zipserv CUDA: {name} must be {dtype} {list(shape)} for a {m} x {k} weight, "
                             f"got {t.dtype} {list(t.shape)}")
    if sm.dtype != torch.uint8 or fb.dtype != torch.int16 or sm.dim() != 1 or fb.dim() != 1:
        raise ValueError(f"zipserv CUDA: sm must be 1-D uint8 and fb 1-D int16, got {sm.dtype} {list(sm.shape)} "
                         f"and {fb.dtype} {list(fb.shape)}")
    if dev.type != "cuda":
        raise ValueError(f"zipserv CUDA: the compressed weight is on {dev}, not a CUDA device")
    for name, t in (("bitmaps", bitmaps), ("base", base), ("offsets", offsets), ("sm", sm), ("fb", fb)) + (
            (("x", x),) if x is not None else ()) + ((("bias", bias),) if bias is not None else ()):
        if t.device != dev:
            raise ValueError(f"zipserv CUDA: {name} is on {t.device}, sm on {dev}")
        if name != "x" and not t.is_contiguous():  # raw pointers: the kernels assume dense rows
            raise ValueError(f"zipserv CUDA: {name} must be contiguous")
    if x is not None and x.dtype != torch.bfloat16:
        raise TypeError(f"zipserv CUDA: x must be bfloat16, got {x.dtype}")
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (m,)):
        raise ValueError(f"zipserv CUDA: bias must be bfloat16 [{m}], got {bias.dtype} {list(bias.shape)}")
    _check_offsets_once(bitmaps, base, offsets, sm, fb, m, k)


def validate_weight(bitmaps, base, offsets, sm, fb, m: int, k: int) -> None:
    """Check on the host that every tile's segments lie inside the streams (the kernels'
    cp.async copies read through these offsets) and remember it for these tensors."""
    from ..format import CompressedTensor, FormatError

    ct = CompressedTensor((m, k), bitmaps.cpu(), base.cpu(), offsets.cpu(), sm, fb)
    try:
        ct.validate("zipserv CUDA weight")
    except FormatError as exc:
        raise ValueError(str(exc)) from None
    # An attribute of the tensor, not a WeakKeyDictionary: a dict lookup of a tensor key compares
    # the stored and the looked-up tensor with ==, which is elementwise (found on the first GPU run).
    setattr(offsets, _VALIDATED_ATTR, _validation_key(bitmaps, base, offsets, sm, fb, m, k))


def _validation_key(bitmaps, base, offsets, sm, fb, m, k) -> tuple:
    return (offsets._version, bitmaps.data_ptr(), bitmaps._version, base.data_ptr(), base._version,
            sm.data_ptr(), sm.numel(), fb.data_ptr(), fb.numel(), m, k)


def _check_offsets_once(bitmaps, base, offsets, sm, fb, m, k) -> None:
    if getattr(offsets, _VALIDATED_ATTR, None) == _validation_key(bitmaps, base, offsets, sm, fb, m, k):
        return
    if _capturing():
        raise RuntimeError("zipserv CUDA: this compressed weight was not validated before CUDA-graph capture "
                           "(validation reads its offsets on the host); call "
                           "zipserv_vllm.kernels.cuda.validate_weight(...) or run it once eagerly first")
    validate_weight(bitmaps, base, offsets, sm, fb, m, k)


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
    _check(x2, bitmaps, base, offsets, sm, fb, m, k, bias)
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
    ws = _scratch(x2.device, parts * n * m, torch.float32) if parts > 1 else None
    ws_ptr = 0 if ws is None else ws.data_ptr()
    xp = x2.data_ptr()
    x_vec = int(k % 8 == 0 and xp % 16 == 0)
    _cuda.zipgemm(xp, _ptr16(bitmaps, "bitmaps"), base.data_ptr(), offsets.data_ptr(),
                  _ptr16(sm, "sm") if sm.numel() else sm.data_ptr(), _ptr16(fb, "fb") if fb.numel() else fb.data_ptr(),
                  0 if bias is None else bias.data_ptr(), y.data_ptr(), ws_ptr, m, k, n, tile_n, parts, x_vec,
                  _stream(x2.device))
    if ws is not None:
        ws.record_stream(torch.cuda.current_stream(x2.device))  # freed only after the kernel that uses it
    return y


PACKED_TILE_NS = dispatch.PACKED_TILE_NS  # the byte-split-layout kernel's instances (decode batch sizes)


def pack_cuda(w: torch.Tensor):
    """A PackedTensor of the bf16 weight ``w`` on ``w``'s device: packed on the CPU (the CPU
    extension's packer, else the layout's executable spec), then copied over."""
    from ..format.cpu_layout import reference_pack
    from . import cpu as cpu_kernels

    host = w.detach().to("cpu")
    return (cpu_kernels.pack(host) if cpu_kernels.available() else reference_pack(host)).to(w.device)


def clone_packed(pt):
    """A copy of a PackedTensor in fresh memory (the tuner's weight copies past the L2)."""
    from ..format.cpu_layout import PackedTensor

    return PackedTensor(pt.shape, *(t.clone() for t in pt.arrays().values()))


def _check_packed(pt, device) -> None:
    """The four arrays contiguous on ``device``, validated on the host once per weight (refused
    during capture: the validation reads them back)."""
    arrays = tuple(pt.arrays().values())
    for name, t in pt.arrays().items():
        if t.device != device or not t.is_contiguous():
            raise ValueError(f"zipserv CUDA: {name} must be contiguous on {device}")
    key = tuple((t._version, t.data_ptr(), t.numel()) for t in arrays) + tuple(pt.shape)
    if getattr(pt.exc_start, _VALIDATED_ATTR, None) != key:
        if _capturing():
            raise RuntimeError("zipserv CUDA: this packed weight was not validated before CUDA-graph capture; "
                               "run it once eagerly first")
        from ..format import FormatError

        try:
            pt.validate("zipserv CUDA packed weight")
        except FormatError as exc:
            raise ValueError(str(exc)) from None
        setattr(pt.exc_start, _VALIDATED_ATTR, key)


def validate_packed(pt) -> None:
    """Validate a packed weight's arrays once, on the host, before any kernel reads them (the vLLM
    plugin does it while loading, so that a captured call never needs to)."""
    _check_packed(pt, pt.device)


def _check_bias(bias, m: int, device) -> None:
    if bias is not None and (bias.dtype != torch.bfloat16 or tuple(bias.shape) != (m,) or bias.device != device
                             or not bias.is_contiguous()):
        raise ValueError(f"zipserv CUDA: bias must be a contiguous bfloat16 [{m}] on {device}")


def packed_gemm(x2: torch.Tensor, pt, bias, tile_n: int, split: int) -> torch.Tensor:
    """Y[N, M] for x2 [N, K] by the byte-split-layout kernel (docs/FORMAT.md appendix A, the CPU fast
    path's layout; csrc/cuda/zipgemm_packed.cuh): 12.05 bits per weight instead of v1's ~11.3, for a
    decode of 0.28 warp instructions per weight instead of 1.41 (benchmarks/sass_budget.py). ``pt`` is
    a PackedTensor on x2's device, validated on the host at its first call (refused during capture)."""
    _need()
    m, k = pt.shape
    if tile_n not in PACKED_TILE_NS:
        raise ValueError(f"zipserv CUDA: the byte-split kernel has tile_n {PACKED_TILE_NS}, got {tile_n}")
    if x2.dim() != 2 or x2.shape[1] != k or x2.dtype != torch.bfloat16 or not x2.is_contiguous():
        raise ValueError(f"zipserv CUDA: x must be a contiguous bfloat16 [N, {k}], got {x2.dtype} {list(x2.shape)}")
    _check_packed(pt, x2.device)
    _check_bias(bias, m, x2.device)
    with torch.cuda.device(x2.device):
        prepare(x2.device)
        n = x2.shape[0]
        kt = -(-k // spec.TILE)
        parts = _cuda.splitk_parts(kt, max(1, min(split, kt)))
        y = torch.empty((n, m), dtype=torch.bfloat16, device=x2.device)
        ws = _scratch(x2.device, parts * n * m, torch.float32) if parts > 1 else None
        xp = x2.data_ptr()
        _cuda.zipgemm_packed(xp, _ptr16(pt.tiles, "tiles"), _ptr16(pt.luts, "luts"), pt.exc_start.data_ptr(),
                             pt.exc.data_ptr(), 0 if bias is None else bias.data_ptr(), y.data_ptr(),
                             0 if ws is None else ws.data_ptr(), m, k, n, tile_n, parts,
                             int(k % 8 == 0 and xp % 16 == 0), _stream(x2.device))
        if ws is not None:
            ws.record_stream(torch.cuda.current_stream(x2.device))
        return y


def _packed_decompress_into(out: torch.Tensor, pt) -> torch.Tensor:
    m, k = pt.shape
    _cuda.decompress_packed(_ptr16(pt.tiles, "tiles"), _ptr16(pt.luts, "luts"), pt.exc_start.data_ptr(),
                            pt.exc.data_ptr(), out.data_ptr(), m, k, _stream(out.device))
    return out


def packed_decompress_cuda(tiles, luts, exc_start, exc, m: int, k: int) -> torch.Tensor:
    """W (bf16 [M, K]) from the byte-split layout by its decompress kernel (csrc/cuda/decompress_packed.cu):
    ``zipserv::packed_decompress`` on CUDA tensors. Bit for bit."""
    from ..format.cpu_layout import PackedTensor

    _need()
    pt = PackedTensor((m, k), tiles, luts, exc_start, exc)
    _check_packed(pt, tiles.device)
    with torch.cuda.device(tiles.device):
        prepare(tiles.device)
        out = torch.empty((m, k), dtype=torch.bfloat16, device=tiles.device)
        return _packed_decompress_into(out, pt)


def packed_decoupled_gemm(x2: torch.Tensor, pt, bias) -> torch.Tensor:
    """The byte-split layout's large-N path: decompress into a per-call BF16 copy, then cuBLAS."""
    _need()
    m, k = pt.shape
    _check_packed(pt, x2.device)
    _check_bias(bias, m, x2.device)
    with torch.cuda.device(x2.device):
        prepare(x2.device)
        w = _scratch(x2.device, m * k, torch.bfloat16).view(m, k)
        return F.linear(x2, _packed_decompress_into(w, pt), bias)


def packed_gemm_cuda(x, tiles, luts, exc_start, exc, m: int, k: int, bias, mode: str) -> torch.Tensor:
    """``zipserv::packed_gemm`` on CUDA tensors: exact mode decodes (packed decompress kernel) and runs
    cuBLAS; fast mode takes the dispatcher's plan for the byte-split layout (its fused kernel at
    tile_n 8 / 16 with split-K, or the decoupled path)."""
    from ..format.cpu_layout import PackedTensor

    _need()
    if mode not in ops.MODES:
        raise ValueError(f"mode must be one of {ops.MODES}, got {mode!r}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    pt = PackedTensor((m, k), tiles, luts, exc_start, exc)
    with torch.cuda.device(x.device):
        if mode == "exact":
            return F.linear(x, packed_decompress_cuda(tiles, luts, exc_start, exc, m, k), bias)
        x2 = x.reshape(-1, k).contiguous()
        n = x2.shape[0]
        if n == 0:
            return x.new_empty((*x.shape[:-1], m))
        p = plan(n, m, k, x.device, layout="bytesplit")
        if p.path == "packed":
            y = packed_gemm(x2, pt, bias, p.tile_n, p.split)
        else:
            y = packed_decoupled_gemm(x2, pt, bias)
        return y.view(*x.shape[:-1], m)


def decoupled_gemm(x2: torch.Tensor, bitmaps, base, offsets, sm, fb, m: int, k: int, bias) -> torch.Tensor:
    """Decompress into a BF16 copy of the weight (per-call scratch), then cuBLAS (F.linear)."""
    _need()
    _check(x2, bitmaps, base, offsets, sm, fb, m, k, bias)
    with torch.cuda.device(x2.device):
        prepare(x2.device)
        return _decoupled_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias)


def _decoupled_gemm(x2, bitmaps, base, offsets, sm, fb, m, k, bias):
    w = _scratch(x2.device, m * k, torch.bfloat16).view(m, k)
    _decompress_into(w.view(torch.int16), bitmaps, base, offsets, sm, fb, m, k)
    return F.linear(x2, w, bias)


def gemm_cuda(x, bitmaps, base, offsets, sm, fb, m: int, k: int, bias, mode: str) -> torch.Tensor:
    _need()
    if mode not in ops.MODES:
        raise ValueError(f"mode must be one of {ops.MODES}, got {mode!r}")
    _check(x, bitmaps, base, offsets, sm, fb, m, k)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    if bias is not None:
        _check(None, bitmaps, base, offsets, sm, fb, m, k, bias)
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


# ------------------------------------------------- grouped (mixtures of experts)
# Decoupled above this many rows per expert on average (each expert then fills 128-column
# blocks, where the dense dispatcher also leaves the fused kernel for cuBLAS on most shapes);
# a starting point until measured on a GPU (benchmarks/bench_cuda_kernels.py, grouped entries).
GROUPED_DECOUPLED_ROWS_PER_EXPERT = 128


def expert_table(experts, device=None) -> torch.Tensor:
    """int64 [E, 5] device addresses of each expert's bitmaps, base, offsets, sm and fb, for
    :func:`grouped_gemm`. Checks that the experts share one shape and validates each one's
    offsets on the host (once). Build it once per layer at load time (not during graph
    capture); the experts' tensors must outlive it."""
    _need()
    if not experts:
        raise ValueError("zipserv CUDA: a grouped GEMM needs at least one expert")
    m, k = experts[0].shape
    rows = []
    for i, ct in enumerate(experts):
        if tuple(ct.shape) != (m, k):
            raise ValueError(f"zipserv CUDA: expert {i} is {list(ct.shape)}, expert 0 is {[m, k]}: "
                             "a grouped GEMM needs experts of one shape")
        _check(None, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k)
        rows.append([_ptr16(ct.bitmaps, "bitmaps"), ct.base.data_ptr(), ct.offsets.data_ptr(),
                     _ptr16(ct.sm, "sm") if ct.sm.numel() else ct.sm.data_ptr(),
                     _ptr16(ct.fb, "fb") if ct.fb.numel() else ct.fb.data_ptr()])
    return torch.tensor(rows, dtype=torch.int64).to(device or experts[0].sm.device)


def grouped_gemm(x: torch.Tensor, experts, expert_rows: torch.Tensor, table: torch.Tensor | None = None,
                 path: str = "auto", tile_n: int | None = None) -> torch.Tensor:
    """Y [rows, M] with Y[r] = X[r] . W_e^T for the rows r of expert e, expert_rows[e] <= r <
    expert_rows[e + 1] (X's rows grouped by expert, int32 [E + 1] row starts on the GPU, as the
    router's sort gives them). ``path``:

    * ``"fused"``: one launch of the grouped fused kernel over all experts (only the experts that
      have rows do work; no host synchronisation: CUDA-graph safe);
    * ``"decoupled"``: per expert with rows, decompress + cuBLAS (reads the row starts on the
      host once: not for graph capture);
    * ``"auto"``: fused up to GROUPED_DECOUPLED_ROWS_PER_EXPERT rows per expert on average.
    """
    _need()
    n_exp = len(experts)
    m, k = experts[0].shape
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.bfloat16 or not x.is_contiguous():
        raise ValueError(f"zipserv CUDA: x must be a contiguous bfloat16 [rows, {k}], got {x.dtype} {list(x.shape)}")
    if expert_rows.dtype != torch.int32 or tuple(expert_rows.shape) != (n_exp + 1,) or expert_rows.device != x.device:
        raise ValueError(f"zipserv CUDA: expert_rows must be int32 [{n_exp + 1}] on {x.device}, got "
                         f"{expert_rows.dtype} {list(expert_rows.shape)} on {expert_rows.device}")
    rows = x.shape[0]
    if path == "auto":  # the decoupled path reads the row starts on the host: never inside graph capture
        path = ("decoupled" if rows >= GROUPED_DECOUPLED_ROWS_PER_EXPERT * n_exp and not _capturing()
                else "fused")
    with torch.cuda.device(x.device):
        prepare(x.device)
        if path == "decoupled":
            starts = expert_rows.tolist()
            if starts[0] != 0 or starts[-1] != rows or any(b < a for a, b in zip(starts, starts[1:])):
                raise ValueError(f"zipserv CUDA: expert_rows must rise from 0 to {rows} (the rows of x), "
                                 f"got {starts}")
            y = torch.empty((rows, m), dtype=torch.bfloat16, device=x.device)
            for e, ct in enumerate(experts):
                a, b = starts[e], starts[e + 1]
                if b > a:
                    y[a:b] = _decoupled_gemm(x[a:b], ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, None)
            return y
        if path != "fused":
            raise ValueError(f"path must be auto, fused or decoupled, got {path!r}")
        if table is None:
            table = expert_table(experts, x.device)
        if table.dtype != torch.int64 or tuple(table.shape) != (n_exp, 5) or table.device != x.device:
            raise ValueError(f"zipserv CUDA: table must be int64 [{n_exp}, 5] on {x.device} (expert_table)")
        y = torch.empty((rows, m), dtype=torch.bfloat16, device=x.device)
        if rows:
            tn = tile_n or dispatch.tile_n_for(max(1, -(-rows // min(n_exp, rows))))
            xp = x.data_ptr()
            _cuda.zipgemm_grouped(table.data_ptr(), expert_rows.data_ptr(), xp, y.data_ptr(), m, k, n_exp, rows, tn,
                                  int(k % 8 == 0 and xp % 16 == 0), _stream(x.device))
        return y


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


def embedding_cuda(ids, bitmaps, base, offsets, sm, fb, m: int, k: int, rows: int) -> torch.Tensor:
    """Rows ``ids`` of the compressed table (``rows - m`` zero padding rows; ids clamped to
    [0, rows)): the gather kernel, no host synchronisation, no allocation but the output."""
    _need()
    embedding._check_ids(ids, m, rows)
    _check(None, bitmaps, base, offsets, sm, fb, m, k)
    if ids.device != sm.device:
        raise ValueError(f"zipserv CUDA: ids are on {ids.device}, the table on {sm.device}")
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    with torch.cuda.device(sm.device):
        prepare(sm.device)
        out = torch.empty((flat.numel(), k), dtype=torch.bfloat16, device=sm.device)
        _cuda.embedding_gather(flat.data_ptr(), int(flat.dtype == torch.int64), flat.numel(), bitmaps.data_ptr(),
                               base.data_ptr(), offsets.data_ptr(), sm.data_ptr(), fb.data_ptr(), out.data_ptr(),
                               m, k, rows, _stream(sm.device))
    return out.view(*ids.shape, k)


# ---------------------------------------------------------- registration
def _register() -> bool:
    """Register the CUDA kernels on the ops; only when the extension is built."""
    if _cuda is None:
        if torch.cuda.is_available():
            warnings.warn(f"zipserv: {_REASON}; CUDA tensors take the slow composite path (decoded on the CPU)",
                          stacklevel=2)
        return False
    ops.gemm.register_kernel("cuda")(gemm_cuda)
    ops.decompress.register_kernel("cuda")(decompress_cuda)
    ops.packed_decompress.register_kernel("cuda")(packed_decompress_cuda)
    ops.register_lean_kernel("packed_gemm", "CUDA", packed_gemm_cuda)
    embedding.embedding.register_kernel("cuda")(embedding_cuda)
    return True


REGISTERED = _register()
