"""zipserv::packed_gemm's C++ CPU kernel (zipserv_vllm._cpu_op, csrc/cpu_op/packed_gemm_op.cpp).

* after the Python implementation has served a shape once, calls of that shape run in C++ (no
  Python call), with the dispatcher's kernel per token bucket: the same bits as the Python path
  (both kernels, bias, strided x, 3-D x, every bucket up to 512 and past it);
* every call it does not serve reaches the Python implementation and gives what that gives:
  exact mode, fp32 x, a fp32 or mis-sized bias, non-contiguous arrays, zero rows, more tokens
  than ZIPSERV_CPU_FUSED_MAX_N (read from the environment on every call), set_isa / set_threads,
  and a malformed exception list (the Python path's ValueError naming the tile);
* new measured choices (set_measured) reach it; it runs under torch.compile(fullgraph) without
  Python; ZIPSERV_CPU_OP=0 and a build for another torch keep the op in Python.

Skipped, with the reason, where the extension was not built (torch not importable at build time).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from zipserv_vllm.kernels import cpu as cpu_kernels
from zipserv_vllm.kernels import cpu_dispatch, ops

from test_cpu_gemm import _bits, _weight
from test_cpu_layout import _corrupt, _mixed_weight

try:
    from zipserv_vllm import _cpu_op  # noqa: F401
except ImportError as exc:  # pragma: no cover - only without the build
    _WHY = f"zipserv_vllm._cpu_op is not built ({exc})"
else:
    _WHY = "" if cpu_kernels.available() else cpu_kernels.unavailable_reason()

pytestmark = pytest.mark.skipif(bool(_WHY), reason=_WHY or "-")
M, K = 130, 200


def _op(x, pt, bias=None, mode="fast"):
    return torch.ops.zipserv.packed_gemm(x, pt.tiles, pt.luts, pt.exc_start, pt.exc, *pt.shape, bias, mode)


def _counting(name: str):
    """(calls, a stand-in for op ``name``'s Python implementation that records them, the real one),
    with the C++ kernel installed."""
    cpu_kernels.install_op(ops._packed_gemm_python)
    assert cpu_kernels._op is not None, cpu_kernels.op_status()
    calls, real = [], ops._PYTHON_IMPLS[name]

    def python(*a):
        calls.append(a)
        return real(*a)

    return calls, python, real


@pytest.fixture
def counted(monkeypatch):
    """Installs the C++ kernel (one call through Python) and counts later Python calls."""
    calls, python, real = _counting("packed_gemm")
    cpu_kernels._op.install(python, cpu_kernels._cpu_gemm.packed_call, "ZIPSERV_CPU_FUSED_MAX_N")
    cpu_kernels._op_sync()
    yield calls
    cpu_kernels._op.install(real, cpu_kernels._cpu_gemm.packed_call, "ZIPSERV_CPU_FUSED_MAX_N")
    cpu_kernels._op_sync()


def _python_result(x, pt, bias=None, mode="fast"):
    """The op's Python implementation, called directly."""
    return ops._PYTHON_IMPLS["packed_gemm"](x, pt.tiles, pt.luts, pt.exc_start, pt.exc, *pt.shape, bias, mode)


def _outcome(fn, args):
    try:
        y = fn(*args)
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)
    return y.dtype, tuple(y.shape), y.contiguous().view(torch.int16 if y.element_size() == 2 else torch.int32)


def _same(args) -> None:
    """The op (through the C++ kernel) and its Python implementation give the same result, bit for
    bit, or raise the same error."""
    a, b = _outcome(_op, args), _outcome(_python_result, args)
    assert a[:2] == b[:2], (a[:2], b[:2])
    if not isinstance(a[0], type):
        assert torch.equal(a[2], b[2])


