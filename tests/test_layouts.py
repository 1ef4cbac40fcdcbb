"""Checkpoint layouts users bring (no vLLM here; tests/vllm/test_layouts_e2e.py serves them).

GPT-2 Conv1D weights, a sentence-transformers BERT, mixtures of experts, sharded
PyTorch .bin checkpoints, a tensor that compression would grow, and the
writer's header reservation. Budget: a few seconds.
"""

from __future__ import annotations

import json
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")

from zipserv_vllm.checkpoint import (  # noqa: E402
    Checkpoint,
    ShardWriter,
    compress_checkpoint,
    decompress_checkpoint,
    inspect_checkpoint,
    verify_checkpoint,
)
from zipserv_vllm.checkpoint.names import plan_weight  # noqa: E402
from zipserv_vllm.testing.zoo import build_zoo_model  # noqa: E402


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    root = tmp_path_factory.mktemp("zoo")
    return {k: build_zoo_model(root / k, k) for k in ("gpt2", "gpt2-seqcls", "bert-st", "qwen3-moe", "mixtral",
                                                        "llama-bin", "clip", "paligemma")}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def qconfig(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def test_gpt2_conv1d_stored_transposed(zoo, tmp_path):
    src, dst = zoo["gpt2"], tmp_path / "zs"
    rep = compress_checkpoint(src, dst, progress=False)
    orig, got = tensors(src), tensors(dst)
    conv = sorted(n[: -len(".weight")] for n in orig
                  if n.endswith(".weight") and n.rsplit(".", 2)[-2] in ("c_attn", "c_proj", "c_fc"))
    assert sorted(rep.transposed) == conv and sorted(qconfig(dst)["transposed_modules"]) == conv
    for p in conv:  # zs_meta holds [out, in]: the orientation vLLM's layer uses
        m, k = got[p + ".zs_meta"][2:4].tolist()
        assert [k, m] == list(orig[p + ".weight"].shape)
    # attn.c_proj is square: only the stored orientation tells it apart; decoding gives W.T
    from zipserv_vllm import decompress_tensor
    from zipserv_vllm.format import CompressedTensor

    p = "transformer.h.0.attn.c_proj"
    ct = CompressedTensor.from_arrays({s.split(".")[-1]: t for s, t in got.items() if s.startswith(p + ".zs_")})
    assert torch.equal(bits(decompress_tensor(ct)), bits(orig[p + ".weight"].t()))
    info = {r["name"]: r for r in inspect_checkpoint(dst)["tensors"]}
    assert info[p + ".weight"]["transposed"] and info["transformer.h.0.attn.c_attn.weight"]["shape"] == [64, 192]
    assert verify_checkpoint(dst, src, progress=False).ok
    decompress_checkpoint(dst, tmp_path / "back", progress=False)
    back = tensors(tmp_path / "back")
    assert set(back) == set(orig)
    for n, t in orig.items():
        assert back[n].shape == t.shape and torch.equal(bits(back[n]), bits(t)), n


def test_names_that_vllm_does_not_quantize_stay_plain(zoo, tmp_path):
    cases = {
        "gpt2-seqcls": ["score.weight"],
        "bert-st": ["embeddings.word_embeddings.weight", "embeddings.token_type_embeddings.weight",
                    "embeddings.position_embeddings.weight", "pooler.dense.weight"],
        # the routers stay plain; the routed experts are compressed (vllm_plugin/moe.py loads them by tile)
        "qwen3-moe": [f"model.layers.{i}.mlp.gate.weight" for i in range(2)],
        "mixtral": [f"model.layers.{i}.block_sparse_moe.gate.weight" for i in range(2)]
        + ["model.embed_tokens.weight"],  # vLLM's Mixtral builds it without the quantization method
    }
    compressed = {"bert-st": "encoder.layer.0.attention.self.query", "qwen3-moe": "model.layers.0.mlp.experts.3.up_proj",
                  "mixtral": "model.layers.1.block_sparse_moe.experts.0.w2", "gpt2-seqcls": "transformer.h.1.mlp.c_fc"}
    for kind, plain in cases.items():
        dst = tmp_path / kind
        rep = compress_checkpoint(zoo[kind], dst, progress=False)
        got = tensors(dst)
        for n in plain:
            assert n in got and not any(k.startswith(n[: -len("weight")] + "zs_") for k in got), (kind, n)
        # named with a reason, unless not a linear weight at all (position and token-type tables)
        # (tiny k/v projections of 32 rows also stay plain: padded to a 64-row tile they would grow)
        assert {n for n, why in rep.kept_bf16 if "smaller" not in why} == set(plain) - {"embeddings.position_embeddings.weight",
                                                               "embeddings.token_type_embeddings.weight"}
        assert compressed[kind] + ".zs_sm" in got, kind
        assert verify_checkpoint(dst, zoo[kind], progress=False).ok
    why = dict(compress_checkpoint(zoo["mixtral"], tmp_path / "m2", progress=False).kept_bf16)
    assert "without the quantization method" in why["model.layers.0.block_sparse_moe.gate.weight"]
    # experts of an architecture not tested end to end, and per-expert fused gate_up, stay plain with a reason
    olmoe = {"architectures": ["OlmoeForCausalLM"], "num_experts": 4}
    plan = plan_weight("model.layers.0.mlp.experts.0.gate_proj.weight", (128, 64), olmoe)
    assert plan.action == "plain" and "has not tested" in plan.reason and "MixtralForCausalLM" in plan.reason
    plan = plan_weight("model.layers.0.mlp.experts.0.gate_up_proj.weight", (256, 64),
                       {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4})
    assert plan.action == "plain" and "splits itself" in plan.reason
    assert "MixtralForCausalLM" in why["model.embed_tokens.weight"]


def test_conv1d_rule_is_per_architecture():
    # GPTBigCode uses the same names with nn.Linear ([out, in]): never transposed
    assert plan_weight("transformer.h.0.attn.c_attn.weight", (192, 64), {"model_type": "gpt_bigcode"}).action == \
        "compress"
    assert plan_weight("transformer.h.0.attn.c_attn.weight", (64, 192), {"model_type": "gpt2"}).action == "transpose"
    # a router outside a mixture of experts is an ordinary linear layer
    assert plan_weight("model.layers.0.mlp.gate.weight", (128, 64), {"model_type": "x"}).action == "compress"
    assert plan_weight("model.embed_tokens.weight", (512, 64), {"model_type": "llama"}).action == "compress"
    assert plan_weight("embeddings.word_embeddings.weight", (512, 64), {"model_type": "bert"}).action == "plain"


def test_sentence_transformers_folders_survive(zoo, tmp_path):
    src, dst = zoo["bert-st"], tmp_path / "zs"
    compress_checkpoint(src, dst, progress=False)
    for rel in ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json", "2_Dense/config.json",
                "2_Dense/model.safetensors"):
        assert (dst / rel).read_bytes() == (src / rel).read_bytes(), rel
    assert (dst / "3_Normalize").is_dir()


