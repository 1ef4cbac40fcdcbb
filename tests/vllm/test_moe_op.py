"""zipserv::moe_experts' C++ CPU kernel (zipserv_vllm._cpu_op): which calls it serves, and that they
equal the Python implementation's bit for bit.

The op's Python implementation (vllm_plugin/moe.py) finds the layer by name and runs its method;
once it has served a layer through the one-call kernel (``cpu_kernels.moe_layer``) and the name is
unambiguous, it registers the layer with the C++ kernel, which then serves the calls itself until
something that decides the path changes. Here a stand-in method (``compute`` through the real
one-call kernel, ``one_call`` handing the real holder) counts the calls that reach Python; the real
method is covered by a compiled engine (test_compile.py)."""

from __future__ import annotations

import gc

import pytest
import torch

from zipserv_vllm.kernels import cpu as cpu_kernels
from zipserv_vllm.kernels import ops

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.available() and cpu_kernels.bf16_supported()),
    reason="the one-call MoE kernel (and so the op's C++ path) needs AVX512-BF16; this CPU has none")

H, I, E, K = 128, 64, 4, 2  # hidden, expert intermediate, experts, top-k


class Layer(torch.nn.Module):
    def __init__(self, on_input=False):
        super().__init__()
        self.apply_router_weight_on_input = on_input


class Method:
    """What the op uses of a ZipServMoEMethod, over the real one-call kernel."""

    zs_prefix = "test_moe_op.layers.0.mlp.experts"

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.parts13 = [cpu_kernels.pack((torch.randn(2 * I, H, generator=g) * 0.05).bfloat16()) for _ in range(E)]
        self.parts2 = [cpu_kernels.pack((torch.randn(H, I, generator=g) * 0.05).bfloat16()) for _ in range(E)]
        self.held = self._held()
        self.calls = 0

    def _held(self):
        from zipserv_vllm.vllm_plugin import loading

        native = cpu_kernels.moe_layer(cpu_kernels.expert_table(self.parts13, (2 * I, H)),
                                       cpu_kernels.expert_table(self.parts2, (H, I)), I, H)
        return cpu_kernels._Held((loading.parts_epoch(), H, None, self.parts13 + self.parts2), native)

    def compute(self, layer, x, topk_weights, topk_ids):
        self.calls += 1
        from zipserv_vllm.vllm_plugin import loading

        if self.held.key[0] != loading.parts_epoch():  # (as the real method rebuilds its holder)
            self.held = self._held()
        return cpu_kernels.moe_run(self.held.obj, x, topk_ids, topk_weights,
                                   on_input=bool(layer.apply_router_weight_on_input))

    def one_call(self, layer, x):
        from zipserv_vllm.vllm_plugin import loading

        ok = x.dim() == 2 and self.held.key[0] == loading.parts_epoch() and cpu_kernels._isa_override is None
        return self.held if ok else None


def _inputs(t: int, seed: int = 1, ids_dtype=torch.int32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K)
    ids = ids.to(ids_dtype)
    return x, torch.rand(t, K, generator=g), ids


@pytest.fixture
def registered():
    """A registered stand-in layer (its name unique in this process) and the C++ op installed."""
    from zipserv_vllm.vllm_plugin import moe

    cpu_kernels.install_op(ops._packed_gemm_python)
    if cpu_kernels._op is None:
        pytest.fail(f"the C++ op kernel is not installed: {cpu_kernels.op_status()}")
    layer, method = Layer(), Method(0)
    moe._register(layer, method)
    name = moe._op_name(Method.zs_prefix)
    yield layer, method, name
    del layer
    gc.collect()


def _op(x, w, ids, name):
    return torch.ops.zipserv.moe_experts(x, w, ids, name)


def test_served_in_cpp_after_the_first_call_bit_identical(registered):
    layer, method, name = registered
    x, w, ids = _inputs(5)
    want = cpu_kernels.moe_run(method.held.obj, x, ids, w)
    assert torch.equal(_op(x, w, ids, name), want) and method.calls == 1  # Python, registers the layer
    if method.calls == 1 and name not in cpu_kernels._op.remembered_moe():  # the first call installs it
        assert torch.equal(_op(x, w, ids, name), want) and method.calls == 2
    assert name in cpu_kernels._op.remembered_moe()
    before = method.calls
    for t, seed, dt in ((5, 1, torch.int32), (1, 2, torch.int64), (17, 3, torch.int32), (0, 4, torch.int32)):
        x, w, ids = _inputs(t, seed, dt)
        y = _op(x, w, ids, name)
        assert y.shape == (t, H) and y.dtype == torch.bfloat16
        assert torch.equal(y, cpu_kernels.moe_run(method.held.obj, x, ids, w))
    x, w, ids = _inputs(6, 5)  # a non-contiguous x: copied, the same result
    xt = torch.cat([x, x], 1)[:, ::2]
    assert not xt.is_contiguous()
    assert torch.equal(_op(xt, w, ids, name), cpu_kernels.moe_run(method.held.obj, xt.contiguous(), ids, w))
    assert method.calls == before  # none of these reached Python


