"""Mixture-of-experts: the routed experts held compressed, computed by vLLM's own MoE kernel.

vLLM builds each MoE layer's routed experts as one module (``RoutedExperts``)
whose weights are ``w13_weight [E, 2I, H]`` (gate rows, then up rows) and
``w2_weight [E, H, I]``; its router picks ``topk_ids`` / ``topk_weights`` and
then calls the quant method's ``apply`` (docs/VLLM-MOE-NOTES.md).

:class:`ZipServMoEMethod` lets vLLM's unquantized method create and load the
BF16 weights (so vLLM's expert weight loader does the checkpoint names, the
tensor-parallel slices and the expert ids), then compresses every expert's
``w13`` and ``w2`` into the paged arena, one TCA-TBE v1 matrix each, and drops
the BF16 copies. ``apply`` decodes the experts and hands them, through vLLM's
own weight preparation (padding, prepacking) to vLLM's own expert kernel, so the
result is bit-identical to the BF16 model's (exact mode). Fast mode runs each
routed expert's two GEMMs with the fused CPU kernel straight from the
compressed bytes, over the tokens routed to it (SiLU-gated experts without
expert parallelism; others take the exact path).

Both ways in reach it: a BF16 checkpoint with ``--quantization zipserv`` and a
zipserv checkpoint (whose experts are stored BF16: ``zipserv compress`` keeps
them plain, see zipserv_vllm/checkpoint/names.py). While loading, a MoE layer
briefly holds its BF16 weights and vLLM's prepacked copy; once loaded, only the
compressed bytes stay.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.nn import Parameter

from . import compat, loading

UnquantizedFusedMoEMethod = compat.find("UnquantizedFusedMoEMethod")
set_weight_attrs = compat.find("set_weight_attrs")

_LAYERS: dict[int, tuple] = {}  # op key -> (weakref to the layer, its method)
_KEYS = itertools.count()
_MOE = "_zs_moe_states"


def moe_states(layer) -> list[loading.LayerState]:
    """The compressed expert matrices of a MoE layer: ``w13`` of every expert, then ``w2``."""
    return layer.__dict__.get(_MOE) or []


@torch.library.custom_op("zipserv::moe_experts", mutates_args=())
def _moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, key: int) -> torch.Tensor:
    ref, method = _LAYERS[key]
    layer = ref()
    if layer is None:
        raise RuntimeError("zipserv: a MoE layer was called after its model was freed")
    return method.compute(layer, x, topk_weights, topk_ids)


@_moe_experts.register_fake
def _(x, topk_weights, topk_ids, key):
    return torch.empty_like(x)


class _Weights(torch.nn.Module):
    """The decoded experts, in the shape vLLM's expert kernel prepares them from."""

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor):
        super().__init__()
        self.w13_weight = Parameter(w13, requires_grad=False)
        self.w2_weight = Parameter(w2, requires_grad=False)


