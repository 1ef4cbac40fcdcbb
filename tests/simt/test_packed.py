"""The byte-split-layout GPU kernel (csrc/cuda/zipgemm_packed.cuh), its own source run by the SIMT harness.

The layout is docs/FORMAT.md appendix A (the CPU fast path's, packed here by its
executable spec, ``reference_pack``). Checked: every one of the 65,536 BF16
patterns through one-hot X (exact; rows holding inf/NaN give NaN), weights
whose high bytes miss the tile's table (the exceptions, patched in a loop of
their own), Gaussian weights over ragged M, N and K with bias and split-K
against a float64 product, both instances (16-byte X chunks when X is aligned
and K a multiple of 64; element by element otherwise), and three thread
schedules. tests/simt/test_faults.py plants faults in it.
"""

import numpy as np
import pytest

from . import cases, harness
from .corpus import ALL, bf16_bits, packed_case, weight

simt = harness.module()
pytestmark = pytest.mark.skipif(simt is None, reason=harness.MISSING)


@pytest.fixture(autouse=True)
def _prepared():
    simt.configure("forward", 1)
    simt.prepare()
    yield
    simt.configure("forward", 1)


def _check(case):
    msg = cases.run(simt, case)
    assert msg is None, msg


def with_exceptions(m, k, seed=0):
    """Gaussian weights with finite values no 16-entry table of their tile can hold: huge, tiny, subnormal,
    zero, -0 (inf and NaN are in the all-patterns matrix; a one-hot row with a single inf gives inf, not
    the NaN check_one_hot expects of a row with several)."""
    rng = np.random.default_rng(seed)
    w = weight(rng, m, k)
    odd = np.array([0x7149, 0xF149, 0x0080, 0x8001, 0x0000, 0x8000, 0x7F7F, 0x4C00, 0x2000, 0x0001], np.uint16)
    flat = w.reshape(-1)
    at = rng.choice(flat.size, size=3 * odd.size, replace=False)
    flat[at] = np.resize(odd, at.size)
    return w


@pytest.mark.parametrize("tile_n", [8, 16])
@pytest.mark.parametrize("split", [1, 3])
@pytest.mark.parametrize("x_offset", [0, 1])
def test_all_patterns_one_hot(tile_n, split, x_offset):
    w = ALL.reshape(256, 256)
    _check(packed_case(w, "packed_onehot", "all patterns", tile_n, split, cols=np.arange(256), x_offset=x_offset))


@pytest.mark.parametrize("shape", [(130, 452), (128, 256)])
@pytest.mark.parametrize("tile_n", [8, 16])
def test_exceptions_one_hot(shape, tile_n):
    m, k = shape
    w = with_exceptions(m, k, seed=m)
    for split in (1, 3):
        _check(packed_case(w, "packed_onehot", f"exceptions {m}x{k}", tile_n, split, cols=np.arange(k)))


@pytest.mark.parametrize("shape", [(72, 130), (130, 452), (128, 256), (200, 512)])
@pytest.mark.parametrize("n", [1, 5, 8, 13, 16, 21])
def test_gaussian_against_float64(shape, n):
    m, k = shape
    rng = np.random.default_rng([m, k, n])
    w = weight(rng, m, k)
    x = bf16_bits(rng.standard_normal((n, k)))
    b = bf16_bits(rng.standard_normal(m) * 0.1)
    for tile_n in (8, 16):
        for split, off in ((1, 0), (2, 1), (3, 0)):
            _check(packed_case(w, "packed", f"gaussian {m}x{k} N={n}", tile_n, split, x=x, bias=b, x_offset=off))


@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_other_thread_schedules(schedule):
    simt.configure(schedule, 7)
    w = with_exceptions(128, 256, seed=3)
    _check(packed_case(w, "packed_onehot", f"exceptions ({schedule})", 16, 2, cols=np.arange(256)))
    rng = np.random.default_rng(9)
    _check(packed_case(weight(rng, 72, 130), "packed", f"gaussian ({schedule})", 8, 1,
                       x=bf16_bits(rng.standard_normal((9, 130)))))


def test_bad_tile_n_is_refused():
    w = weight(np.random.default_rng(0), 64, 64)
    msg = cases.run(simt, packed_case(w, "packed_onehot", "tile_n 32", 32, 1, cols=np.arange(64)))
    assert msg is not None and "zipgemm_packed failed" in msg


# ------------------------------------------------------------------ decompress
# The byte-split layout's decompress kernel (csrc/cuda/decompress_packed.cu): the decoupled path and
# exact mode of a weight held in that layout on a GPU. Bit for bit against the weight that was packed.
def test_decompress_all_patterns():
    _check(packed_case(ALL.reshape(256, 256), "packed_decompress", "all patterns", 0, 1))
    _check(packed_case(ALL.reshape(512, 128), "packed_decompress", "all patterns 512x128", 0, 1))


@pytest.mark.parametrize("shape", [(1, 1), (3, 70), (64, 64), (130, 452), (200, 512), (65, 129)])
def test_decompress_ragged_shapes_with_exceptions(shape):
    m, k = shape
    w = with_exceptions(max(m, 8), max(k, 8), seed=m * k)[:m, :k]
    _check(packed_case(np.ascontiguousarray(w), "packed_decompress", f"exceptions {m}x{k}", 0, 1))


def test_decompress_gaussian_and_all_schedules():
    w = weight(np.random.default_rng(5), 136, 200)
    for schedule in ("forward", "reverse", "random"):
        simt.configure(schedule, 11)
        _check(packed_case(w, "packed_decompress", f"gaussian ({schedule})", 0, 1))
        _check(packed_case(with_exceptions(128, 256, seed=8), "packed_decompress", f"exceptions ({schedule})", 0, 1))


def test_decompress_unaligned_output_is_written_element_by_element():
    from .kernels import PACKED, ptr

    w = with_exceptions(64, 72, seed=2)  # K % 8 == 0: the vector store unless the output is misaligned
    case = packed_case(w, "packed_decompress", "unaligned out", 0, 1)
    buf = np.full(64 * 72 + 8, 0xFFFF, np.uint16)
    out = buf[1:1 + 64 * 72].reshape(64, 72)
    simt.decompress_packed(*(ptr(case[a]) for a in PACKED), ptr(out), 64, 72, 0)
    assert np.array_equal(out, w) and buf[0] == 0xFFFF and buf[-7:].tolist() == [0xFFFF] * 7
