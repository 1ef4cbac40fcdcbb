"""Python side of the fused decode-GEMM CPU kernels (``zipserv_vllm._cpu_gemm``).

``fused_linear(x, ct, bias)`` computes ``F.linear(x, W, bias)`` for bf16 ``x``
straight from the compressed ``ct`` (docs/CPU.md): tiles are decoded into
cache-resident buffers and consumed at once, W is never materialised. The
result is rounded from an fp32 sum whose order is fixed (csrc/include/zipserv/
cpu_gemm.h), so every ISA and thread count gives the same bits; it differs from
torch's BF16 GEMM only by fp32 rounding order.

``packed_linear(..., kernel="panel")`` runs the AVX512-BF16 panel kernel
instead (``vdpbf16ps``; CPUs with AVX512-BF16, ``bf16_supported()``): fp32
accumulation of exact BF16 products in another order, so not bit-identical to
the fused kernels (docs/CPU.md, "Numerical bounds"). Fast mode picks between
the two per shape and token count (kernels/cpu_dispatch.py).

``pack(w)`` repacks a weight (BF16, or a CompressedTensor) into the CPU
byte-split layout (docs/FORMAT.md appendix A; ``PackedTensor``), whose kernel
``packed_linear(x, pt, bias)`` decodes a few times faster than v1's; it is
what the vLLM plugin's fast mode uses on the CPU (docs/CPU.md). Same summation
contract, so both kernels give identical bits.

The extension is optional: ``available()`` says whether it was built and
``unavailable_reason()`` why not.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..format import CompressedTensor
from ..format.cpu_layout import PackedTensor
from . import cpu_dispatch

try:
    from .. import _cpu_gemm  # type: ignore[attr-defined]
except ImportError as exc:  # pragma: no cover - exercised only without a build
    _cpu_gemm = None
    _REASON = f"zipserv_vllm._cpu_gemm is not built ({exc}); build it with `python setup.py build_ext --inplace`"
else:
    _REASON = ""

# Largest number of tokens (rows of x) for which ops.gemm(mode="fast") uses the
# fused kernel; above it, decode + torch's BF16 GEMM. benchmarks/bench_cpu_gemm.py
# measures both sides (docs/CPU.md): on the AVX2 development machine (no native
# BF16 GEMM hardware) the fused kernel wins at every N measured, up to 512, so
# the threshold is the largest N measured. ZIPSERV_CPU_FUSED_MAX_N overrides it
# (e.g. lower it on CPUs with AMX / AVX512-BF16, where torch's BF16 GEMM is fast
# at large N; that crossover has not been measured).
FUSED_MAX_N_DEFAULT = 512
# With AVX512-BF16 the panel kernel is within a few percent of vLLM's BF16 kernel up to 512
# tokens and beyond, and decode + F.linear is slower than either: no threshold by default.
FUSED_MAX_N_BF16 = 1 << 30
PACKED_KERNELS = ("fused", "panel")

_isa_override: str | None = None
_threads_override: int | None = None


def available() -> bool:
    return _cpu_gemm is not None


def unavailable_reason() -> str:
    return _REASON


def _need() -> None:
    if _cpu_gemm is None:
        raise ImportError(_REASON)


_BF16 = _cpu_gemm is not None and bool(_cpu_gemm.bf16_supported())
_BF16_DTYPE = torch.bfloat16
_CPU = torch.device("cpu")  # (the output's device, whatever torch's default device is)


def bf16_supported() -> bool:
    """Whether this CPU runs the AVX512-BF16 panel kernel (``kernel="panel"``)."""
    return _BF16


def isas() -> list[str]:
    """ISAs this CPU can run, best first; always ends with ``"scalar"``."""
    _need()
    return list(_cpu_gemm.isas())


# ------------------------------------------------------------------ the C++ op kernel
# zipserv::packed_gemm's CPU kernel in C++ (zipserv_vllm._cpu_op, csrc/cpu_op/packed_gemm_op.cpp):
# a compiled graph then calls the GEMM as it calls vLLM's own BF16 kernel, with no Python per call.
# It serves the calls the Python implementation (kernels/ops.py packed_gemm) has served once for the
# shape, with the same kernel choice and threshold (remembered below), and hands everything else to
# that implementation. Installed at the first such call (op_served); ZIPSERV_CPU_OP=0 keeps Python.
_op = None  # the installed extension module
_op_reason = "not installed yet (at the first fast-mode packed_gemm call)"
_op_tried = False


def _op_sync() -> None:
    """Forget the remembered choices (they changed) and enable the C++ path only without overrides."""
    if _op is not None:
        _op.forget()
        _op.enable(_isa_override is None and _threads_override is None)


cpu_dispatch.on_change(_op_sync)


def install_op(fallback) -> str | None:
    """Install the C++ kernel of zipserv::packed_gemm with ``fallback`` (the op's Python
    implementation) for the calls it does not serve; None when installed, else why not."""
    global _op, _op_reason, _op_tried
    _op_tried = True
    if _op is not None:
        return None
    from ..settings import cpu_op

    if _cpu_gemm is None:
        _op_reason = _REASON
    elif not cpu_op():
        _op_reason = "ZIPSERV_CPU_OP=0"
    elif not hasattr(_cpu_gemm, "packed_call"):
        _op_reason = "zipserv_vllm._cpu_gemm is an older build without the packed_call entry: rebuild it"
    else:
        try:
            from .. import _cpu_op  # type: ignore[attr-defined]
        except ImportError as exc:
            _op_reason = f"zipserv_vllm._cpu_op is not built or does not load ({exc})"
        else:
            if _cpu_op.torch_version != torch.__version__:  # (built against another torch's C++ ABI)
                _op_reason = (f"zipserv_vllm._cpu_op was built for torch {_cpu_op.torch_version}, this is "
                              f"{torch.__version__}: rebuild it")
            else:
                _cpu_op.install(fallback, _cpu_gemm.packed_call, "ZIPSERV_CPU_FUSED_MAX_N")
                _op = _cpu_op
                _op_sync()
                return None
    return _op_reason


def op_status() -> str:
    """Whether zipserv::packed_gemm's C++ CPU kernel serves calls, and why not."""
    return "C++ CPU kernel installed" if _op is not None else f"Python only: {_op_reason}"


