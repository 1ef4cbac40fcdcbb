"""First contact: every CUDA kernel instance checked exactly on a small layer before it serves.

The CUDA kernels are proven on the CPU by the SIMT harness (their own source,
compiled by g++), but a GPU build is a different compiler, a different
machine and a different driver. So before an engine in fast mode serves from
CUDA weights, :func:`first_contact` runs each kernel instance the dispatcher
can pick (the decompress kernel, the fused kernel at every ``tile_n`` with
split-K off and on, the decoupled path, the grouped kernel at every
``tile_n``) once on a small random layer and compares with the weight it
encoded:

(and, where the ops have them, the byte-split layout's kernels: its decompress kernel, its fused
kernel at both tile_n with split-K off and on, its decoupled path)

* **exactly**, by one-hot inputs: ``X`` holds rows of the identity, so
  ``Y[i, m] = W[m, cols[i]]`` (an fp32 sum of one product and zeros is
  exact); every column of ``W`` is covered, so one wrong weight fails;
* the accumulation over ``K``, by random inputs against a float64 product,
  within fp32 accumulation (``K * 2^-24 * sum |x||w|``) plus the bf16
  rounding of the output.

The plugin (``vllm_plugin/config.py``) then serves in exact mode (decompress +
cuBLAS, bit-identical to BF16) when a GEMM instance fails, and refuses to load
when the decompress kernel itself fails (exact mode needs it). The checks take
the kernels as an argument, so the tests run them on the CPU against the SIMT
harness (the kernels' own code) and against planted faults.
"""

from __future__ import annotations

import torch

from . import dispatch

SPLITS = (1, 3)  # split-K off, and three parts (partials reduced by the split-K kernel)
PACKED = "packed"  # failures of the byte-split kernels start with this: they decide the layout, not the mode
_RESULTS: dict[tuple[str, int | None], list[str]] = {}


def one_hot(n: int, k: int, offset: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(X [n, k] bf16, cols [n]): row i of X is 1.0 at column cols[i]; every column when n == k."""
    cols = torch.arange(n) if n == k else (offset + 7 * torch.arange(n)) % k
    x = torch.zeros(n, k, dtype=torch.bfloat16)
    x[torch.arange(n), cols] = 1
    return x.to(device), cols.to(device)


def exact_one_hot(y: torch.Tensor, w: torch.Tensor, cols: torch.Tensor) -> bool:
    """``Y = onehot(cols) . W^T`` must be ``W[:, cols]^T`` exactly (compared as values: a -0 weight
    gives +0, the sum of -0 and +0 products). Only for finite ``W`` (0 * inf is NaN)."""
    return y.shape == (cols.numel(), w.shape[0]) and torch.equal(y.float(), w[:, cols].T.float())


def within_f64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """``Y`` within fp32 accumulation over K (``K * 2^-24 * sum |x||w|``) plus the output's bf16
    rounding (``2^-8 |ref|``) of the float64 product ``X . W^T``."""
    ref = x.double() @ w.double().T
    bound = x.shape[1] * 2.0**-24 * (x.double().abs() @ w.double().abs().T) + 2.0**-8 * ref.abs()
    return y.shape == ref.shape and bool(((y.double() - ref).abs() <= bound).all())


def run(ops, device, m: int = 200, k: int = 520, n_random: int = 37, seed: int = 0) -> list[str]:
    """Every instance once on an ``m x k`` random layer (ragged against the 64 x 64 tiles); the
    failing ones, one description each (empty: all exact). ``ops`` has ``kernels.cuda``'s
    functions (``compress_tensor_cuda``, ``decompress_cuda``, ``fused_gemm``, ``decoupled_gemm``,
    ``grouped_gemm``). A wrong decompress is reported alone (nothing else can be judged then)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(m, k, generator=g) * 0.02).to(torch.bfloat16).to(device)
    ct = ops.compress_tensor_cuda(w)
    arrays = (ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k)
    wd = ops.decompress_cuda(*arrays)
    if not torch.equal(wd.view(torch.int16), w.view(torch.int16)):
        return [f"decompress ({m} x {k}): the decoded weight differs from the encoded one"]
    xo, cols = one_hot(k, k, device=device)
    xr = torch.randn(n_random, k, generator=g).to(torch.bfloat16).to(device)
    fails = []

    def check(name: str, fn, w=w, xo=xo, cols=cols, xr=xr) -> None:
        try:
            ok = exact_one_hot(fn(xo), w, cols) and within_f64(fn(xr), xr, w)
        except Exception as exc:  # a launch error is a failure of this instance, reported as such
            fails.append(f"{name}: {type(exc).__name__}: {exc}")
            return
        if not ok:
            fails.append(f"{name}: wrong outputs")

    for tn in dispatch.TILE_NS:
        for split in SPLITS:
            check(f"fused tile_n={tn} split={split}",
                  lambda x, tn=tn, split=split: ops.fused_gemm(x, *arrays, None, tn, split))
    check("decoupled", lambda x: ops.decoupled_gemm(x, *arrays, None))
    # grouped: two experts, the second one the same layer again, rows split unevenly between them
    rows = torch.tensor([0, 0, 0], dtype=torch.int32)
    for path, tns in (("fused", dispatch.TILE_NS), ("decoupled", (None,))):
        for tn in tns:
            def grouped(x, tn=tn, path=path):
                first = x.shape[0] // 3
                rows[1], rows[2] = first, x.shape[0]
                return ops.grouped_gemm(x, [ct, ct], rows.to(device), path=path, tile_n=tn)

            check(f"grouped {path}" + (f" tile_n={tn}" if tn else ""), grouped)
    if hasattr(ops, "packed_gemm"):  # the byte-split layout's kernels (docs/FORMAT.md appendix A)
        from ..format.cpu_layout import reference_pack

        # the general instance on this layer (K % 64 != 0), the aligned-X one on a K = 512 layer
        w2 = (torch.randn(m, 512, generator=g) * 0.02).to(torch.bfloat16).to(device)
        for wk, label in ((w, "general X"), (w2, "aligned X")):
            pt = reference_pack(wk.cpu()).to(device)
            kk = wk.shape[1]
            xo_k, cols_k = one_hot(kk, kk, device=device)
            xr_k = torch.randn(n_random, kk, generator=g).to(torch.bfloat16).to(device)
            try:
                got = ops.packed_decompress_cuda(pt.tiles, pt.luts, pt.exc_start, pt.exc, *pt.shape)
                same = torch.equal(got.view(torch.int16), wk.view(torch.int16))
            except Exception as exc:
                fails.append(f"{PACKED} decompress ({label}): {type(exc).__name__}: {exc}")
            else:
                if not same:
                    fails.append(f"{PACKED} decompress ({label}): the decoded weight differs from the packed one")
            for tn in ops.PACKED_TILE_NS:
                for split in SPLITS:
                    check(f"{PACKED} tile_n={tn} split={split} ({label})",
                          lambda x, pt=pt, tn=tn, split=split: ops.packed_gemm(x, pt, None, tn, split),
                          w=wk, xo=xo_k, cols=cols_k, xr=xr_k)
            check(f"{PACKED} decoupled ({label})", lambda x, pt=pt: ops.packed_decoupled_gemm(x, pt, None),
                  w=wk, xo=xo_k, cols=cols_k, xr=xr_k)
    return fails


