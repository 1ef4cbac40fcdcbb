"""Fused decode-GEMM CPU kernels (zipserv_vllm._cpu_gemm, docs/CPU.md).

* the kernels' own tile decoder is bit-exact (every ISA this CPU runs);
* the fused GEMM matches an exact (float64) GEMM on the reference-decoded
  weight within a bound that one wrong weight element breaks (negative check);
* it is close to F.linear on the decompressed weight, and bitwise identical
  across ISAs and thread counts;
* awkward shapes, token counts, bias, non-finite weights, batch dims, bad input;
* zipserv::gemm dispatch: "fast" -> fused (small N), "exact" -> decode + F.linear.

Budget: < 90 s on 2 cores (the scalar path is the slow one; shapes are small).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zipserv_vllm
from zipserv_vllm import compress_tensor
from zipserv_vllm.kernels import cpu as cpu_kernels
from zipserv_vllm.format import reference

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())

NS = (1, 2, 3, 4, 7, 8, 16, 17, 33)
SHAPES = ((1, 1), (63, 65), (65, 63), (64, 64), (130, 200), (200, 130), (64, 65), (3, 300))


def _isas():
    return cpu_kernels.isas() if cpu_kernels.available() else []


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _weight(m, k, seed=0, scale=0.02):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).bfloat16()


def _ref_decode(ct) -> torch.Tensor:
    """The NumPy reference decoder (the oracle), as a bf16 tensor."""
    m, k = ct.shape
    e = reference.Encoded(m, k, ct.bitmaps.numpy().view(np.uint64), ct.base.numpy(), ct.offsets.numpy(),
                          ct.sm.numpy(), ct.fb.numpy().view(np.uint16))
    return torch.from_numpy(reference.decode(e).view(np.int16).copy()).view(torch.bfloat16)


def _exact(x, w, bias=None) -> torch.Tensor:
    """float64 GEMM (exact to ~1e-16 relative): the reference result."""
    y = x.double() @ w.double().T
    return y + bias.double() if bias is not None else y


def _bound(x, w, bias=None) -> torch.Tensor:
    """|fused - exact| bound: bf16 output rounding + fp32 accumulation error."""
    k = x.shape[-1]
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        mag = mag + bias.double().abs()
    return _exact(x, w, bias).abs() * 2.0 ** -8 + mag * (k + 4) * 2.0 ** -24 + 1e-30


def _close_to_exact(y, x, w, bias=None) -> bool:
    return bool(((y.double() - _exact(x, w, bias)).abs() <= _bound(x, w, bias)).all())


# --- decode -----------------------------------------------------------------

@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("shape", SHAPES + ((128, 256),))
def test_fused_decoder_bit_exact(isa, shape):
    w = _weight(*shape, seed=shape[0] * 7 + shape[1])
    ct = compress_tensor(w)
    assert torch.equal(_bits(cpu_kernels.decode(ct, isa=isa, threads=2)), _bits(w))


@pytest.mark.parametrize("isa", _isas())
def test_fused_decoder_every_bit_pattern(isa):
    """All 65,536 BF16 patterns (NaN payloads, -0, inf, subnormals) come back, with many fallbacks."""
    g = torch.Generator().manual_seed(1)
    pats = torch.arange(65536, dtype=torch.int32).to(torch.int16)[torch.randperm(65536, generator=g)]
    w = pats.reshape(256, 256).view(torch.bfloat16)
    ct = compress_tensor(w)
    assert torch.equal(_bits(cpu_kernels.decode(ct, isa=isa, threads=2)), _bits(w))
    assert torch.equal(_bits(_ref_decode(ct)), _bits(w))


# --- GEMM accuracy ------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_bias", (False, True))
def test_fused_matches_exact_gemm(shape, with_bias):
    m, k = shape
    w = _weight(m, k, seed=m + 3 * k)
    ct = compress_tensor(w)
    wref = _ref_decode(ct)
    g = torch.Generator().manual_seed(m * k)
    bias = torch.randn(m, generator=g).bfloat16() if with_bias else None
    for n in NS:
        x = torch.randn(n, k, generator=g).bfloat16()
        y = cpu_kernels.fused_linear(x, ct, bias)
        assert y.dtype == torch.bfloat16 and y.shape == (n, m)
        assert _close_to_exact(y, x, wref, bias), (shape, n)
        # Close to torch's own BF16 GEMM on the decompressed weight (both round to bf16).
        lin = F.linear(x, zipserv_vllm.decompress_tensor(ct), bias)
        assert torch.allclose(y.float(), lin.float(), rtol=2 ** -6, atol=2 * _bound(x, wref, bias).max().item())


def test_bound_catches_one_wrong_weight():
    """Negative check: the accuracy bound above is tight enough to see a single corrupted weight."""
    m, k, n = 64, 256, 4
    w = _weight(m, k, seed=5)
    ct = compress_tensor(w)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(n, k, generator=g).bfloat16()
    y = cpu_kernels.fused_linear(x, ct)
    assert _close_to_exact(y, x, w)
    contrib = (x[0].float() * w.float()).abs()  # [m, k], token 0
    r, c = divmod(int(contrib.argmax()), k)
    bad = w.clone()
    bad[r, c] = -bad[r, c]  # one flipped sign bit
    assert not _close_to_exact(y, x, bad)
    # And a kernel fed the corrupted weight disagrees with the true one beyond the bound.
    y_bad = cpu_kernels.fused_linear(x, compress_tensor(bad))
    assert not _close_to_exact(y_bad, x, w)


# --- determinism across ISAs and threads -----------------------------------------

@pytest.mark.parametrize("shape", ((63, 65), (130, 200), (256, 192)))
def test_bitwise_identical_across_isas_and_threads(shape):
    m, k = shape
    w = _weight(m, k, seed=11)
    ct = compress_tensor(w)
    g = torch.Generator().manual_seed(12)
    bias = torch.randn(m, generator=g).bfloat16()
    for n in (1, 3, 8, 17):
        x = torch.randn(n, k, generator=g).bfloat16()
        outs = {(isa, t): cpu_kernels.fused_linear(x, ct, bias, isa=isa, threads=t)
                for isa in cpu_kernels.isas() for t in (1, 2, 3)}
        first = _bits(next(iter(outs.values())))
        for key, y in outs.items():
            assert torch.equal(_bits(y), first), (shape, n, key)


def test_flush_denormal_does_not_change_results():
    """The kernels run with IEEE semantics whatever MXCSR the caller set."""
    w = (_weight(64, 128, seed=2).float() * 2.0 ** -120).bfloat16()  # subnormal products
    ct = compress_tensor(w)
    x = (torch.randn(3, 128, generator=torch.Generator().manual_seed(3)) * 2.0 ** -10).bfloat16()
    base = {isa: cpu_kernels.fused_linear(x, ct, isa=isa) for isa in cpu_kernels.isas()}
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        for isa in cpu_kernels.isas():
            assert torch.equal(_bits(cpu_kernels.fused_linear(x, ct, isa=isa)), _bits(base[isa]))
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(_bits(base["scalar"]), _bits(base[cpu_kernels.isas()[0]]))


# --- special values, shapes, batch dims -------------------------------------------

@pytest.mark.parametrize("isa", _isas())
def test_non_finite_weights_propagate_like_f_linear(isa):
    m, k, n = 70, 130, 5
    w = _weight(m, k, seed=21)
    w[3, 7] = float("inf")
    w[10, 100] = float("-inf")
    w[20, 64] = float("nan")
    w[30, 5] = float("inf")
    w[30, 6] = float("-inf")  # inf - inf = NaN
    ct = compress_tensor(w)
    g = torch.Generator().manual_seed(22)
    x = torch.randn(n, k, generator=g).bfloat16()
    x[1, 7] = 0.0  # inf * 0 = NaN for row 3, token 1
    x[:, 5] = x[:, 6] = 1.0  # row 30: inf + (-inf) = NaN
    y = cpu_kernels.fused_linear(x, ct, isa=isa)
    lin = F.linear(x, w)
    assert torch.equal(torch.isnan(y), torch.isnan(lin))
    assert torch.equal(torch.isposinf(y), torch.isposinf(lin))
    assert torch.equal(torch.isneginf(y), torch.isneginf(lin))
    assert torch.isnan(y[:, 20]).all() and torch.isnan(y[1, 3]) and torch.isnan(y[:, 30]).all()
    fin = torch.isfinite(lin)
    assert torch.allclose(y[fin].float(), lin[fin].float(), rtol=2 ** -6, atol=1e-2)
    assert (y[torch.isnan(y)].view(torch.int16) == 0x7FC0).all()  # torch's canonical NaN


def test_batch_dims_and_shapes():
    w = _weight(96, 80, seed=31)
    ct = compress_tensor(w)
    x = torch.randn(2, 5, 80, generator=torch.Generator().manual_seed(32)).bfloat16()
    y = cpu_kernels.fused_linear(x, ct)
    assert y.shape == (2, 5, 96)
    assert torch.equal(_bits(y.reshape(10, 96)), _bits(cpu_kernels.fused_linear(x.reshape(10, 80), ct)))
    assert cpu_kernels.fused_linear(torch.empty(0, 80, dtype=torch.bfloat16), ct).shape == (0, 96)
    # A non-contiguous x is accepted.
    xt = torch.randn(80, 4, generator=torch.Generator().manual_seed(33)).bfloat16().T
    assert torch.equal(_bits(cpu_kernels.fused_linear(xt, ct)), _bits(cpu_kernels.fused_linear(xt.contiguous(), ct)))


def test_narrowed_and_concatenated_tensors():
    w = _weight(192, 160, seed=41)
    ct = compress_tensor(w)
    x = torch.randn(3, 160, generator=torch.Generator().manual_seed(42)).bfloat16()
    full = cpu_kernels.fused_linear(x, ct)
    part = cpu_kernels.fused_linear(x, ct.narrow(0, 64, 128))
    assert torch.equal(_bits(part), _bits(full[:, 64:192]))
    both = zipserv_vllm.CompressedTensor.cat([ct.narrow(0, 0, 64), ct.narrow(0, 64, 128)])
    assert torch.equal(_bits(cpu_kernels.fused_linear(x, both)), _bits(full))


# --- bad input ---------------------------------------------------------------------

def test_bad_input_errors():
    w = _weight(64, 64, seed=51)
    ct = compress_tensor(w)
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.fused_linear(torch.randn(2, 63).bfloat16(), ct)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_kernels.fused_linear(x.float(), ct)
    with pytest.raises(ValueError, match="bias"):
        cpu_kernels.fused_linear(x, ct, torch.zeros(63, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="isa"):
        cpu_kernels.fused_linear(x, ct, isa="sse9")
    with pytest.raises(ValueError, match="threads"):
        cpu_kernels.set_threads(0)
    huge = ct.offsets.clone()
    huge[..., 0] = 2 ** 63 - 16  # must not overflow the bounds check
    for offsets in (ct.offsets + 16, ct.offsets - 16, huge):
        bad = zipserv_vllm.CompressedTensor(ct.shape, ct.bitmaps, ct.base, offsets, ct.sm, ct.fb)
        for isa in cpu_kernels.isas():
            with pytest.raises(ValueError, match=r"tile \(0, 0\)"):
                cpu_kernels.fused_linear(x, bad, isa=isa)
            with pytest.raises(ValueError, match=r"tile \(0, 0\)"):
                cpu_kernels.decode(bad, isa=isa)


def test_avx512_path_reported_honestly():
    if "avx512" in cpu_kernels.isas():
        pytest.skip("this CPU runs the AVX-512 path; the identity tests above cover it")
    with pytest.raises(ValueError, match="not supported on this CPU"):
        cpu_kernels.fused_linear(torch.randn(1, 64).bfloat16(), compress_tensor(_weight(64, 64)), isa="avx512")


def test_set_isa_and_threads_overrides():
    w = _weight(64, 96, seed=61)
    ct = compress_tensor(w)
    x = torch.randn(4, 96).bfloat16()
    ref = cpu_kernels.fused_linear(x, ct, isa="scalar", threads=1)
    try:
        cpu_kernels.set_isa(cpu_kernels.isas()[0])
        cpu_kernels.set_threads(2)
        assert torch.equal(_bits(cpu_kernels.fused_linear(x, ct)), _bits(ref))
    finally:
        cpu_kernels.set_isa(None)
        cpu_kernels.set_threads(None)


# --- op dispatch -----------------------------------------------------------------

def test_linear_dispatch(monkeypatch):
    w = _weight(96, 130, seed=71)
    ct = compress_tensor(w)
    g = torch.Generator().manual_seed(72)
    bias = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(2, 3, 130, generator=g).bfloat16()
    fast = zipserv_vllm.linear(x, ct, bias, mode="fast")
    assert cpu_kernels.dispatch(x, bias, 96)[0]
    assert torch.equal(_bits(fast), _bits(cpu_kernels.fused_linear(x, ct, bias)))
    exact = zipserv_vllm.linear(x, ct, bias, mode="exact")
    assert torch.equal(_bits(exact), _bits(F.linear(x, w, bias)))
    # Above the threshold, "fast" is decode + F.linear (bit-identical to BF16).
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", "5")
    use, why = cpu_kernels.dispatch(x, bias, 96)
    assert not use and "fused_max_n" in why
    assert torch.equal(_bits(zipserv_vllm.linear(x, ct, bias, mode="fast")), _bits(F.linear(x, w, bias)))
    # fp32 activations are not the fused kernel's: decode + F.linear says why.
    assert "bfloat16" in cpu_kernels.dispatch(x.float(), None, 96)[1]
    with pytest.raises(ValueError, match="mode"):
        zipserv_vllm.linear(x, ct, bias, mode="fastest")


def test_fused_max_n_follows_the_environment_every_call(monkeypatch):
    """fused_max_n reads ZIPSERV_CPU_FUSED_MAX_N on every call through os.environ's own store
    (kernels/cpu.py _env_reader): set, changed and removed through os.environ, it is seen at once."""
    monkeypatch.delenv("ZIPSERV_CPU_FUSED_MAX_N", raising=False)
    default = cpu_kernels.fused_max_n(packed=False)
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", "7")
    assert cpu_kernels.fused_max_n(packed=False) == 7
    os.environ["ZIPSERV_CPU_FUSED_MAX_N"] = "9"
    assert cpu_kernels.fused_max_n(packed=False) == 9
    del os.environ["ZIPSERV_CPU_FUSED_MAX_N"]
    assert cpu_kernels.fused_max_n(packed=False) == default
    assert cpu_kernels._env_reader("ZIPSERV_TEST_UNSET_VARIABLE")() is None


def test_eager_bypass_equals_op_and_traces():
    """linear() calls the fused kernel directly in eager mode; the op gives the same bits and traces."""
    w = _weight(64, 128, seed=81)
    ct = compress_tensor(w)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(82)).bfloat16()
    eager = zipserv_vllm.linear(x, ct, mode="fast")
    via_op = torch.ops.zipserv.gemm(x, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, 64, 128, None, "fast")
    assert torch.equal(_bits(eager), _bits(via_op))
    traced = torch.compile(lambda t: zipserv_vllm.linear(t, ct, mode="fast"), backend="eager", fullgraph=True)
    assert torch.equal(_bits(traced(x)), _bits(eager))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_kernel_runs_on_torchs_openmp_runtime():
    """The extension links libgomp and the process holds exactly one copy: torch's threads run the kernel.

    (A second OpenMP runtime, or threads of our own, would compete with torch's
    spinning workers for the cores: docs/CPU.md, "Work split".) In a fresh process
    that imports only torch and the package: other libraries a test run has loaded
    by then (sentencepiece bundles a libgomp of its own) are not ours to count."""
    import json
    import subprocess
    import sys

    probe = """
