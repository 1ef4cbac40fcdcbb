"""The ``weight_loader`` functions of zipserv's placeholder parameters, and weight updates.

* :func:`recorder`: during the initial load it only records each checkpoint
  tensor (:mod:`.loading` executes the records once all have arrived); once
  the layer is loaded the same loader takes **weight updates**;
* :func:`update_loader`: the loaded layer's 0-size ``weight``, every call an update;
* :func:`refuse_arrays`: a pack-at-load layer's ``zs_*`` placeholders (BF16 updates only);
* :func:`ignore_loader`: a tied lm_head's placeholders.

An update (vLLM's ``reload_weights``, ``model.load_weights`` from an RL trainer)
decodes the rank's weight, lets vLLM's own loader place the new shard, and
encodes the layer again in its layout (:func:`reencode`), freeing the pages no
layer uses any more.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..codec import check_tiles, compress_tensor, decompress_tensor
from ..format import FormatError
from ..format.cpu_layout import PackedTensor
from .arena import PagedArena
from .loading import SUFFIXES, WEIGHT, LayerState, ZipServLoadError, ckpt_name, damaged, shard_ct
from .tiles import store_compressed


def recorder(state: LayerState, name: str) -> Callable:
    """A weight_loader that records the checkpoint tensor (both call shapes, pitfall 13).

    Once the layer is loaded, the same loader takes **weight updates** (vLLM's
    ``reload_weights``, or ``model.load_weights`` from an RL trainer): see
    :func:`update_layer`. vLLM's layer-wise reload first runs every loader on
    meta parameters to count elements; those calls are ignored."""

    def zipserv_record_loader(param, loaded_weight, shard_id=None):
        if state.done:
            return _update_once(state, name, loaded_weight, shard_id, param)
        key = (shard_id, name)
        if key in state.records:
            raise ZipServLoadError(f"zipserv: {ckpt_name(state, shard_id, name)} appears twice in the checkpoint")
        state.records[key] = loaded_weight

    return zipserv_record_loader


def update_loader(state: LayerState) -> Callable:
    """The weight_loader of a loaded layer's 0-size ``weight``: every call is an update."""

    def zipserv_update_loader(param, loaded_weight, shard_id=None):
        return _update_once(state, WEIGHT, loaded_weight, shard_id, param)

    return zipserv_update_loader


def refuse_arrays(state: LayerState) -> Callable:
    """Loader of a pack-at-load layer's zs_* placeholders: such a layer takes BF16 updates only."""

    def zipserv_refuse_loader(param, loaded_weight, shard_id=None):
        raise errors_report(ZipServLoadError(
            f"zipserv: {state.prefix or 'this layer'} was compressed while loading (--quantization zipserv on a BF16 "
            "checkpoint): it takes BF16 weight updates, not a zipserv checkpoint's zs_* arrays; update it from "
            "the BF16 checkpoint, or serve the zipserv checkpoint itself"))

    return zipserv_refuse_loader


def errors_report(exc):
    from .errors import report

    return report(exc)


# Placeholders declare this many checkpoint elements, so that vLLM's layer-wise reload never
# counts a compressed layer complete on its own: it hands every new tensor to the loaders
# (which apply it at once) and finishes the layer in finalize_layerwise_reload.
RELOAD_NUMEL = 1 << 62


def _update_once(state: LayerState, name: str, loaded, shard_id, param) -> None:
    """Apply an update the first time a tensor arrives. vLLM's layer-wise reload calls each
    loader twice with the same tensor (first on meta parameters, to count elements; then
    again when it finishes the layer); the second call is skipped."""
    import weakref

    seen = state.__dict__.setdefault("_seen", {})
    ref = seen.get(id(loaded))
    if ref is not None and ref() is loaded:
        return None
    seen[id(loaded)] = weakref.ref(loaded)
    if getattr(param, "is_meta", False):
        torch.empty(1).copy_(torch.zeros(1))  # one element for vLLM's count: the layer waits for finalize
    return update_layer(state, name, loaded, shard_id)


