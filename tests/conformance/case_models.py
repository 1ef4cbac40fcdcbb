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
from conftest import source_weight
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