import json, os, torch
from zipserv_vllm import compress_tensor
from zipserv_vllm.kernels import cpu as cpu_kernels
w = (torch.randn(256, 128, generator=torch.Generator().manual_seed(95)) * 0.05).bfloat16()
x = torch.randn(1, 128, generator=torch.Generator().manual_seed(96)).bfloat16()
cpu_kernels.fused_linear(x, compress_tensor(w), threads=2)
with open("/proc/self/maps") as f:
    libs = sorted({line.split()[-1] for line in f if len(line.split()) >= 6})
print(json.dumps(libs))
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    libs = json.loads(r.stdout.strip().splitlines()[-1])
    gomp = {p for p in libs if os.path.basename(p).startswith("libgomp")}
    ext = [p for p in libs if "_cpu_gemm" in os.path.basename(p)]
    assert ext, "the _cpu_gemm extension is not mapped"
    assert len(gomp) == 1, f"expected one OpenMP runtime in the process, found {sorted(gomp)}"
    assert any(os.path.dirname(p) == os.path.join(os.path.dirname(torch.__file__), "lib") for p in gomp), gomp
    with open(ext[0], "rb") as f:
        assert b"GOMP_parallel" in f.read(), "the extension does not use OpenMP (built without -fopenmp?)"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_fork_after_use_does_not_deadlock():
    """GNU OpenMP cannot start a team in a forked child: the kernel must run there on the calling thread."""
    from forking import passes_in_forked_child

    w = _weight(256, 128, seed=91)
    ct = compress_tensor(w)
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(92)).bfloat16()
    ref = cpu_kernels.fused_linear(x, ct, threads=2)
    passes_in_forked_child(lambda: torch.equal(_bits(cpu_kernels.fused_linear(x, ct, threads=2)), _bits(ref)),
                           "the fused kernel")


def test_without_the_extension_fast_falls_back_with_a_reason(monkeypatch):
    """When _cpu_gemm is missing, mode="fast" is decode + F.linear and dispatch() says why."""
    w = _weight(64, 96, seed=101)
    ct = compress_tensor(w)
    x = torch.randn(2, 96, generator=torch.Generator().manual_seed(102)).bfloat16()
    monkeypatch.setattr(cpu_kernels, "_cpu_gemm", None)
    monkeypatch.setattr(cpu_kernels, "_REASON", "zipserv_vllm._cpu_gemm is not built (test)")
    use, why = cpu_kernels.dispatch(x, None, 64)
    assert not use and "not built" in why
    assert torch.equal(_bits(zipserv_vllm.linear(x, ct, mode="fast")), _bits(F.linear(x, w)))
    with pytest.raises(ImportError, match="not built"):
        cpu_kernels.fused_linear(x, ct)
