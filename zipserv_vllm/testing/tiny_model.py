"""Build a tiny, deterministic, offline Hugging Face checkpoint for tests.

``build_tiny_model(path)`` writes a random-weight Llama (or Qwen2) causal LM
that transformers 5 and vLLM 0.32 load like any hub checkpoint:

* ``model.safetensors`` (or shards plus ``model.safetensors.index.json``) with
  the tensor names ``save_pretrained`` writes (``model.layers.0.self_attn.q_proj.weight``...),
  BF16 by default (``dtype=`` writes FP16/FP32 copies for error tests);
* ``config.json`` and ``generation_config.json``;
* a byte-level BPE tokenizer trained here with the ``tokenizers`` library on
  text generated from a fixed seed, with special tokens and a chat template
  (``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
  when transformers writes it, and ``chat_template.jinja``).

Every output file is byte-identical from run to run for the same arguments, so
tests can compare checkpoints and outputs across processes. Weights are
normal(0, std) on matrices and biases and ones on norms, drawn from a seeded
``torch.Generator`` in float32 and rounded to the output dtype.

The shapes are free: ``intermediate_size=700`` gives MLP weights whose shape is
not a multiple of the 64x64 tile, which exercises the padding paths.

Command line: ``python -m zipserv_vllm.testing.tiny_model OUT [--arch qwen2]``.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

ARCHS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [BOS, EOS, UNK, PAD, "<|user|>", "<|assistant|>", "<|system|>"]

# One line per message: "<|role|>\ncontent</s>\n"; the generation prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

_SEED_TEXT = """\
The quick brown fox jumps over the lazy dog. A lossless format keeps every bit of
every weight: the exponent window, the sign and the mantissa. Large language models
are served from compressed weights when memory bandwidth is the bottleneck.
def forward(self, x):
    return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
for i in range(10): print(i, i * i, hex(i))
User: What is the capital of France? Assistant: Paris is the capital of France.
0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -1 +1 = == != <= >= ( ) [ ] { } : ; , .
"""

_WORDS = (
    "the of and to in is that for it as with was on be by this are or from at an which "
    "model weight tensor tile window exponent mantissa sign bit byte stream layer matrix "
    "compress decode encode lossless memory bandwidth kernel token prompt answer question "
    "hello world python function return value list dict string number file path server "
    "request response cache batch sequence attention query key value projection hidden "
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work"
).split()
_SYLLABLES = "ka ri to mu se na lo ve pi da qu ex zo bar tin gle ment tion ing ed er ly un re pre".split()


def _training_text(n_lines: int = 4000) -> list[str]:
    """Fixed text for the tokenizer trainer: a seed paragraph plus seeded pseudo-sentences."""
    rng = random.Random(20261201)
    lines = _SEED_TEXT.splitlines()
    for _ in range(n_lines):
        words = []
        for _ in range(rng.randint(4, 14)):
            if rng.random() < 0.7:
                words.append(rng.choice(_WORDS))
            else:
                words.append("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
        if rng.random() < 0.2:
            words.append(str(rng.randint(0, 9999)))
        sentence = " ".join(words)
        lines.append(sentence[0].upper() + sentence[1:] + rng.choice(".?!,;:"))
    return lines


def _train_tokenizer(vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` that prepends ``<s>`` to every sequence."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def _save_tokenizer(tok, path: Path) -> dict[str, int]:
    """Save ``tok`` the way transformers 5 and vLLM 0.32 read it; return the special token ids."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=PAD,
        additional_special_tokens=SPECIAL_TOKENS[4:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=1 << 20,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(path))
    # transformers 5 writes the template to chat_template.jinja (which vLLM reads) and names
    # its own backend class; older readers want both in tokenizer_config.json.
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    if not (path / "chat_template.jinja").exists():
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return {name: tok.token_to_id(name) for name in (BOS, EOS, UNK, PAD)}