def _ensure_op(fallback) -> bool:
    """Whether the C++ op kernel is installed: installs it (``fallback``: packed_gemm's Python
    implementation) unless that was tried before."""
    return _op is not None or (not _op_tried and install_op(fallback) is None)


def op_served(m: int, k: int, fallback) -> None:
    """The op's Python implementation served a fast-mode call on an m x k byte-split weight with a
    fused kernel: hand the C++ kernel this shape's choices (installing it the first time). Never
    raises: whatever goes wrong leaves the op in Python, with the reason in op_status()."""
    try:
        if not _ensure_op(fallback):
            return
        gen = _op.generation()
        per = cpu_dispatch.bucket_choices(m, k)
        raw = _fused_max_n_raw()
        max_n = fused_max_n(True)
        if per is None or raw != _fused_max_n_raw():  # (not one choice per bucket; the variable moved)
            return
        _op.remember(m, k, [c == "panel" for c in per], min(max_n, (1 << 63) - 1),
                     None if raw is None else os.fsdecode(raw), gen)
    except Exception as exc:  # noqa: BLE001  (the call itself was served: keep its result)
        _op_failed(exc)


# zipserv::packed_embedding and zipserv::moe_experts likewise (csrc/cpu_op), each installed at the
# first call its Python implementation served natively. The embedding's C++ kernel serves every hot
# call from then on (the lookup is bit-exact whatever decodes it: nothing to remember); a MoE layer
# that the Python implementation (vllm_plugin/moe.py) served through its one-call MoeLayer is
# registered by name and served in C++ until something that decides its path changes
# (moe_op_forget; _op_sync).
_op_extras: set[str] = set()  # the ops installed beside packed_gemm: "embedding", "moe"


def _install_extra(name: str, fallback) -> bool:
    """Install op ``name``'s C++ kernel with ``fallback`` (its Python implementation) unless it is;
    True when it was installed before this call."""
    if _op is not None and name in _op_extras:
        return True
    from .ops import _packed_gemm_python

    if not _ensure_op(_packed_gemm_python):
        return False
    capsule = getattr(_cpu_gemm, f"{name}_call", None)
    if capsule is not None:  # (None: an older _cpu_gemm build; the op stays Python)
        getattr(_op, f"install_{name}")(fallback, capsule)
        _op_extras.add(name)
    return False


