"""Checkpoint layouts users bring, served by a real vLLM engine: identical to BF16 in exact mode.

* GPT-2 (Conv1D weights stored [in, out], fused c_attn, tied head) and
  GPT2ForSequenceClassification (the second Conv1D model vLLM runs; ``score``
  stays BF16), pre-compressed and packed at load;
* a sentence-transformers BERT (``1_Pooling``, ``2_Dense``, ``3_Normalize``) in
  the pooling runner: embeddings of the Dense projection's width, identical;
* mixtures of experts (Qwen3-MoE, Mixtral): attention, embeddings and the routed
  experts compressed (routers BF16), read by tile from a zipserv checkpoint, also one that
  holds some experts BF16; outputs identical (more in test_moe.py);
* a sharded PyTorch ``.bin`` checkpoint: packed at load, and compressed to safetensors;
* a vision-language model: CLIP in the pooling runner, text and image requests
  (the vision tower's linear layers compressed). A generative VLM (PaliGemma,
  LLaVA, Qwen2-VL) cannot run on this vLLM CPU build without torchvision, which
  PyPI only has for CUDA torch; tests/test_layouts.py checks PaliGemma's layout.
"""

from __future__ import annotations

import pytest

from zs_e2e import ENGINE_KW, PROMPTS, _release, run_engine


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    from zipserv_vllm.checkpoint import compress_checkpoint
    from zipserv_vllm.testing.zoo import build_zoo_model

    root = tmp_path_factory.mktemp("zoo_e2e")
    out = {}
    for kind in ("gpt2", "gpt2-seqcls", "bert-st", "qwen3-moe", "mixtral", "llama-bin", "clip"):
        src = build_zoo_model(root / kind, kind)
        out[kind] = (src, compress_checkpoint(src, root / f"{kind}-zs", progress=False).dst)
    return out


def _same(a, b):
    assert a["tokens"] == b["tokens"]
    assert a["logprobs"] == b["logprobs"]  # bit-identical logits
    assert a["text"] == b["text"]


def _pooled(model, task: str, **kw):
    """``LLM(model, runner="pooling")``: embeddings (task "embed") or class probabilities ("classify")."""
    from vllm import LLM

    from zipserv_vllm.vllm_plugin.memory import weight_memory

    llm = LLM(model=str(model), runner="pooling", **{**ENGINE_KW, **kw})
    try:
        outs = llm.embed(PROMPTS, use_tqdm=False) if task == "embed" else llm.classify(PROMPTS, use_tqdm=False)
        vecs = [list(o.outputs.embedding if task == "embed" else o.outputs.probs) for o in outs]
        return {"vectors": vecs, "memory": llm.apply_model(weight_memory)[0]}
    finally:
        _release(llm)


def test_gpt2_conv1d(vllm_env, zoo):
    bf16, zs = zoo["gpt2"]
    base = run_engine(bf16, chat=False)
    pre, pack = run_engine(zs, chat=False), run_engine(bf16, chat=False, quantization="zipserv")
    for run in (pre, pack):
        _same(base, run)
    # 2 x (c_attn, attn.c_proj, c_fc, mlp.c_proj) + wte (the tied lm_head shares it)
    assert pre["memory"]["layers_compressed"] == 9 and pre["memory"]["load_paths"] == {"tiles": 9}
    assert pack["memory"]["layers_compressed"] == 9


def test_gpt2_sequence_classification(vllm_env, zoo):
    bf16, zs = zoo["gpt2-seqcls"]
    base, pre = _pooled(bf16, "classify"), _pooled(zs, "classify")
    pack = _pooled(bf16, "classify", quantization="zipserv")
    assert len(base["vectors"][0]) == 3
    assert pre["vectors"] == base["vectors"] and pack["vectors"] == base["vectors"]
    assert pre["memory"]["layers_compressed"] == 9


def test_sentence_transformers_embeddings(vllm_env, zoo):
    bf16, zs = zoo["bert-st"]
    base, pre = _pooled(bf16, "embed"), _pooled(zs, "embed")
    pack = _pooled(bf16, "embed", quantization="zipserv")
    assert len(base["vectors"][0]) == 32  # the 2_Dense projection ran (BERT's hidden size is 64)
    assert pre["vectors"] == base["vectors"] and pack["vectors"] == base["vectors"]
    # 2 layers x (qkv, attention.output.dense, intermediate.dense, output.dense); embeddings stay BF16
    assert pre["memory"]["layers_compressed"] == 8