def _param_shapes(arch: str, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
                  vocab: int, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every parameter, in ``model.state_dict()`` order."""
    head_dim = hidden // heads
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        attn = [
            ("self_attn.q_proj", (heads * head_dim, hidden)),
            ("self_attn.k_proj", (kv_heads * head_dim, hidden)),
            ("self_attn.v_proj", (kv_heads * head_dim, hidden)),
        ]
        for name, shape in attn:
            shapes.append((p + name + ".weight", shape))
            if arch == "qwen2":
                shapes.append((p + name + ".bias", (shape[0],)))
        shapes.append((p + "self_attn.o_proj.weight", (hidden, heads * head_dim)))
        shapes.append((p + "mlp.gate_proj.weight", (inter, hidden)))
        shapes.append((p + "mlp.up_proj.weight", (inter, hidden)))
        shapes.append((p + "mlp.down_proj.weight", (hidden, inter)))
        shapes.append((p + "input_layernorm.weight", (hidden,)))
        shapes.append((p + "post_attention_layernorm.weight", (hidden,)))
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def _make_weights(shapes, seed: int, std: float, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes:
        if name.endswith("norm.weight"):
            w = torch.ones(shape, dtype=torch.float32)
        else:
            w = torch.empty(shape, dtype=torch.float32).normal_(0.0, std, generator=gen)
        out[name] = w.to(dtype).contiguous()
    return out


def _write_weights(path: Path, tensors: dict[str, torch.Tensor], sharded: bool, max_shard_bytes: int) -> None:
    from safetensors.torch import save_file

    meta = {"format": "pt"}
    if not sharded:
        save_file(tensors, str(path / "model.safetensors"), metadata=meta)
        return
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():  # greedy, in state-dict order, like save_pretrained
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(path / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_configs(path: Path, arch: str, dtype_name: str, ids: dict[str, int], *, hidden: int, inter: int,
                   layers: int, heads: int, kv_heads: int, vocab: int, tied: bool, max_pos: int) -> None:
    from transformers import GenerationConfig, LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        tie_word_embeddings=tied,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[PAD],
        dtype=dtype_name,
    )
    if arch == "llama":
        cfg = LlamaConfig(head_dim=hidden // heads, attention_bias=False, mlp_bias=False, **common)
    else:
        cfg = Qwen2Config(use_sliding_window=False, **common)
    cfg.architectures = [ARCHS[arch]]
    cfg.save_pretrained(str(path))
    GenerationConfig(bos_token_id=ids[BOS], eos_token_id=ids[EOS], pad_token_id=ids[PAD]).save_pretrained(str(path))


def build_tiny_model(
    path,
    arch: str = "llama",
    *,
    hidden_size: int = 256,
    intermediate_size: int = 688,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 2048,
    tie_word_embeddings: bool | None = None,
    seed: int = 0,
    std: float = 0.08,
    max_position_embeddings: int = 512,
    sharded: bool = False,
    max_shard_bytes: int = 1 << 20,
    dtype: str | torch.dtype = "bfloat16",
) -> Path:
    """Write a tiny causal LM checkpoint into ``path`` (created if needed) and return it as a Path.

    ``arch``: "llama" (LlamaForCausalLM) or "qwen2" (Qwen2ForCausalLM, q/k/v biases).
    ``tie_word_embeddings``: None means the architecture's usual choice (False for
    llama, True for qwen2), so a tied model has no ``lm_head.weight``.
    ``sharded``: write ``model-0000i-of-0000n.safetensors`` shards of at most
    ``max_shard_bytes`` each (a tensor larger than that gets a shard of its own)
    plus ``model.safetensors.index.json``.
    ``dtype``: "bfloat16" (default), "float16" or "float32" for the weights.
    """
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {sorted(ARCHS)}, got {arch!r}")
    if isinstance(dtype, torch.dtype):
        dtype_name = next((k for k, v in DTYPES.items() if v == dtype), None)
        if dtype_name is None:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype}")
    else:
        dtype_name = _DTYPE_ALIASES.get(str(dtype), str(dtype))
        if dtype_name not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    for label, value in [("hidden_size", hidden_size), ("intermediate_size", intermediate_size),
                         ("num_layers", num_layers), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                         ("max_position_embeddings", max_position_embeddings)]:
        if value < 1:
            raise ValueError(f"{label} must be positive, got {value}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be at least 512 (the byte alphabet plus special tokens), got {vocab_size}")
    tied = (arch == "qwen2") if tie_word_embeddings is None else bool(tie_word_embeddings)

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    tok = _train_tokenizer(vocab_size)
    if tok.get_vocab_size() > vocab_size:  # pragma: no cover - the trainer respects vocab_size
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, more than vocab_size {vocab_size}")
    ids = _save_tokenizer(tok, path)

    shapes = _param_shapes(arch, hidden_size, intermediate_size, num_layers, num_heads, num_kv_heads,
                           vocab_size, tied)
    _write_weights(path, _make_weights(shapes, seed, std, DTYPES[dtype_name]), sharded, max_shard_bytes)
    _write_configs(path, arch, dtype_name, ids, hidden=hidden_size, inter=intermediate_size, layers=num_layers,
                   heads=num_heads, kv_heads=num_kv_heads, vocab=vocab_size, tied=tied,
                   max_pos=max_position_embeddings)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zipserv_vllm.testing.tiny_model", description=__doc__.split("\n")[0])
    ap.add_argument("out", help="output directory (created)")
    ap.add_argument("--arch", choices=sorted(ARCHS), default="llama")
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=688)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--vocab-size", type=int, default=2048)
    ap.add_argument("--tie-word-embeddings", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--std", type=float, default=0.08)
    ap.add_argument("--max-position-embeddings", type=int, default=512)
    ap.add_argument("--sharded", action="store_true")
    ap.add_argument("--max-shard-bytes", type=int, default=1 << 20)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    a = ap.parse_args(argv)
    try:
        out = build_tiny_model(
            a.out, a.arch, hidden_size=a.hidden_size, intermediate_size=a.intermediate_size,
            num_layers=a.num_layers, num_heads=a.num_heads, num_kv_heads=a.num_kv_heads,
            vocab_size=a.vocab_size, tie_word_embeddings=a.tie_word_embeddings, seed=a.seed, std=a.std,
            max_position_embeddings=a.max_position_embeddings, sharded=a.sharded,
            max_shard_bytes=a.max_shard_bytes, dtype=a.dtype,
        )
    except (ValueError, OSError) as exc:
        ap.exit(2, f"{ap.prog}: error: {exc}\n")
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