def test_hot_calls_run_in_cpp_with_the_python_paths_bits(counted, monkeypatch):
    pt = cpu_kernels.pack(_mixed_weight(M, K))
    xs = _weight(600, 2 * K, seed=5, scale=1.0)[:, ::2]  # strided
    bias = _weight(1, M, seed=7).view(-1)
    kernels = tuple(cpu_dispatch.candidates(1, M, K))
    # the measured choice per bucket: alternate the kernels so that both run
    times = {(M, K): {b: {kern: (1.0 if (i + j) % 2 else 2.0) for j, kern in enumerate(kernels)}
                      for i, b in enumerate(cpu_dispatch.BUCKETS)}}
    cpu_dispatch.set_measured(times)
    try:
        _op(xs[:1].contiguous(), pt)  # the first call of the shape: Python, which hands over the choices
        assert len(counted) == 1 and cpu_kernels._op.remembered() >= 1
        for n in (1, 2, 3, 7, 8, 9, 19, 100, 512, 600):
            for b in (None, bias):
                got = _op(xs[:n], pt, b)
                assert torch.equal(_bits(got), _bits(_python_result(xs[:n], pt, b))), (n, b is None)
                if n <= cpu_kernels.fused_max_n():  # (the kernel the dispatcher chose, not decode + F.linear)
                    want = cpu_kernels.packed_linear(xs[:n].contiguous(), pt, b, kernel=cpu_dispatch.choose(n, M, K))
                    assert torch.equal(_bits(got), _bits(want)), (n, b is None)
        x3 = xs[:6].reshape(2, 3, K)
        assert torch.equal(_bits(_op(x3, pt, bias)), _bits(_python_result(x3, pt, bias)))
        beyond = sum(2 for n in (512, 600) if n > cpu_kernels.fused_max_n())  # (decode + F.linear, in Python)
        assert len(counted) == 1 + beyond  # all the others in C++
        # new measurements reach it: every bucket the other kernel now
        flipped = {(M, K): {b: {kern: 3.0 - t for kern, t in d.items()} for b, d in times[(M, K)].items()}}
        cpu_dispatch.set_measured(flipped)
        assert cpu_kernels._op.remembered() == 0
        _op(xs[:8], pt)
        for n in (1, 8, 100):
            want = cpu_kernels.packed_linear(xs[:n].contiguous(), pt, None, kernel=cpu_dispatch.choose(n, M, K))
            assert torch.equal(_bits(_op(xs[:n], pt)), _bits(want))
            assert torch.equal(_bits(_op(xs[:n], pt)), _bits(_python_result(xs[:n], pt)))
        assert len(counted) == 2 + beyond
    finally:
        cpu_dispatch.clear_measured()


def test_every_other_call_is_the_python_paths(counted, monkeypatch):
    w = _mixed_weight(M, K)
    pt = cpu_kernels.pack(w)
    x = _weight(5, K, seed=3, scale=1.0)
    _op(x, pt)
    served = len(counted)
    bias = _weight(1, M, seed=7).view(-1)
    cases = [
        (x, pt, None, "exact"),
        (x.float(), pt, None, "fast"),
        (x, pt, bias.float(), "fast"),
        (x[:0], pt, None, "fast"),
    ]
    strided = type(pt)(pt.shape, pt.tiles, pt.luts, pt.exc_start, torch.stack([pt.exc, pt.exc], 1)[:, 0])
    cases.append((x, strided, None, "fast"))
    cases.append((x, pt, bias[:-1], "fast"))  # a mis-sized bias: the Python path's refusal
    for args in cases:
        _same(args)
        assert len(counted) == served + 1, args[3]
        served += 1
    # more tokens than the threshold, read on every call
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", "4")
    _same((x, pt, None, "fast"))  # decode + F.linear
    assert len(counted) == served + 1
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", "8")
    _op(x, pt)  # (Python again: the raw value changed, and it hands over the new one)
    _op(x, pt)
    assert len(counted) == served + 2
    monkeypatch.delenv("ZIPSERV_CPU_FUSED_MAX_N")
    _op(x, pt)
    _op(x, pt)
    assert len(counted) == served + 3
    served += 3
    # overrides: everything through Python while one is set
    cpu_kernels.set_isa(cpu_kernels.isas()[-1])
    try:
        _same((x, pt, None, "fast"))
        assert len(counted) == served + 1
    finally:
        cpu_kernels.set_isa(None)
    cpu_kernels.set_threads(1)
    try:
        _op(x, pt)
        assert len(counted) == served + 2
    finally:
        cpu_kernels.set_threads(None)
    _op(x, pt)  # (hands the shape over again)
    _op(x, pt)
    assert len(counted) == served + 3


