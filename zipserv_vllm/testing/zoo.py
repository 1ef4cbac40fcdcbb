"""More tiny, deterministic, offline checkpoints: the layouts users bring besides Llama/Qwen2.

``build_zoo_model(path, kind)`` writes a random-weight checkpoint of one of
:data:`KINDS` with ``transformers``' own model class and ``save_pretrained``
(so tensor names, orientations and side files are what the Hub holds), and
the byte-level tokenizer of :mod:`.tiny_model`:

* ``gpt2``: ``GPT2LMHeadModel`` (Conv1D weights stored ``[in, out]``, tied head);
* ``gpt2-seqcls``: ``GPT2ForSequenceClassification`` (a ``score`` head vLLM runs as ``nn.Linear``);
* ``bert-st``: a ``BertModel`` in the sentence-transformers layout (``modules.json``,
  ``1_Pooling/``, ``2_Dense/model.safetensors``, ``3_Normalize/``);
* ``qwen3-moe`` / ``mixtral``: mixtures of experts (per-expert tensors, a router);
* ``llama-bin``: a tiny Llama saved as sharded ``pytorch_model-*.bin`` + index
  (``torch.save`` of the state dict, as older Hub checkpoints are);
* ``clip``: a ``CLIPModel`` (text and vision towers) with its processor, for
  vLLM's pooling runner (text or image embeddings; the Pillow image
  processor, no torchvision);
* ``paligemma``: a ``PaliGemmaForConditionalGeneration`` (SigLIP tower, Gemma
  language model) with its processor. vLLM 0.32's CPU build cannot run it here:
  its vision-encoder lookup imports Pixtral's image processor, which needs
  torchvision, and PyPI's torchvision needs CUDA torch. Its layout is checked
  at compress time only.

Weights are N(0, std) from a seeded generator (norms and layer-norm weights 1,
their biases 0), cast to BF16. Head dimensions are 32 (vLLM's CPU attention
supports 32, 64, ...). Command line: ``python -m zipserv_vllm.testing.zoo OUT KIND``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from .tiny_model import BOS, EOS, PAD, _save_tokenizer, _train_tokenizer

KINDS = ("gpt2", "gpt2-seqcls", "bert-st", "qwen3-moe", "mixtral", "llama-bin", "clip", "paligemma")
VOCAB = 512


def _init(model: torch.nn.Module, seed: int, std: float) -> None:
    """Deterministic weights, independent of transformers' own initialisation."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.state_dict().items()):
            if not p.is_floating_point():
                continue
            low = name.lower()
            if ("norm" in low or ".ln_" in low or low.startswith("ln_") or "layernorm" in low) and p.dim() == 1:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))


def _save(model, path: Path, ids: dict[str, int]) -> None:
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = ids[BOS], ids[EOS], ids[PAD]
    model.to(torch.bfloat16).save_pretrained(str(path))


def _tokenizer(path: Path) -> dict[str, int]:
    return _save_tokenizer(_train_tokenizer(VOCAB), path)


def _gpt2(path: Path, seed: int, std: float, seqcls: bool) -> None:
    from transformers import GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    ids = _tokenizer(path)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=256, n_embd=64, n_layer=2, n_head=2,
                     bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD])
    if seqcls:
        cfg.num_labels = 3
    model = (GPT2ForSequenceClassification if seqcls else GPT2LMHeadModel)(cfg)
    _init(model, seed, std)
    _save(model, path, ids)


def _bert_st(path: Path, seed: int, std: float) -> None:
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel

    ids = _tokenizer(path)
    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, max_position_embeddings=256, type_vocab_size=2,
                     position_embedding_type="absolute", pad_token_id=ids[PAD])
    model = BertModel(cfg)
    _init(model, seed, std)
    _save(model, path, ids)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"},
        {"idx": 3, "name": "3", "path": "3_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (path / "modules.json").write_text(json.dumps(modules, indent=2) + "\n")
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}) + "\n")
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}, indent=2) + "\n")
    (path / "2_Dense").mkdir(exist_ok=True)
    (path / "2_Dense" / "config.json").write_text(json.dumps({
        "in_features": 64, "out_features": 32, "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh"}, indent=2) + "\n")
    gen = torch.Generator().manual_seed(seed + 1)
    save_file({"linear.weight": torch.empty(32, 64).normal_(0.0, 0.2, generator=gen),
               "linear.bias": torch.empty(32).normal_(0.0, 0.2, generator=gen)},
              str(path / "2_Dense" / "model.safetensors"))
    (path / "3_Normalize").mkdir(exist_ok=True)


def _moe(path: Path, seed: int, std: float, kind: str, config: dict | None = None) -> None:
    ids = _tokenizer(path)
    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, max_position_embeddings=256, tie_word_embeddings=False,
                  rms_norm_eps=1e-6)
    common.update(config or {})
    if kind == "qwen3-moe":
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        cfg = Qwen3MoeConfig(**{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
                                "intermediate_size": 128, "decoder_sparse_step": 1, "mlp_only_layers": [], **common})
        model = Qwen3MoeForCausalLM(cfg)
    else:
        from transformers import MixtralConfig, MixtralForCausalLM

        cfg = MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 128, **common})
        model = MixtralForCausalLM(cfg)
    _init(model, seed, std)
    _save(model, path, ids)