def test_router_weight_on_input(registered):
    from zipserv_vllm.vllm_plugin import moe

    _, method, _ = registered
    layer, m2 = Layer(on_input=True), Method(1)
    m2.zs_prefix = "test_moe_op.on_input.mlp.experts"
    moe._register(layer, m2)
    name = moe._op_name(m2.zs_prefix)
    x, w, ids = _inputs(3)
    want = cpu_kernels.moe_run(m2.held.obj, x, ids, w, on_input=True)
    for _ in range(3):
        assert torch.equal(_op(x, w, ids, name), want)
    assert name in cpu_kernels._op.remembered_moe() and m2.calls <= 2


def _served(name, layer_method, x, w, ids):
    before = layer_method.calls
    _op(x, w, ids, name)
    return layer_method.calls == before


def test_what_goes_to_python(registered):
    """Calls the C++ kernel does not serve reach the Python implementation, which computes or raises
    exactly as without it; what changes the layer's path stops the C++ kernel serving it."""
    from zipserv_vllm.vllm_plugin import loading, moe

    layer, method, name = registered
    x, w, ids = _inputs(4)
    _op(x, w, ids, name), _op(x, w, ids, name)
    assert _served(name, method, x, w, ids)
    # arguments off the hot case: Python (same numbers, or its error)
    assert not _served(name, method, x, w.double(), ids)
    assert torch.equal(_op(x, w.half(), ids, name), cpu_kernels.moe_run(method.held.obj, x, ids, w.half()))
    bad = ids.clone()
    bad[1, 0] = E
    with pytest.raises(ValueError, match="outside"):
        _op(x, w, bad, name)
    with pytest.raises(ValueError, match="columns"):
        _op(torch.zeros(2, H + 64, dtype=torch.bfloat16), w[:2], ids[:2], name)
    assert _served(name, method, x, w, ids)
    # an ISA override: every call in Python until it is lifted
    cpu_kernels.set_isa(cpu_kernels.isas()[-1])
    try:
        assert not _served(name, method, x, w, ids) and not _served(name, method, x, w, ids)
    finally:
        cpu_kernels.set_isa(None)
    _op(x, w, ids, name)
    assert _served(name, method, x, w, ids)
    cpu_kernels.set_threads(1)  # a thread override likewise
    try:
        assert not _served(name, method, x, w, ids)
    finally:
        cpu_kernels.set_threads(None)
    _op(x, w, ids, name)
    assert _served(name, method, x, w, ids)
    # a registration computed before a forget is dropped (the generation moved)
    stale = cpu_kernels.moe_op_generation()
    cpu_kernels.moe_op_forget(name)
    cpu_kernels.moe_op_served(name, moe._moe_experts_python, method.held, False, stale)
    assert name not in cpu_kernels._op.remembered_moe() and cpu_kernels._op is not None
    _op(x, w, ids, name)
    assert _served(name, method, x, w, ids)
    # any layer's parts assigned (a weight update re-encodes experts): Python again, then C++
    st = loading.LayerState.__new__(loading.LayerState)
    st.parts = []
    assert name not in cpu_kernels._op.remembered_moe()
    assert not _served(name, method, x, w, ids)
    assert _served(name, method, x, w, ids)
    # a second live layer of the same name: ambiguous outside a forward pass, never served in C++
    other, m3 = Layer(), Method(2)
    moe._register(other, m3)
    assert name not in cpu_kernels._op.remembered_moe()
    with pytest.raises(RuntimeError, match="2 models in this process"):
        _op(x, w, ids, name)
    del other
    gc.collect()
    assert name not in cpu_kernels._op.remembered_moe()
    assert not _served(name, method, x, w, ids) and _served(name, method, x, w, ids)


def test_freed_layer_is_forgotten(registered):
    from zipserv_vllm.vllm_plugin import moe

    _, _, _ = registered
    layer, m = Layer(), Method(3)
    m.zs_prefix = "test_moe_op.freed.mlp.experts"
    moe._register(layer, m)
    name = moe._op_name(m.zs_prefix)
    x, w, ids = _inputs(2)
    _op(x, w, ids, name), _op(x, w, ids, name)
    assert name in cpu_kernels._op.remembered_moe()
    del layer
    gc.collect()
    assert name not in cpu_kernels._op.remembered_moe()
    with pytest.raises(RuntimeError, match="no compressed MoE layer named"):
        _op(x, w, ids, name)
