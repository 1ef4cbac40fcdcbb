"""The first-contact self-check (zipserv_vllm/kernels/selfcheck.py) run against the kernels' own code.

On a GPU, ``selfcheck.first_contact`` runs each CUDA kernel instance once on a
small layer before an engine serves from it. Here the same checks run with the
SIMT harness's build of those kernels standing in for ``kernels.cuda`` (same
launch sequence, raw pointers): they must pass on the real kernels, and name
exactly the instance that reads one wrong byte when a fault is planted in
its input. ``engine_mode`` (the plugin's decision) is checked with these
results too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import zipserv_vllm
from zipserv_vllm.kernels import dispatch, selfcheck

from . import harness, kernels

simt = harness.module()
pytestmark = pytest.mark.skipif(simt is None, reason=harness.MISSING)

M, K = 72, 130  # ragged against the 64 x 64 tiles on both sides; small: the harness runs every thread


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.int16).numpy().view(np.uint16)


def _bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.int16)).view(torch.bfloat16)


class SimtOps:
    """``kernels.cuda``'s functions over the SIMT build; ``fault`` names one instance whose weight
    has one sign/mantissa byte flipped before the kernel reads it."""

    def __init__(self, fault: str | None = None):
        self.fault = fault
        self.calls: list[str] = []

    def _weight(self, name, bitmaps, base, offsets, sm, fb, m, k):
        self.calls.append(name)
        sm = sm.numpy().copy()
        if name == self.fault:
            sm[0] ^= 0x01  # the first weight of the first tile: one mantissa bit
        return kernels.weight_arrays(type("E", (), dict(m=m, k=k, bitmaps=bitmaps.numpy(), base=base.numpy(),
                                                        offsets=offsets.numpy(), sm=sm, fb=fb.numpy())))

    def compress_tensor_cuda(self, w):
        return zipserv_vllm.compress_tensor(w)

    def decompress_cuda(self, bitmaps, base, offsets, sm, fb, m, k):
        return _bf16(kernels.decompress(simt, self._weight("decompress", bitmaps, base, offsets, sm, fb, m, k)))

    def fused_gemm(self, x, bitmaps, base, offsets, sm, fb, m, k, bias, tile_n, split):
        e = self._weight(f"fused tile_n={tile_n} split={split}", bitmaps, base, offsets, sm, fb, m, k)
        return _bf16(kernels.zipgemm(simt, e, _bits(x), None, tile_n, split))

    def decoupled_gemm(self, x, bitmaps, base, offsets, sm, fb, m, k, bias):
        w = _bf16(kernels.decompress(simt, self._weight("decoupled", bitmaps, base, offsets, sm, fb, m, k)))
        return F.linear(x, w)

    PACKED_TILE_NS = (8, 16)

    def _packed(self, name, pt):
        self.calls.append(name)
        luts = np.ascontiguousarray(pt.luts.numpy()).copy()  # a fault must not touch the shared table
        if name == self.fault:
            luts.reshape(-1)[5] ^= 0x01  # one table entry of the first tile: one exponent bit
        return type("P", (), dict(m=pt.shape[0], k=pt.shape[1], tiles=np.ascontiguousarray(pt.tiles.numpy()),
                                  luts=luts, exc_start=np.ascontiguousarray(pt.exc_start.numpy()),
                                  exc=np.ascontiguousarray(pt.exc.numpy())))

    def packed_gemm(self, x, pt, bias, tile_n, split):
        pk = self._packed(f"packed tile_n={tile_n} split={split}", pt)
        return _bf16(kernels.zipgemm_packed(simt, pk, _bits(x), None, tile_n, split))

    def packed_decompress_cuda(self, tiles, luts, exc_start, exc, m, k):
        pt = type("T", (), dict(shape=(m, k), tiles=tiles, luts=luts, exc_start=exc_start, exc=exc))
        return _bf16(kernels.decompress_packed(simt, self._packed("packed decompress", pt)))

    def packed_decoupled_gemm(self, x, pt, bias):
        return F.linear(x, _bf16(kernels.decompress_packed(simt, self._packed("packed decoupled", pt))))

    def grouped_gemm(self, x, experts, expert_rows, path="auto", tile_n=None):
        name = f"grouped {path}" + (f" tile_n={tile_n}" if tile_n else "")
        starts = expert_rows.tolist()
        es = [self._weight(name, ct.bitmaps, ct.base, ct.offsets, ct.sm, ct.fb, *ct.shape) for ct in experts]
        if path == "fused":
            counts = [b - a for a, b in zip(starts, starts[1:])]
            return _bf16(kernels.zipgemm_grouped(simt, es, _bits(x), counts, tile_n))
        ws = [_bf16(kernels.decompress(simt, e)) for e in es]
        return torch.cat([F.linear(x[a:b], w) for w, a, b in zip(ws, starts, starts[1:])])


@pytest.fixture(autouse=True)
def _prepared():
    simt.configure("forward", 1)
    simt.prepare()


def test_every_instance_passes_on_the_kernels_own_code():
    ops = SimtOps()
    assert selfcheck.run(ops, "cpu", M, K, n_random=5) == []
    want = {"decompress", "decoupled", "grouped decoupled"} | {
        f"fused tile_n={tn} split={s}" for tn in dispatch.TILE_NS for s in selfcheck.SPLITS} | {
        f"grouped fused tile_n={tn}" for tn in dispatch.TILE_NS} | {
        f"packed tile_n={tn} split={s}" for tn in (8, 16) for s in selfcheck.SPLITS} | {
        "packed decompress", "packed decoupled"}
    assert set(ops.calls) == want  # every instance the dispatcher can pick was run


@pytest.mark.parametrize("fault", ["fused tile_n=32 split=3", "fused tile_n=8 split=1", "grouped fused tile_n=128",
                                   "decoupled"])
def test_one_wrong_byte_names_its_instance(fault):
    fails = selfcheck.run(SimtOps(fault), "cpu", M, K, n_random=5)
    assert [f.split(":")[0] for f in fails] == [fault]


def test_a_wrong_byte_split_kernel_is_reported_but_does_not_change_the_mode():
    fails = selfcheck.run(SimtOps("packed tile_n=16 split=3"), "cpu", M, K, n_random=5)
    assert [f.split(":")[0] for f in fails] == ["packed tile_n=16 split=3 (general X)",
                                                 "packed tile_n=16 split=3 (aligned X)"]
    mode, line, layout = selfcheck.engine_mode("fast", ["cuda:0"], lambda d: fails)
    assert (mode, layout) == ("fast", "v1") and "not used for serving" in line and "serving is unaffected" in line
    # an engine about to hold the byte-split layout keeps v1 instead (and stays in fast mode)
    mode, line, layout = selfcheck.engine_mode("fast", ["cuda:0"], lambda d: fails, layout="bytesplit")
    assert (mode, layout) == ("fast", "v1") and "stay in the TCA-TBE v1 layout" in line and "1 more" in line


@pytest.mark.parametrize("fault", ["packed decompress", "packed decoupled"])
def test_a_wrong_byte_split_decompress_names_itself(fault):
    fails = selfcheck.run(SimtOps(fault), "cpu", M, K, n_random=5)
    assert [f.split(" (")[0] for f in fails] == [fault, fault]  # general X and aligned X
    assert selfcheck.engine_mode("fast", ["cuda:0"], lambda d: fails, layout="bytesplit")[2] == "v1"


def test_a_wrong_decompress_is_reported_alone():
    fails = selfcheck.run(SimtOps("decompress"), "cpu", M, K, n_random=5)
    assert len(fails) == 1 and fails[0].startswith("decompress")


def test_checks_catch_one_wrong_value_and_tolerate_only_rounding():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(M, K, generator=g) * 0.02).to(torch.bfloat16)
    x, cols = selfcheck.one_hot(K, K)
    y = (x.float() @ w.float().T).to(torch.bfloat16)
    assert selfcheck.exact_one_hot(y, w, cols)
    off = y.clone()
    off[3, 7] = torch.nextafter(off[3, 7].float(), torch.tensor(1.0)).to(torch.bfloat16)  # one bf16 ulp
    off[3, 7] = off[3, 7] if off[3, 7] != y[3, 7] else off[3, 7] * (1 + 2.0**-7)
    assert not selfcheck.exact_one_hot(off, w, cols)
    xr = torch.randn(5, K, generator=g).to(torch.bfloat16)
    assert selfcheck.within_f64((xr.float() @ w.float().T).to(torch.bfloat16), xr, w)
    r, c = divmod(int((w.float().abs() > 0.01).flatten().nonzero()[0]), K)  # a weight of the usual size
    wrong = w.clone()
    wrong[r, c] = -wrong[r, c]
    assert not selfcheck.within_f64((xr.float() @ wrong.float().T).to(torch.bfloat16), xr, w)


def test_engine_mode():
    def fails(dev):
        return {"cuda:0": [], "cuda:1": ["fused tile_n=16 split=3: wrong outputs", "decoupled: wrong outputs"]}[dev]

    assert selfcheck.engine_mode("fast", ["cuda:0"], fails) == ("fast", None, "v1")
    assert selfcheck.engine_mode("fast", ["cuda:0"], fails, layout="bytesplit") == ("fast", None, "bytesplit")
    mode, line, layout = selfcheck.engine_mode("fast", ["cuda:0", "cuda:1"], fails, layout="bytesplit")
    assert (mode, layout) == ("exact", "v1") and "cuda:1" in line and "tile_n=16 split=3" in line and "1 more" in line
    assert selfcheck.engine_mode("exact", ["cuda:1"], lambda d: pytest.fail("exact mode runs no check")) == (
        "exact", None, "v1")
    with pytest.raises(selfcheck.DecodeError, match="decompress kernel failed"):
        selfcheck.engine_mode("fast", ["cuda:0"], lambda d: ["decompress (200 x 520): differs"])


def test_one_hot_covers_every_column():
    x, cols = selfcheck.one_hot(K, K)
    assert torch.equal(x.float(), torch.eye(K)) and torch.equal(cols, torch.arange(K))
    x, cols = selfcheck.one_hot(21, K, offset=3)
    assert x.shape == (21, K) and torch.equal(x.float().argmax(1), cols) and float(x.float().sum()) == 21