class ZipServMoEMethod(UnquantizedFusedMoEMethod):
    """Routed experts compressed after loading (see the module docstring)."""

    def __init__(self, moe, config, prefix: str = ""):
        super().__init__(moe)
        self.zs_config = config
        self.zs_prefix = prefix
        config.expect_moe()

    def process_weights_after_loading(self, layer) -> None:
        if layer.__dict__.get(_MOE) is not None or getattr(layer, "_zs_moe_plain", False):
            return
        try:
            self._compress(layer)
        finally:
            self.zs_config.moe_done()

    def _compress(self, layer) -> None:
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        why = None
        if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            why = f"dtype {w13.dtype}, not bfloat16"
        elif getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
            why = "experts with biases"
        elif w13.device.type != "cpu":
            why = "compressed experts run on the CPU backend only so far"
        states = []
        if why is None:
            arena = self.zs_config.arena(w13.device)
            packed = loading.uses_packed(w13.device, self.zs_config.mode)  # CPU fast mode: byte-split layout
            try:
                for which, w in (("w13", w13), ("w2", w2)):
                    for e in range(w.shape[0]):
                        st = loading.LayerState(prefix=f"{self.zs_prefix}.{e}.{which}", kind="linear",
                                                rows=w.shape[1], cols=w.shape[2], device=w.device,
                                                expected_shards=[], layer_ref=weakref.ref(layer))
                        loading.pack_layer(st, w[e], arena, packed=packed)
                        states.append(st)
            except (TypeError, ValueError) as exc:
                why = str(exc)
        if why is not None:
            layer._zs_moe_plain = True
            self.zs_config.note_plain(self.zs_prefix or "<experts>", why)
            super().process_weights_after_loading(layer)
            return
        for st in states:
            st.path = "packed"
            self.zs_config.register_state(st)
        layer.__dict__[_MOE] = states
        self._shapes = (tuple(w13.shape), tuple(w2.shape))
        # vLLM sets up its expert kernel (and prepacks the BF16 weights, which are dropped next).
        super().process_weights_after_loading(layer)
        for name in ("w13_weight", "w2_weight"):
            empty = Parameter(torch.empty(0, dtype=torch.bfloat16, device=w13.device), requires_grad=False)
            layer.register_parameter(name, empty)
            set_weight_attrs(empty, {"weight_loader": self._refuse_update})
        self._key = next(_KEYS)
        _LAYERS[self._key] = (weakref.ref(layer), self)

    def _refuse_update(self, param, loaded_weight, *args, **kwargs):
        """Weight updates after loading (reload_weights, model.load_weights) reach the experts here."""
        raise loading.ZipServLoadError(
            f"zipserv: {self.zs_prefix}: the routed experts of this mixture-of-experts layer are held compressed, "
            f"and updating them after loading is not supported yet (dense layers and the embedding do take "
            f"updates); restart the engine on the new weights")

    # ------------------------------------------------------------------ run
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if not moe_states(layer):
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        return torch.ops.zipserv.moe_experts(x, topk_weights, topk_ids, self._key)

    def compute(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """The experts' output for ``x`` (eager; inside ``zipserv::moe_experts``)."""
        if self.zs_config.mode == "fast" and getattr(layer.activation, "value", None) == "silu" \
                and layer.expert_map is None:
            return self._compute_fast(layer, x, topk_weights, topk_ids)
        return self._compute_exact(layer, x, topk_weights, topk_ids)

    def _compute_fast(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """Fast mode: each routed expert's two GEMMs straight from its compressed bytes
        (``zipserv_vllm.linear``, the fused CPU kernel), over the tokens routed to it; only the
        routed experts are read. Same numbers as vLLM's kernel up to summation order and its
        approximate exp in SiLU (the fast-mode logprob bound, tests/vllm/test_moe.py)."""
        from .methods import compressed_linear

        states = moe_states(layer)
        n_exp, inter = len(states) // 2, self._shapes[0][1] // 2
        k = topk_ids.shape[-1]
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_exp).tolist()
        tokens, weights = order // k, topk_weights.reshape(-1).to(torch.float32)[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            idx, w = tokens[start:start + c], weights[start:start + c, None]
            start += c
            xe = x.index_select(0, idx)
            if layer.apply_router_weight_on_input:
                xe = (xe * w).to(x.dtype)
            h = compressed_linear(states[e], xe, None, "fast")
            act = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
            y = compressed_linear(states[n_exp + e], act, None, "fast").float()
            out.index_add_(0, idx, y if layer.apply_router_weight_on_input else y * w)
        return out.to(x.dtype)

    def _compute_exact(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        from .methods import _full_weight

        states = moe_states(layer)
        (e, i2, h), (_, h2, i) = self._shapes
        w13 = torch.stack([_full_weight(st) for st in states[:e]])
        w2 = torch.stack([_full_weight(st) for st in states[e:]])
        assert w13.shape == (e, i2, h) and w2.shape == (e, h2, i)
        w = _Weights(w13, w2)
        kernel = self.moe_kernel
        kernel.fused_experts.process_weights_after_loading(w)  # vLLM's own padding and prepacking
        return kernel.apply(hidden_states=x, w1=w.w13_weight, w2=w.w2_weight, topk_weights=topk_weights,
                            topk_ids=topk_ids, activation=layer.activation,
                            apply_router_weight_on_input=layer.apply_router_weight_on_input,
                            global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                            shared_experts=None, shared_experts_input=None)

