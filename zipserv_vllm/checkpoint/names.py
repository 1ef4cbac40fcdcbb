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

import torch

from ..format import spec

QUANT_METHOD = "zipserv"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
WEIGHT_SUFFIX = ".weight"
SUFFIXES = spec.SUFFIXES  # zs_meta, zs_bitmaps, zs_base, zs_offsets, zs_sm, zs_fb

# Never compressed: anything with "norm" in its name, and these dotted components (positional
# embeddings and rotary tables are plain tensors or nn.Embedding in vLLM, not linear layers).
_EXCLUDED = re.compile(
    r"norm|(^|\.)(ln|ln_f|ln_\d+|wpe|position_embeddings|embed_positions|rotary_emb|rotary)(\.|$)"
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
    if prefix and suffix in SUFFIXES:
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