def first_contact(device) -> list[str]:
    """:func:`run` with ``kernels.cuda`` on ``device``, once per device and process (cached)."""
    device = torch.device(device)
    key = (device.type, device.index)
    if key not in _RESULTS:
        from . import cuda

        _RESULTS[key] = run(cuda, device)
    return _RESULTS[key]


class DecodeError(RuntimeError):
    """The decompress kernel itself is wrong on this device: no mode can serve from it."""


def engine_mode(mode: str, devices, check=None, layout: str = "v1") -> tuple[str, str | None, str]:
    """(mode, the one line to log or None, layout) an engine serves with once its CUDA ``devices``
    had first contact. Fast mode with a failing TCA-TBE GEMM instance becomes exact mode (decompress
    + cuBLAS, bit-identical to BF16; layers stay v1); a failing decompress kernel raises
    :class:`DecodeError`. ``layout`` "bytesplit" (the engine is about to hold its layers in the
    byte-split layout) becomes "v1" when any byte-split kernel fails; in a v1 engine their failures
    are only reported. Exact mode runs no check beyond what loading does."""
    if mode != "fast":
        return mode, None, layout
    check = check or first_contact  # (looked up per call)
    notes = []
    for dev in devices:
        every = check(dev)
        fails = [f for f in every if not f.startswith(PACKED)]
        notes += [f"{dev}: {f}" for f in every if f.startswith(PACKED)]
        if not fails:
            continue
        if fails[0].startswith("decompress"):
            raise DecodeError(f"zipserv: the CUDA decompress kernel failed its first-contact check on {dev} "
                              f"({fails[0]}): this build cannot serve compressed weights on this GPU; please "
                              "report it with the GPU's name and the CUDA version")
        more = f" and {len(fails) - 1} more" if len(fails) > 1 else ""
        return "exact", (f"zipserv: the fused CUDA kernels failed their first-contact check on {dev} "
                         f"({fails[0]}{more}); serving in exact mode (decompress + cuBLAS, bit-identical to BF16)"
                         ), "v1"
    if notes:
        more = f" and {len(notes) - 1} more" if len(notes) > 1 else ""
        if layout == "bytesplit":
            return mode, (f"zipserv: the byte-split CUDA kernels failed their first-contact check ({notes[0]}"
                          f"{more}); the layers stay in the TCA-TBE v1 layout"), "v1"
        return mode, (f"zipserv: the byte-split CUDA kernel (not used for serving) failed its first-contact check "
                      f"({notes[0]}{more}); serving is unaffected"), layout
    return mode, None, layout
