"""Property tests (hypothesis): the native codec equals the reference on any shape and data.

For random shapes (edge cases included) and value distributions (normal weights
at several scales, exact zeros, signed zeros, infinities, NaNs with payloads,
subnormals, constants, uniform random bits, large outliers), every instruction
set gives the reference's bytes, any thread count gives the same bytes, and
decoding returns the input bit for bit. Example counts are kept small so the
file runs in about 10-20 s on 2 cores (the reference is the slow part).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from zipserv_vllm.format import reference

_C = pytest.importorskip("zipserv_vllm._C", reason="native extension not built (pip install -e .)")
if not hasattr(_C, "encode"):
    pytest.skip("zipserv_vllm._C was built without the codec; rebuild it", allow_module_level=True)

ISAS = list(_C.supported_isas())
NAMES = ("bitmaps", "base", "offsets", "sm", "fb")

EDGE_SHAPES = [(1, 1), (1, 97), (97, 1), (63, 65), (64, 64), (65, 64), (64, 65), (128, 192), (100, 4096), (4096, 100)]
SPECIALS = np.array(
    [0x0000, 0x8000,  # +0, -0
     0x7F80, 0xFF80,  # +inf, -inf
     0x7FC0, 0xFFC1, 0x7F81, 0x7FFF,  # NaNs with payloads
     0x0001, 0x807F, 0x0040],  # subnormals
    dtype=np.uint16)


def _bf16(x: np.ndarray) -> np.ndarray:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


shapes = st.one_of(
    st.sampled_from(EDGE_SHAPES),
    st.tuples(st.integers(1, 200), st.integers(1, 200)),
)


@st.composite
def matrices(draw):
    """A uint16 matrix of BF16 bit patterns with a drawn shape and distribution."""
    m, k = draw(shapes)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["normal", "uniform bits", "constant", "sparse specials"]))
    if kind == "normal":
        sigma = draw(st.sampled_from([1e-6, 1e-3, 0.02, 1.0, 3e4]))
        w = _bf16(rng.normal(0.0, sigma, size=(m, k)))
    elif kind == "uniform bits":
        w = rng.integers(0, 65536, size=(m, k), dtype=np.uint16)
    elif kind == "constant":
        w = np.full((m, k), draw(st.integers(0, 65535)), dtype=np.uint16)
    else:  # normal weights sprinkled with special patterns
        w = _bf16(rng.normal(0.0, 0.05, size=(m, k)))
    # optional decorations, each on a drawn fraction of the elements
    zeros = draw(st.sampled_from([0.0, 0.01, 0.5]))
    if zeros:
        mask = rng.random((m, k)) < zeros
        w[mask] = rng.choice(np.array([0x0000, 0x8000], dtype=np.uint16), size=int(mask.sum()))
    specials = draw(st.sampled_from([0.0, 0.001, 0.05])) if kind != "sparse specials" else 0.1
    if specials:
        mask = rng.random((m, k)) < specials
        w[mask] = rng.choice(SPECIALS, size=int(mask.sum()))
    outliers = draw(st.integers(0, 4))
    for _ in range(outliers):  # large magnitudes, e.g. +-2^15 .. 2^60
        w[rng.integers(0, m), rng.integers(0, k)] = (int(rng.integers(0, 2)) << 15) | (int(rng.integers(142, 187)) << 7)
    return np.ascontiguousarray(w)


def _check(w: np.ndarray) -> None:
    ref = reference.encode(w)
    want = (ref.bitmaps, ref.base, ref.offsets, ref.sm, ref.fb)
    try:
        for isa in ISAS:
            _C.set_isa(isa)
            for threads in (1, 2, 3):
                got = _C.encode(w, threads)
                for name, a, b in zip(NAMES, got, want):
                    assert a.dtype == b.dtype and a.shape == b.shape, f"{isa} t={threads} {name}: {a.dtype}{a.shape}"
                    assert np.array_equal(a, b), f"{isa} threads={threads}: {name} differs from the reference"
                out = np.empty(w.shape, np.uint16)
                _C.decode(*got, out, threads)
                assert np.array_equal(out, w), f"{isa} threads={threads}: decode(encode(w)) != w"
    finally:
        _C.set_isa("auto")


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(matrices())
def test_native_matches_reference_and_round_trips(w):
    _check(w)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(EDGE_SHAPES), st.integers(0, 2**32 - 1),
       st.sampled_from([1e-4, 1e-2, 0.02, 0.5, 100.0]))
def test_edge_shapes_with_normal_weights(shape, seed, sigma):
    w = _bf16(np.random.default_rng(seed).normal(0.0, sigma, size=shape))
    _check(w)
