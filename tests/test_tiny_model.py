"""The tiny offline checkpoint builder: files, determinism, and loading by transformers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from zipserv_vllm.testing import build_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama") / "m")


def test_llama_files_and_tensors(llama):
    names = {p.name for p in llama.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja"} <= names
    t = _tensors(llama)
    assert t["model.embed_tokens.weight"].shape == (2048, 256)
    assert t["lm_head.weight"].shape == (2048, 256)
    assert t["model.layers.1.self_attn.q_proj.weight"].shape == (256, 256)
    assert t["model.layers.1.self_attn.k_proj.weight"].shape == (128, 256)  # 2 kv heads x 64
    assert t["model.layers.0.mlp.gate_proj.weight"].shape == (688, 256)
    assert t["model.layers.0.mlp.down_proj.weight"].shape == (256, 688)
    assert not any(k.endswith(".bias") for k in t)
    assert len(t) == 1 + 2 * 9 + 2
    assert all(v.dtype == torch.bfloat16 for v in t.values())
    assert torch.equal(t["model.norm.weight"], torch.ones(256, dtype=torch.bfloat16))
    w = t["model.layers.0.mlp.up_proj.weight"].float()
    assert abs(w.std().item() - 0.08) < 0.005 and abs(w.mean().item()) < 0.005
    cfg = json.loads((llama / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert "quantization_config" not in cfg


def test_deterministic_across_processes(llama, tmp_path):
    """The CLI in a fresh process (new hash seeds) writes the very same bytes."""
    out = tmp_path / "again"
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.testing.tiny_model", str(out)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert _files(out) == _files(llama)


def test_seed_changes_weights_not_tokenizer(llama, tmp_path):
    other = build_tiny_model(tmp_path / "s1", seed=1)
    a, b = _files(llama), _files(other)
    assert a["tokenizer.json"] == b["tokenizer.json"]
    assert a["model.safetensors"] != b["model.safetensors"]


def test_transformers_loads_config_tokenizer_and_chat_template(llama):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(llama)
    assert cfg.model_type == "llama" and cfg.intermediate_size == 688 and cfg.num_key_value_heads == 2
    tok = AutoTokenizer.from_pretrained(llama)
    assert len(tok) == 2048
    ids = tok("Hello world, the model weight").input_ids
    assert ids[0] == tok.bos_token_id == 0 and max(ids) < 2048
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world, the model weight"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi there"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<s><|user|>\nHi there</s>\n<|assistant|>\n"
    assert tok.eos_token == "</s>" and tok.pad_token_id == 3
    tcfg = json.loads((llama / "tokenizer_config.json").read_text())
    assert tcfg["chat_template"] == (llama / "chat_template.jinja").read_text()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_transformers_model_has_every_weight(arch, tmp_path):
    """from_pretrained finds every parameter under its HF name: nothing missing or unexpected."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path / arch, arch, num_layers=1)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, dtype=torch.bfloat16)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    sd = _tensors(path)
    got = model.state_dict()
    for k, v in sd.items():
        assert torch.equal(got[k].view(torch.int16), v.view(torch.int16)), k


def test_qwen2_biases_and_tied_embeddings(tmp_path):
    path = build_tiny_model(tmp_path / "q", "qwen2")
    t = _tensors(path)
    assert "lm_head.weight" not in t
    assert t["model.layers.0.self_attn.q_proj.bias"].shape == (256,)
    assert t["model.layers.0.self_attn.v_proj.bias"].shape == (128,)
    assert t["model.layers.0.self_attn.k_proj.bias"].abs().sum() > 0
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is True
    untied = build_tiny_model(tmp_path / "q2", "qwen2", tie_word_embeddings=False)
    assert "lm_head.weight" in _tensors(untied)


def test_odd_shapes_sharded_and_dtype(llama, tmp_path):
    odd = build_tiny_model(tmp_path / "odd", intermediate_size=700, sharded=True, max_shard_bytes=300_000)
    index = json.loads((odd / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in odd.glob("*.safetensors"))
    assert len(shards) > 3 and set(index["weight_map"].values()) == set(shards)
    t = _tensors(odd)
    assert set(index["weight_map"]) == set(t)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t.values())
    assert t["model.layers.0.mlp.up_proj.weight"].shape == (700, 256)
    # Same seed, same shapes: sharding changes the files, not the tensors.
    same = build_tiny_model(tmp_path / "sh", sharded=True, max_shard_bytes=1 << 20)
    ref, sh = _tensors(llama), _tensors(same)
    assert ref.keys() == sh.keys() and all(torch.equal(ref[k], sh[k]) for k in ref)
    fp16 = build_tiny_model(tmp_path / "fp16", dtype="fp16", num_layers=1)
    assert {v.dtype for v in _tensors(fp16).values()} == {torch.float16}
    assert json.loads((fp16 / "config.json").read_text())["dtype"] == "float16"
    fp32 = build_tiny_model(tmp_path / "fp32", dtype=torch.float32, num_layers=1)
    assert {v.dtype for v in _tensors(fp32).values()} == {torch.float32}


@pytest.mark.parametrize("kwargs, match", [
    (dict(arch="gpt2"), "arch must be one of"),
    (dict(hidden_size=250), "not a multiple of num_heads"),
    (dict(num_kv_heads=3), "not a multiple of num_kv_heads"),
    (dict(dtype="int8"), "dtype must be one of"),
    (dict(vocab_size=100), "vocab_size must be at least"),
])
def test_bad_arguments(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        build_tiny_model(tmp_path / "x", **kwargs)
