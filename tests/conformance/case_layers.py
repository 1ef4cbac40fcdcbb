"""Every layer type vLLM builds with the zipserv method, driven the way vLLM drives it.

For QKV, merged gate/up, column-, row-parallel and replicated linear layers,
the vocabulary embedding, lm_head and a tied lm_head: vLLM's class is built with
``quant_config=ZipServConfig``, loaded through its own parameters'
``weight_loader`` with the call shapes vLLM's model loaders use (``(param, w)``
or ``(param, w, shard_id)``), processed as vLLM's loader does (the layer-wise
hook where the plugin uses it, then ``process_weights_after_loading``, twice),
and run. Pre-compressed (the checkpoint's ``zs_*`` arrays) and pack at load
(BF16 tensors). Checks: the compressed parts decode to the exact bits of the
weight, and the output equals the same vLLM class built unquantized (exact
mode), bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

H, D, NH, NKV, V = 256, 64, 4, 2, 1000


def _w(*shape, seed=0):
    g = torch.Generator().manual_seed(seed + 1000 * shape[0] + shape[-1])
    return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)


def _layers():
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear)

    # name -> (constructor(quant_config), [(shard_id, weight)], bias size or 0)
    return {
        "qkv": (lambda qc: QKVParallelLinear(H, D, NH, NKV, bias=True, quant_config=qc, prefix="m.qkv_proj"),
                [("q", _w(NH * D, H)), ("k", _w(NKV * D, H, seed=1)), ("v", _w(NKV * D, H, seed=2))],
                (NH + 2 * NKV) * D),
        "gate_up": (lambda qc: MergedColumnParallelLinear(H, [688, 688], bias=False, quant_config=qc,
                                                          prefix="m.gate_up_proj"),
                    [(0, _w(688, H)), (1, _w(688, H, seed=1))], 0),
        "column": (lambda qc: ColumnParallelLinear(H, 320, bias=True, quant_config=qc, prefix="m.col"),
                   [(None, _w(320, H))], 320),
        "row": (lambda qc: RowParallelLinear(700, H, bias=False, quant_config=qc, prefix="m.down_proj"),
                [(None, _w(H, 700))], 0),
        "replicated": (lambda qc: ReplicatedLinear(H, 128, bias=False, quant_config=qc, prefix="m.rep"),
                       [(None, _w(128, H))], 0),
    }


def _load_linear(layer, shards, bias, precompressed):
    from zipserv_vllm import compress_tensor

    for shard, w in shards:
        if precompressed:
            for suffix, arr in compress_tensor(w, checksums=True).arrays().items():
                p = getattr(layer, suffix)
                (p.weight_loader(p, arr) if shard is None else p.weight_loader(p, arr, shard))
        else:
            p = layer.weight
            (p.weight_loader(p, w) if shard is None else p.weight_loader(p, w, shard))
    if bias:
        if isinstance(shards[0][0], str):  # q/k/v biases arrive per shard, like the weights
            for shard, w in shards:
                layer.bias.weight_loader(layer.bias, _w(w.shape[0], seed=9), shard)
        else:
            layer.bias.weight_loader(layer.bias, _w(bias, seed=7))


def _process(layer):
    """What vLLM's loader does after the weights are loaded: the layer-wise pass for layers whose
    elements were not all loaded (vocabulary padding), then process_weights_after_loading."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_processing

    if getattr(layer.quant_method, "uses_meta_device", False):
        finalize_layerwise_processing(torch.nn.ModuleList([layer]), None)
    for _ in range(2):  # vLLM's generic pass visits a module again after the layer-wise one
        layer.quant_method.process_weights_after_loading(layer)


def _full(layer):
    from zipserv_vllm.vllm_plugin.methods import _full_weight

    return _full_weight(layer.__dict__["_zs_state"])


