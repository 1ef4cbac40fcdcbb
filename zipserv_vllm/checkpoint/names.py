"""Which checkpoint tensors are compressed, what kind of layer they belong to, and sizes.

The rule (``compressible``) is shared by the compressor and the vLLM plugin, so
both agree on which modules carry ``zs_*`` arrays: a 2-D tensor whose name ends
in ``.weight`` and that vLLM runs through a linear layer, the input embedding or
``lm_head``. Norms and positional embeddings (plain ``nn.Embedding`` / buffers in
vLLM) are never compressed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..format import spec

QUANT_METHOD = "zipserv"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIX = ".weight"
SUFFIXES = spec.SUFFIXES  # zs_meta, zs_bitmaps, zs_base, zs_offsets, zs_sm, zs_fb (all required)
ALL_SUFFIXES = spec.ALL_SUFFIXES  # plus the optional zs_crc

# Never compressed: anything with "norm" in its name, and these dotted components (positional
# embeddings, token-type tables and rotary tables are plain tensors or nn.Embedding in vLLM,
# not linear layers).
_EXCLUDED = re.compile(
    r"norm|(^|\.)(ln|ln_f|ln_\d+|wpe|position_embeddings|position_embedding|embed_positions|token_type_embeddings"
    r"|rotary_emb|rotary)(\.|$)"
)

# Layer kinds of the summary tables, in display order.
KINDS = ("attn.q", "attn.k", "attn.v", "attn.qkv", "attn.o", "mlp.gate", "mlp.up", "mlp.gate_up", "mlp.down",
         "embedding", "lm_head", "linear.other", "uncompressed")

_KIND_PATTERNS = [
    ("attn.qkv", re.compile(r"(qkv_proj|query_key_value|c_attn|W_pack|Wqkv)\.weight$")),
    ("attn.q", re.compile(r"(q_proj|query|\.wq)\.weight$")),
    ("attn.k", re.compile(r"(k_proj|key|\.wk)\.weight$")),
    ("attn.v", re.compile(r"(v_proj|value|\.wv)\.weight$")),
    ("attn.o", re.compile(r"(self_attn\.o_proj|attn\.o_proj|attention\.dense|attn\.c_proj|out_proj|\.wo|o_proj)\.weight$")),
    ("mlp.gate_up", re.compile(r"(gate_up_proj)\.weight$")),
    ("mlp.gate", re.compile(r"(gate_proj|\.w1)\.weight$")),
    ("mlp.up", re.compile(r"(up_proj|\.w3|dense_h_to_4h|c_fc)\.weight$")),
    ("mlp.down", re.compile(r"(down_proj|\.w2|dense_4h_to_h|mlp\.c_proj)\.weight$")),
    ("embedding", re.compile(r"(embed_tokens|wte|word_embeddings|tok_embeddings|embed_in)\.weight$")),
    ("lm_head", re.compile(r"(^|\.)(lm_head|embed_out|output)\.weight$")),
]


def _shape_of(x) -> tuple[int, ...]:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape)
    if hasattr(x, "get_shape"):  # a safetensors slice
        return tuple(x.get_shape())
    return tuple(int(d) for d in x)


def compressible(name: str, tensor_or_shape: torch.Tensor | Sequence[int]) -> bool:
    """True when ``name`` is a weight that zipserv stores compressed (whatever its dtype).

    A 2-D ``*.weight`` that is not a norm or positional embedding. The dtype is
    deliberately not part of the rule: a non-BF16 tensor that matches is refused
    by the compressor (converting it would not be lossless), not silently copied.
    """
    if not name.endswith(WEIGHT_SUFFIX):
        return False
    if len(_shape_of(tensor_or_shape)) != 2:
        return False
    return not _EXCLUDED.search(name[: -len(WEIGHT_SUFFIX)].lower())


# ----------------------------------------------------------------- per-architecture rules
# 2-D BF16 weights that pass ``compressible`` but that vLLM does not run through a layer
# that takes zipserv's quantization method: compressing them would make the checkpoint
# unloadable (vLLM has no ``zs_*`` parameter to put them in), so they are stored as they are.
# Storing a weight uncompressed is always safe: zipserv then keeps that layer BF16.
_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")
# The per-expert matrices vLLM's expert loader (RoutedExperts) maps one by one onto its w13 / w2
# slots; zipserv stores these compressed (vllm_plugin/moe.py loads them by tile).
_EXPERT_SHARD = re.compile(r"(^|\.)experts\.\d+\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
# Architectures whose compressed experts are tested end to end (tests/vllm/test_moe.py,
# test_layouts_e2e.py); the experts of others stay BF16 in a zipserv checkpoint (packing them at
# load with --quantization zipserv works for any model vLLM builds with RoutedExperts).
MOE_EXPERT_ARCHS = frozenset({"MixtralForCausalLM", "Qwen3MoeForCausalLM"})
_ROUTER = re.compile(r"(^|\.)(mlp|block_sparse_moe|moe|feed_forward|mixer)\.(gate|router)\.weight$"
                     r"|(^|\.)(shared_expert_gate|router)\.weight$")
_TORCH_HEADS = re.compile(r"(^|\.)(score|classifier|pooler|text_projection|visual_projection|multi_modal_projector"
                          r"|cls|qa_outputs)(\.|$)|(^|\.)head\.(dense|attention)\.|^(text_model\.)?head\.weight$")
_TEXT_TOWER_EMBED = re.compile(r"(^|\.)token_embedding\.weight$")
_ENCODER_EMBED = re.compile(r"(^|\.)(word_embeddings|tok_embeddings)\.weight$")
# Encoder models whose vLLM implementation builds the input embedding without the quantization method.
ENCODER_MODEL_TYPES = frozenset({"bert", "roberta", "xlm-roberta", "camembert", "modernbert", "nomic_bert", "new",
                                 "gte", "electra", "ernie"})
_SIGLIP_MLP = re.compile(r"(^|\.)mlp\.fc[12]\.weight$")
# Models whose checkpoints store linear weights as Conv1D, [in, out]: vLLM transposes them
# while loading; zipserv stores them compressed as [out, in] (docs/FORMAT.md section 7).
CONV1D_WEIGHTS = {"gpt2": re.compile(r"(^|\.)(c_attn|c_proj|c_fc)\.weight$")}

MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _model_types(config: dict | None) -> set[str]:
    """``model_type`` of a config and of its nested configs (text_config, vision_config, ...)."""
    out: set[str] = set()
    stack = [config or {}]
    while stack:
        c = stack.pop()
        if isinstance(c, dict):
            if isinstance(c.get("model_type"), str):
                out.add(c["model_type"])
            stack.extend(v for v in c.values() if isinstance(v, dict))
    return out


def _has_experts(config: dict | None) -> bool:
    stack = [config or {}]
    while stack:
        c = stack.pop()
        if isinstance(c, dict):
            if any(isinstance(c.get(k), int) and c[k] > 1 for k in MOE_KEYS):
                return True
            stack.extend(v for v in c.values() if isinstance(v, dict))
    return False


@dataclass(frozen=True)
class WeightPlan:
    """What the compressor does with one ``compressible`` weight."""

    action: str  # "compress", "transpose" (a Conv1D weight, compressed as W.T) or "plain"
    reason: str = ""  # why it stays plain


_TABLE: dict | None = None


def vllm_layer_table() -> dict:
    """``vllm_layers.json``: per vLLM architecture, the layer attribute names its model code
    builds without the quantization method (generated from vLLM's sources by
    scripts/scan_vllm_layers.py; tests/test_vllm_layer_table.py keeps it current)."""
    global _TABLE
    if _TABLE is None:
        import json
        from pathlib import Path

        _TABLE = json.loads((Path(__file__).with_name("vllm_layers.json")).read_text())
    return _TABLE


def plan_weight(name: str, shape: Sequence[int], config: dict | None = None) -> WeightPlan:
    """How the ``compressible`` weight ``name`` of a model with ``config`` (its config.json)
    is stored so that vLLM can load the result: first the architecture's entry in
    :func:`vllm_layer_table`, then the name rules above (which also cover
    architectures the table does not know)."""
    types = _model_types(config)
    archs = [a for a in (config or {}).get("architectures") or [] if isinstance(a, str)]
    attr = module_name(name).rpartition(".")[2]
    table = vllm_layer_table()["architectures"]
    for arch in archs:
        if attr in table.get(arch, {}).get("plain", ()):
            return WeightPlan("plain", f"vLLM's {arch} builds its {attr} layers without the quantization method")
    if _EXPERT.search(name):
        if not any(a in MOE_EXPERT_ARCHS for a in archs):
            return WeightPlan("plain", "a mixture-of-experts expert of an architecture whose compressed experts "
                                       f"zipserv has not tested with vLLM's expert loader (tested: "
                                       f"{', '.join(sorted(MOE_EXPERT_ARCHS))})")
        if not _EXPERT_SHARD.search(name):
            return WeightPlan("plain", "a mixture-of-experts expert stored in a layout vLLM's expert loader splits "
                                       "itself (e.g. a per-expert fused gate_up_proj)")
        return WeightPlan("compress")
    if _ROUTER.search(name) and _has_experts(config):
        return WeightPlan("plain", "a mixture-of-experts router: vLLM builds most routers without the "
                                   "quantization method")
    if _TORCH_HEADS.search(name):
        return WeightPlan("plain", "a head or projection vLLM runs as a plain torch layer or in fp32")
    if _TEXT_TOWER_EMBED.search(name) or (_ENCODER_EMBED.search(name) and types & ENCODER_MODEL_TYPES):
        return WeightPlan("plain", "an encoder's input embedding, which vLLM builds without the quantization method")
    if _SIGLIP_MLP.search(name) and any(t.startswith("siglip") for t in types) \
            and any(int(d) % spec.TILE for d in _shape_of(shape)):
        return WeightPlan("plain", "a SigLIP MLP whose sizes are not multiples of 64: vLLM builds it without "
                                   "the quantization method")
    for model_type, pattern in CONV1D_WEIGHTS.items():
        if model_type in types and pattern.search(name):
            return WeightPlan("transpose")
    return WeightPlan("compress")


def layer_kind(name: str) -> str:
    """Summary bucket of a compressed weight: "attn.q", "mlp.down", "embedding", ... or "linear.other"."""
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(name):
            return kind
    return "linear.other"


def module_name(weight_name: str) -> str:
    """``model.layers.0.mlp.up_proj.weight`` -> ``model.layers.0.mlp.up_proj``."""
    return weight_name[: -len(WEIGHT_SUFFIX)] if weight_name.endswith(WEIGHT_SUFFIX) else weight_name


def split_array_name(name: str) -> tuple[str, str] | None:
    """``P.zs_sm`` -> (``P``, ``zs_sm``); None for a tensor that is not a zipserv array."""
    prefix, _, suffix = name.rpartition(".")
    if prefix and suffix in ALL_SUFFIXES:
        return prefix, suffix
    return None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "ki": 2**10, "kib": 2**10, "mi": 2**20, "mib": 2**20, "gi": 2**30,
          "gib": 2**30, "ti": 2**40, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"512MiB"`` -> 536_870_912, ``"1000"`` -> 1000 (as Hugging Face counts)."""
    if isinstance(text, int):
        value = text
    else:
        m = _SIZE.match(str(text))
        unit = (m.group(2) or "").lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(f"invalid size {text!r}: expected e.g. 5GB, 500MB, 2GiB or a byte count")
        value = int(float(m.group(1)) * _UNITS[unit])
    if value < 1:
        raise ValueError(f"size must be positive, got {text!r}")
    return value
