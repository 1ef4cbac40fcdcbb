"""CUDA kernels on a real GPU (skipped elsewhere, see conftest.py).

* decompress kernel: bit-exact vs the CPU codec (raw int16 patterns);
* GPU encoder: byte-identical to the reference / native encoder;
* fused ZipGEMM vs torch.matmul (fp32) on the decompressed weight, over
  Llama-3-8B/70B and Qwen2.5 layer shapes and N in shapes.NS, with and
  without split-K, with bias, through dispatch and under CUDA-graph capture.

The GEMM tolerance is bf16 output rounding (2^-8 relative) plus 1e-4 of
sum_k |x||w|; a single wrong weight element at the usual 0.02 scale moves an
output by ~0.02 |x_k|, and any wrong mapping moves thousands of them.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zipserv_vllm
from zipserv_vllm.kernels import cuda as cuda_ops, dispatch
from zipserv_vllm.format import reference

from .shapes import LLAMA3_8B, NS, all_shapes

DEV = "cuda"


def _gauss(m, k, seed=0, device=DEV):
    g = torch.Generator(device=device).manual_seed(seed)
    return (torch.randn(m, k, generator=g, device=device) * 0.02).to(torch.bfloat16)


_CT = {}


def _weight(m, k):
    """(decompressed W, CompressedTensor), both on the GPU.

    Encoded by the GPU encoder (compared with the CPU encoders below); the GEMM
    reference is the *decompressed* weight (the decompress kernel is checked
    bit-exact against the CPU codec below), and the round trip must be exact."""
    if (m, k) not in _CT:
        w = _gauss(m, k, seed=m * 7 + k)
        ct = cuda_ops.compress_tensor_cuda(w)
        wd = cuda_ops.decompress_cuda(ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, m, k)
        assert torch.equal(wd.view(torch.int16), w.view(torch.int16)), f"GPU round trip of {m}x{k} is not exact"
        _CT[(m, k)] = (wd, ct)
    return _CT[(m, k)]


def _assert_gemm_close(y, x, w, bias=None):
    ref = x.float() @ w.float().T
    scale = x.float().abs() @ w.float().abs().T
    if bias is not None:
        ref += bias.float()
        scale += bias.float().abs()
    err = (y.float() - ref).abs()
    tol = 2.0**-8 * ref.abs() + 1e-4 * scale + 1e-6
    bad = err > tol
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} outputs off; worst {float((err - tol).max()):.3g}"


# ------------------------------------------------------------ decompress
@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (100, 130), (129, 257), (4096, 4096), (6144, 4096), (4096, 14336)])
def test_decompress_bit_exact(shape):
    m, k = shape
    w = _gauss(m, k, seed=3).cpu()
    ct = zipserv_vllm.compress_tensor(w)
    out = cuda_ops.decompress_cuda(*[t.to(DEV) for t in (ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb)], m, k)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu().view(torch.int16), w.view(torch.int16))


def test_decompress_all_patterns_and_non_finite():
    allp = torch.from_numpy(np.random.default_rng(0).permutation(65536).astype(np.uint16).view(np.int16))
    w = allp.view(torch.bfloat16).reshape(256, 256)
    ct = zipserv_vllm.compress_tensor(w).to(DEV)
    assert torch.equal(zipserv_vllm.kernels.ops.decompress(ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, 256, 256)
                       .cpu().view(torch.int16), w.view(torch.int16))


# --------------------------------------------------------------- encoder
@pytest.mark.parametrize("shape", [(1, 1), (64, 64), (65, 63), (100, 130), (256, 256)])
def test_gpu_encoder_equals_reference(shape):
    m, k = shape
    rng = np.random.default_rng(m * k)
    bits = rng.integers(0, 65536, size=shape, dtype=np.uint32).astype(np.uint16)
    if m * k > 1:
        bits[: m // 2] = ((rng.standard_normal((m // 2, k)) * 0.02).astype(np.float32).view(np.uint32) >> 16)
    e = reference.encode(bits)
    ct = cuda_ops.compress_tensor_cuda(torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).to(DEV))
    assert np.array_equal(ct.bitmaps.cpu().numpy().view(np.uint64), e.bitmaps)
    assert np.array_equal(ct.base.cpu().numpy(), e.base)
    assert np.array_equal(ct.offsets.cpu().numpy(), e.offsets)
    assert np.array_equal(ct.sm.cpu().numpy(), e.sm)
    assert np.array_equal(ct.fb.cpu().numpy().view(np.uint16), e.fb)


@pytest.mark.parametrize("name,m,k", [s for s in all_shapes() if s[0].startswith("llama3-8b")])
def test_gpu_encoder_equals_native_on_layer_shapes(name, m, k):
    w, ct = _weight(m, k)
    assert ct.same_encoding(zipserv_vllm.compress_tensor(w.cpu())), name


def test_gpu_encoder_chunked_equals_unchunked():
    w = _gauss(1000, 700, seed=9)
    assert cuda_ops.compress_tensor_cuda(w, max_scratch_bytes=1).same_encoding(cuda_ops.compress_tensor_cuda(w))


# ----------------------------------------------------------------- gemm
def _args(ct):
    return ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, ct.shape[0], ct.shape[1]


@pytest.mark.parametrize("shape", [(64, 64), (100, 130), (129, 257), (200, 72), (65, 577), (4100, 4104)])
@pytest.mark.parametrize("n", [1, 3, 9, 17, 33, 130])
def test_zipgemm_awkward_shapes(shape, n):
    m, k = shape
    w, ct = _weight(m, k)
    bias = (torch.randn(m, device=DEV) * 0.1).to(torch.bfloat16)
    x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
    for tn in dispatch.TILE_NS:
        for split in (1, 2, 3, 100):
            _assert_gemm_close(cuda_ops.fused_gemm(x, *_args(ct), bias, tn, split), x, w, bias)


def test_unaligned_x_uses_the_scalar_path():
    m, k = 192, 256
    w, ct = _weight(m, k)
    buf = torch.randn(5 * k + 1, device=DEV).to(torch.bfloat16)
    x = buf[1:].view(5, k)  # data_ptr % 16 == 2
    assert x.data_ptr() % 16 != 0
    _assert_gemm_close(cuda_ops.fused_gemm(x, *_args(ct), None, 8, 2), x, w)


def test_exact_mode_is_bit_identical_to_bf16_path():
    m, k = LLAMA3_8B["o"]
    w, ct = _weight(m, k)
    for n in (1, 17, 300):
        x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
        assert torch.equal(zipserv_vllm.linear(x, ct, mode="exact").view(torch.int16), F.linear(x, w).view(torch.int16))


def test_batched_input_shape():
    w, ct = _weight(256, 320)
    x = torch.randn(2, 3, 320, device=DEV).to(torch.bfloat16)
    y = zipserv_vllm.linear(x, ct)
    assert y.shape == (2, 3, 256)
    _assert_gemm_close(y.reshape(6, 256), x.reshape(6, 320), w)


# ------------------------------------------------------------ cuda graph
def _capture(fn):
    """Warm ``fn`` up on a side stream, capture it in a CUDA graph; (graph, outputs of the capture)."""
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


def test_cuda_graph_capture_fused_splitk_and_decoupled():
    shapes = [LLAMA3_8B["o"], LLAMA3_8B["qkv"]]
    cts = [_weight(m, k) for m, k in shapes]
    for n in (1, 16, 100, 512):  # fused + split-K, fused, and (on most tables) decoupled at 512
        xs = [torch.randn(n, k, device=DEV).to(torch.bfloat16) for _, k in shapes]
        bias = (torch.randn(shapes[0][0], device=DEV) * 0.1).to(torch.bfloat16)
        eager = [zipserv_vllm.linear(xs[0], cts[0][1], bias), zipserv_vllm.linear(xs[1], cts[1][1])]
        g, outs = _capture(lambda: [zipserv_vllm.linear(xs[0], cts[0][1], bias), zipserv_vllm.linear(xs[1], cts[1][1])])
        g.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, eager):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        for x in xs:  # new inputs in the captured buffers: results follow
            x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        _assert_gemm_close(outs[0], xs[0], cts[0][0], bias)
        _assert_gemm_close(outs[1], xs[1], cts[1][0])


def test_captured_splitk_survives_larger_eager_calls():
    """The split-K canary: a graph captured with split-K partials, then eager calls that need far
    more scratch (the lm_head after capture, in vLLM), then the replay: still exact. With a
    module-level workspace that eager calls replaced, the replay wrote into freed memory."""
    w, ct = _weight(*LLAMA3_8B["o"])
    x = torch.randn(1, w.shape[1], device=DEV).to(torch.bfloat16)
    p = cuda_ops.plan(1, *w.shape, DEV)
    if p.path != "fused" or p.split == 1:
        pytest.skip(f"this GPU's plan for N=1, {w.shape} uses no split-K ({p})")
    want = zipserv_vllm.linear(x, ct)
    g, y = _capture(lambda: zipserv_vllm.linear(x, ct))
    big_w, big_ct = _weight(*LLAMA3_8B["lm_head"])
    for n in (1, 8, 32):  # eager calls with more partials than the captured one
        xb = torch.randn(n, big_w.shape[1], device=DEV).to(torch.bfloat16)
        _assert_gemm_close(zipserv_vllm.linear(xb, big_ct), xb, big_w)
    junk = torch.full((64 << 20,), 7.0, device=DEV)  # reuse whatever the allocator has free
    del junk
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))


def test_embedding_graph_capture_and_no_host_sync():
    m, k = LLAMA3_8B["lm_head"][0] // 8, 512
    w, ct = _weight(m, k)
    rows = m + 64  # vLLM's vocabulary padding
    ids = torch.tensor([0, 5, m - 1, m, rows - 1, 1234], device=DEV)
    padded = torch.cat([w, torch.zeros(rows - m, k, dtype=w.dtype, device=DEV)])
    from zipserv_vllm.kernels.embedding import compressed_embedding

    compressed_embedding(ids, ct, rows)  # validates the offsets once, eagerly
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = compressed_embedding(ids, ct, rows)
        g, cap = _capture(lambda: compressed_embedding(ids, ct, rows))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out.view(torch.int16), padded[ids].view(torch.int16))
    ids.copy_(torch.tensor([7, 8, 9, 0, 1, m + 3], device=DEV))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(cap.view(torch.int16), padded[ids].view(torch.int16))
    for dtype in (torch.int32, torch.int64):
        i2 = torch.randint(-3, rows + 3, (4, 33), device=DEV, dtype=dtype)
        got = compressed_embedding(i2, ct, rows)
        assert torch.equal(got.view(torch.int16), padded[i2.clamp(0, rows - 1).long()].view(torch.int16))


def test_no_host_sync_in_forward_ops():
    """Every op a forward pass calls runs under set_sync_debug_mode("error") once validated."""
    w, ct = _weight(*LLAMA3_8B["qkv"])
    bias = (torch.randn(w.shape[0], device=DEV) * 0.1).to(torch.bfloat16)
    xs = {n: torch.randn(n, w.shape[1], device=DEV).to(torch.bfloat16) for n in (1, 32, 33, 256)}
    for x in xs.values():
        zipserv_vllm.linear(x, ct, bias)  # first call: validation (a host copy) and kernel loading
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x in xs.values():
            zipserv_vllm.linear(x, ct, bias)
            zipserv_vllm.linear(x, ct, bias, mode="exact")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bad_offsets_raise_before_any_kernel_reads_them():
    w, ct = _weight(256, 320)
    bad = ct.offsets.clone()
    bad[-1, -1, 0] = 1 << 40
    x = torch.randn(4, 320, device=DEV).to(torch.bfloat16)
    with pytest.raises(ValueError, match="overrun"):
        zipserv_vllm.kernels.ops.gemm(x, ct.bitmaps, ct.base, bad, ct.sm, ct.fb, 256, 320, None, "fast")
    with pytest.raises(ValueError, match="bias is on cpu"):
        zipserv_vllm.linear(x, ct, torch.zeros(256, dtype=torch.bfloat16))
    g = torch.cuda.CUDAGraph()
    fresh = ct.offsets.clone()  # never validated: refused inside a capture
    with pytest.raises(RuntimeError, match="not validated before CUDA-graph capture"):
        with torch.cuda.graph(g):
            zipserv_vllm.kernels.ops.gemm(x, ct.bitmaps, ct.base, fresh, ct.sm, ct.fb, 256, 320, None, "fast")


# ------------------------------------------ layer shapes (the long sweep, last)
@pytest.mark.parametrize("name,m,k", all_shapes())
def test_zipgemm_layer_shapes_all_n(name, m, k):
    w, ct = _weight(m, k)
    bias = (torch.randn(m, device=DEV) * 0.1).to(torch.bfloat16)
    for n in NS:
        x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
        tn = dispatch.tile_n_for(n)
        for split in (1, 4):
            for b in (None, bias):
                y = cuda_ops.fused_gemm(x, *_args(ct), b, tn, split)
                _assert_gemm_close(y, x, w, b)
        y = zipserv_vllm.linear(x, ct, bias)  # dispatched (fused or decoupled)
        _assert_gemm_close(y, x, w, bias)


# ------------------------------------------------- grouped (mixtures of experts)
# Expert shapes: Qwen3-30B-A3B (hidden 2048, expert intermediate 768: w13 1536 x 2048, w2 2048 x 768)
# and Mixtral-8x7B's w2 (4096 x 14336); plus a ragged one.
GROUPED_SHAPES = [(1536, 2048), (2048, 768), (4096, 14336), (130, 200)]


def _experts(n_exp, m, k):
    ws, cts = [], []
    for e in range(n_exp):
        w = _gauss(m, k, seed=1000 + e * 13 + m)
        ws.append(w)
        cts.append(cuda_ops.compress_tensor_cuda(w))
    return ws, cts


def _routed(counts, k, seed=0):
    rows = torch.tensor([0, *np.cumsum(counts).tolist()], dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(int(sum(counts)), k, generator=g, device=DEV).to(torch.bfloat16)
    return x, rows


@pytest.mark.parametrize("m,k", GROUPED_SHAPES)
@pytest.mark.parametrize("counts", [[1, 0, 1, 0, 0, 0, 0, 0], [3, 0, 9, 17, 1, 0, 2, 40], [0] * 7 + [130]])
def test_grouped_fused_equals_one_launch_per_expert(m, k, counts):
    """The grouped kernel's rows of each expert equal that expert's fused launch bit for bit (same
    block body, same tile_n) and are within the GEMM tolerance of the decompressed weight."""
    n_exp = len(counts)
    ws, cts = _experts(n_exp, m, k)
    x, rows = _routed(counts, k)
    tn = 16
    y = cuda_ops.grouped_gemm(x, cts, rows, path="fused", tile_n=tn)
    starts = rows.tolist()
    for e in range(n_exp):
        a, b = starts[e], starts[e + 1]
        if b > a:
            one = cuda_ops.fused_gemm(x[a:b].contiguous(), *_args(cts[e]), None, tn, 1)
            assert torch.equal(y[a:b].view(torch.int16), one.view(torch.int16)), e
            _assert_gemm_close(y[a:b], x[a:b], ws[e])


def test_grouped_decoupled_and_auto_paths():
    ws, cts = _experts(4, 1536, 2048)
    counts = [300, 0, 700, 64]
    x, rows = _routed(counts, 2048)
    y = cuda_ops.grouped_gemm(x, cts, rows, path="decoupled")
    auto = cuda_ops.grouped_gemm(x, cts, rows)  # 1064 rows >= 128 x 4: decoupled
    starts = rows.tolist()
    for e in range(4):
        a, b = starts[e], starts[e + 1]
        if b > a:
            assert torch.equal(y[a:b], F.linear(x[a:b], ws[e])), e  # decoded weight + cuBLAS: as BF16
    assert torch.equal(auto, y)


def test_grouped_fused_under_cuda_graph_capture():
    """The fused grouped path reads nothing on the host: captured once, replayed with new routing."""
    ws, cts = _experts(8, 2048, 768)
    table = cuda_ops.expert_table(cts)
    x, rows = _routed([2, 0, 0, 1, 0, 3, 0, 2], 768)
    cuda_ops.grouped_gemm(x, cts, rows, table=table, path="fused")  # warm up
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = cuda_ops.grouped_gemm(x, cts, rows, table=table, path="fused")
    x2, rows2 = _routed([0, 8, 0, 0, 0, 0, 0, 0], 768, seed=5)
    x.copy_(x2)
    rows.copy_(rows2)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, cuda_ops.grouped_gemm(x, cts, rows, table=table, path="fused"))
    _assert_gemm_close(y, x, ws[1])


# ------------------------------------------------- the byte-split layout on the GPU
# What a GPU engine holding the byte-split layout runs (ZIPSERV_GPU_LAYOUT=bytesplit or
# prefer: speed): zipserv::packed_decompress and zipserv::packed_gemm on CUDA tensors.
def _packed(w):
    return cuda_ops.pack_cuda(w)


def test_packed_decompress_bit_exact_all_patterns_and_shapes():
    allp = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    for w in (allp.to(DEV), _gauss(1, 1), _gauss(100, 130), _gauss(129, 257), _gauss(4096, 4096)):
        pt = _packed(w)
        got = torch.ops.zipserv.packed_decompress(pt.tiles, pt.luts, pt.exc_start, pt.exc, *pt.shape)
        assert got.is_cuda and torch.equal(got.view(torch.int16), w.view(torch.int16)), tuple(w.shape)


@pytest.mark.parametrize("shape", [(100, 130), LLAMA3_8B["o"], LLAMA3_8B["qkv"]])
@pytest.mark.parametrize("n", [1, 8, 9, 16, 17, 64, 512])
def test_packed_linear_every_path(shape, n):
    m, k = shape
    w = _gauss(m, k, seed=m + n)
    pt = _packed(w)
    x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
    bias = (torch.randn(m, device=DEV) * 0.1).to(torch.bfloat16)
    _assert_gemm_close(zipserv_vllm.linear(x, pt, bias), x, w, bias)  # the dispatcher's plan
    exact = zipserv_vllm.linear(x, pt, bias, mode="exact")
    assert torch.equal(exact.view(torch.int16), F.linear(x, w, bias).view(torch.int16))
    _assert_gemm_close(cuda_ops.packed_decoupled_gemm(x, pt, bias), x, w, bias)
    if n <= 16:
        for split in (1, 3):
            _assert_gemm_close(cuda_ops.packed_gemm(x, pt, bias, dispatch.packed_tile_n(n), split), x, w, bias)


def test_packed_linear_under_cuda_graph_capture():
    m, k = LLAMA3_8B["o"]
    w = _gauss(m, k, seed=5)
    pt = _packed(w)
    for n in (1, 16, 512):
        x = torch.randn(n, k, device=DEV).to(torch.bfloat16)
        eager = zipserv_vllm.linear(x, pt)
        g, out = _capture(lambda: zipserv_vllm.linear(x, pt))
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out.view(torch.int16), eager.view(torch.int16))
        x.copy_(torch.randn_like(x.float()).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        _assert_gemm_close(out, x, w)
