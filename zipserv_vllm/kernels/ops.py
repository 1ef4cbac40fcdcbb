"""torch.library custom ops over compressed weights, traceable by torch.compile.

* ``zipserv::decompress(bitmaps, base, offsets, sm, fb, M, K) -> Tensor[M, K] bf16``
* ``zipserv::gemm(x, bitmaps, base, offsets, sm, fb, M, K, bias, mode) -> Tensor[..., M]``
  computes ``F.linear(x, W, bias)``. ``mode="exact"`` decodes W and runs the
  same GEMM as the BF16 path (bit-identical to it); ``mode="fast"`` may use a
  fused kernel (CPU: csrc/cpu_gemm, CUDA: csrc/cuda) whose summation order
  differs. On the CPU, "fast" takes the fused kernel when
  ``cpu_kernels.dispatch()`` says so (extension built, bf16 x, at most
  ``cpu_kernels.fused_max_n()`` tokens) and decode + F.linear otherwise.

* ``zipserv::packed_decompress`` / ``zipserv::packed_gemm``: the same for a
  weight in the byte-split layout (``PackedTensor``, docs/FORMAT.md
  appendix A); on the CPU "fast" runs the kernel kernels/cpu_dispatch.py
  chooses for the shape and token count (the fp32 fused kernel or the
  AVX512-BF16 panel kernel), under the same threshold; CUDA tensors take
  kernels/cuda.py's kernels where ``_cuda`` is built.

The default implementation below serves CPU tensors; device-specific kernels
register themselves with ``gemm.register_kernel(...)`` /
``decompress.register_kernel(...)`` in their own modules. Every op has a fake
implementation so it can be traced without running.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..format import CompressedTensor
from ..format.cpu_layout import PackedTensor, reference_unpack

MODES = ("fast", "exact")
_is_compiling = torch.compiler.is_compiling  # (held: two attribute lookups fewer per eager call)


_CPU = None


def _cpu_kernels():
    """The CPU backend module, imported on first use (this module imports no backend at module
    level) and then held: an import statement per call costs microseconds when a decode step's
    weight stream has pushed the interpreter's state out of the caches."""
    global _CPU
    if _CPU is None:
        from . import cpu

        _CPU = cpu
    return _CPU


_LIB = torch.library.Library("zipserv", "FRAGMENT")  # (held: the registrations below live as long as it)
_PYTHON_IMPLS: dict = {}  # lean_op's name -> its Python implementation


def lean_op(schema: str, fake):
    """Decorator: define ``zipserv::<schema>`` with the function as its kernel on every device
    (CompositeExplicitAutograd), registered on the dispatcher directly, and ``fake`` as its fake
    implementation; returns the op. ``torch.library.custom_op`` puts Python layers in front of the
    function (an autograd wrapper, its own device routing) that cost ~55 µs a call when a decode
    step's weight stream has left the caches cold, against ~17 µs this way (1024x1024 at one token,
    medians of 3 x 300 calls), and a compiled graph calls these ops for every layer of every step.
    Traceable like a custom op's (torch.compile, fullgraph); no autograd formula (inference only,
    like every op here). Used for the ops a served model's forward pass calls on the CPU."""
    def define(fn):
        name = schema.split("(", 1)[0]
        if hasattr(torch.ops.zipserv, name):  # defined by an earlier execution of this module (a reload)
            op = getattr(torch.ops.zipserv, name)
        else:
            _LIB.define(schema)
            _LIB.impl(name, fn, "CompositeExplicitAutograd")
            torch.library.register_fake(f"zipserv::{name}", fake, lib=_LIB)
            op = getattr(torch.ops.zipserv, name)
        _PYTHON_IMPLS[name] = fn
        return op

    return define


def register_lean_kernel(name: str, device_key: str, fn) -> None:
    """``fn`` as the kernel of the lean op ``zipserv::<name>`` for ``device_key`` ("CUDA"): it takes
    precedence over the every-device implementation on that device's tensors."""
    key = (name, device_key)
    if key not in _DEVICE_IMPLS:  # (once per process: a second impl for one key is refused)
        _LIB.impl(name, fn, device_key)
        _DEVICE_IMPLS.add(key)


_DEVICE_IMPLS: set = set()


def _ct(bitmaps, base, offsets, sm, fb, m, k) -> CompressedTensor:
    return CompressedTensor((m, k), bitmaps, base, offsets, sm, fb)


@torch.library.custom_op("zipserv::decompress", mutates_args=())
def decompress(bitmaps: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor,
               sm: torch.Tensor, fb: torch.Tensor, m: int, k: int) -> torch.Tensor:
    from ..codec import decompress_tensor

    # The composite path (also CUDA tensors when zipserv_vllm._cuda is not built): decode on the
    # CPU, return on the arrays' device.
    return decompress_tensor(_ct(bitmaps, base, offsets, sm, fb, m, k)).to(sm.device)