@pytest.mark.parametrize("kind", ["qwen3-moe", "mixtral"])
def test_mixture_of_experts_loads_and_matches(vllm_env, zoo, kind, caplog):
    bf16, zs = zoo[kind]
    base = run_engine(bf16, chat=False)
    pre, pack = run_engine(zs, chat=False), run_engine(bf16, chat=False, quantization="zipserv")
    for run in (pre, pack):
        _same(base, run)
        mem = run["memory"]
        # every routed expert's w13 and w2 (4 experts x 2 layers), held compressed (vllm_plugin/moe.py)
        moe = "mlp" if kind == "qwen3-moe" else "block_sparse_moe"
        assert sorted(k for k in mem["parts"] if ".experts." in k) == sorted(
            f"model.layers.{i}.{moe}.experts.{e}.{w}" for i in range(2) for e in range(4) for w in ("w13", "w2"))
        assert mem["layers_compressed"] >= 4 + 16  # + q/o projections of both layers, embedding, lm_head
        assert mem["total_bytes"] < 0.85 * base["memory"]["total_bytes"]  # measured resident bytes
        assert mem["arena_unreferenced_bytes"] == 0  # every arena byte belongs to a loaded layer
    # the checkpoint's compressed experts were read by tile (vLLM's expert loader recorded them), not re-encoded
    for run, way in ((pre, "tiles"), (pack, "packed")):
        paths = {k: v for k, v in run["memory"]["layer_paths"].items() if ".experts." in k}
        assert len(paths) == 16 and set(paths.values()) == {way}, paths


def test_bin_checkpoint(vllm_env, zoo):
    bf16, zs = zoo["llama-bin"]
    base = run_engine(bf16, chat=False)
    _same(base, run_engine(bf16, chat=False, quantization="zipserv"))
    _same(base, run_engine(zs, chat=False))


def test_clip_text_and_image_embeddings(vllm_env, zoo):
    import numpy as np
    from PIL import Image
    from vllm import LLM

    from zipserv_vllm.vllm_plugin.memory import weight_memory

    img = Image.fromarray((np.arange(32 * 32 * 3).reshape(32, 32, 3) % 251).astype(np.uint8))

    def run(model, **kw):
        llm = LLM(model=str(model), runner="pooling", **{**ENGINE_KW, "max_model_len": 64, **kw})
        try:
            text = llm.embed(["a photo of a tile", "hello world"], use_tqdm=False)
            image = llm.embed([{"prompt": "", "multi_modal_data": {"image": img}}], use_tqdm=False)
            return ([list(o.outputs.embedding) for o in text + image], llm.apply_model(weight_memory)[0])
        finally:
            _release(llm)

    bf16, zs = zoo["clip"]
    (base, _), (pre, mem), (pack, _) = run(bf16), run(zs), run(bf16, quantization="zipserv")
    assert len(base) == 3 and len(base[2]) == 64
    assert pre == base and pack == base
    assert mem["layers_compressed"] == 16  # 2 towers x 2 layers x (qkv, out_proj, fc1, fc2)


def test_experts_stored_partly_bf16(vllm_env, zoo, tmp_path):
    """A zipserv checkpoint may hold some experts BF16 (as zipserv-vllm 0.2 wrote every expert, or
    after decompressing one tensor): expert 1's up_proj and all of expert 2 are BF16 here. They are
    encoded at load (expert 1's w13 re-encoded from its decoded gate rows and BF16 up rows), the
    rest read by tile; outputs stay identical."""
    import shutil

    from safetensors.torch import load_file, save_file

    from zipserv_vllm.codec import decompress_tensor
    from zipserv_vllm.format import CompressedTensor, spec

    bf16, zs = zoo["qwen3-moe"]
    d = tmp_path / "mixed"
    shutil.copytree(zs, d)
    f = d / "model.safetensors"
    t = load_file(str(f))
    for name in ("model.layers.0.mlp.experts.1.up_proj",
                 *(f"model.layers.0.mlp.experts.2.{w}" for w in ("gate_proj", "up_proj", "down_proj"))):
        arrays = {s: t.pop(f"{name}.{s}") for s in spec.ALL_SUFFIXES if f"{name}.{s}" in t}
        t[f"{name}.weight"] = decompress_tensor(CompressedTensor.from_arrays(arrays))
    save_file(t, str(f), metadata={"format": "pt"})
    base, mixed = run_engine(bf16, chat=False), run_engine(d, chat=False)
    _same(base, mixed)
    paths = {k: v for k, v in mixed["memory"]["layer_paths"].items() if ".experts." in k}
    e = "model.layers.0.mlp.experts"
    assert len(paths) == 16
    assert {k: v for k, v in paths.items() if v != "tiles"} == {
        f"{e}.1.w13": "re-encoded", f"{e}.2.w13": "packed", f"{e}.2.w2": "packed"}
