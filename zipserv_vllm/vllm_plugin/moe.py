"""Mixture-of-experts: the routed experts held compressed, computed by vLLM's own MoE kernel.

vLLM builds each MoE layer's routed experts as one module (``RoutedExperts``)
whose weights are ``w13_weight [E, 2I, H]`` (gate rows, then up rows) and
``w2_weight [E, H, I]``; its router picks ``topk_ids`` / ``topk_weights`` and
then calls the quant method's ``apply`` (docs/VLLM-MOE-NOTES.md).

:class:`ZipServMoEMethod` keeps vLLM's unquantized method's BF16 weights and
expert weight loader (which does the checkpoint names, the tensor-parallel
slices and the expert ids) and holds every local expert's ``w13`` and ``w2`` in
the paged arena, one TCA-TBE v1 matrix each (or the byte-split layout in
CPU fast mode), dropping the BF16 copies once loaded. ``apply`` decodes the
experts and hands them, through vLLM's own weight preparation (padding,
prepacking), to vLLM's own expert kernel, so the result is bit-identical to the
BF16 model's (exact mode). Fast mode runs each routed expert's two GEMMs with
the fused CPU kernel straight from the compressed bytes, over the tokens routed
to it (SiLU-gated experts without expert parallelism; others take the exact
path).

Both ways in:

* **pre-compressed**: ``zipserv compress`` stores each expert's ``w1``/``w3``/
  ``w2`` (``experts.N.gate_proj`` ...) compressed (zipserv_vllm/checkpoint/names.py
  lists the tested architectures). vLLM's expert loader maps
  ``experts.N.w1.zs_sm`` onto the placeholder ``experts.w13_zs_sm`` exactly as it
  maps ``experts.N.w1.weight`` onto ``experts.w13_weight``; the placeholders
  record the (memory-mapped) arrays, and after loading each rank's tiles are
  selected (the rank's rows of ``w1``/``w3``, its columns of ``w2``) and copied
  into the arena with no re-encoding. A split off the 64-element tiles is decoded,
  placed by vLLM's expert loader and re-encoded (one log line per layer). Experts a
  checkpoint stores BF16 are encoded at load.
* **pack at load**: a BF16 checkpoint with ``--quantization zipserv``.

Every local expert's three matrices must arrive (as BF16 or as all six arrays);
otherwise loading stops with one line naming the tensor. Weight updates after
loading (``model.load_weights``, vLLM's layer-wise ``reload_weights``) take BF16
expert tensors and re-encode each updated expert. While loading, a MoE
layer briefly holds its BF16 weights and vLLM's prepacked copy (vLLM's kernel
setup prepacks them); once loaded, only the compressed bytes stay.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch.nn import Parameter

from ..codec import check_tiles
from ..format import spec
from ..kernels import ops
from . import compat, layouts, loading, weight_loaders
from .log import logger

UnquantizedFusedMoEMethod = compat.find("UnquantizedFusedMoEMethod")
set_weight_attrs = compat.find("set_weight_attrs")

_LAYERS: dict[str, list["_Entry"]] = {}  # op name -> the live layers of that name (outside a forward pass)
_MOE = "_zs_moe_states"
_RECORDS, _ARRIVED, _GLOBAL = "_zs_moe_records", "_zs_moe_arrived", "_zs_moe_global"
_RELOADED = "_zs_moe_reloaded"  # (local expert, shard) loaded by vLLM's layer-wise reload
_SHARDS = ("w1", "w3", "w2")


def moe_states(layer) -> list[loading.LayerState]:
    """The compressed expert matrices of a MoE layer: ``w13`` of every expert, then ``w2``."""
    return layer.__dict__.get(_MOE) or []


def _op_name(prefix: str) -> str:
    """The key a MoE layer's zipserv entry has in vLLM's ``static_forward_context`` (beside vLLM's own
    entry for the layer under ``prefix``, which must stay unique)."""
    return f"{prefix}#zipserv"


class _Entry:
    """A compressed MoE layer and its method, as ``zipserv::moe_experts`` finds them by name."""

    def __init__(self, layer, method):
        self.layer_ref, self.method = weakref.ref(layer), method


def _register(layer, method) -> None:
    """Make the layer findable by its name: in the engine's ``static_forward_context`` (which vLLM hands
    to every forward pass as ``no_compile_layers``, as attention finds its layer), and in a per-process
    table for a traced call outside any forward pass (where the name must then be unambiguous)."""
    name = _op_name(method.zs_prefix)
    entry = _Entry(layer, method)
    ctx = getattr(getattr(compat.current_vllm_config(), "compilation_config", None), "static_forward_context", None)
    if isinstance(ctx, dict):
        ctx[name] = entry
    _LAYERS.setdefault(name, []).append(entry)
    ops._cpu_kernels().moe_op_forget(name)  # (the C++ kernel serves a name only while it is unambiguous)
    weakref.finalize(layer, _forget, name, entry)  # the method (and its arenas) go with the model


def _forget(name: str, entry: _Entry) -> None:
    entries = _LAYERS.get(name, [])
    if entry in entries:
        entries.remove(entry)
    if not entries:
        _LAYERS.pop(name, None)
    ops._cpu_kernels().moe_op_forget(name)


def _parts_changed() -> None:
    """Some layer's parts were assigned: the C++ kernel's MoE layers may point at old tensors."""
    ops._cpu_kernels().moe_op_forget()


loading.on_parts_change(_parts_changed)


def _lookup(name: str) -> _Entry:
    """The layer named ``name``: the running forward pass's, else the only live one in this process."""
    avail = compat.find("is_forward_context_available", required=False)
    if avail is not None and avail():
        entry = compat.find("get_forward_context")().no_compile_layers.get(name)
        if entry is not None:
            return entry
    live = [e for e in _LAYERS.get(name, []) if e.layer_ref() is not None]
    if len(live) == 1:
        return live[0]
    if not live:
        raise RuntimeError(f"zipserv: no compressed MoE layer named {name!r} in this process")
    raise RuntimeError(f"zipserv: {len(live)} models in this process have a compressed MoE layer named {name!r}; "
                       "outside a vLLM forward pass the traced op cannot tell which one to run")