def _op_failed(exc: Exception) -> None:
    """Leave every op in Python after an error while handing over: the C++ kernels disabled, their
    tables emptied (a MoE layer's entry holds its experts' tensors), the reason kept."""
    global _op, _op_reason
    if _op is not None:
        try:
            _op.enable(False)
            _op.forget()
        except Exception:  # noqa: BLE001  (already failing: the reason below is the first error)
            pass
    _op, _op_reason = None, f"disabled after an error: {type(exc).__name__}: {exc}"
    _op_extras.clear()


def embedding_op_served(fallback) -> None:
    """The Python implementation of ``zipserv::packed_embedding`` (``fallback``) served a lookup
    natively: install its C++ kernel (once). Never raises."""
    try:
        _install_extra("embedding", fallback)
    except Exception as exc:  # noqa: BLE001  (the call itself was served: keep its result)
        _op_failed(exc)


def moe_op_served(name: str, fallback, held: "_Held", on_input: bool, generation: int) -> None:
    """The Python implementation of ``zipserv::moe_experts`` (``fallback``) served the MoE layer
    ``name`` through ``held.obj`` (a :func:`moe_layer`; ``held`` keeps it and the experts' tensors
    alive): let the C++ kernel serve that name (installing it the first time). ``generation``:
    :func:`moe_op_generation` read before the call was computed (a forget since drops it). Never
    raises: whatever goes wrong leaves the op in Python, with the reason in op_status()."""
    try:
        if _install_extra("moe", fallback):  # (just installed: install_moe forgot, generation is stale)
            _op.remember_moe(name, held.obj.handle(), held, int(held.obj.hidden), bool(on_input), generation)
    except Exception as exc:  # noqa: BLE001  (the call itself was served: keep its result)
        _op_failed(exc)


def moe_op_generation() -> int:
    """The C++ kernel's generation (0 when not installed): read before computing a call whose
    layer :func:`moe_op_served` then registers."""
    return _op.generation() if _op is not None else 0


def moe_op_forget(name: str | None = None) -> None:
    """Stop serving the MoE layer ``name`` (every layer: None) in C++: its layers, or their parts, changed."""
    if _op is not None and "moe" in _op_extras:
        _op.forget_moe(name)


def set_isa(isa: str | None) -> None:
    """Force an ISA (``"avx512"``, ``"avx2"``, ``"scalar"``) for later calls; None = best."""
    if isa is not None:
        _need()
        if isa not in _cpu_gemm.isas():
            raise ValueError(f"isa {isa!r} is not supported on this CPU (supported: {', '.join(_cpu_gemm.isas())})")
    global _isa_override
    _isa_override = isa
    _op_sync()


def set_threads(threads: int | None) -> None:
    """Threads for later calls; None = ``torch.get_num_threads()`` at each call."""
    if threads is not None and int(threads) < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    global _threads_override
    _threads_override = None if threads is None else int(threads)
    _op_sync()


_max_n_cache: dict[bool, tuple[object, int]] = {}


def _env_reader(name: str):
    """A reader of one environment variable's raw value (None when unset): os.environ's own store
    read directly on POSIX, ~1 µs with the caches cold, where ``os.environ.get`` takes ~7 (Python
    frames, and a KeyError raised and caught for an unset variable); it sees every change made
    through os.environ. Elsewhere ``os.environ.get``."""
    data = getattr(os.environ, "_data", None)
    if os.name == "posix" and isinstance(data, dict):
        key = os.fsencode(name)
        return lambda: data.get(key)
    return lambda: os.environ.get(name)


_fused_max_n_raw = _env_reader("ZIPSERV_CPU_FUSED_MAX_N")


def fused_max_n(packed: bool = True) -> int:
    """Token count up to which fast mode runs the fused kernels (dispatch threshold); above it,
    decode + F.linear. ``packed``: for the byte-split layout (unlimited by default on CPUs with
    AVX512-BF16, whose panel kernel serves large N), else for TCA-TBE v1 (512: its kernel is
    the fp32 one only).

    Read on every fast-mode call, so the parsed value is kept per raw value of the variable."""
    raw = _fused_max_n_raw()
    hit = _max_n_cache.get(packed)
    if hit is None or hit[0] != raw:
        from ..settings import cpu_fused_max_n

        default = FUSED_MAX_N_BF16 if packed and bf16_supported() else FUSED_MAX_N_DEFAULT
        hit = _max_n_cache[packed] = (raw, cpu_fused_max_n(default))
    return hit[1]