def test_bin_checkpoint_becomes_safetensors(zoo, tmp_path):
    src, dst = zoo["llama-bin"], tmp_path / "zs"
    ck = Checkpoint.open(src)
    assert ck.format == "bin" and ck.index_file == "pytorch_model.bin.index.json" and len(ck.shards) == 2
    rep = compress_checkpoint(src, dst, progress=False)
    assert not list(dst.glob("*.bin")) and not (dst / "pytorch_model.bin.index.json").exists()
    assert (dst / "model.safetensors").is_file() and len(rep.compressed_modules) == 16
    assert verify_checkpoint(dst, src, progress=False).ok
    decompress_checkpoint(dst, tmp_path / "back", progress=False)
    back = tensors(tmp_path / "back")
    orig = {}
    for f in sorted(src.glob("*.bin")):
        orig.update(torch.load(f, weights_only=True))
    assert set(back) == set(orig)
    assert all(torch.equal(bits(back[n]), bits(t)) for n, t in orig.items())


class _Code:  # unpickling this needs code: refused
    def __reduce__(self):
        return (print, ("this must never run",))


def test_bin_that_needs_code_is_refused(zoo, tmp_path):
    src = tmp_path / "evil"
    shutil.copytree(zoo["llama-bin"], src)
    state = torch.load(src / "pytorch_model-00001-of-00002.bin", weights_only=True)
    state["extra"] = _Code()
    with open(src / "pytorch_model-00001-of-00002.bin", "wb") as f:
        torch.save(state, f, pickle_module=pickle)
    r = subprocess.run([sys.executable, "-m", "zipserv_vllm.cli", "compress", str(src), str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "this must never run" not in r.stdout
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "refused: loading it needs code to be unpickled" in lines[0]
    assert not (tmp_path / "o").exists()


def test_tensor_that_would_grow_stays_plain(tmp_path):
    from zipserv_vllm.testing import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "llama")
    state = load_file(str(src / "model.safetensors"))
    state["model.layers.0.mlp.probe.weight"] = torch.randn(4, 64).to(torch.bfloat16)  # 1 tile for 256 weights
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    rep = compress_checkpoint(src, tmp_path / "zs", progress=False)
    why = dict(rep.kept_bf16)
    assert "would not be smaller" in why["model.layers.0.mlp.probe.weight"]
    got = tensors(tmp_path / "zs")
    assert torch.equal(bits(got["model.layers.0.mlp.probe.weight"]), bits(state["model.layers.0.mlp.probe.weight"]))
    assert "model.layers.0.mlp.probe" not in qconfig(tmp_path / "zs")["compressed_modules"]


def test_writer_moves_data_once_when_the_header_outgrows_its_reservation(tmp_path):
    ts = {f"t{i}.weight": torch.arange(i * 8 + 3, dtype=torch.int16) for i in range(40)}
    ts["odd"] = torch.arange(5, dtype=torch.uint8)
    w = ShardWriter(tmp_path, None, header_reserve=64)
    for n, t in ts.items():
        w.add({n: t})
    w.finish()
    assert w.moved_shards == 1
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(ts)
        for n, t in ts.items():
            assert torch.equal(f.get_tensor(n), t)


@pytest.mark.parametrize("kind", ["clip", "paligemma"])
def test_multimodal_towers(zoo, kind, tmp_path):
    """The language model and the vision tower's linear layers are compressed; embeddings,
    positional tables, projections and the patch embedding (a convolution) are copied."""
    src, dst = zoo[kind], tmp_path / kind
    rep = compress_checkpoint(src, dst, progress=False)
    got = tensors(dst)
    vision = "vision_model" if kind == "clip" else "vision_tower"
    for layer in range(2):
        for m in ("self_attn.q_proj", "self_attn.out_proj", "mlp.fc1", "mlp.fc2"):
            assert f"{vision}.encoder.layers.{layer}.{m}.zs_sm" in got, (kind, m)
    plain = {"clip": ["text_model.embeddings.token_embedding.weight", "text_projection.weight",
                      "visual_projection.weight", "vision_model.embeddings.position_embedding.weight",
                      "vision_model.embeddings.patch_embedding.weight"],
             "paligemma": ["multi_modal_projector.linear.weight", "vision_tower.embeddings.position_embedding.weight",
                           "vision_tower.embeddings.patch_embedding.weight"]}[kind]
    for n in plain:
        assert n in got, n
    if kind == "paligemma":
        for m in ("model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
            assert f"language_model.{m}.zs_sm" in got, m
    assert (dst / "processor_config.json").read_bytes() == (src / "processor_config.json").read_bytes()
    assert verify_checkpoint(dst, src, progress=False).ok
    assert len(rep.compressed_modules) >= 16