@pytest.mark.parametrize("way", ["pre", "pack"])
@pytest.mark.parametrize("kind", ["qkv", "gate_up", "column", "row", "replicated"])
def test_linear_layers(vllm_cpu, kind, way):
    from vllm.config import set_current_vllm_config

    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    make, shards, bias = _layers()[kind]
    with set_current_vllm_config(vllm_cpu):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = make(ZipServConfig(precompressed=(way == "pre")))
            base = make(None)
        finally:
            torch.set_default_dtype(torch.float32)
        assert type(layer.quant_method).__name__.startswith("ZipServ")
        _load_linear(layer, shards, bias, way == "pre")
        _load_linear(base, shards, bias, False)
        _process(layer)
        base.quant_method.process_weights_after_loading(base)
        w = torch.cat([s[1] for s in shards])
        assert torch.equal(_full(layer).view(torch.int16), w.view(torch.int16))  # lossless
        x = _w(5, w.shape[1], seed=3)
        y, yb = layer(x), base(x)
        y, yb = (y[0] if isinstance(y, tuple) else y), (yb[0] if isinstance(yb, tuple) else yb)
        assert torch.equal(y, yb)
        b = None if not bias else base.bias
        assert torch.allclose(y.float(), F.linear(x, w, b).float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("way", ["pre", "pack"])
def test_embedding_lm_head_and_tied_head(vllm_cpu, way):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from zipserv_vllm import compress_tensor
    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    we, wh = _w(V, H), _w(V, H, seed=5)
    with set_current_vllm_config(vllm_cpu):
        torch.set_default_dtype(torch.bfloat16)
        try:
            qc = ZipServConfig(precompressed=(way == "pre"))
            emb = VocabParallelEmbedding(V, H, quant_config=qc, prefix="model.embed_tokens")
            head = ParallelLMHead(V, H, quant_config=qc, prefix="lm_head")
            tied = ParallelLMHead(V, H, quant_config=qc, prefix="lm_head")
            base_head = ParallelLMHead(V, H, prefix="lm_head")
        finally:
            torch.set_default_dtype(torch.float32)
        tied = tied.tie_weights(emb)
        for layer, w in ((emb, we), (head, wh)):
            if way == "pre":
                for suffix, arr in compress_tensor(w, checksums=True).arrays().items():
                    p = getattr(layer, suffix)
                    p.weight_loader(p, arr)
            else:
                layer.weight.weight_loader(layer.weight, w)
        base_head.weight.weight_loader(base_head.weight, wh)
        for layer in (emb, head, tied):
            _process(layer)
        base_head.quant_method.process_weights_after_loading(base_head)
        ids = torch.tensor([0, 7, 512, V - 1])
        assert torch.equal(emb(ids).view(torch.int16), F.embedding(ids, we).view(torch.int16))
        x = _w(3, H, seed=6)
        logits = head.quant_method.apply(head, x)
        assert torch.equal(logits, base_head.quant_method.apply(base_head, x))
        assert torch.equal(tied.quant_method.apply(tied, x)[:, :V],
                           emb.quant_method.apply(emb, x)[:, :V])  # the tied head reads the embedding's table
        assert torch.equal(_full(emb)[:V].view(torch.int16), we.view(torch.int16))


@pytest.mark.parametrize("way", ["pre", "pack"])
def test_partly_loaded_merged_layer_is_refused(vllm_cpu, way):
    """A merged gate/up layer that receives only its gate shard (a damaged or mis-mapped checkpoint)
    is refused with one line naming the layer, never compressed with rows that were not loaded.
    On vLLM >= 0.34 the layer is a StackedColumnParallelLinear, and its own record of loaded shards
    (``pop_missing_shards``, which vLLM's loader consults only for unquantized models) agrees."""
    import vllm.model_executor.layers.linear as vllm_linear
    from vllm.config import set_current_vllm_config

    from zipserv_vllm.vllm_plugin.config import ZipServConfig

    make, shards, _ = _layers()["gate_up"]
    with set_current_vllm_config(vllm_cpu):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = make(ZipServConfig(precompressed=(way == "pre")))
        finally:
            torch.set_default_dtype(torch.float32)
        stacked = getattr(vllm_linear, "StackedColumnParallelLinear", None)
        if stacked is not None:
            assert isinstance(layer, stacked) and layer.shard_ids == (0, 1)
        _load_linear(layer, shards[:1], 0, way == "pre")
        if stacked is not None and way == "pack":
            assert layer.pop_missing_shards() == ["weight.1"]
        with pytest.raises(Exception) as info:
            _process(layer)
    msg = str(info.value)
    assert msg.startswith("zipserv: ") and "\n" not in msg and "m.gate_up_proj" in msg, msg
    if way == "pack":  # the shard check's own line, naming the shard that never came
        assert "was never loaded, so layer m.gate_up_proj is only partly filled" in msg and "shard 1" in msg, msg
    else:
        assert "is missing" in msg and "shard 1" in msg, msg