def _llama_bin(path: Path, seed: int, std: float) -> None:
    from .tiny_model import build_tiny_model

    build_tiny_model(path, "llama", seed=seed, std=std)
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    (path / "model.safetensors").unlink()
    names = list(state)
    half = len(names) // 2
    shards = {"pytorch_model-00001-of-00002.bin": names[:half], "pytorch_model-00002-of-00002.bin": names[half:]}
    weight_map = {}
    for fname, keys in shards.items():
        torch.save({k: state[k] for k in keys}, str(path / fname))
        weight_map.update({k: fname for k in keys})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (path / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n")


def _clip(path: Path, seed: int, std: float) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import CLIPConfig, CLIPImageProcessorPil, CLIPModel, CLIPProcessor, PreTrainedTokenizerFast

    from .tiny_model import _training_text

    # vLLM's CLIP uses token id 0 as its image placeholder: no special token may have it.
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_training_text(), trainer=trainers.BpeTrainer(
        vocab_size=VOCAB - 12, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2, show_progress=False))
    sot, eot = "<|startoftext|>", "<|endoftext|>"
    tok.add_special_tokens([sot, eot])
    bos, eos = tok.token_to_id(sot), tok.token_to_id(eot)
    tok.post_processor = processors.TemplateProcessing(single=f"{sot} $A {eot}", special_tokens=[(sot, bos), (eot, eos)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=sot, eos_token=eot, pad_token=eot,
                                   model_max_length=64)
    ip = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=ip, tokenizer=fast).save_pretrained(str(path))
    cfg = CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=64, projection_dim=64, bos_token_id=bos,
                         eos_token_id=eos, pad_token_id=eos),
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8, projection_dim=64),
        projection_dim=64)
    model = CLIPModel(cfg)
    _init(model, seed, std)
    model.to(torch.bfloat16).save_pretrained(str(path))


def _paligemma(path: Path, seed: int, std: float) -> None:
    from transformers import (PaliGemmaConfig, PaliGemmaForConditionalGeneration, PaliGemmaProcessor,
                              PreTrainedTokenizerFast, SiglipImageProcessorPil)

    from .tiny_model import UNK

    fast = PreTrainedTokenizerFast(tokenizer_object=_train_tokenizer(VOCAB), bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, pad_token=PAD, model_max_length=1 << 20)
    fast.add_tokens(["\n"])
    ip = SiglipImageProcessorPil(size={"height": 32, "width": 32})
    ip.image_seq_length = 16
    proc = PaliGemmaProcessor(image_processor=ip, tokenizer=fast)  # adds <image>, <loc....>, <seg...>
    proc.save_pretrained(str(path))
    cfg = PaliGemmaConfig(
        text_config=dict(model_type="gemma", vocab_size=2048, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                         max_position_embeddings=256),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=2, image_size=32, patch_size=8,
                           projection_dim=64),
        image_token_index=proc.image_token_id, projection_dim=64, vocab_size=2048)
    model = PaliGemmaForConditionalGeneration(cfg)
    _init(model, seed, std)
    ids = {BOS: fast.bos_token_id, EOS: fast.eos_token_id, PAD: fast.pad_token_id}
    _save(model, path, ids)


def build_zoo_model(path, kind: str, *, seed: int = 0, std: float = 0.08, config: dict | None = None) -> Path:
    """Write the tiny ``kind`` checkpoint (one of :data:`KINDS`) into ``path`` and return it.
    ``config`` overrides the mixtures of experts' config fields (e.g. a larger model for benchmarks)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if config and kind not in ("qwen3-moe", "mixtral"):
        raise ValueError(f"config overrides are for the mixtures of experts only, not {kind!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if kind in ("gpt2", "gpt2-seqcls"):
        _gpt2(path, seed, std, kind == "gpt2-seqcls")
    elif kind == "bert-st":
        _bert_st(path, seed, std)
    elif kind in ("qwen3-moe", "mixtral"):
        _moe(path, seed, std, kind, config)
    elif kind == "clip":
        _clip(path, seed, std)
    elif kind == "paligemma":
        _paligemma(path, seed, std)
    else:
        _llama_bin(path, seed, std)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipserv_vllm.testing.zoo", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("kind", choices=KINDS)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    print(build_zoo_model(a.out, a.kind, seed=a.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def build_lora_adapter(path, base: str | os.PathLike, *, rank: int = 8, seed: int = 3) -> Path:
    """A PEFT-format LoRA adapter (``adapter_config.json`` + ``adapter_model.safetensors``) for the
    tiny Llama/Qwen2 checkpoint ``base``: q/v/o and gate/down projections of every layer,
    N(0, 0.05^2) A and B matrices, BF16."""
    from safetensors.torch import save_file

    cfg = json.loads((Path(base) / "config.json").read_text())
    h, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head, cfg["num_key_value_heads"] * head
    shapes = {"self_attn.q_proj": (h, q), "self_attn.v_proj": (h, kv), "self_attn.o_proj": (q, h),
              "mlp.gate_proj": (h, inter), "mlp.down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for name, (din, dout) in shapes.items():
            p = f"base_model.model.model.layers.{i}.{name}"
            tensors[f"{p}.lora_A.weight"] = (torch.randn(rank, din, generator=gen) * 0.05).to(torch.bfloat16)
            tensors[f"{p}.lora_B.weight"] = (torch.randn(dout, rank, generator=gen) * 0.05).to(torch.bfloat16)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": sorted({n.rsplit(".", 1)[1] for n in shapes}), "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(base), "fan_in_fan_out": False, "modules_to_save": None}, indent=2) + "\n")
    return path