def _why_not(x: torch.Tensor, bias: torch.Tensor | None, m: int, packed: bool = False) -> str | None:
    """None when fast mode runs a fused kernel for this call, else the reason."""
    if _cpu_gemm is None:
        return _REASON
    if not x.is_cpu:
        return f"x is on {x.device}, not the CPU"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}; the fused kernel takes bfloat16"
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_cpu or bias.shape != (m,)):
        return f"bias is {bias.dtype} {list(bias.shape)} on {bias.device}; the fused kernel takes bfloat16 [{m}] on the CPU"
    n = x.numel() // max(1, x.shape[-1])
    if n < 1:
        return "x has no rows"
    limit = fused_max_n(packed)
    if n > limit:
        return f"{n} tokens > fused_max_n() = {limit}: decode + F.linear"
    return None


def dispatch(x: torch.Tensor, bias: torch.Tensor | None, m: int, packed: bool = False) -> tuple[bool, str]:
    """Whether fast mode runs a fused kernel for this call, and why (not); ``packed``: W in the
    byte-split layout (then the kernel is the dispatcher's choice, kernels/cpu_dispatch.py)."""
    why = _why_not(x, bias, m, packed)
    if why is not None:
        return False, why
    n = x.numel() // x.shape[-1]
    kernel = fast_kernel(x, m, x.shape[-1]) if packed else "fused"
    isa = "avx512-bf16" if kernel == "panel" else (_isa_override or _cpu_gemm.isas()[0])
    return True, f"{kernel} kernel ({isa}, {n} tokens <= {fused_max_n(packed)})"