def _moe_experts_fake(x, topk_weights, topk_ids, layer_name):
    return torch.empty_like(x)


@ops.lean_op("moe_experts(Tensor x, Tensor topk_weights, Tensor topk_ids, str layer_name) -> Tensor",
             _moe_experts_fake)
def _moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_name: str) -> torch.Tensor:
    """The routed experts of the MoE layer ``layer_name``, looked up by name at run time (never a
    number baked into a traced graph, which a compile cache could hand to another engine or process)."""
    entry = _lookup(layer_name)
    layer = entry.layer_ref()
    if layer is None:
        raise RuntimeError("zipserv: a MoE layer was called after its model was freed")
    cpu_kernels = ops._cpu_kernels()
    generation = cpu_kernels.moe_op_generation()
    y = entry.method.compute(layer, x, topk_weights, topk_ids)
    held = entry.method.one_call(layer, x)
    if held is not None and sum(e.layer_ref() is not None for e in _LAYERS.get(layer_name, ())) == 1:
        # served by the one-call kernel, and the name means this layer in any forward pass: the
        # op's C++ CPU kernel serves the next calls (the same kernel on the same arguments)
        cpu_kernels.moe_op_served(layer_name, _moe_experts_python, held,
                                  bool(layer.apply_router_weight_on_input), generation)
    return y


_moe_experts_python = ops._PYTHON_IMPLS["moe_experts"]  # (the function; the C++ CPU kernel hands it the rest)