# -------------------------------------------------------------- weight updates
def update_layer(state: LayerState, name: str, loaded, shard_id=None) -> None:
    """Replace (part of) a loaded layer's weight: ``loaded`` is the new checkpoint tensor
    of ``shard_id`` (BF16 ``weight``, or one ``zs_*`` array of a compressed one; the arrays
    of a shard are gathered until all have arrived). The rank's weight is decoded,
    vLLM's own loader places the new shard into it (q/k/v, gate/up, TP narrowing,
    vocabulary padding), and the layer is encoded again into its arena; pages no
    layer uses any more are freed. Outputs then equal a BF16 model given the same update."""
    st = state.source()
    if name != WEIGHT:
        got = st.__dict__.setdefault("_update_arrays", {}).setdefault(shard_id, {})
        got[name] = loaded
        if not all(x in got for x in SUFFIXES):
            return
        arrays = st.__dict__["_update_arrays"].pop(shard_id)
        ct = shard_ct(st, shard_id, arrays)
        try:
            ct.validate(ckpt_name(st, shard_id, "weight"))
            check_tiles(ct, ckpt_name(st, shard_id, "weight"))
        except FormatError as exc:
            raise damaged(st, shard_id, exc) from None
        loaded = decompress_tensor(ct)
    if loaded.dtype != torch.bfloat16:
        raise ZipServLoadError(f"zipserv: the update of {ckpt_name(st, shard_id, 'weight')} is {loaded.dtype}, "
                               "not bfloat16: a compressed layer takes BF16 weights")
    if st.orig_loader is None or not (st.parts or st.bf16):
        raise ZipServLoadError(f"zipserv: layer {st.prefix} cannot take weight updates (it was not loaded)")
    from .methods import _full_weight

    if st.bf16:  # kept BF16: vLLM's unquantized method holds it; stage the new values and re-run it
        w = st.__dict__.get("_staging")
        if w is None:
            w = torch.nn.Parameter(torch.zeros(st.rows, st.cols, dtype=torch.bfloat16, device=st.device),
                                   requires_grad=False)
            w.output_dim, w.input_dim = 0, 1
            st.__dict__["_staging"] = w
    else:
        w = torch.nn.Parameter(_full_weight(st).to(st.device), requires_grad=False)
        w.output_dim, w.input_dim = 0, 1
    for attr in ("is_sharded_weight",):
        if hasattr(loaded, attr):
            setattr(w, attr, getattr(loaded, attr))
    if shard_id is None:
        st.orig_loader(w, loaded.to(w.device))
    else:
        st.orig_loader(w, loaded.to(w.device), shard_id)
    if st.bf16:
        layer = st.layer
        layer.weight = torch.nn.Parameter(w.data.clone(), requires_grad=False)
        layer._zs_unq_done = False
        layer.quant_method._bf16_process(layer)
        return
    reencode(st, w.data)


def reencode(st: LayerState, w: torch.Tensor) -> None:
    """Encode the rank's new BF16 weight ``w`` into ``st``'s arena in the layer's parts."""
    packed = all(isinstance(p, PackedTensor) for p in st.parts)
    tables, shapes, row = [], [], 0
    for m, k in st.part_shapes:
        part = w[row : row + m].detach().to("cpu").contiguous()
        row += m
        if packed:
            from ..kernels import cpu as cpu_kernels

            tables.append(st.arena.store(cpu_kernels.pack(part).arrays()))
        else:
            ct = compress_tensor(part)
            if ct.device != st.arena.device:
                ct = ct.to(st.arena.device)
            tables.append(store_compressed(st.arena, ct))
        shapes.append((m, k))
    old_pages = {e.slot.page for t in st.tables for e in t.entries.values()}
    st.parts = []
    st.tables, st.part_shapes = tables, shapes
    st.bind()
    st.path = st.path if st.path.endswith("updated") else f"{st.path}, updated"
    release_unused(st.arena, old_pages)


def release_unused(arena: PagedArena, candidates: set[int]) -> None:
    """Free the pages among ``candidates`` that no layer's table references any more."""
    users = arena.__dict__.get("_zs_states", [])
    used = {e.slot.page for s in users if s.arena is arena for t in s.tables for e in t.entries.values()}
    for page in candidates - used:
        arena.release(page)


def ignore_loader(param, loaded_weight, shard_id=None):
    """Loader for a tied lm_head's placeholders: the embedding's data is used."""
    return None