@decompress.register_fake
def _(bitmaps, base, offsets, sm, fb, m, k):
    return torch.empty((m, k), dtype=torch.bfloat16, device=sm.device)


@torch.library.custom_op("zipserv::gemm", mutates_args=())
def gemm(x: torch.Tensor, bitmaps: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor,
         sm: torch.Tensor, fb: torch.Tensor, m: int, k: int, bias: torch.Tensor | None,
         mode: str) -> torch.Tensor:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "fast" and x.device.type == "cpu":
        cpu_kernels = _cpu_kernels()
        if cpu_kernels.use_fused(x, bias, m):
            return cpu_kernels.fused_gemm(x, bitmaps, base, offsets, sm, fb, m, k, bias)
    w = decompress(bitmaps, base, offsets, sm, fb, m, k)
    return F.linear(x, w, bias)


@gemm.register_fake
def _(x, bitmaps, base, offsets, sm, fb, m, k, bias, mode):
    return x.new_empty((*x.shape[:-1], m))


@torch.library.custom_op("zipserv::packed_decompress", mutates_args=())
def packed_decompress(tiles: torch.Tensor, luts: torch.Tensor, exc_start: torch.Tensor, exc: torch.Tensor,
                      m: int, k: int) -> torch.Tensor:
    cpu_kernels = _cpu_kernels()
    pt = PackedTensor((m, k), tiles, luts, exc_start, exc)
    return cpu_kernels.packed_decode(pt) if cpu_kernels.available() else reference_unpack(pt)


@packed_decompress.register_fake
def _(tiles, luts, exc_start, exc, m, k):
    return torch.empty((m, k), dtype=torch.bfloat16, device=tiles.device)


def _packed_gemm_fake(x, tiles, luts, exc_start, exc, m, k, bias, mode):
    return x.new_empty((*x.shape[:-1], m))


@lean_op("packed_gemm(Tensor x, Tensor tiles, Tensor luts, Tensor exc_start, Tensor exc, int m, int k, "
         "Tensor? bias, str mode) -> Tensor", _packed_gemm_fake)
def packed_gemm(x: torch.Tensor, tiles: torch.Tensor, luts: torch.Tensor, exc_start: torch.Tensor,
                exc: torch.Tensor, m: int, k: int, bias: torch.Tensor | None, mode: str) -> torch.Tensor:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "fast" and x.is_cpu:
        cpu_kernels = _cpu_kernels()
        if x.shape[-1] == k:  # (else the F.linear below names the mismatch)
            y = cpu_kernels.native_linear(x, tiles, luts, exc_start, exc, m, k, bias)
            if y is not None:
                cpu_kernels.op_served(m, k, _packed_gemm_python)
                return y
        if cpu_kernels.use_fused(x, bias, m, packed=True):
            return cpu_kernels.packed_gemm(x, tiles, luts, exc_start, exc, m, k, bias,
                                           kernel=cpu_kernels.fast_kernel(x, m, k))
    w = packed_decompress(tiles, luts, exc_start, exc, m, k)
    return F.linear(x, w.to(x.device), bias)


_packed_gemm_python = _PYTHON_IMPLS["packed_gemm"]  # (the function; the C++ CPU kernel hands it the calls it does not serve)


def decode(ct: CompressedTensor | PackedTensor) -> torch.Tensor:
    """W (bf16 [M, K]) of a weight in either layout, bit for bit, by the decompress op of its
    layout on the arrays' device (the CUDA kernels where they are registered)."""
    m, k = ct.shape
    if isinstance(ct, PackedTensor):
        return packed_decompress(ct.tiles, ct.luts, ct.exc_start, ct.exc, m, k)
    return decompress(ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k)


def linear(x: torch.Tensor, ct: CompressedTensor | PackedTensor, bias: torch.Tensor | None = None,
           mode: str = "fast") -> torch.Tensor:
    """``F.linear(x, W, bias)`` for W compressed (CompressedTensor, TCA-TBE v1) or in the
    byte-split layout (PackedTensor), by whichever kernel fits the device."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if x.shape[-1] != ct.shape[1]:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {ct.shape[1]}")
    m, k = ct.shape
    packed = isinstance(ct, PackedTensor)
    if mode == "fast" and x.is_cpu and not _is_compiling():
        # Eager CPU: call the fused kernel directly (the op dispatcher adds
        # ~10-20 us per call with the caches cold, a lot for a decode step's
        # small GEMMs). Traced code goes through the op below (same kernel).
        cpu_kernels = _cpu_kernels()
        if packed:
            y = cpu_kernels.eager_packed_linear(x, ct, bias)
            if y is not None:
                return y
        elif cpu_kernels.use_fused(x, bias, m, packed):
            return cpu_kernels.fused_gemm(x, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, bias)
    if packed:
        return packed_gemm(x, ct.tiles, ct.luts, ct.exc_start, ct.exc, m, k, bias, mode)
    return gemm(x, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, bias, mode)


