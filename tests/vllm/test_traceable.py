"""The plugin's ops trace under torch.compile(fullgraph=True) and match eager bit for bit.

``zipserv::gemm`` (exact and fast), ``zipserv::decompress`` and
``zipserv::embedding`` are torch.library custom ops with fake implementations
(issue 3 section 5), so dynamo traces them without graph breaks even though the
embedding's tile selection is data dependent. ``fullgraph=True`` makes any graph
break an error. No vLLM needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import zipserv_vllm
from zipserv_vllm.kernels import cpu as cpu_kernels
from zipserv_vllm.codec import compress_tensor, decompress_tensor
from zipserv_vllm.kernels.embedding import compressed_embedding


def _bits(t):
    return t.contiguous().view(torch.int16)


@pytest.fixture(scope="module")
def weight():
    g = torch.Generator().manual_seed(3)
    w = (torch.randn(200, 320, generator=g) * 0.05).to(torch.bfloat16)  # 200 rows: last tile row partial
    return w, compress_tensor(w)


def _compile(fn, backend):
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)


def test_embedding_op_equals_gather(weight):
    w, ct = weight
    rows = 256  # vocabulary padding: ids 200..255 read zeros
    padded = torch.cat([w, torch.zeros(rows - 200, 320, dtype=torch.bfloat16)])
    ids = torch.tensor([[0, 5, 199, 64], [130, 200, 255, 5]])
    out = compressed_embedding(ids, ct, rows)
    assert out.shape == (2, 4, 320)
    assert torch.equal(_bits(out), _bits(F.embedding(ids, padded)))
    assert torch.equal(_bits(compressed_embedding(torch.tensor([210, 250]), ct, rows)), _bits(torch.zeros(2, 320, dtype=torch.bfloat16)))
    with pytest.raises(TypeError, match="int32 or int64"):
        compressed_embedding(ids.float(), ct, rows)


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compiled_ops_match_eager(weight, backend):
    w, ct = weight
    bias = (torch.randn(200) * 0.1).to(torch.bfloat16)
    ids = torch.tensor([3, 77, 199, 150, 3, 10])

    def step(ids, x):
        e = compressed_embedding(ids, ct, 256)
        h = zipserv_vllm.linear(x, ct, bias, mode="exact")
        f = zipserv_vllm.linear(x, ct, bias, mode="fast")
        d = torch.ops.zipserv.decompress(ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, 200, 320)
        return e, h, f, d

    x = (torch.randn(6, 320) * 0.5).to(torch.bfloat16)
    got = _compile(step, backend)(ids, x)  # inductor needs the C++ toolchain the extensions are built with
    want = step(ids, x)
    for g, e in zip(got, want):
        assert g.dtype == e.dtype and g.shape == e.shape
        assert torch.equal(_bits(g), _bits(e))
    # and the references themselves: exact == F.linear on the decoded weight, lookup == gather
    assert torch.equal(_bits(want[1]), _bits(F.linear(x, w, bias)))
    assert torch.equal(_bits(want[3]), _bits(w))
    assert torch.equal(_bits(want[0]), _bits(F.embedding(ids, w)))


def test_fast_mode_traced_uses_fused_kernel(weight):
    """Traced fast-mode linear runs the same fused kernel as eager (bitwise), not decode + F.linear."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    w, ct = weight
    x = (torch.randn(3, 320) * 0.5).to(torch.bfloat16)
    f = _compile(lambda x: zipserv_vllm.linear(x, ct, None, mode="fast"), "eager")
    got = f(x)
    fused = cpu_kernels.fused_gemm(x, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, 200, 320)
    assert torch.equal(_bits(got), _bits(fused))
    torch.testing.assert_close(got.float(), F.linear(x, decompress_tensor(ct)).float(), rtol=2e-2, atol=2e-2)


def test_no_graph_breaks(weight):
    w, ct = weight
    torch._dynamo.reset()

    def fn(ids, x):
        return compressed_embedding(ids, ct, 256).sum() + zipserv_vllm.linear(x, ct, None, mode="fast").sum() \
            + zipserv_vllm.linear(x, ct, None, mode="exact").sum()

    ex = torch._dynamo.explain(fn)(torch.tensor([1, 2, 190]), torch.randn(2, 320).to(torch.bfloat16))
    assert ex.graph_break_count == 0 and ex.graph_count == 1, ex.break_reasons
