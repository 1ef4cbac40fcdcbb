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
result is bit-identical to the BF16 model's. This is the exact path; fast mode
uses it too for now (a fused per-expert kernel is issue 13's next step).

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
            try:
                for which, w in (("w13", w13), ("w2", w2)):
                    for e in range(w.shape[0]):
                        st = loading.LayerState(prefix=f"{self.zs_prefix}.{e}.{which}", kind="linear",
                                                rows=w.shape[1], cols=w.shape[2], device=w.device,
                                                expected_shards=[], layer_ref=weakref.ref(layer))
                        loading.pack_layer(st, w[e], arena)
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
        from .methods import _decode

        states = moe_states(layer)
        (e, i2, h), (_, h2, i) = self._shapes
        w13 = torch.stack([_decode(st.parts[0]) for st in states[:e]])
        w2 = torch.stack([_decode(st.parts[0]) for st in states[e:]])
        assert w13.shape == (e, i2, h) and w2.shape == (e, h2, i)
        w = _Weights(w13, w2)
        kernel = self.moe_kernel
        kernel.fused_experts.process_weights_after_loading(w)  # vLLM's own padding and prepacking
        return kernel.apply(hidden_states=x, w1=w.w13_weight, w2=w.w2_weight, topk_weights=topk_weights,
                            topk_ids=topk_ids, activation=layer.activation,
                            apply_router_weight_on_input=layer.apply_router_weight_on_input,
                            global_num_experts=layer.global_num_experts, expert_map=layer.expert_map,
                            shared_experts=None, shared_experts_input=None)