@pytest.mark.parametrize("kind", ["start_past_end", "d_out_of_tile", "not_ascending"])
def test_a_malformed_weight_raises_the_python_paths_error(counted, kind):
    pt = cpu_kernels.pack(_mixed_weight(M, K))
    x = _weight(3, K, seed=3, scale=1.0)
    _op(x, pt)  # the shape is served in C++ from here on
    bad = _corrupt(pt, kind)
    with pytest.raises(ValueError) as cpp:
        _op(x, bad)
    with pytest.raises(ValueError) as py:
        _python_result(x, bad)
    assert str(cpp.value) == str(py.value)


def test_compiled_graphs_call_it_without_python(counted):
    import zipserv_vllm

    pt = cpu_kernels.pack(_mixed_weight(M, K))
    bias = _weight(1, M, seed=7).view(-1)
    x = _weight(8, K, seed=3, scale=1.0)
    want = _python_result(x, pt, bias)
    fn = torch.compile(lambda a: zipserv_vllm.linear(a, pt, bias), fullgraph=True)
    fn(x)
    before = len(counted)
    for _ in range(3):
        assert torch.equal(_bits(fn(x)), _bits(want))
    assert len(counted) == before
    torch._dynamo.reset()


def _child(code: str, env: dict) -> str:
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


_STATUS = """
import torch
from zipserv_vllm.kernels import cpu, ops
{patch}
pt = cpu.pack((torch.randn(64, 64) * 0.02).bfloat16())
x = torch.randn(2, 64).bfloat16()
torch.ops.zipserv.packed_gemm(x, pt.tiles, pt.luts, pt.exc_start, pt.exc, 64, 64, None, "fast")
print(cpu.op_status())
"""


def test_installed_unless_disabled_or_built_for_another_torch():
    assert _child(_STATUS.format(patch=""), {}) == "C++ CPU kernel installed"
    assert _child(_STATUS.format(patch=""), {"ZIPSERV_CPU_OP": "0"}) == "Python only: ZIPSERV_CPU_OP=0"
    other = "import zipserv_vllm._cpu_op as m; m.torch_version = '0.0.1'"
    got = _child(_STATUS.format(patch=other), {})
    assert got.startswith("Python only: zipserv_vllm._cpu_op was built for torch 0.0.1"), got


def test_no_hand_over_where_a_bucket_has_two_choices(counted, monkeypatch):
    """A measurement at an N that is no bucket (set_measured takes any) gives token counts of one
    bucket different kernels: the shape then stays in Python, which follows it exactly."""
    pt = cpu_kernels.pack(_mixed_weight(M, K))
    x = _weight(8, K, seed=3, scale=1.0)
    kernels = tuple(cpu_dispatch.candidates(1, M, K))
    cpu_dispatch.set_measured({(M, K): {3: {kernels[0]: 1.0, kernels[-1]: 2.0},
                                        512: {kernels[0]: 2.0, kernels[-1]: 1.0}}})
    try:
        assert cpu_dispatch.bucket_choices(M, K) is None or len(kernels) == 1
        for n in (3, 4):
            _same((x[:n], pt, None, "fast"))
        assert cpu_kernels._op.remembered() == (1 if len(kernels) == 1 else 0)
    finally:
        cpu_dispatch.clear_measured()