class _NotSmaller(ValueError):
    """An expert whose compressed form would not be smaller: the layer stays BF16."""


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

    # ------------------------------------------------------------- creation
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        """vLLM's BF16 expert weights, their loader wrapped to note which experts arrive, and, for a
        zipserv checkpoint, 0-size placeholders ``w13_zs_*`` / ``w2_zs_*`` that vLLM's expert loader
        fills with each expert's compressed arrays (``experts.N.w1.zs_sm`` maps to ``experts.w13_zs_sm``
        as ``experts.N.w1.weight`` maps to ``experts.w13_weight``): recorded, read by tile later."""
        super().create_weights(layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                               **extra_weight_attrs)
        _register(layer, self)
        layer.__dict__[_ARRIVED] = set()  # (local expert, shard) loaded as BF16
        layer.__dict__[_RECORDS] = {}     # (local expert, shard) -> {suffix: checkpoint tensor}
        layer.__dict__[_GLOBAL] = {}      # local expert -> its id in the checkpoint
        for which in ("w13", "w2"):
            param = getattr(layer, f"{which}_weight")
            orig = param.weight_loader
            param.weight_loader = self._bf16_loader(layer, orig)
            layer.__dict__[f"_zs_{which}_loader"] = orig
        if not self.zs_config.precompressed:
            return
        for which in ("w13", "w2"):
            for suffix in loading.ALL_SUFFIXES:
                p = Parameter(torch.empty(0, dtype=loading.ARRAY_DTYPES[suffix]), requires_grad=False)
                layer.register_parameter(f"{which}_{suffix}", p)
                set_weight_attrs(p, {"weight_loader": self._array_recorder(layer, suffix)})

    @staticmethod
    def _local(layer, expert_id: int) -> int:
        emap = layer.expert_map
        return int(expert_id) if emap is None else int(emap[int(expert_id)])

    def _bf16_loader(self, layer, orig):
        def zipserv_expert_bf16_loader(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None,
                                       return_success=False, **kw):
            ok = orig(param, loaded_weight, weight_name, shard_id=shard_id, expert_id=expert_id,
                      return_success=True, **kw)
            if ok is not False and shard_id is not None and expert_id is not None:
                if layer.__dict__.get(_MOE) is not None:  # vLLM's layer-wise reload, after loading
                    layer.__dict__.setdefault(_RELOADED, set()).update(
                        ((e, shard_id) for e in range(param.shape[0])) if loaded_weight.dim() == 3
                        else [(self._local(layer, expert_id), shard_id)])
                elif loaded_weight.dim() == 3:  # all experts of a shard in one tensor
                    layer.__dict__[_ARRIVED].update((e, shard_id) for e in range(param.shape[0]))
                else:
                    local = self._local(layer, expert_id)
                    layer.__dict__[_ARRIVED].add((local, shard_id))
                    layer.__dict__[_GLOBAL][local] = int(expert_id)
            return ok if return_success else None

        return zipserv_expert_bf16_loader

    def _array_recorder(self, layer, suffix: str):
        def zipserv_expert_record_loader(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None,
                                         return_success=False, **kw):
            if layer.__dict__.get(_MOE) is not None or getattr(layer, "_zs_moe_plain", False):
                return self._refuse_update(param, loaded_weight)
            local = self._local(layer, expert_id)
            if local < 0:  # another rank's expert (expert parallelism)
                return False if return_success else None
            layer.__dict__[_GLOBAL][local] = int(expert_id)
            got = layer.__dict__[_RECORDS].setdefault((local, shard_id), {})
            if suffix in got:
                raise loading.ZipServLoadError(
                    f"zipserv: {self._ckpt(layer, local, shard_id)}.{suffix} appears twice in the checkpoint")
            got[suffix] = loaded_weight
            return True if return_success else None

        return zipserv_expert_record_loader

    @staticmethod
    def _global(layer, local: int) -> int:
        """The checkpoint's id of local expert ``local``."""
        glob = layer.__dict__.get(_GLOBAL, {}).get(local)
        if glob is None:
            emap = layer.expert_map
            glob = local if emap is None else int((emap == local).nonzero()[0, 0])
        return glob

    def _ckpt(self, layer, local: int, shard: str) -> str:
        """The checkpoint module name of a local expert's shard, e.g. ``...experts.3.w1``."""
        names = {"w1": getattr(layer, "ckpt_gate_proj_name", "w1"), "w3": getattr(layer, "ckpt_up_proj_name", "w3"),
                 "w2": getattr(layer, "ckpt_down_proj_name", "w2")}
        return f"{self.zs_prefix}.{self._global(layer, local)}.{names[shard]}"

    # ----------------------------------------------------------- processing
    def process_weights_after_loading(self, layer) -> None:
        if layer.__dict__.get(_MOE) is not None:
            self._after_reload(layer)
            return
        if getattr(layer, "_zs_moe_plain", False):  # kept BF16: vLLM's method prepares the (re)loaded weights
            super().process_weights_after_loading(layer)
            return
        try:
            self._compress(layer)
        except Exception as exc:
            from .errors import report

            raise report(exc)
        finally:
            self.zs_config.moe_done()
            layer.__dict__.pop(_RECORDS, None)  # drop the checkpoint views (unmaps the files)

    def _check_complete(self, layer) -> None:
        """Every local expert's w1, w3 and w2 arrived, as BF16 or as all six compressed arrays."""
        records, arrived = layer.__dict__.get(_RECORDS, {}), layer.__dict__.get(_ARRIVED, set())
        n = layer.w13_weight.shape[0]
        for e in range(n):
            for shard in _SHARDS:
                got = records.get((e, shard))
                name = self._ckpt(layer, e, shard)
                if got is None:
                    if (e, shard) not in arrived:
                        raise loading.ZipServLoadError(
                            f"zipserv: checkpoint tensor {name}.weight is missing (and there are no {name}.zs_* "
                            f"arrays either): expert {self._global(layer, e)} of {self.zs_prefix} has no "
                            f"{shard} weights")
                    continue
                if (e, shard) in arrived:
                    raise loading.ZipServLoadError(
                        f"zipserv: {name}.weight is stored both uncompressed and compressed ({name}.zs_*)")
                missing = [x for x in loading.SUFFIXES if x not in got]
                if missing:
                    raise loading.ZipServLoadError(
                        f"zipserv: checkpoint tensor {name}.{missing[0]} is missing (a compressed expert needs "
                        f"{', '.join(name + '.' + x for x in loading.SUFFIXES)})")

    def _compress(self, layer) -> None:
        self._check_complete(layer)
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        why = None
        if w13.dtype != torch.bfloat16 or w2.dtype != torch.bfloat16:
            why = f"dtype {w13.dtype}, not bfloat16"
        elif getattr(layer, "w13_bias", None) is not None or getattr(layer, "w2_bias", None) is not None:
            why = "experts with biases"
        elif w13.device.type != "cpu":
            why = "compressed experts run on the CPU backend only so far"
        states: list[loading.LayerState] = []
        if why is None:
            try:
                self._load_experts(layer, states)
            except _NotSmaller as exc:
                why = str(exc)
        if why is not None:
            # Served BF16: compressed experts of a zipserv checkpoint are decoded into vLLM's weights,
            # and any arena pages already filled for this layer are given back.
            for (e, shard) in layer.__dict__.get(_RECORDS, {}):
                self._decode_into(layer, e, shard)
            for arena in {id(st.arena): st.arena for st in states if st.arena is not None}.values():
                weight_loaders.release_unused(arena, {x.slot.page for st in states if st.arena is arena
                                                      for t in st.tables for x in t.entries.values()})
            layer._zs_moe_plain = True
            self.zs_config.note_plain(self.zs_prefix or "<experts>", why)
            super().process_weights_after_loading(layer)
            return
        for st in states:
            self.zs_config.register_state(st)
        layer.__dict__[_MOE] = states
        self._shapes = (tuple(w13.shape), tuple(w2.shape))
        # vLLM sets up its expert kernel (and prepacks the BF16 weights, which are dropped next).
        super().process_weights_after_loading(layer)
        self._placeholders(layer, w13.device)

    def _load_experts(self, layer, states: list) -> None:
        """Every local expert's ``w13`` and ``w2`` into the arena, one LayerState each (appended to
        ``states`` as they are made, so a layer that stops halfway can give their pages back): by tile from
        the checkpoint's compressed arrays (the rank's slice selected where it falls on tiles), else
        packed from the BF16 weights vLLM loaded (compressed shards decoded into them first). The BF16
        weights then hold every expert, for vLLM's kernel setup."""
        w13, w2 = layer.w13_weight.data, layer.w2_weight.data
        records = layer.__dict__.get(_RECORDS, {})
        arena = self.zs_config.arena(w13.device)
        packed = layouts.uses_packed(w13.device, self.zs_config.mode)  # CPU fast mode: byte-split layout
        planned = []
        for which, w in (("w13", w13), ("w2", w2)):
            shards = ("w1", "w3") if which == "w13" else ("w2",)
            for e in range(w.shape[0]):
                st = loading.LayerState(prefix=f"{self.zs_prefix}.{self._global(layer, e)}.{which}", kind="linear",
                                        rows=w.shape[1], cols=w.shape[2], device=w.device,
                                        expected_shards=list(shards), layer_ref=weakref.ref(layer),
                                        ckpt_prefixes={sh: self._ckpt(layer, e, sh) for sh in shards})
                states.append(st)
                plans = self._tile_plans(layer, st, e, shards) if all((e, sh) in records for sh in shards) else None
                if plans is not None:
                    st.path = "tiles"
                    planned.append((st, plans))
                    continue
                seen = [self._decode_into(layer, e, sh) for sh in shards if (e, sh) in records]
                if seen:  # how the checkpoint shards it decoded were checked (the worst of them)
                    bad = [c for c in seen if c not in ("tiles", "full")]
                    st.checked = bad[0] if bad else ("full" if all(c == "full" for c in seen) else "tiles")
                try:
                    layouts.pack_layer(st, w[e], arena, packed=packed)
                except ValueError as exc:
                    raise _NotSmaller(f"{st.prefix}: {exc}") from None
                st.path = "packed" if not any((e, sh) in records for sh in shards) else "re-encoded"
        off = layer.__dict__.pop("_zs_moe_offtile", None)
        if off is not None:
            logger.info("zipserv: %s: rank %d's expert slices are not on %d-element tiles (e.g. %s: dim %d, "
                        "start %d, length %d); decoding, splitting with vLLM's expert loader and re-encoding them",
                        self.zs_prefix, off[4], spec.TILE, *off[:4])
        loading.load_plans(planned, self.zs_config.arena, self.zs_config.verify)
        from .methods import _full_weight

        for st, _ in planned:  # vLLM's kernel setup below prepacks the BF16 weights
            e = int(st.__dict__["_zs_local"])
            (w13 if st.prefix.endswith(".w13") else w2)[e].copy_(_full_weight(st))

    def _expert_ct(self, layer, st: loading.LayerState, e: int, shard: str, whole: bool = True):
        """The checkpoint's compressed shard of local expert ``e``, checked against the layer's
        (unpadded) sizes; with ``whole``, every tile's segments and checksum too (the tile path
        leaves those to the rank's own tiles: TilePlan.select and copy_into check them)."""
        from ..format import FormatError

        ct = loading.shard_ct(st, shard, layer.__dict__[_RECORDS][(e, shard)])
        hidden = getattr(self.moe, "hidden_dim_unpadded", None) or layer.w2_weight.shape[1]
        inter = getattr(self.moe, "intermediate_size_per_partition_unpadded", None) or layer.w2_weight.shape[2]
        tp = self.moe.moe_parallel_config.tp_size
        want = (hidden, inter * tp) if shard == "w2" else (inter * tp, hidden)
        if tuple(ct.shape) != want:
            raise loading.ZipServLoadError(
                f"zipserv: checkpoint tensor {loading.ckpt_name(st, shard, 'zs_meta')} says shape {list(ct.shape)}, "
                f"but {self.zs_prefix} expects {list(want)} for every expert's {shard}")
        if not whole:
            return ct
        name = loading.ckpt_name(st, shard, "weight")
        try:
            ct.validate(name)
            if self.zs_config.verify != "none":
                if check_tiles(ct, name):
                    loading._mark_tiles_checked(st)
                loading._note_unchecked(st, ct, self.zs_config.verify)
        except FormatError as exc:
            raise loading.damaged(st, shard, exc) from None
        return ct

    def _tile_plans(self, layer, st: loading.LayerState, e: int, shards) -> list | None:
        """The rank's tiles of expert ``e`` (gate rows then up rows for ``w13``), or None where the
        tensor-parallel split does not fall on tiles (then decoded, split and re-encoded)."""
        from ..format import FormatError
        from .tiles import TilePlan

        st.__dict__["_zs_local"] = e
        tp, rank = self.moe.moe_parallel_config.tp_size, self.moe.moe_parallel_config.tp_rank
        plans = []
        for sh in shards:
            ct = self._expert_ct(layer, st, e, sh, whole=False)
            dim = 1 if sh == "w2" else 0
            local = ct.shape[dim] // tp
            split = (dim, rank * local, local) if tp > 1 else None
            if not loading._aligned(split, ct.shape):
                layer.__dict__.setdefault("_zs_moe_offtile", (loading.ckpt_name(st, sh, "weight"), dim, rank * local,
                                                              local, rank))
                return None
            if self.zs_config.verify == "full":
                loading._check_full(st, sh, ct)
            loading._note_unchecked(st, ct, self.zs_config.verify)  # copy_into checks only zs_crc'd tiles
            try:
                label = loading.ckpt_name(st, sh, "zs_*")
                plans.append(TilePlan.select(ct, *split, label=label) if split else TilePlan.select(ct, label=label))
            except FormatError as exc:
                raise loading.ZipServLoadError(
                    f"zipserv: corrupt checkpoint tensor {loading.ckpt_name(st, sh, 'weight')}: {exc}") from None
        return loading.join_rows(plans)

    def _decode_into(self, layer, e: int, shard: str) -> str:
        """Decode local expert ``e``'s compressed ``shard`` and let vLLM's expert loader place it
        (its tensor-parallel slice) into the BF16 weights; returns how its data was checked."""
        from ..codec import decompress_tensor

        which = "w2" if shard == "w2" else "w13"
        st = loading.LayerState(prefix=self.zs_prefix, kind="linear", rows=0, cols=0, device=torch.device("cpu"),
                                expected_shards=[shard], ckpt_prefixes={shard: self._ckpt(layer, e, shard)})
        ct = self._expert_ct(layer, st, e, shard)
        full = decompress_tensor(ct)
        if self.zs_config.verify == "full":
            loading._check_full(st, shard, ct, full)
        glob = self._global(layer, e)
        layer.__dict__[f"_zs_{which}_loader"](getattr(layer, f"{which}_weight"), full, f"{which}_weight",
                                               shard_id=shard, expert_id=glob, return_success=True)
        return st.checked

    def _after_reload(self, layer) -> None:
        """vLLM's layer-wise ``reload_weights`` restored this layer's BF16 ``w13_weight`` / ``w2_weight``,
        loaded the new experts into them and now processes the layer: every expert shard that arrived
        is written into its decoded matrix and the matrix is encoded again; the layer gets its 0-size
        placeholders back (vLLM then restores the tensors it had before)."""
        from .methods import _full_weight

        w13 = layer.__dict__.get("_parameters", {}).get("w13_weight")
        arrived = layer.__dict__.pop(_RELOADED, set())
        if w13 is None or w13.numel() == 0 or w13.is_meta:
            return
        w2 = layer.w2_weight
        states = moe_states(layer)
        n_exp, inter = len(states) // 2, w2.shape[2]
        for e in sorted({e for e, _ in arrived}):
            shards = {sh for x, sh in arrived if x == e}
            if shards & {"w1", "w3"}:
                w = _full_weight(states[e]).clone()
                if "w1" in shards:
                    w[:inter] = w13.data[e, :inter]
                if "w3" in shards:
                    w[inter:] = w13.data[e, inter:]
                weight_loaders.reencode(states[e], w)
            if "w2" in shards:
                weight_loaders.reencode(states[n_exp + e], w2.data[e])
        self._placeholders(layer, w13.device)

    def _placeholders(self, layer, device) -> None:
        """The loaded layer's 0-size ``w13_weight`` / ``w2_weight``, whose loaders take weight updates."""
        for which in ("w13", "w2"):
            empty = Parameter(torch.empty(0, dtype=torch.bfloat16, device=device), requires_grad=False)
            layer.register_parameter(f"{which}_weight", empty)
            set_weight_attrs(empty, {"weight_loader": self._update_loader(layer, which)})

    def _refuse_update(self, param, loaded_weight, *args, **kwargs):
        """A zipserv checkpoint's compressed arrays arriving after loading."""
        raise loading.ZipServLoadError(
            f"zipserv: {self.zs_prefix}: the routed experts of this mixture-of-experts layer take BF16 weight "
            f"updates (experts.N.w1.weight ...), not a zipserv checkpoint's zs_* arrays; update them from the BF16 "
            f"checkpoint, or restart the engine on the new zipserv checkpoint")

    def _update_loader(self, layer, which: str):
        """The loader of a loaded layer's 0-size ``w13_weight`` / ``w2_weight``: a weight update
        (``model.load_weights`` after loading, e.g. from an RL trainer) of one expert's shard. The
        expert's rank-local matrix is decoded, vLLM's own expert loader places the new shard into it
        (its tensor-parallel slice), and it is encoded again into the arena (old pages freed once no
        layer uses them). Outputs then equal a BF16 engine given the same update."""

        def zipserv_expert_update_loader(param, loaded_weight, weight_name=None, shard_id=None, expert_id=None,
                                         return_success=False, **kw):
            from .methods import _full_weight

            if loaded_weight.dim() != 2:
                raise loading.ZipServLoadError(
                    f"zipserv: {self.zs_prefix}: a weight update of the compressed experts must come one expert at "
                    f"a time (2-D tensors), got {list(loaded_weight.shape)}")
            if loaded_weight.dtype != torch.bfloat16:
                raise loading.ZipServLoadError(
                    f"zipserv: {self.zs_prefix}: the update of expert {expert_id}'s {shard_id} is {loaded_weight.dtype}, "
                    f"not bfloat16: compressed experts take BF16 weights")
            local = self._local(layer, expert_id)
            if local < 0:  # another rank's expert
                return False if return_success else None
            states = moe_states(layer)
            st = states[local if which == "w13" else len(states) // 2 + local]
            one = torch.empty((1, st.rows, st.cols), dtype=torch.bfloat16, device=st.device)
            one[0] = _full_weight(st)
            w = one.expand(local + 1, st.rows, st.cols)  # vLLM's loader writes w[local]: the one real matrix
            ok = layer.__dict__[f"_zs_{which}_loader"](Parameter(w, requires_grad=False), loaded_weight,
                                                       weight_name or f"{which}_weight", shard_id=shard_id,
                                                       expert_id=expert_id, return_success=True, **kw)
            if ok is not False:
                weight_loaders.reencode(st, one[0])
                layer.__dict__.pop("_zs_moe_native", None)  # its addresses keep the old pages alive
            return ok if return_success else None

        return zipserv_expert_update_loader

    # ------------------------------------------------------------------ run
    def apply(self, layer, x, topk_weights, topk_ids, shared_experts=None, shared_experts_input=None):
        if not moe_states(layer):
            return super().apply(layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input)
        if not torch.compiler.is_compiling():  # eager: this layer, directly (no op dispatch, no lookup)
            return self.compute(layer, x, topk_weights, topk_ids)
        return torch.ops.zipserv.moe_experts(x, topk_weights, topk_ids, _op_name(self.zs_prefix))

    def compute(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """The experts' output for ``x`` (eager; inside ``zipserv::moe_experts``)."""
        if self._fast_path(layer):
            return self._compute_fast(layer, x, topk_weights, topk_ids)
        return self._compute_exact(layer, x, topk_weights, topk_ids)

    def _compute_fast(self, layer, x, topk_weights, topk_ids) -> torch.Tensor:
        """Fast mode: each routed expert's two GEMMs straight from its compressed bytes, over the
        tokens routed to it; only the routed experts are read. On CPUs with AVX512-BF16 one native
        call runs the whole layer (``cpu_kernels.moe_run``: the rows grouped by expert, every
        (expert, tile-row run) item of w13 in one parallel loop, SiLU x up, w2 likewise, the weighted
        sum per token); elsewhere one ``zipserv_vllm.linear`` per expert and GEMM. Same numbers as
        vLLM's kernel up to summation order and its approximate exp in SiLU (the fast-mode logprob
        bound, tests/vllm/test_moe.py). (No import statement on the one-call path: each costs
        ~5 µs a call with the caches cold.)"""
        states = moe_states(layer)
        n_exp, inter = len(states) // 2, self._shapes[0][1] // 2
        held = self._native_layer(layer, states, n_exp, inter, x.shape[1])  # (kept: it holds the parts)
        if held.obj is not None and x.dim() == 2:  # one native call for the whole layer (CPU with AVX512-BF16)
            return ops._cpu_kernels().moe_run(held.obj, x, topk_ids, topk_weights,
                                              on_input=bool(layer.apply_router_weight_on_input))
        from .methods import compressed_linear

        k = topk_ids.shape[-1]
        flat = topk_ids.reshape(-1).to(torch.int64)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=n_exp).tolist()
        tokens, weights = order // k, topk_weights.reshape(-1).to(torch.float32)[order, None]
        # the routed (token, expert) rows grouped by expert; per expert only its two GEMMs, on row slices
        xs = x.index_select(0, tokens)
        if layer.apply_router_weight_on_input:
            xs = (xs * weights).to(x.dtype)
        bounds = list(itertools.accumulate(counts, initial=0))
        active = [e for e in range(n_exp) if counts[e]]
        if not active:  # no tokens (e.g. a dummy or data-parallel step)
            return torch.zeros_like(x)

        def grouped(first: int, rows: torch.Tensor) -> torch.Tensor:
            outs = [compressed_linear(states[first + e], rows[bounds[e]:bounds[e + 1]], None, "fast") for e in active]
            return outs[0] if len(outs) == 1 else torch.cat(outs)

        h = grouped(0, xs)
        act = (torch.nn.functional.silu(h[:, :inter].float()) * h[:, inter:].float()).to(x.dtype)
        y = grouped(n_exp, act).float()
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        out.index_add_(0, tokens, y if layer.apply_router_weight_on_input else y * weights)
        return out.to(x.dtype)

    def _fast_path(self, layer) -> bool:
        """Whether :meth:`compute` takes the fast path (else vLLM's own kernel, exact)."""
        return self.zs_config.mode == "fast" and getattr(layer.activation, "value", None) == "silu" \
            and layer.expert_map is None

    @staticmethod
    def _current_native(layer, hidden: int):
        """The layer's cached :meth:`_native_layer` holder while it is valid (no parts assigned since,
        the same hidden size and ISA override), else None."""
        held = layer.__dict__.get("_zs_moe_native")
        if held is not None and held.key is not None and held.key[0] == loading.parts_epoch() \
                and held.key[1] == hidden and held.key[2] == ops._cpu_kernels()._isa_override:
            return held
        return None

    def one_call(self, layer, x):
        """The holder of the layer's one-call kernel (:meth:`_native_layer`) when a call on ``x``
        just ran through it and it is still current, else None."""
        if not (self._fast_path(layer) and x.dim() == 2 and moe_states(layer)):
            return None
        held = self._current_native(layer, x.shape[1])
        return held if held is not None and held.obj is not None else None

    def _native_layer(self, layer, states, n_exp: int, inter: int, hidden: int):
        """A holder of the layer's ``cpu_kernels.moe_layer`` (its experts' address tables, checked
        once) in ``.obj``, None there where the one-call path does not apply (not a CPU with
        AVX512-BF16, ``set_isa`` forcing the fused kernel, sizes not multiples of 64, experts not held
        as single byte-split matrices). Cached on the layer per set of expert tensors (a weight update
        re-encodes an expert: new parts, a new epoch, a new native layer); the holder references the
        parts the addresses point into (the caller keeps it while the kernel runs), and copies and
        pickles of the layer get an empty one (``cpu_kernels._Held``), so they build their own."""
        # Valid while no layer's parts were assigned since (loading.parts_epoch): an O(1) check per call
        # instead of a Python walk over the 2 E parts on every call.
        held = self._current_native(layer, hidden)
        if held is not None:
            return held
        epoch = loading.parts_epoch()
        cpu_kernels = ops._cpu_kernels()
        native, parts = None, None
        if cpu_kernels.available() and cpu_kernels.bf16_supported() and cpu_kernels._isa_override is None \
                and hidden % spec.TILE == 0 and inter % spec.TILE == 0:
            parts = [st.parts[0] if len(st.parts) == 1 else None for st in states]
            t13 = cpu_kernels.expert_table(parts[:n_exp], (2 * inter, hidden))
            t2 = cpu_kernels.expert_table(parts[n_exp:], (hidden, inter))
            if t13 is not None and t2 is not None:
                native = cpu_kernels.moe_layer(t13, t2, inter, hidden)
        held = cpu_kernels._Held((epoch, hidden, cpu_kernels._isa_override, parts if native is not None else None),
                                 native)
        layer.__dict__["_zs_moe_native"] = held
        return held

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

