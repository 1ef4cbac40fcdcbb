"""zipserv_vllm/checkpoint/vllm_layers.json is what scripts/scan_vllm_layers.py finds in the installed vLLM.

The compressor keeps a weight BF16 when the architecture's vLLM code builds its
layer without the quantization method (compressing it would make the checkpoint
unloadable). The table is generated from vLLM's sources; this test fails when
the installed vLLM builds its layers differently, so the table is regenerated
with the vLLM the plugin is tested on.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed: nothing to scan")
def test_table_matches_installed_vllm():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "scan_vllm_layers.py"), "--check"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_table_drives_the_compressor():
    from zipserv_vllm.checkpoint.names import plan_weight, vllm_layer_table

    t = vllm_layer_table()["architectures"]
    assert "embed_tokens" in t["MixtralForCausalLM"]["plain"] and t["LlamaForCausalLM"]["plain"] == []
    mixtral = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": 8}
    assert plan_weight("model.embed_tokens.weight", (512, 64), mixtral).action == "plain"
    assert plan_weight("model.embed_tokens.weight", (512, 64), {"architectures": ["LlamaForCausalLM"]}).action == \
        "compress"
    # BERT's "dense" is built both ways (pooler: nn.Linear; encoder: quantized): the name rules decide
    bert = {"architectures": ["BertModel"], "model_type": "bert"}
    assert plan_weight("encoder.layer.0.output.dense.weight", (64, 128), bert).action == "compress"
    assert plan_weight("pooler.dense.weight", (64, 64), bert).action == "plain"
