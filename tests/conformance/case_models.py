"""Whole models built with this vLLM's own model classes and loaded through its model loader.

A tiny Llama (untied head, 688-wide MLP) and a tiny Qwen2 (q/k/v biases, tied
embeddings, 700-wide MLP), compressed by ``zipserv compress``: vLLM's
``EngineArgs`` builds the configuration from the checkpoint's config.json (so
the plugin is detected from its ``quantization_config``, with no flag), its
``get_model`` builds the model class for the architecture and runs its default
loader, and every compressed layer then decodes to the exact bits of the
source checkpoint's tensors (q/k/v and gate/up joined as vLLM joins them).
"""

from __future__ import annotations

import pytest
import torch
import vllm
from conftest import building_config, source_weight
from safetensors.torch import load_file


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing import build_tiny_model

    root = tmp_path_factory.mktemp("conf_models")
    out = {}
    for arch, kw in (("llama", {}), ("qwen2", {"intermediate_size": 700, "seed": 1})):
        bf16 = build_tiny_model(root / f"{arch}-bf16", arch, **kw)
        out[arch] = (bf16, compress_checkpoint(bf16, root / f"{arch}-zs", progress=False).dst)
    return out


def _get_model(path):
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model

    with building_config():
        vc = EngineArgs(model=str(path), dtype="bfloat16", enforce_eager=True, max_model_len=128,
                        kv_cache_memory_bytes=32 << 20).create_engine_config()
    assert vc.model_config.quantization == "zipserv"  # detected from config.json
    with set_current_vllm_config(vc):
        return get_model(vllm_config=vc), vc


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_model_loaded_by_vllm_decodes_to_the_source_bits(vllm_cpu, models, arch):
    from zipserv_vllm.vllm_plugin.methods import _full_weight

    bf16, zs = models[arch]
    src = load_file(str(bf16 / "model.safetensors"))
    model, vc = _get_model(zs)
    checked = 0
    for name, mod in model.named_modules():
        st = mod.__dict__.get("_zs_state")
        if st is None or not st.parts or st.tied_to is not None:
            continue
        want = source_weight(src, name)
        got = _full_weight(st)[: want.shape[0]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), name
        assert st.checked == "tiles", name  # every tile checked against zs_crc while loading
        checked += 1
    # 2 layers x (qkv, o, gate_up, down) + embed_tokens (+ lm_head for the untied Llama)
    assert checked == (10 if arch == "llama" else 9)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    root = tmp_path_factory.mktemp("conf_moe")
    bf16 = build_zoo_model(root / "bf16", "qwen3-moe")
    return bf16, compress_checkpoint(bf16, root / "zs", progress=False).dst


def _expert_weight(src: dict, prefix: str) -> torch.Tensor:
    """The source bits of one compressed expert matrix ``<experts>.<e>.w13`` (gate rows, then up) or
    ``<experts>.<e>.w2`` (down)."""
    head, e, which = prefix.rsplit(".", 2)
    if which == "w13":
        return torch.cat([src[f"{head}.{e}.gate_proj.weight"], src[f"{head}.{e}.up_proj.weight"]])
    return src[f"{head}.{e}.down_proj.weight"]


def test_moe_model_loaded_by_vllm_and_processed_again(vllm_cpu, moe_dirs):
    """A Qwen3-MoE-style zipserv checkpoint built by this vLLM's model class and loaded by its model
    loader: every routed expert is held compressed (read by tile) and decodes to the source bits; then
    vLLM's post-load pass runs again over every module (as a weight reload or a later release's
    re-preparation does), and every expert still decodes to the same bits from the same compressed
    storage (nothing re-encoded, nothing left pointing at a dropped copy)."""
    from vllm.config import set_current_vllm_config

    from zipserv_vllm.vllm_plugin.methods import _full_weight
    from zipserv_vllm.vllm_plugin.moe import moe_states

    bf16, zs = moe_dirs
    src = load_file(str(bf16 / "model.safetensors"))
    try:
        model, vc = _get_model(zs)
    except AttributeError as exc:
        if "'_C' object has no attribute 'prepack_moe_weight'" not in str(exc) or vllm.__version__.startswith("0.32"):
            raise
        # A GPU wheel's Python package on the CPU: vLLM's own CPU expert-weight preparation (which the
        # plugin calls, as for BF16 experts) needs a compiled op only vLLM's CPU build has.
        pytest.skip(f"vLLM {vllm.__version__}'s CPU MoE weight preparation needs a compiled op this GPU wheel "
                    f"lacks on the CPU ({exc})")
    layers = [m for m in model.modules() if moe_states(m)]
    assert len(layers) == 2  # the zoo model's two MoE layers

    def decoded():
        out = {}
        for layer in layers:
            for st in moe_states(layer):
                want = _expert_weight(src, st.prefix)
                assert torch.equal(_full_weight(st).view(torch.int16), want.view(torch.int16)), st.prefix
                assert st.path == "tiles", st.prefix
                out[st.prefix] = st.parts[0].sm.data_ptr()
        return out

    first = decoded()
    assert len(first) == 2 * 4 * 2  # 2 layers x 4 experts x (w13, w2)
    with set_current_vllm_config(vc):
        for module in model.modules():
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)
    assert decoded() == first