def test_a_threshold_past_int64_is_clamped_not_an_error(counted, monkeypatch):
    pt = cpu_kernels.pack(_mixed_weight(M, K))
    x = _weight(3, K, seed=3, scale=1.0)
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", str(10 ** 19))
    _same((x, pt, None, "fast"))
    before = len(counted)
    _same((x, pt, None, "fast"))
    assert len(counted) == before and cpu_kernels.op_status() == "C++ CPU kernel installed"


# ------------------------------------------------------------- zipserv::packed_embedding
def _emb(ids, pt, rows):
    return torch.ops.zipserv.packed_embedding(ids, pt.tiles, pt.luts, pt.exc_start, pt.exc, *pt.shape, rows)


def _emb_python(ids, pt, rows):
    return ops._PYTHON_IMPLS["packed_embedding"](ids, pt.tiles, pt.luts, pt.exc_start, pt.exc, *pt.shape, rows)


@pytest.fixture
def counted_embedding():
    """The embedding's C++ kernel installed, with a Python implementation that counts its calls."""
    from zipserv_vllm.kernels import embedding  # noqa: F401  (defines the op)

    calls, python, real = _counting("packed_embedding")
    cpu_kernels._op.install_embedding(python, cpu_kernels._cpu_gemm.embedding_call)
    cpu_kernels._op_extras.add("embedding")
    yield calls
    cpu_kernels._op.install_embedding(real, cpu_kernels._cpu_gemm.embedding_call)


def test_embedding_lookups_run_in_cpp_bit_exact(counted_embedding):
    """Every lookup of a well-formed table runs in C++ (no Python call) and gives the rows of the
    decoded table bit for bit: ids of any shape, int32 or int64, clamped to [0, rows), rows past the
    table zeros (vLLM's vocabulary padding), repeated ids, no ids."""
    from zipserv_vllm.format.cpu_layout import reference_unpack

    w = _mixed_weight(200, 136)
    pt = cpu_kernels.pack(w)
    rows = 256
    table = torch.cat([reference_unpack(pt), torch.zeros(rows - 200, 136, dtype=torch.bfloat16)])
    g = torch.Generator().manual_seed(0)
    cases = [torch.tensor([5]), torch.tensor([0, 199, 64, 64, 5]), torch.randint(-5, 300, (3, 7), generator=g),
             torch.randint(0, 256, (40,), generator=g).to(torch.int32), torch.zeros(0, dtype=torch.int64),
             torch.arange(0, 256).reshape(2, 2, 64)[:, :, ::3]]  # (the last one strided)
    for ids in cases:
        got = _emb(ids, pt, rows)
        want = table[ids.clamp(0, rows - 1).long()]
        assert got.shape == (*ids.shape, 136) and torch.equal(_bits(got), _bits(want)), ids.shape
    assert counted_embedding == []


def test_embedding_calls_it_does_not_serve_are_the_python_paths(counted_embedding):
    pt = cpu_kernels.pack(_mixed_weight(200, 136))
    ids = torch.tensor([3, 150])
    with pytest.raises(TypeError, match="int32 or int64"):
        _emb(ids.float(), pt, 200)
    with pytest.raises(ValueError, match="at least the table"):
        _emb(ids, pt, 100)
    assert len(counted_embedding) == 2
    # a malformed table: the C++ kernel refuses, the Python path raises its error
    bad = _corrupt(pt, "d_out_of_tile")
    with pytest.raises(ValueError) as cpp:
        _emb(torch.tensor([0]), bad, 200)
    with pytest.raises(ValueError) as py:
        _emb_python(torch.tensor([0]), bad, 200)
    assert str(cpp.value) == str(py.value) and len(counted_embedding) == 3
    # set_isa: Python until lifted
    cpu_kernels.set_isa(cpu_kernels.isas()[-1])
    try:
        assert torch.equal(_emb(ids, pt, 200), _emb_python(ids, pt, 200)) and len(counted_embedding) == 4
    finally:
        cpu_kernels.set_isa(None)
    _emb(ids, pt, 200)
    assert len(counted_embedding) == 4