def fast_kernel(x: torch.Tensor, m: int, k: int) -> str:
    """The byte-split kernel fast mode runs for this call (kernels/cpu_dispatch.py); ``set_isa``
    forces the fused kernel (the ISA applies to it only)."""
    if _isa_override is not None:
        return "fused"
    return cpu_dispatch.choose(x.numel() // max(1, k), m, k)


def use_fused(x: torch.Tensor, bias: torch.Tensor | None, m: int, packed: bool = False) -> bool:
    return _why_not(x, bias, m, packed) is None


def _arrays(ct: CompressedTensor):
    return (
        ct.bitmaps.contiguous().numpy().view(np.uint64),
        ct.base.contiguous().numpy(),
        ct.offsets.contiguous().numpy(),
        ct.sm.contiguous().numpy(),
        ct.fb.contiguous().numpy().view(np.uint16),
    )


def _u16(t: torch.Tensor) -> np.ndarray:
    return t.view(torch.int16).numpy().view(np.uint16)


def _c(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _check_call(x: torch.Tensor, m: int, k: int, bias: torch.Tensor | None):
    """(x as [N, k] contiguous, bias as int16 numpy or None) after the common checks."""
    if _cpu_gemm is None:
        raise ImportError(_REASON)
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the fused CPU kernel takes bfloat16 activations, got {x.dtype}")
    if x.device.type != "cpu":
        raise ValueError(f"the fused CPU kernel takes CPU tensors, got x on {x.device}")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    if bias is not None:
        if bias.dtype != torch.bfloat16 or bias.shape != (m,):
            raise ValueError(f"bias must be bfloat16 of shape [{m}], got {bias.dtype} {list(bias.shape)}")
        bias = _c(bias).view(torch.int16).numpy()
    return _c(x.reshape(-1, k)), bias


def _views(ts: tuple) -> tuple:
    return tuple(_c(t).numpy() for t in ts)


def _packed_views(pt: PackedTensor) -> tuple:
    """NumPy views of a PackedTensor's arrays, kept on the object while the same contiguous tensors
    hold the same storage (a decode step calls the kernel for every layer; four ``.numpy()`` calls
    cost several microseconds). They die with the PackedTensor."""
    ts = (pt.tiles, pt.luts, pt.exc_start, pt.exc)
    key = tuple((id(t), t.data_ptr()) for t in ts)
    hit = pt.__dict__.get("_np_views")
    if hit is not None and hit[0] == key:
        return hit[1]
    arrs = _views(ts)
    if all(t.is_contiguous() for t in ts):  # (a contiguous copy would go stale)
        pt.__dict__["_np_views"] = (key, arrs)
    return arrs


def _threads(threads: int | None) -> int:
    return int(threads or _threads_override or torch.get_num_threads())


def fused_gemm(x: torch.Tensor, bitmaps: torch.Tensor, base: torch.Tensor, offsets: torch.Tensor,
               sm: torch.Tensor, fb: torch.Tensor, m: int, k: int, bias: torch.Tensor | None = None,
               *, isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """``F.linear(x, W, bias)`` from the arrays of a CompressedTensor (all CPU; x, bias bf16).

    Kept lean: a decode step calls it once per linear layer (~10 us of Python here).
    """
    x2, bias = _check_call(x, m, k, bias)
    out = torch.empty((x2.shape[0], m), dtype=torch.bfloat16)
    _cpu_gemm.gemm(
        x2.view(torch.int16).numpy(), _c(bitmaps).numpy(), _c(base).numpy(), _c(offsets).numpy(),
        _c(sm).numpy(), _c(fb).numpy(), m, k, bias, out.view(torch.int16).numpy(),
        _threads(threads), isa or _isa_override or "auto",
    )
    return out.view(*x.shape[:-1], m)


def packed_gemm(x: torch.Tensor, tiles: torch.Tensor, luts: torch.Tensor, exc_start: torch.Tensor,
                exc: torch.Tensor, m: int, k: int, bias: torch.Tensor | None = None,
                *, isa: str | None = None, threads: int | None = None, kernel: str = "fused") -> torch.Tensor:
    """``F.linear(x, W, bias)`` from the arrays of a PackedTensor (all CPU; x, bias bf16).

    ``kernel``: ``"fused"`` (fp32, any ``isa``) or ``"panel"`` (AVX512-BF16; ``isa`` does not apply)."""
    return _packed_call(x, _views((tiles, luts, exc_start, exc)), m, k, bias, isa, threads, kernel)


def _packed_call(x, arrs, m, k, bias, isa, threads, kernel) -> torch.Tensor:
    x2, bias = _check_call(x, m, k, bias)
    if kernel == "panel" and not bf16_supported():
        raise ValueError("kernel 'panel' needs a CPU with AVX512-BF16 (vdpbf16ps); this one has none")
    if kernel not in PACKED_KERNELS:
        raise ValueError(f"kernel must be one of {PACKED_KERNELS}, got {kernel!r}")
    return _packed_run(x, x2, arrs, m, k, bias, _threads(threads), kernel, isa)


def _packed_run(x, x2, arrs, m, k, bias, threads: int, kernel: str, isa) -> torch.Tensor:
    """The native call on checked arguments (x2: x as [N, k] contiguous bf16; bias: int16 numpy or None)."""
    out = torch.empty((x2.shape[0], m), dtype=torch.bfloat16)
    if kernel == "panel":
        _cpu_gemm.packed_gemm_bf16(x2.view(torch.int16).numpy(), *arrs, m, k, bias, out.view(torch.int16).numpy(),
                                   threads)
    else:
        _cpu_gemm.packed_gemm(x2.view(torch.int16).numpy(), *arrs, m, k, bias, out.view(torch.int16).numpy(),
                              threads, isa or _isa_override or "auto")
    return out.view(*x.shape[:-1], m)


class _Held:
    """A native object cached on a tensor by :func:`_native`. Copies and pickles of the tensor
    (``copy.deepcopy``, ``torch.save``, which take its ``__dict__`` along) get an empty one: the
    object cannot be copied, and a copy's arrays are other memory."""

    __slots__ = ("key", "obj")

    def __init__(self, key=None, obj=None):
        self.key, self.obj = key, obj

    def __reduce__(self):
        return (_Held, ())

    def __copy__(self):
        return _Held()

    def __deepcopy__(self, memo):
        return _Held()


def _native(tiles: torch.Tensor, luts: torch.Tensor, exc_start: torch.Tensor, exc: torch.Tensor, m: int, k: int):
    """The extension's ``PackedLinear`` for a byte-split weight's arrays (checked once), held on the
    ``tiles`` tensor while the other three are the same objects, all four have the same storage and
    the shape is the same; None where they are not contiguous CPU tensors (the callers then take the
    array path, which copies). Eager calls and the ``zipserv::packed_gemm`` op (what compiled graphs
    run) both find it there. The object holds NumPy views of the four arrays, whose bases are tensor
    objects of their own, so ``tiles`` -> object -> views makes no reference cycle: all of it goes
    with the weight (tests/test_cpu_layout.py checks that)."""
    hit = tiles.__dict__.get("_zs_native")
    key = (tiles.data_ptr(), luts.data_ptr(), exc_start.data_ptr(), exc.data_ptr(), m, k)
    if hit is not None and hit.key is not None and hit.key[0] is luts and hit.key[1] is exc_start \
            and hit.key[2] is exc and hit.key[3] == key:
        return hit.obj
    ts = (tiles, luts, exc_start, exc)
    if not all(t.is_cpu and t.is_contiguous() for t in ts):
        return None
    nat = _cpu_gemm.PackedLinear(*_views(ts), m, k)
    tiles.__dict__["_zs_native"] = _Held((luts, exc_start, exc, key), nat)
    return nat


def native_linear(x: torch.Tensor, tiles: torch.Tensor, luts: torch.Tensor, exc_start: torch.Tensor,
                  exc: torch.Tensor, m: int, k: int, bias: torch.Tensor | None) -> torch.Tensor | None:
    """Fast mode's CPU call on a byte-split weight's arrays: what ``use_fused`` + ``fast_kernel`` +
    ``packed_gemm`` do, with each check made once (``_why_not``'s) and the weight's arrays checked
    once per weight (:func:`_native`), not per call: a decode step calls every layer once, and when
    its weight stream has left the interpreter's state out of the caches the per-call NumPy views and
    array checks cost about as much as the kernel at a few tokens (docs/CPU.md). None when no fused
    kernel applies (the caller then takes the decode + F.linear path); the caller has checked that
    x's last dimension is ``k``."""
    if _isa_override is not None or _why_not(x, bias, m, packed=True) is not None:
        return None
    nat = _native(tiles, luts, exc_start, exc, m, k)
    if nat is None:
        return None
    x2 = x if x.is_contiguous() else x.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    n = x2.numel() // k
    y = torch.empty(n, m, dtype=_BF16_DTYPE, device=_CPU)  # (positional sizes: ~3 µs less than a tuple, cold)
    nat.run(x2.data_ptr(), n, y.data_ptr(), 0 if bias is None else bias.data_ptr(), _threads(None),
            cpu_dispatch.choose(n, m, k) == "panel")
    return y if x.dim() == 2 else y.view(*x.shape[:-1], m)


def eager_packed_linear(x: torch.Tensor, pt: PackedTensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """:func:`native_linear` on a PackedTensor (``zipserv_vllm.linear``'s eager CPU path)."""
    m, k = pt.shape
    return native_linear(x, pt.tiles, pt.luts, pt.exc_start, pt.exc, m, k, bias)


def packed_linear(x: torch.Tensor, pt: PackedTensor, bias: torch.Tensor | None = None, *,
                  isa: str | None = None, threads: int | None = None, kernel: str = "fused") -> torch.Tensor:
    """``F.linear(x, W, bias)`` for W in the byte-split layout, by ``kernel`` (see packed_gemm)."""
    m, k = pt.shape
    return _packed_call(x, _packed_views(pt), m, k, bias, isa, threads, kernel)


def pack(w: torch.Tensor | CompressedTensor, *, threads: int | None = None) -> PackedTensor:
    """Repack a weight into the CPU byte-split layout (lossless; docs/FORMAT.md appendix A).

    ``w``: a 2-D bfloat16 tensor, or a CompressedTensor (decoded first, one
    matrix at a time). Multi-threaded (``threads`` as for the kernels).
    """
    _need()
    if isinstance(w, CompressedTensor):
        from ..codec import decompress_tensor

        w = decompress_tensor(w.to("cpu"))
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16 or w.dim() != 2 or w.numel() == 0:
        got = f"{w.dtype} {list(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"pack takes a non-empty 2-D bfloat16 tensor or a CompressedTensor, got {got}")
    bits = _c(w.detach().to("cpu")).view(torch.int16).numpy().view(np.uint16)
    tiles, luts, exc_start, exc = _cpu_gemm.pack(bits, _threads(threads))
    return PackedTensor(tuple(w.shape), torch.from_numpy(tiles), torch.from_numpy(luts),
                        torch.from_numpy(exc_start), torch.from_numpy(exc))


def packed_decode(pt: PackedTensor, *, isa: str | None = None, threads: int | None = None,
                  kernel: str = "fused") -> torch.Tensor:
    """W (bf16 [M, K]) from the byte-split layout, bit for bit, by ``kernel``'s tile decoder."""
    _need()
    m, k = pt.shape
    out = torch.empty((m, k), dtype=torch.bfloat16)
    if kernel == "panel":
        if not bf16_supported():
            raise ValueError("kernel 'panel' needs a CPU with AVX512-BF16 (vdpbf16ps); this one has none")
        _cpu_gemm.packed_decode_bf16(_c(pt.tiles).numpy(), _c(pt.luts).numpy(), _c(pt.exc_start).numpy(),
                                     _c(pt.exc).numpy(), int(m), int(k), _u16(out), _threads(threads))
        return out
    if kernel != "fused":
        raise ValueError(f"kernel must be one of {PACKED_KERNELS}, got {kernel!r}")
    _cpu_gemm.packed_decode(_c(pt.tiles).numpy(), _c(pt.luts).numpy(), _c(pt.exc_start).numpy(),
                            _c(pt.exc).numpy(), int(m), int(k), _u16(out), _threads(threads),
                            isa or _isa_override or "auto")
    return out


def packed_embedding(ids: torch.Tensor, pt: PackedTensor, rows: int | None = None, *, isa: str | None = None,
                     threads: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, W)`` for W in the byte-split layout, bit for bit: only the rows the ids name
    are decoded, each from the 8 FTs per tile that hold it (ids clamped to ``[0, rows)``; rows
    ``M .. rows - 1`` are zeros, vLLM's vocabulary padding). The lookup is portable code: ``isa`` is
    only checked."""
    _need()
    m, k = pt.shape
    rows = m if rows is None else int(rows)
    flat = _c(ids.reshape(-1).to(torch.int64))
    out = torch.empty((flat.numel(), k), dtype=torch.bfloat16)
    _cpu_gemm.packed_embedding(flat.numpy(), *_packed_views(pt), int(m), int(k), rows, _u16(out), _threads(threads),
                               isa or _isa_override or "auto")
    return out.reshape(*ids.shape, k)


# ------------------------------------------------------- MoE experts, one call
def expert_table(parts: list, shape: tuple[int, int]) -> np.ndarray | None:
    """The address table ``moe_experts`` / ``moe_layer`` / ``moe_forward`` take for experts ``parts``
    (all PackedTensors of ``shape`` on the CPU, contiguous, with the layout's dtypes and array
    shapes), or None where one is not: per expert the four arrays' addresses, the exception count
    and ``shape`` (checked against the sizes by every ``moe_experts`` call, once by ``moe_layer``).
    The caller keeps ``parts`` alive while it uses the table or a ``moe_layer`` made from it."""
    from ..format.cpu_layout import LUT_ENTRIES, TILE_BYTES, grid

    mt, kt = grid(*shape)
    rows = []
    for p in parts:
        if not isinstance(p, PackedTensor) or tuple(p.shape) != tuple(shape) or p.tiles.device.type != "cpu":
            return None
        a = (p.tiles, p.luts, p.exc_start, p.exc)
        if not all(t.is_contiguous() for t in a) or (p.tiles.dtype, p.luts.dtype, p.exc_start.dtype) != (
                torch.uint8, torch.uint8, torch.int64) or p.exc.dtype not in (torch.int32, torch.uint32):
            return None
        if (tuple(p.tiles.shape) != (mt, kt, TILE_BYTES) or tuple(p.luts.shape) != (mt, kt, LUT_ENTRIES)
                or tuple(p.exc_start.shape) != (mt * kt + 1,) or p.exc.dim() != 1):
            return None
        rows.append([t.data_ptr() for t in a] + [p.exc.numel(), shape[0], shape[1]])
    return np.array(rows, dtype=np.int64).reshape(len(rows), 7)


def _check_moe_x(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        raise ValueError(f"{name} must be a 2-D bfloat16 CPU tensor, got {x.dtype} {list(x.shape)} on {x.device}")


def moe_experts(xs: torch.Tensor, counts: list[int], w13: np.ndarray, w2: np.ndarray, inter: int, *,
                threads: int | None = None) -> torch.Tensor:
    """One MoE layer's routed experts in one native call (AVX512-BF16 panel kernel, fast mode):
    rows ``xs`` grouped by expert (``counts[e]`` rows for expert e), through w13 (gate rows then up
    rows), bf16(silu(gate) * up) in fp32, and w2. ``w13`` / ``w2``: :func:`expert_table`s."""
    _need()
    if not bf16_supported():
        raise ValueError("moe_experts needs a CPU with AVX512-BF16 (vdpbf16ps); this one has none")
    _check_moe_x(xs, "xs")
    r, hidden = xs.shape
    bounds = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=bounds[1:])
    h = torch.empty((r, 2 * inter), dtype=torch.bfloat16)
    act = torch.empty((r, inter), dtype=torch.bfloat16)
    y = torch.empty((r, hidden), dtype=torch.bfloat16)
    _cpu_gemm.moe_experts_bf16(_u16(_c(xs)), bounds, w13, w2, int(inter), int(hidden), _u16(h), _u16(act), _u16(y),
                               _threads(threads))
    return y


def moe_layer(w13: np.ndarray, w2: np.ndarray, inter: int, hidden: int):
    """The extension's ``MoeLayer`` for one MoE layer's :func:`expert_table` tables (``w13``: gate rows
    then up rows, 2 I x H; ``w2``: H x I): the tables checked against the sizes once and copied;
    the experts' tensors must outlive it (the caller keeps them). Run it with :func:`moe_run`."""
    _need()
    if not bf16_supported():
        raise ValueError("the one-call MoE kernel needs a CPU with AVX512-BF16 (vdpbf16ps); this one has none")
    return _cpu_gemm.MoeLayer(w13, w2, int(inter), int(hidden))


_ID_DTYPES = (torch.int32, torch.int64)


def moe_run(layer, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
            on_input: bool = False, threads: int | None = None) -> torch.Tensor:
    """A MoE layer's routed experts for tokens ``x`` [T, H] in one native call through ``layer``
    (:func:`moe_layer`): the rows grouped by expert, both GEMMs and SiLU x up as :func:`moe_experts`,
    and ``out[t] = sum_j w[t, j] * y[t, j]`` in fp32 (``on_input``: the weight scales ``x[t]``
    instead), returned as bf16 [T, H]. Only the buffers' addresses cross into the extension, after
    the checks here (the per-call cost of a decode step's MoE layer)."""
    _check_moe_x(x, "x")
    if x.shape[1] != layer.hidden:
        raise ValueError(f"x must have {layer.hidden} columns (the layer's hidden size), got {x.shape[1]}")
    t = x.shape[0]
    ids = topk_ids if topk_ids.dtype in _ID_DTYPES else topk_ids.to(torch.int64)
    wts = topk_weights if topk_weights.dtype == torch.float32 else topk_weights.to(torch.float32)
    if ids.dim() != 2 or ids.shape[0] != t or not ids.is_cpu or tuple(wts.shape) != tuple(ids.shape) \
            or not wts.is_cpu or ids.shape[1] < 1:
        raise ValueError(f"topk_ids and topk_weights must be [{t}, k] CPU tensors, got {list(ids.shape)} and "
                         f"{list(wts.shape)}")
    ids = ids if ids.is_contiguous() else ids.contiguous()
    wts = wts if wts.is_contiguous() else wts.contiguous()
    x = x if x.is_contiguous() else x.contiguous()
    out = torch.empty(t, layer.hidden, dtype=_BF16_DTYPE, device=_CPU)
    if t:
        layer.run(x.data_ptr(), t, ids.data_ptr(), ids.element_size(), wts.data_ptr(), ids.shape[1], out.data_ptr(),
                  bool(on_input), _threads(threads))
    return out


def moe_forward(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w13: np.ndarray,
                w2: np.ndarray, inter: int, *, on_input: bool = False, threads: int | None = None) -> torch.Tensor:
    """:func:`moe_run` on the :func:`expert_table` tables ``w13`` / ``w2`` (checked on every call; the
    plugin keeps a :func:`moe_layer` per layer instead)."""
    _need()
    _check_moe_x(x, "x")
    return moe_run(moe_layer(w13, w2, inter, x.shape[1]), x, topk_ids, topk_weights, on_input=on_input,
                   threads=threads)


def fused_linear(x: torch.Tensor, ct: CompressedTensor, bias: torch.Tensor | None = None, *,
                 isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """``F.linear(x, decompress_tensor(ct), bias)`` by the fused kernel."""
    m, k = ct.shape
    return fused_gemm(x, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k, bias, isa=isa, threads=threads)


def decode(ct: CompressedTensor, *, isa: str | None = None, threads: int | None = None) -> torch.Tensor:
    """Decode ``ct`` with the fused kernel's own tile decoder (tests its bit-exactness)."""
    _need()
    m, k = ct.shape
    out = torch.empty((m, k), dtype=torch.bfloat16)
    _cpu_gemm.decode(*_arrays(ct), int(m), int(k), _u16(out), _threads(threads), isa or _isa_override or "auto")
    return out
